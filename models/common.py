"""Shared pieces of the model zoo: config lookup, state/batch builders, the generic
train step, and the transformer layers (attention, FFN, block) used by ViT/BERT/GPT/MoE."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

# "medium": GPT-2-medium; "1.3b", "6.7b", "13b": GPT-3 XL, 6.7B and 13B sizes (gpt only)
CONFIG_NAMES = ("tiny", "small", "paper", "medium", "1.3b", "6.7b", "13b")
BIG = ("paper", "medium", "1.3b", "6.7b", "13b")  # planned from abstract shapes by default
EMBED_INIT = nnx.initializers.normal(0.02)


# ----------------------------------------------------------------------------- configs

def pick_config(configs: dict, name: str, devices: int, global_batch: int | None = None,
                **per_device: int):
    """Return ``configs[name]``; for "paper", each field in ``per_device`` becomes value × devices
    (e.g. ``batch=32`` → global batch 32·devices, as in HAP's evaluation); ``global_batch``,
    when given, is the batch whatever the size and devices."""
    if name not in configs:
        raise ValueError(f"unknown config {name!r}; valid configs: {sorted(configs)}")
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive int, got {devices!r}")
    cfg = configs[name]
    if name == "paper" and per_device:
        cfg = dataclasses.replace(cfg, **{k: v * devices for k, v in per_device.items()})
    if global_batch is not None:
        if not isinstance(global_batch, int) or global_batch < 1:
            raise ValueError(f"batch must be a positive int, got {global_batch!r}")
        cfg = dataclasses.replace(cfg, batch=global_batch)
    return cfg


# ----------------------------------------------------------------------------- state & batches

def init_state(make_model: Callable[[], nnx.Module], tx: optax.GradientTransformation, abstract: bool):
    """Build (graphdef, params, opt_state). With ``abstract`` nothing is allocated: the model is
    built under ``nnx.eval_shape`` and every leaf is a ``jax.ShapeDtypeStruct``."""
    model = nnx.eval_shape(make_model) if abstract else make_model()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(rest):  # the step is a function of params only: no BatchNorm stats, no RNG state
        raise TypeError(f"model has non-Param state, which the zoo's train steps do not carry: {rest}")
    opt_state = jax.eval_shape(tx.init, params) if abstract else tx.init(params)
    return graphdef, params, opt_state


def init_plain(init_fn: Callable[[], Any], tx: optax.GradientTransformation, abstract: bool):
    """(params, opt_state) for a model whose params are a plain pytree built by ``init_fn()``."""
    params = jax.eval_shape(init_fn) if abstract else init_fn()
    opt_state = jax.eval_shape(tx.init, params) if abstract else tx.init(params)
    return params, opt_state


def make_batch(batch_fn: Callable[[jax.Array], dict], abstract: bool, seed: int = 1) -> dict:
    """Deterministic batch ``batch_fn(jax.random.key(seed))``, or its shapes only when abstract."""
    fn = lambda: batch_fn(jax.random.key(seed))
    return jax.eval_shape(fn) if abstract else fn()


def param_count(params) -> int:
    """Number of scalars in a params pytree (arrays or ShapeDtypeStructs)."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


# ----------------------------------------------------------------------------- train step

def make_train_step(loss_fn: Callable[[Any, dict], jax.Array], tx: optax.GradientTransformation,
                    graphdef: nnx.GraphDef | None = None):
    """Pure ``train_step(params, opt_state, batch) -> (params, opt_state, loss)``: forward,
    ``value_and_grad`` and the Optax update all inside. With a ``graphdef`` (closed over, static)
    ``loss_fn`` receives the merged nnx module; without, it receives the params pytree itself."""

    def loss_of_params(params, batch):
        model = nnx.merge(graphdef, params) if graphdef is not None else params
        return loss_fn(model, batch)

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_of_params)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss.astype(jnp.float32)

    return train_step


def cross_entropy(logits: jax.Array, labels: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """Mean softmax cross-entropy over integer labels (optionally weighted, e.g. the MLM mask)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    if weights is None:
        return ce.mean()
    return (ce * weights).sum() / jnp.maximum(weights.sum(), 1.0)


# ----------------------------------------------------------------------------- transformer layers

class Attention(nnx.Module):
    """Multi-head self-attention, written out: q/k/v/out projections without bias (a key bias
    has an exactly-zero true gradient, which Adam turns into noise-driven updates)."""

    def __init__(self, d: int, heads: int, *, causal: bool = False, rngs: nnx.Rngs):
        assert d % heads == 0, (d, heads)
        self.heads, self.causal = heads, causal
        self.q, self.k, self.v, self.o = (nnx.Linear(d, d, use_bias=False, rngs=rngs) for _ in range(4))

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, d = x.shape
        h = self.heads
        split = lambda t: t.reshape(b, s, h, d // h)
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // h)
        if self.causal:
            keep = jnp.tril(jnp.ones((s, s), dtype=bool))
            scores = jnp.where(keep, scores, jnp.float32(-1e9))
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
        return self.o(out)


class FFN(nnx.Module):
    """Position-wise feed-forward: Linear → GELU → Linear."""

    def __init__(self, d: int, hidden: int, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(d, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, d, rngs=rngs)

    def __call__(self, x: jax.Array):
        return self.down(jax.nn.gelu(self.up(x))), None  # (output, aux loss or None)


class Block(nnx.Module):
    """Transformer layer: self-attention + FFN with residuals; pre-LN (GPT/ViT) or post-LN (BERT).
    ``ffn`` may be replaced (MoE); it returns ``(y, aux)`` where aux is an extra loss or None."""

    def __init__(self, d: int, heads: int, hidden: int, *, causal: bool = False, post_ln: bool = False,
                 ffn: nnx.Module | None = None, rngs: nnx.Rngs):
        self.post_ln = post_ln
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = Attention(d, heads, causal=causal, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.ffn = ffn if ffn is not None else FFN(d, hidden, rngs=rngs)

    def __call__(self, x: jax.Array):
        if self.post_ln:
            x = self.ln1(x + self.attn(x))
            y, aux = self.ffn(x)
            return self.ln2(x + y), aux
        x = x + self.attn(self.ln1(x))
        y, aux = self.ffn(self.ln2(x))
        return x + y, aux


def run_blocks(blocks, x: jax.Array):
    """Apply blocks in order (unrolled, so every layer is visible in the jaxpr); sum aux losses."""
    aux_total = None
    for blk in blocks:
        x, aux = blk(x)
        if aux is not None:
            aux_total = aux if aux_total is None else aux_total + aux
    return x, aux_total
