"""BERT-MoE: the BERT encoder with every other layer's FFN replaced by a GShard-style mixture of
experts — softmax router, top-2 gating, per-sequence expert capacity, tokens over capacity dropped,
dispatch/combine by einsum with expert weights stacked as [E, d, ffn]; plus a load-balancing loss."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from .bert import Encoder, mlm_batch, mlm_loss
from .common import init_state, make_batch, make_train_step, pick_config


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int
    d: int
    heads: int
    ffn: int
    seq: int
    vocab: int
    batch: int
    experts: int
    capacity_factor: float
    moe_every: int = 2  # layers i with i % moe_every == moe_every - 1 are MoE
    aux_weight: float = 0.01
    mask_rate: float = 0.15
    lr: float = 1e-3

    @property
    def capacity(self) -> int:
        """Slots per expert per sequence (group): ceil(cf · top-2 · seq / E), at most seq."""
        return min(self.seq, math.ceil(self.capacity_factor * 2 * self.seq / self.experts))


CONFIGS = {
    "tiny": Config(layers=2, d=64, heads=4, ffn=128, seq=16, vocab=64, batch=16, experts=4,
                   capacity_factor=1.25),
    "small": Config(layers=4, d=128, heads=4, ffn=512, seq=64, vocab=512, batch=32, experts=8,
                    capacity_factor=1.25),
    "paper": Config(layers=12, d=768, heads=12, ffn=3072, seq=128, vocab=30522, batch=32 * 8,
                    experts=2 * 8, capacity_factor=2.5, lr=1e-4),
}


def config(name: str = "tiny", devices: int = 8, batch: int | None = None) -> Config:
    return pick_config(CONFIGS, name, devices, global_batch=batch, batch=32, experts=2)


class MoE(nnx.Module):
    """Top-2 mixture of GELU FFN experts. Each sequence is one routing group, so capacity and
    token dropping never couple different batch rows. Returns (output, aux load-balancing loss)."""

    def __init__(self, d: int, hidden: int, experts: int, capacity: int, aux_weight: float, *, rngs: nnx.Rngs):
        self.experts, self.capacity, self.aux_weight = experts, capacity, aux_weight
        self.router = nnx.Linear(d, experts, use_bias=False, rngs=rngs)
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.w_up = nnx.Param(init(rngs.params(), (experts, d, hidden), jnp.float32))
        self.b_up = nnx.Param(jnp.zeros((experts, hidden), jnp.float32))
        self.w_down = nnx.Param(init(rngs.params(), (experts, hidden, d), jnp.float32))
        self.b_down = nnx.Param(jnp.zeros((experts, d), jnp.float32))

    def __call__(self, x: jax.Array):  # x: [G groups, S tokens, d]
        E, C = self.experts, self.capacity
        probs = jax.nn.softmax(self.router(x), axis=-1)  # [G, S, E]
        _, top = jax.lax.top_k(jax.lax.stop_gradient(probs), 2)  # choice only; gates carry the grad
        mask1 = jax.nn.one_hot(top[..., 0], E, dtype=jnp.float32)
        mask2 = jax.nn.one_hot(top[..., 1], E, dtype=jnp.float32)
        gate1, gate2 = (probs * mask1).sum(-1), (probs * mask2).sum(-1)  # [G, S]
        norm = gate1 + gate2 + 1e-9
        gate1, gate2 = gate1 / norm, gate2 / norm

        # Load balancing (GShard/Switch): E · Σ_e mean_s(prob_e) · mean_s(first choice is e).
        aux = E * (probs.mean(axis=1) * mask1.mean(axis=1)).sum(-1).mean()

        # Slot of each token in its expert's buffer: running count over the sequence; first
        # choices are placed before second choices; tokens past capacity are dropped.
        pos1 = jnp.cumsum(mask1, axis=1) - 1.0
        mask1 = mask1 * (pos1 < C)
        pos2 = jnp.cumsum(mask2, axis=1) - 1.0 + mask1.sum(axis=1, keepdims=True)
        mask2 = mask2 * (pos2 < C)
        slot1 = jax.nn.one_hot((pos1 * mask1).sum(-1).astype(jnp.int32), C, dtype=jnp.float32)  # [G, S, C]
        slot2 = jax.nn.one_hot((pos2 * mask2).sum(-1).astype(jnp.int32), C, dtype=jnp.float32)
        route1 = mask1[..., :, None] * slot1[..., None, :]  # [G, S, E, C]
        route2 = mask2[..., :, None] * slot2[..., None, :]
        dispatch = route1 + route2
        combine = gate1[..., None, None] * route1 + gate2[..., None, None] * route2

        xe = jnp.einsum("gsec,gsd->egcd", dispatch, x)  # expert inputs [E, G, C, d]
        h = jax.nn.gelu(jnp.einsum("egcd,edf->egcf", xe, self.w_up[...]) + self.b_up[...][:, None, None])
        ye = jnp.einsum("egcf,efd->egcd", h, self.w_down[...]) + self.b_down[...][:, None, None]
        y = jnp.einsum("gsec,egcd->gsd", combine, ye)
        return y, self.aux_weight * aux


def build(name: str = "tiny", *, devices: int = 8, abstract: bool = False,
          batch: int | None = None):
    cfg = config(name, devices, batch)
    tx = optax.adamw(cfg.lr)

    def make_ffn(i, rngs):
        if i % cfg.moe_every != cfg.moe_every - 1:
            return None
        return MoE(cfg.d, cfg.ffn, cfg.experts, cfg.capacity, cfg.aux_weight, rngs=rngs)

    make_model = lambda: Encoder(cfg, make_ffn=make_ffn, rngs=nnx.Rngs(0))
    graphdef, params, opt_state = init_state(make_model, tx, abstract)
    step = make_train_step(mlm_loss, tx, graphdef)
    return step, (params, opt_state, make_batch(lambda k: mlm_batch(k, cfg), abstract))
