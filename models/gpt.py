"""GPT-style causal decoder: pre-LN blocks with causal attention, tied input/output embeddings
(logits = h · Eᵀ), next-token loss; global-norm clipping (1.0) + AdamW. "paper": 12×768, vocab 50257;
"medium": GPT-2-medium, 24×1024, sequence 1024, batch 64; "1.3b", "6.7b", "13b": GPT-3 XL, 6.7B and 13B."""
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
    lr: float = 1e-3


CONFIGS = {
    "tiny": Config(layers=2, d=64, heads=4, ffn=128, seq=16, vocab=64, batch=16),
    "small": Config(layers=4, d=128, heads=4, ffn=512, seq=64, vocab=512, batch=32),
    "paper": Config(layers=12, d=768, heads=12, ffn=3072, seq=128, vocab=50257, batch=32 * 8, lr=1e-4),
    # GPT-2-medium (~355M parameters) at sequence 1024 and global batch 64, whatever the
    # devices: the size where HARP (EuroSys '26) pipelines across islands
    "medium": Config(layers=24, d=1024, heads=16, ffn=4096, seq=1024, vocab=50257, batch=64,
                     lr=1e-4),
    # LLM sizes whose state no single GPU of the presets holds with its activations (GPT-3's
    # XL and 6.7B shapes, heads of 128): 128 sequences of 1024 tokens, vocabulary 50304
    "1.3b": Config(layers=24, d=2048, heads=16, ffn=8192, seq=1024, vocab=50304, batch=128,
                   lr=1e-4),
    "6.7b": Config(layers=32, d=4096, heads=32, ffn=16384, seq=1024, vocab=50304, batch=128,
                   lr=1e-4),
    "13b": Config(layers=40, d=5120, heads=40, ffn=20480, seq=1024, vocab=50304, batch=128,
                  lr=1e-4),
}


def config(name: str = "tiny", devices: int = 8, batch: int | None = None) -> Config:
    return pick_config(CONFIGS, name, devices, global_batch=batch, batch=32)


class GPT(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.tok = nnx.Embed(cfg.vocab, cfg.d, embedding_init=EMBED_INIT, rngs=rngs)
        self.pos = nnx.Param(EMBED_INIT(rngs.params(), (cfg.seq, cfg.d), jnp.float32))
        self.blocks = nnx.List([Block(cfg.d, cfg.heads, cfg.ffn, causal=True, rngs=rngs)
                                for _ in range(cfg.layers)])
        self.ln = nnx.LayerNorm(cfg.d, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.tok(tokens) + self.pos[...][None, : tokens.shape[1]]
        x, _ = run_blocks(self.blocks, x)
        return self.tok.attend(self.ln(x))  # tied output projection


def build(name: str = "tiny", *, devices: int = 8, abstract: bool = False,
          batch: int | None = None):
    cfg = config(name, devices, batch)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(cfg.lr))
    graphdef, params, opt_state = init_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), tx, abstract)

    def batch_fn(key):
        seq = jax.random.randint(key, (cfg.batch, cfg.seq + 1), 0, cfg.vocab, jnp.int32)
        return {"inputs": seq[:, :-1], "targets": seq[:, 1:]}

    def loss_fn(model, batch):
        return cross_entropy(model(batch["inputs"]), batch["targets"])

    step = make_train_step(loss_fn, tx, graphdef)
    return step, (params, opt_state, make_batch(batch_fn, abstract))
