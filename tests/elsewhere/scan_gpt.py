"""A GPT in plain JAX, the MaxText / levanter way: no NN library.

The parameters are a dict of arrays; every per-layer weight is stacked on a leading
layer axis and the blocks run under `jax.lax.scan` over that axis, the block body
rematerialised with `jax.checkpoint`.  Tied token embedding, learned positions,
pre-LayerNorm, a `jnp.tril` causal mask, next-token loss on ``ids[:, :-1] -> ids[:, 1:]``
with optax, AdamW with a warmup-cosine schedule and decoupled weight decay on the
matrices only.

Sizes: ``tiny`` (vocab 256, width 64, 4 heads, 2 layers, batch 16 x 32 tokens) and
``paper`` (BERT-base size: vocab 30522, width 768, 12 heads, 12 layers, MLP 3072,
batch 2048 x 128 tokens, i.e. ids of length 129; abstract); ``medium`` (GPT-2-medium
size: 24 layers of width 1024, batch 64 x 1024 tokens; abstract).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax


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
    lr: float = 3e-4
    warmup: int = 2000
    total_steps: int = 100_000
    weight_decay: float = 0.1


CONFIGS = {
    "tiny": Config(vocab_size=256, d_model=64, n_heads=4, n_layers=2, d_ff=256,
                   max_len=32, batch=16, seq_len=32, lr=1e-2, warmup=1, total_steps=100),
    "paper": Config(vocab_size=30522, d_model=768, n_heads=12, n_layers=12, d_ff=3072,
                    max_len=128, batch=2048, seq_len=128),
    # GPT-2-medium size, as the zoo's gpt "medium" (the pipeline benchmark's row)
    "medium": Config(vocab_size=50257, d_model=1024, n_heads=16, n_layers=24, d_ff=4096,
                     max_len=1024, batch=64, seq_len=1024),
}


def init_params(key, cfg: Config) -> dict:
    """GPT-2 initialisation; residual projections scaled by 1/sqrt(2 * n_layers)."""
    L, D, F = cfg.n_layers, cfg.d_model, cfg.d_ff
    std, res_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layers)
    k_wte, k_wpe, k_qkv, k_o, k_fc, k_proj = jax.random.split(key, 6)
    normal = jax.nn.initializers.normal
    return {
        "wte": normal(std)(k_wte, (cfg.vocab_size, D)),
        "wpe": normal(0.01)(k_wpe, (cfg.max_len, D)),
        "layers": {
            "ln1": {"scale": jnp.ones((L, D)), "bias": jnp.zeros((L, D))},
            "attn": {
                "w_qkv": normal(std)(k_qkv, (L, D, 3 * D)),
                "b_qkv": jnp.zeros((L, 3 * D)),
                "w_o": normal(res_std)(k_o, (L, D, D)),
                "b_o": jnp.zeros((L, D)),
            },
            "ln2": {"scale": jnp.ones((L, D)), "bias": jnp.zeros((L, D))},
            "mlp": {
                "w_fc": normal(std)(k_fc, (L, D, F)),
                "b_fc": jnp.zeros((L, F)),
                "w_proj": normal(res_std)(k_proj, (L, F, D)),
                "b_proj": jnp.zeros((L, D)),
            },
        },
        "ln_f": {"scale": jnp.ones((D,)), "bias": jnp.zeros((D,))},
    }


def layer_norm(x, p, eps=1e-5):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def attention(x, p, n_heads):
    B, T, D = x.shape
    qkv = x @ p["w_qkv"] + p["b_qkv"]
    q, k, v = jnp.split(qkv, 3, axis=-1)
    q, k, v = (t.reshape(B, T, n_heads, D // n_heads) for t in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(D // n_heads).astype(x.dtype)
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    scores = jnp.where(causal[None, None], scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, T, D)
    return out @ p["w_o"] + p["b_o"]


def mlp(x, p):
    h = jax.nn.gelu(x @ p["w_fc"] + p["b_fc"])
    return h @ p["w_proj"] + p["b_proj"]


def block(x, layer, n_heads):
    """One pre-LN transformer block; `layer` is one slice of params["layers"]."""
    x = x + attention(layer_norm(x, layer["ln1"]), layer["attn"], n_heads)
    x = x + mlp(layer_norm(x, layer["ln2"]), layer["mlp"])
    return x


def embed(params, ids):
    T = ids.shape[1]
    return params["wte"][ids] + params["wpe"][:T]


def unembed(params, x):
    x = layer_norm(x, params["ln_f"])
    return jnp.einsum("btd,vd->btv", x, params["wte"])  # tied embedding


def forward(params, ids, cfg: Config):
    x = embed(params, ids)

    @functools.partial(jax.checkpoint, prevent_cse=False,
                       policy=jax.checkpoint_policies.nothing_saveable)
    def body(x, layer):
        return block(x, layer, cfg.n_heads), None

    x, _ = jax.lax.scan(body, x, params["layers"])
    return unembed(params, x)


def next_token_loss(logits, ids):
    targets = ids[:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


_DECAYED = ("wte", "wpe", "w_qkv", "w_o", "w_fc", "w_proj")


def decay_mask(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in _DECAYED, params)


def make_optimizer(cfg: Config):
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=cfg.lr / cfg.warmup, peak_value=cfg.lr, warmup_steps=cfg.warmup,
        decay_steps=cfg.total_steps, end_value=cfg.lr * 0.1)
    return optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8,
                       weight_decay=cfg.weight_decay, mask=decay_mask)


def make_train_step(forward_fn, cfg: Config, tx):
    def loss_fn(params, ids):
        logits = forward_fn(params, ids[:, :-1], cfg)
        return next_token_loss(logits, ids)

    def train_step(params, opt_state, ids):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    return train_step


def example_args(cfg: Config, tx, init_fn=init_params, abstract: bool = False):
    key = jax.random.PRNGKey(0)
    ids_shape = (cfg.batch, cfg.seq_len + 1)
    if abstract:
        params = jax.eval_shape(lambda: init_fn(key, cfg))
        opt_state = jax.eval_shape(tx.init, params)
        ids = jax.ShapeDtypeStruct(ids_shape, jnp.int32)
    else:
        params = init_fn(key, cfg)
        opt_state = tx.init(params)
        ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, ids_shape,
                                                            dtype=np.int32))
    return params, opt_state, ids


def make(size: str = "tiny"):
    cfg = CONFIGS[size]
    tx = make_optimizer(cfg)
    return make_train_step(forward, cfg, tx), example_args(cfg, tx, abstract=size != "tiny")
