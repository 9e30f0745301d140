"""A ViT classifier in Flax linen, trained in bf16 with f32 master weights.

The parameters and the AdamW state stay f32; each step casts the parameters to bf16
(``jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)``), runs the forward and
backward pass in bf16 on uint8 images normalised in bf16, computes the loss from f32
logits, casts the bf16 grads back to f32 and applies the optax update to the f32
weights.  The ViT is the usual one: a strided `nn.Conv` patch embedding, a class token,
learned position embeddings, pre-LN encoder blocks, the head on the class token.

The step is ``train_step(params, opt_state, batch) -> (params, opt_state, loss)``,
``batch = {"images": u8[B, H, W, 3], "labels": i32[B]}``.

Sizes: ``tiny`` (32 x 32 images, patch 8, width 64, 4 heads, 2 layers, 10 classes,
batch 16) and ``paper`` (ViT-B/16 on ImageNet: 224 x 224, patch 16, width 768,
12 heads, 12 layers, MLP 3072, 1000 classes, batch 2048; abstract).
"""
from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclass(frozen=True)
class Config:
    image_size: int
    patch: int
    hidden: int
    num_heads: int
    num_layers: int
    mlp_dim: int
    num_classes: int
    batch: int
    lr: float = 1e-3
    warmup_steps: int = 10_000
    total_steps: int = 90 * 625


CONFIGS = {
    "tiny": Config(image_size=32, patch=8, hidden=64, num_heads=4, num_layers=2, mlp_dim=256,
                   num_classes=10, batch=16, lr=1e-3, warmup_steps=1, total_steps=100),
    "paper": Config(image_size=224, patch=16, hidden=768, num_heads=12, num_layers=12,
                    mlp_dim=3072, num_classes=1000, batch=2048),
}


class MlpBlock(nn.Module):
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(self.mlp_dim)(x)
        y = nn.gelu(y)
        return nn.Dense(x.shape[-1])(y)


class Encoder1DBlock(nn.Module):
    num_heads: int
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=self.num_heads)(y, y)
        x = x + y
        y = nn.LayerNorm()(x)
        return x + MlpBlock(self.mlp_dim)(y)


class ViT(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, images):
        cfg = self.cfg
        x = nn.Conv(cfg.hidden, (cfg.patch, cfg.patch), strides=(cfg.patch, cfg.patch),
                    padding="VALID", name="embedding")(images)
        n, h, w, c = x.shape
        x = jnp.reshape(x, [n, h * w, c])
        cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
        x = jnp.concatenate([jnp.tile(cls, [n, 1, 1]), x], axis=1)
        x = x + self.param("pos_embedding", nn.initializers.normal(stddev=0.02),
                           (1, x.shape[1], c))
        for i in range(cfg.num_layers):
            x = Encoder1DBlock(cfg.num_heads, cfg.mlp_dim, name=f"encoderblock_{i}")(x)
        x = nn.LayerNorm(name="encoder_norm")(x)
        return nn.Dense(cfg.num_classes, kernel_init=nn.initializers.zeros, name="head")(x[:, 0])


def make(size: str = "tiny"):
    cfg = CONFIGS[size]
    model = ViT(cfg)
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup_steps,
                                                  cfg.total_steps)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=0.9, b2=0.999, weight_decay=1e-4))

    def loss_fn(params_bf16, batch):
        images = batch["images"].astype(jnp.bfloat16) / 127.5 - 1.0
        logits = model.apply({"params": params_bf16}, images)
        logits = logits.astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    def train_step(params, opt_state, batch):
        params_bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
        loss, grads = jax.value_and_grad(loss_fn)(params_bf16, batch)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    shape = (cfg.batch, cfg.image_size, cfg.image_size, 3)
    init = lambda rng, images: model.init(rng, images)["params"]
    rng = jax.random.PRNGKey(0)
    if size == "tiny":
        rs = np.random.default_rng(1)  # what the input pipeline hands over: host arrays
        batch = {"images": jnp.asarray(rs.integers(0, 256, shape, dtype=np.uint8)),
                 "labels": jnp.asarray(rs.integers(0, cfg.num_classes, cfg.batch, dtype=np.int32))}
        params = jax.jit(init)(rng, jnp.zeros(shape, jnp.float32))
        opt_state = tx.init(params)
    else:
        batch = {"images": jax.ShapeDtypeStruct(shape, jnp.uint8),
                 "labels": jax.ShapeDtypeStruct((cfg.batch,), jnp.int32)}
        params = jax.eval_shape(init, rng, jax.ShapeDtypeStruct(shape, jnp.float32))
        opt_state = jax.eval_shape(tx.init, params)
    return train_step, (params, opt_state, batch)
