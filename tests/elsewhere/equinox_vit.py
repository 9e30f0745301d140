"""A Vision Transformer in Equinox, written the way Equinox's ViT / transformer examples
write one.

`eqx.Module` classes holding `eqx.nn` layers; every module works on one example
(no batch axis) and the loss `jax.vmap`s the model over the batch.  The patch
embedding is an `eqx.nn.Conv2d` with stride = kernel = patch size on a channels-first
image, flattened to ``[num_patches, width]``; a learned class token and learned
position embeddings are plain array fields; each pre-LN encoder block is
`eqx.nn.LayerNorm` (vmapped over the tokens) -> `eqx.nn.MultiheadAttention`
(self-attention, with the query/key/value/output biases on) -> residual ->
`eqx.nn.LayerNorm` -> `eqx.nn.Linear` -> GELU -> `eqx.nn.Linear` -> residual; a final
LayerNorm and a linear head on the class token.  No dropout (ImageNet ViT-B/16 from
scratch is usually trained without it), so the step needs no PRNG key.

Training: integer-label softmax cross-entropy (`optax`), `eqx.filter_value_and_grad`,
``optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(...))`` on a warmup-cosine
schedule with weight decay masked to the matrices (no decay on biases, LayerNorm
scales, the class token or position embeddings).  As in `equinox_cnn`, the step is a
pure function of array pytrees: the model is split once with
``eqx.partition(model, eqx.is_array)``, the step `eqx.combine`s the arrays with the
static part and hands back ``eqx.filter(model, eqx.is_array)``.

The step is ``train_step(params, opt_state, images, labels) -> (params, opt_state,
loss)`` with ``images: f32[B, 3, H, W]`` (channels-first) and ``labels: i32[B]``.

Sizes: ``tiny`` (32 x 32 images, patch 8, width 64, 4 heads, 2 layers, MLP 256,
10 classes, batch 32) and ``paper`` (ViT-B/16 on ImageNet: 224 x 224 x 3, patch 16,
width 768, 12 heads, 12 layers, MLP 3072, 1000 classes, batch 2048; ~86M parameters;
abstract).
"""
from __future__ import annotations

from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclass(frozen=True)
class Config:
    image_size: int
    patch: int
    width: int
    num_heads: int
    num_layers: int
    mlp_dim: int
    num_classes: int
    batch: int
    channels: int = 3
    lr: float = 3e-3
    warmup_steps: int = 10_000
    total_steps: int = 300 * 625
    weight_decay: float = 0.3
    clip_norm: float = 1.0


CONFIGS = {
    "tiny": Config(image_size=32, patch=8, width=64, num_heads=4, num_layers=2, mlp_dim=256,
                   num_classes=10, batch=32, lr=1e-3, warmup_steps=1, total_steps=100,
                   weight_decay=1e-4),
    "paper": Config(image_size=224, patch=16, width=768, num_heads=12, num_layers=12,
                    mlp_dim=3072, num_classes=1000, batch=2048),
}


class PatchEmbedding(eqx.Module):
    conv: eqx.nn.Conv2d

    def __init__(self, channels, width, patch, *, key):
        self.conv = eqx.nn.Conv2d(channels, width, kernel_size=patch, stride=patch, key=key)

    def __call__(self, x):                 # [C, H, W]
        x = self.conv(x)                   # [width, H / p, W / p]
        return x.reshape(x.shape[0], -1).T  # [num_patches, width]


class EncoderBlock(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, width, num_heads, mlp_dim, *, key):
        k_attn, k_fc1, k_fc2 = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(width)
        self.attention = eqx.nn.MultiheadAttention(
            num_heads, width, use_query_bias=True, use_key_bias=True,
            use_value_bias=True, use_output_bias=True, key=k_attn)
        self.norm2 = eqx.nn.LayerNorm(width)
        self.fc1 = eqx.nn.Linear(width, mlp_dim, key=k_fc1)
        self.fc2 = eqx.nn.Linear(mlp_dim, width, key=k_fc2)

    def __call__(self, x):                 # [seq, width]
        y = jax.vmap(self.norm1)(x)
        x = x + self.attention(y, y, y)
        y = jax.vmap(self.norm2)(x)
        y = jax.vmap(self.fc1)(y)
        y = jax.nn.gelu(y)
        y = jax.vmap(self.fc2)(y)
        return x + y


class VisionTransformer(eqx.Module):
    patch_embedding: PatchEmbedding
    cls_token: jax.Array
    positional_embedding: jax.Array
    blocks: list
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, cfg: Config, *, key):
        k_patch, k_cls, k_pos, k_head, k_blocks = jax.random.split(key, 5)
        num_patches = (cfg.image_size // cfg.patch) ** 2
        self.patch_embedding = PatchEmbedding(cfg.channels, cfg.width, cfg.patch, key=k_patch)
        self.cls_token = 0.02 * jax.random.normal(k_cls, (1, cfg.width))
        self.positional_embedding = 0.02 * jax.random.normal(
            k_pos, (num_patches + 1, cfg.width))
        self.blocks = [
            EncoderBlock(cfg.width, cfg.num_heads, cfg.mlp_dim, key=k)
            for k in jax.random.split(k_blocks, cfg.num_layers)
        ]
        self.norm = eqx.nn.LayerNorm(cfg.width)
        self.head = eqx.nn.Linear(cfg.width, cfg.num_classes, key=k_head)

    def __call__(self, x):                 # [C, H, W] -> [num_classes]
        x = self.patch_embedding(x)
        x = jnp.concatenate([self.cls_token, x], axis=0)
        x = x + self.positional_embedding
        for block in self.blocks:
            x = block(x)
        x = self.norm(x[0])                # the class token
        return self.head(x)


def loss(model, images, labels):
    logits = jax.vmap(model)(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make(size: str = "tiny"):
    cfg = CONFIGS[size]
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.total_steps)
    optim = optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(schedule, b1=0.9, b2=0.999, weight_decay=cfg.weight_decay,
                    mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
    )
    key = jax.random.PRNGKey(42)
    shape = (cfg.batch, cfg.channels, cfg.image_size, cfg.image_size)
    if size == "tiny":
        model = VisionTransformer(cfg, key=key)
        params, static = eqx.partition(model, eqx.is_array)
        opt_state = optim.init(params)
        rs = np.random.default_rng(1)  # a batch from the data loader
        images = jnp.asarray(rs.standard_normal(shape, dtype=np.float32))
        labels = jnp.asarray(rs.integers(0, cfg.num_classes, cfg.batch, dtype=np.int32))
    else:
        model = eqx.filter_eval_shape(VisionTransformer, cfg, key=key)
        params, static = eqx.partition(
            model, lambda leaf: isinstance(leaf, jax.ShapeDtypeStruct))
        opt_state = jax.eval_shape(optim.init, params)
        images = jax.ShapeDtypeStruct(shape, jnp.float32)
        labels = jax.ShapeDtypeStruct((cfg.batch,), jnp.int32)

    def train_step(params, opt_state, images, labels):
        model = eqx.combine(params, static)
        loss_value, grads = eqx.filter_value_and_grad(loss)(model, images, labels)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return eqx.filter(model, eqx.is_array), opt_state, loss_value

    return train_step, (params, opt_state, images, labels)
