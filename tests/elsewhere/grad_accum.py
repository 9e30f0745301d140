"""Gradient accumulation over microbatches on a small Flax linen decoder LM.

Two idioms, one model:

* ``loop="scan"`` (MaxText style): the batch is reshaped to ``[n_micro, micro, ...]``
  and `jax.lax.scan` runs the microbatches, summing loss and grads in the carry;
* ``loop="fori"`` (big_vision's ``accumulate_gradient``): the first microbatch is
  computed outside the loop, then `jax.lax.fori_loop(1, n_micro, ...)` takes each next
  one with `jax.lax.dynamic_slice` and adds its loss and grads.

Both then average and take one optax AdamW step (global-norm clipped).  The step is
``train_step(params, opt_state, tokens) -> (params, opt_state, loss)``, ``tokens:
i32[B, T + 1]`` sliced into next-token inputs and targets.

Sizes: ``tiny`` (vocab 256, width 64, 4 heads, 2 layers, batch 32 = 4 x 8, 32 tokens)
and ``paper`` (BERT-base size, as every transformer here: vocab 30522, width 768,
12 heads, 12 layers, MLP 3072, batch 2048 = 8 microbatches x 256, 128 tokens;
abstract).
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
    vocab_size: int
    d_model: int
    num_heads: int
    num_layers: int
    d_ff: int
    batch: int
    n_micro: int
    seq_len: int
    lr: float = 3e-4


CONFIGS = {
    "tiny": Config(vocab_size=256, d_model=64, num_heads=4, num_layers=2, d_ff=256,
                   batch=32, n_micro=4, seq_len=32, lr=3e-3),
    "paper": Config(vocab_size=30522, d_model=768, num_heads=12, num_layers=12, d_ff=3072,
                    batch=2048, n_micro=8, seq_len=128),
}


class DecoderBlock(nn.Module):
    num_heads: int
    d_ff: int

    @nn.compact
    def __call__(self, x, mask):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.num_heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        h = nn.Dense(self.d_ff)(h)
        h = nn.gelu(h)
        return x + nn.Dense(x.shape[-1])(h)


class DecoderLM(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        x = nn.Embed(cfg.vocab_size, cfg.d_model)(tokens)
        x = x + self.param("pos_embedding", nn.initializers.normal(0.02),
                           (1, tokens.shape[1], cfg.d_model))
        mask = nn.make_causal_mask(tokens)
        for _ in range(cfg.num_layers):
            x = DecoderBlock(cfg.num_heads, cfg.d_ff)(x, mask)
        x = nn.LayerNorm()(x)
        return nn.Dense(cfg.vocab_size, use_bias=False)(x)


def make(size: str = "tiny", loop: str = "scan"):
    cfg = CONFIGS[size]
    model = DecoderLM(cfg)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(cfg.lr, weight_decay=0.1))

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    grad_fn = jax.value_and_grad(loss_fn)

    def accumulate_scan(params, tokens):
        microbatches = tokens.reshape((cfg.n_micro, -1) + tokens.shape[1:])

        def body(carry, mb):
            loss_sum, grad_sum = carry
            loss, grads = grad_fn(params, mb)
            return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

        init = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(body, init, microbatches)
        return loss / cfg.n_micro, jax.tree.map(lambda g: g / cfg.n_micro, grads)

    def accumulate_fori(params, tokens):
        step_size = tokens.shape[0] // cfg.n_micro
        l, g = grad_fn(params, tokens[:step_size])

        def acc_grad_and_loss(i, l_and_g):
            mb = jax.lax.dynamic_slice(tokens, (i * step_size, 0),
                                       (step_size,) + tokens.shape[1:])
            li, gi = grad_fn(params, mb)
            l, g = l_and_g
            return (l + li, jax.tree.map(lambda x, y: x + y, g, gi))

        l, g = jax.lax.fori_loop(1, cfg.n_micro, acc_grad_and_loss, (l, g))
        return jax.tree.map(lambda x: x / cfg.n_micro, (l, g))

    accumulate = {"scan": accumulate_scan, "fori": accumulate_fori}[loop]

    def train_step(params, opt_state, tokens):
        loss, grads = accumulate(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    shape = (cfg.batch, cfg.seq_len + 1)
    init = lambda rng, tokens: model.init(rng, tokens[:, :-1])["params"]
    if size == "tiny":
        tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, shape,
                                                               dtype=np.int32))
        params = jax.jit(init)(jax.random.PRNGKey(0), tokens)
        opt_state = tx.init(params)
    else:
        tokens = jax.ShapeDtypeStruct(shape, jnp.int32)
        params = jax.eval_shape(init, jax.random.PRNGKey(0), tokens)
        opt_state = jax.eval_shape(tx.init, params)
    return train_step, (params, opt_state, tokens)
