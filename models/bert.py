"""BERT-style encoder: token + learned position embeddings, post-LN GELU layers, and a
masked-LM head (dense → GELU → LN → logits tied to the token embedding, plus an output bias).
Loss: cross-entropy at the masked positions only; AdamW. "paper" is BERT-base (≈109M params)."""
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
    layers: int
    d: int
    heads: int
    ffn: int
    seq: int
    vocab: int
    batch: int
    mask_rate: float = 0.15
    lr: float = 1e-3


CONFIGS = {
    "tiny": Config(layers=2, d=64, heads=4, ffn=128, seq=16, vocab=64, batch=16),
    "small": Config(layers=4, d=128, heads=4, ffn=512, seq=64, vocab=512, batch=32),
    "paper": Config(layers=12, d=768, heads=12, ffn=3072, seq=128, vocab=30522, batch=32 * 8, lr=1e-4),
}


def config(name: str = "tiny", devices: int = 8, batch: int | None = None) -> Config:
    return pick_config(CONFIGS, name, devices, global_batch=batch, batch=32)


class Encoder(nnx.Module):
    """Embeddings → post-LN blocks → MLM head. ``make_ffn(i, rngs)`` may return a custom FFN for
    layer i (MoE uses this); None keeps the dense FFN. Returns (logits, aux loss or None)."""

    def __init__(self, cfg, *, make_ffn=lambda i, rngs: None, rngs: nnx.Rngs):
        self.tok = nnx.Embed(cfg.vocab, cfg.d, embedding_init=EMBED_INIT, rngs=rngs)
        self.pos = nnx.Param(EMBED_INIT(rngs.params(), (cfg.seq, cfg.d), jnp.float32))
        self.ln_emb = nnx.LayerNorm(cfg.d, rngs=rngs)
        self.blocks = nnx.List([Block(cfg.d, cfg.heads, cfg.ffn, post_ln=True, ffn=make_ffn(i, rngs), rngs=rngs)
                                for i in range(cfg.layers)])
        self.head = nnx.Linear(cfg.d, cfg.d, rngs=rngs)
        self.ln_head = nnx.LayerNorm(cfg.d, rngs=rngs)
        self.out_bias = nnx.Param(jnp.zeros((cfg.vocab,), jnp.float32))

    def __call__(self, tokens: jax.Array):
        x = self.ln_emb(self.tok(tokens) + self.pos[...][None, : tokens.shape[1]])
        x, aux = run_blocks(self.blocks, x)
        h = self.ln_head(jax.nn.gelu(self.head(x)))
        return self.tok.attend(h) + self.out_bias[...], aux


def mlm_batch(key: jax.Array, cfg) -> dict:
    """Random tokens in [1, vocab); a fixed ``mask_rate`` share of positions replaced by id 0
    ([MASK]); ``weights`` is 1.0 at the masked positions, where the loss is taken."""
    kt, km = jax.random.split(key)
    targets = jax.random.randint(kt, (cfg.batch, cfg.seq), 1, cfg.vocab, jnp.int32)
    masked = jax.random.uniform(km, (cfg.batch, cfg.seq)) < cfg.mask_rate
    return {"tokens": jnp.where(masked, 0, targets), "targets": targets,
            "weights": masked.astype(jnp.float32)}


def mlm_loss(model, batch) -> jax.Array:
    logits, aux = model(batch["tokens"])
    loss = cross_entropy(logits, batch["targets"], batch["weights"])
    return loss if aux is None else loss + aux


def build(name: str = "tiny", *, devices: int = 8, abstract: bool = False,
          batch: int | None = None):
    cfg = config(name, devices, batch)
    tx = optax.adamw(cfg.lr)
    graphdef, params, opt_state = init_state(lambda: Encoder(cfg, rngs=nnx.Rngs(0)), tx, abstract)
    step = make_train_step(mlm_loss, tx, graphdef)
    return step, (params, opt_state, make_batch(lambda k: mlm_batch(k, cfg), abstract))
