"""How values cross between the stages of a pipelined program: per tick, each shift's
wire (`ppermute` on the stage axis; gathered over "data" first where sender and
receiver split their rows differently), and whole values sent once per step (copied
parameters, values a round of once-per-step ops reads from another stage)."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from hapsynth.ir.trace import Program
from hapsynth.lower.packing import Packing, Ref, bundle, dtype_of
from hapsynth.lower.place import DATA, STAGE
from hapsynth.lower.ticklayout import TickLayout

__all__ = ["cross", "cross_late", "send_once"]


def cross(lay: TickLayout, d: int, pairs, *bufs) -> tuple:
    """What stages `pairs` send on shift d, as their receivers get it."""
    if not pairs:  # read by no one
        return tuple(jnp.broadcast_to(b, (lay.stage_devices, *b.shape)) for b in bufs) \
            if lay.chunked[d] else bufs
    if lay.chunked[d]:
        bufs = tuple(lax.all_gather(b, DATA) for b in bufs)
    return tuple(lax.ppermute(b, STAGE, list(pairs)) for b in bufs)


def cross_late(lay: TickLayout, sidx, made: dict) -> dict:
    """What the last tick made (per shift, its buffers per dtype), as its receivers get
    it: per shift a dict by dtype. A round of two opposite shifts crosses in one
    `ppermute`, each stage sending its own shift's buffers, padded to the wider."""
    out = {}
    for rnd in lay.rounds:
        if len(rnd) == 1:
            d, = rnd
            out[d] = dict(zip(lay.wire_sizes[d], cross(lay, d, lay.senders[d][2], *made[d])))
            continue
        sizes: dict = {}
        for d in rnd:
            for k, n in lay.wire_sizes[d].items():
                sizes[k] = max(sizes.get(k, 0), n)
        mine = [dict(zip(lay.wire_sizes[d], made[d])) for d in rnd]

        def fill(x, k, n):
            return jnp.zeros((n,), dtype_of(k)) if x is None else \
                jnp.pad(x, (0, n - x.shape[0]))
        first = jnp.asarray([any(a == s for a, _ in lay.senders[rnd[0]][2])
                             for s in range(lay.stages)])[sidx]
        both = tuple(jnp.where(first, fill(mine[0].get(k), k, n), fill(mine[1].get(k), k, n))
                     for k, n in sizes.items())
        got = dict(zip(sizes, lax.ppermute(
            both, STAGE, [*lay.senders[rnd[0]][2], *lay.senders[rnd[1]][2]])))
        for d in rnd:
            out[d] = {k: got[k][:n] for k, n in lay.wire_sizes[d].items()}
    return out


def send_once(prog: Program, stages: int, sidx, wants: dict, values_of) -> dict:
    """Whole values sent between stages once: `wants[(src, dst)]` lists keys, ("leaf", p)
    for state leaf p or ("t", x) for value x; the sender's `values_of(src, env)` gives
    them. Returns dst -> [Ref]."""
    by_shift: dict = {}
    for (a, b), keys in wants.items():
        if keys:
            by_shift.setdefault(b - a, {})[a] = (b, keys)
    got: dict = {}
    for d, senders in sorted(by_shift.items()):
        packs = {a: Packing([(k, _whole(prog, k).shape, _whole(prog, k).dtype) for k in keys])
                 for a, (b, keys) in senders.items()}
        sizes = bundle(packs.values())

        def branch(a, packs=packs, sizes=sizes):
            def f():
                if a not in packs:
                    return tuple(jnp.zeros((n,), k) for k, n in sizes.items())
                vals = values_of(a, {})
                return packs[a].pack(vals, sizes)
            return f

        bufs = lax.switch(sidx, [branch(a) for a in range(stages)])
        bufs = tuple(lax.ppermute(b, STAGE, [(a, a + d) for a in senders]) for b in bufs)
        for a, (b, _) in senders.items():
            got.setdefault(b, []).append(Ref(bufs, tuple(sizes), packs[a], sender=a))
    return got


def _whole(prog: Program, key):
    """The aval of a key of `send_once`."""
    return prog.avals[prog.inputs[key[1]] if key[0] == "leaf" else key[1]]
