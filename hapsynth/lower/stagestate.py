"""A pipelined program's state in its per-stage buffers (global `[stages, size]` per
buffer, each device storing its stage's row): the step's state leaves packed in, the
buffers handed back as `Staged` leaves, and a stage's leaves read out inside the body."""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from hapsynth.lower.packing import dtype_of
from hapsynth.lower.place import STAGE
from hapsynth.lower.ticklayout import TickLayout
from hapsynth.lower.values import Sharded, Staged, unshard

__all__ = ["pack_state", "staged", "stage_leaves"]


def pack_state(lay: TickLayout, mesh, owner, leaves, nstate: int) -> tuple:
    """State leaves (arrays, or `Staged` of program `owner`) as the per-stage buffers:
    the buffers themselves where the leaves are `owner`'s last state, as it left them."""
    state = leaves[:nstate]
    if state and all(isinstance(x, Staged) and x.owner is owner and x.buffers is state[0].buffers
                     and lay.state_packing[x.stage].slots.get(p) == (x.key, x.offset, x.shape)
                     for p, x in enumerate(state)):
        return tuple(state[0].buffers[k] for k in lay.state_order)
    rows = {k: np.zeros((lay.stages, n), dtype_of(k)) for k, n in lay.state_sizes.items()}
    for s, p in enumerate(lay.state_packing):
        for key, (k, off, shape) in p.slots.items():
            x = leaves[key]
            x = x.value() if isinstance(x, Staged) else x
            if isinstance(x, Sharded):
                x = unshard(x)
            rows[k][s, off:off + int(np.prod(shape, dtype=np.int64))] = np.ravel(np.asarray(x))
    sharding = NamedSharding(mesh, PS(STAGE, None))
    return tuple(jax.device_put(rows[k], sharding) for k in lay.state_order)


def staged(lay: TickLayout, bufs: dict, stage_of: list, owner) -> list:
    """Each state leaf as a `Staged` view of buffers `bufs` (by name); `stage_of[p]`: the
    stage storing leaf p."""
    out = []
    for p, s in enumerate(stage_of):
        k, off, shape = lay.state_packing[s].slots[p]
        out.append(Staged(bufs, s, k, off, shape, dtype_of(k), owner))
    return out


def stage_leaves(prog, lay: TickLayout, s: int, ctx: dict, copies: dict) -> dict:
    """Traced: stage s's state by tensor id, what it stores (`ctx["state"]`, this
    device's buffers) and the copies it received (`ctx["copies"][s]`, of `copies[s]`)."""
    out = {prog.inputs[p]: v for p, v in lay.state_packing[s].unpack(
        tuple(ctx["state"]), lay.state_order).items()}
    for ref, bufs in zip(copies.get(s, []), ctx["copies"][s]):
        out.update({prog.inputs[k[1]]: v for k, v in ref.packing.unpack(
            tuple(bufs), ref.order).items()})
    return out
