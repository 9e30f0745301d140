"""How values cross between the stages of a pipeline run free (`freerun.py`): a sharded
value leaves its stage as the microbatch's rows in order, split over the stage's devices
(gathered whole first where they hold uneven rows), and is re-laid, where the two
stages' layouts differ, as the receiving devices take it, before `jax.device_put` moves
it (`moves.py`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from hapsynth.lower.packing import pad_to, trim

if TYPE_CHECKING:
    from hapsynth.lower.freerun import FreeRunning

__all__ = ["DATA", "crossing", "leave", "relayout"]

DATA = "data"


def leave(w: FreeRunning, s, t, v):
    """Traced: value t as stage s's devices hold it (padded to the most rows) as it
    leaves: sharded over devices of uneven rows, gathered whole (the devices' rows in
    order). No partial sum crosses (`synth.stages.analyse` keeps its readers with it)."""
    lay = w.plan.tensor_layouts[t]
    if lay.kind != "S" or w.even[s]:
        return v
    chunks = jax.lax.all_gather(v, DATA)
    return jnp.concatenate([trim(chunks[j], lay, w._local(t, r))
                            for j, r in enumerate(w.rows[s])], axis=lay.dim)


def crossing(w: FreeRunning, t, sender=None) -> PS:
    """How value t lies as it crosses: split on its batch dimension over a stage's
    devices where sharded (each device its own rows, so that a stage of other devices
    takes its rows from it), else whole. Leaving a `sender` of uneven rows, sharded
    values are whole (`leave`)."""
    lay = w.plan.tensor_layouts[t]
    if lay.kind == "S" and (sender is None or w.even[sender]):
        return PS(*([None] * lay.dim), DATA)
    return PS()


def relayout(w: FreeRunning, t, a, b):
    """(a program on a's devices or None, b's sharding) for value t from stage a to b.
    A sharded value whose layouts differ (uneven rows on either side, or unequal
    device counts) is first re-laid on a's devices as b's devices take it, their rows
    each padded to the most (each trims its own): split over a's devices where the
    counts match, so that it crosses as it lies (what a transfer across processes
    needs), else whole."""
    lay = w.plan.tensor_layouts[t]
    where = NamedSharding(w.meshes[b], crossing(w, t))
    na, nb = w.meshes[a].devices.size, w.meshes[b].devices.size
    if lay.kind != "S" or w.even[a] and w.even[b] and na == nb:
        return None, where
    scale = w.prog.avals[t].shape[lay.dim] // w.r.batch
    most = max(w.rows[b]) * scale

    def rechunk(x):
        return jnp.concatenate([pad_to(jax.lax.slice_in_dim(
            x, o * scale, (o + r) * scale, axis=lay.dim), lay, (
            *x.shape[:lay.dim], most, *x.shape[lay.dim + 1:]))
            for o, r in zip(w._offsets(b), w.rows[b])], axis=lay.dim)
    on_a = NamedSharding(w.meshes[a], crossing(w, t)) if na == nb else \
        NamedSharding(w.meshes[a], PS())
    return jax.jit(rechunk, out_shardings=on_a), where
