"""A GPT in Flax NNX, trained with a pure `jax.jit` step the way the NNX docs show it
("Performance considerations": split once, `nnx.merge` inside the jitted function,
`nnx.state` out).

The model ties its token embedding (`nnx.Embed` and `.attend` for the logits), adds
learned positions, runs pre-LN blocks with `nnx.MultiHeadAttention` under a causal
mask from `nnx.make_causal_mask`, and is trained on next-token prediction
(``ids[:, :-1] -> ids[:, 1:]``) with an `nnx.Optimizer` around optax AdamW.

The step is ``train_step(state, ids) -> (state, loss)`` where ``state`` is
``nnx.split((model, optimizer))[1]``: the parameters and the optimizer state in one
`nnx.State` (the graphdef is closed over).

Sizes: ``tiny`` (vocab 256, width 64, 4 heads, 2 layers, batch 16 x 32 tokens) and
``paper`` (BERT-base size: vocab 30522, width 768, 12 heads, 12 layers, MLP 3072,
batch 2048 x 128 tokens, ids of length 129; abstract, built with `nnx.eval_shape`).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


@dataclass(frozen=True)
class Config:
    vocab_size: int
    d_model: int
    n_heads: int
    n_layers: int
    d_ff: int
    max_len: int
    batch: int
    seq_len: int
    lr: float = 6e-4
    weight_decay: float = 0.1


CONFIGS = {
    "tiny": Config(vocab_size=256, d_model=64, n_heads=4, n_layers=2, d_ff=256,
                   max_len=32, batch=16, seq_len=32, lr=3e-3),
    "paper": Config(vocab_size=30522, d_model=768, n_heads=12, n_layers=12, d_ff=3072,
                    max_len=128, batch=2048, seq_len=128),
}


class MLP(nnx.Module):
    def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs):
        self.fc = nnx.Linear(d_model, d_ff, rngs=rngs)
        self.proj = nnx.Linear(d_ff, d_model, rngs=rngs)

    def __call__(self, x):
        return self.proj(nnx.gelu(self.fc(x)))


class Block(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=cfg.n_heads, in_features=cfg.d_model, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.mlp = MLP(cfg.d_model, cfg.d_ff, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.wte = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
        self.wpe = nnx.Embed(cfg.max_len, cfg.d_model, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, rngs=rngs)

    def __call__(self, ids):
        pos = jnp.arange(ids.shape[1])[None, :]
        x = self.wte(ids) + self.wpe(pos)
        mask = nnx.make_causal_mask(ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.wte.attend(self.ln_f(x))


def create(cfg: Config):
    model = GPT(cfg, rngs=nnx.Rngs(0))
    tx = optax.adamw(cfg.lr, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    return model, optimizer


def loss_fn(model: GPT, ids):
    logits = model(ids[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def make(size: str = "tiny"):
    cfg = CONFIGS[size]
    if size == "tiny":
        model, optimizer = create(cfg)
        ids = jnp.asarray(np.random.default_rng(1).integers(
            0, cfg.vocab_size, (cfg.batch, cfg.seq_len + 1), dtype=np.int32))
    else:
        model, optimizer = nnx.eval_shape(lambda: create(cfg))
        ids = jax.ShapeDtypeStruct((cfg.batch, cfg.seq_len + 1), jnp.int32)
    graphdef, state = nnx.split((model, optimizer))

    def train_step(state, ids):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, ids)
        optimizer.update(model, grads)
        state = nnx.state((model, optimizer))
        return state, loss

    return train_step, (state, ids)
