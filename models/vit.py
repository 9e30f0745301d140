"""Vision Transformer: patchify by reshape + dense, learned position embeddings, pre-LN
encoder blocks, mean pooling, linear classifier; AdamW. "paper": ViT-B (12×768) on 64 patches."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from .common import (EMBED_INIT, Block, cross_entropy, init_state, make_batch, make_train_step,
                     pick_config, run_blocks)


@dataclasses.dataclass(frozen=True)
class Config:
    image: int
    patch: int
    layers: int
    d: int
    heads: int
    ffn: int
    classes: int
    batch: int
    lr: float = 1e-3

    @property
    def patches(self) -> int:
        return (self.image // self.patch) ** 2


CONFIGS = {
    "tiny": Config(image=16, patch=4, layers=2, d=64, heads=4, ffn=128, classes=10, batch=16),
    "small": Config(image=32, patch=4, layers=4, d=128, heads=4, ffn=512, classes=10, batch=32),
    "paper": Config(image=128, patch=16, layers=12, d=768, heads=12, ffn=3072, classes=1000, batch=32 * 8),
}


def config(name: str = "tiny", devices: int = 8, batch: int | None = None) -> Config:
    return pick_config(CONFIGS, name, devices, global_batch=batch, batch=32)


def patchify(x: jax.Array, p: int) -> jax.Array:
    """[B, H, W, C] → [B, (H/p)·(W/p), p·p·C]."""
    b, h, w, c = x.shape
    x = x.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // p) * (w // p), p * p * c)


class ViT(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.patch = cfg.patch
        self.embed = nnx.Linear(cfg.patch * cfg.patch * 3, cfg.d, rngs=rngs)
        self.pos = nnx.Param(EMBED_INIT(rngs.params(), (cfg.patches, cfg.d), jnp.float32))
        self.blocks = nnx.List([Block(cfg.d, cfg.heads, cfg.ffn, rngs=rngs) for _ in range(cfg.layers)])
        self.ln = nnx.LayerNorm(cfg.d, rngs=rngs)
        self.head = nnx.Linear(cfg.d, cfg.classes, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = self.embed(patchify(images, self.patch)) + self.pos[...][None]
        x, _ = run_blocks(self.blocks, x)
        return self.head(self.ln(x).mean(axis=1))


def build(name: str = "tiny", *, devices: int = 8, abstract: bool = False,
          batch: int | None = None):
    cfg = config(name, devices, batch)
    tx = optax.adamw(cfg.lr)
    graphdef, params, opt_state = init_state(lambda: ViT(cfg, rngs=nnx.Rngs(0)), tx, abstract)

    def batch_fn(key):
        kx, ky = jax.random.split(key)
        return {"image": jax.random.normal(kx, (cfg.batch, cfg.image, cfg.image, 3), jnp.float32),
                "label": jax.random.randint(ky, (cfg.batch,), 0, cfg.classes, jnp.int32)}

    def loss_fn(model, batch):
        return cross_entropy(model(batch["image"]), batch["label"])

    step = make_train_step(loss_fn, tx, graphdef)
    return step, (params, opt_state, make_batch(batch_fn, abstract))
