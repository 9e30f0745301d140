"""Checkpointing by segments: what `jax.checkpoint` around each layer does, found in the
traced step instead of written by its author.

Cheap recomputation (`ir/remat.py`) keeps every contraction's result across the memory
peak; at LLM sizes those alone exceed a GPU. Here the forward pass is cut where little
crosses: positions where the bytes still to be read by later forward ops are near their
smallest (a transformer's residual stream between its blocks, found from the liveness
profile, not from names). Only what crosses a cut is kept; every other activation the
backward pass reads is recomputed from its segment's checkpoints, the whole segment at
once, just before the first backward op that reads one of them. Parameters the
segment reads are copied one segment earlier (at the previous segment's point in the
backward pass), so a parameter stored sharded is gathered again for the backward pass
instead of being held gathered from the forward (`remat._rewrite`'s `deep`), and that
gather can run behind the previous segment's compute (FSDP's backward prefetch). The price is about one more forward pass, which the planner
weighs against memory like any other choice.
"""
from __future__ import annotations

import numpy as np

from hapsynth.ir.fusion import fused_away
from hapsynth.ir.remat import _rewrite, live_profile, recomputable
from hapsynth.ir.rules import cost_for
from hapsynth.ir.trace import Program

MAX_SEGMENT = 4000  # eqns recomputed for one segment at most


def checkpointed(prog: Program) -> Program | None:
    """`prog` with each forward segment recomputed before its backward pass, keeping only
    what crosses the cuts; None where the forward has no cut or nothing is recomputed."""
    eqns = prog.eqns
    if not eqns:
        return None
    p = int(np.argmax(live_profile(prog)))  # the end of the forward pass
    producer = {t: i for i, e in enumerate(eqns) for t in e.outputs}
    readers: dict[int, list[int]] = {}
    end_of = {lp.id: lp.end - 1 for lp in prog.loops}
    for i, e in enumerate(eqns):
        for x in e.inputs:
            if isinstance(x, int):
                readers.setdefault(x, []).append(end_of.get(e.loop, i) if e.loop is not None
                                                 else i)
    fused = fused_away(prog, [cost_for(e) for e in eqns])
    cuts, keep = _cuts(prog, p, producer, readers, fused)
    if not cuts:
        return None
    outputs = {x for x in prog.outputs if isinstance(x, int)}
    held = [t for t, i in producer.items()
            if i <= p and t not in fused and t not in keep and t not in outputs
            and any(r > p for r in readers.get(t, ()))]
    plans, segment_of = {}, {}
    bounds = np.array(cuts)
    for t in held:
        if not recomputable(eqns[producer[t]], deep=True):
            continue
        need = _chain(t, eqns, producer, keep)
        if need is None:
            continue
        plans[t] = need
        segment_of[t] = int(np.searchsorted(bounds, producer[t]))
    inputs = _segment_inputs(prog, p, bounds, producer, readers)
    plain = _all_readers(prog)
    where = _points(prog, p, plans, segment_of, producer, inputs, plain)
    plans = {t: c for t, c in plans.items() if t in where}
    if not plans:
        return None
    # a segment's step inputs (its weights) are copied at the previous segment's point in
    # the backward pass: gathered again there, one segment ahead (FSDP's backward prefetch)
    point_of = {segment_of[t]: at for t, at in where.items()}
    order = sorted(point_of, reverse=True)
    earlier = {k: point_of[order[i - 1]] if i else point_of[k] for i, k in enumerate(order)}
    copies: dict[int, set] = {}
    ahead: dict[int, set] = {}
    for t, at in where.items():
        k = segment_of[t]
        weights = inputs.get(k, set()) | {x for i in plans[t] for x in eqns[i].inputs
                                          if isinstance(x, int) and x not in producer}
        copies.setdefault(earlier[k], set()).update(weights)
        if earlier[k] != at:
            ahead.setdefault(at, set()).update(weights)
    return _rewrite(prog, plans, plain, p, where=where, deep=True, copies=copies, ahead=ahead)


def _segment_inputs(prog: Program, p: int, bounds, producer, readers) -> dict[int, set]:
    """Per segment: the step inputs its forward ops read that the backward reads again (a
    weight read by its own gradient's product and by the product passing the gradient
    on, not only by the recomputation)."""
    out: dict[int, set] = {}
    for i, e in enumerate(prog.eqns[:p + 1]):
        for x in e.inputs:
            if isinstance(x, int) and x not in producer and any(r > p for r in readers.get(x, ())):
                out.setdefault(int(np.searchsorted(bounds, i)), set()).add(x)
    return out


def _points(prog: Program, p: int, plans: dict, segment_of: dict, producer,
            inputs: dict, readers: dict) -> dict[int, int]:
    """Per recomputed tensor: where its segment is recomputed. Segments are taken in the
    backward pass's order (last first); each is recomputed before the first backward op,
    after the previous segment's point, that reads one of its activations or a step
    input its recomputation reads (a weight's own gradient is read before the
    activations are)."""
    eqns = prog.eqns
    start_of = {lp.id: lp.start for lp in prog.loops}
    at = [start_of[e.loop] if e.loop is not None else i for i, e in enumerate(eqns)]
    members: dict[int, list[int]] = {}
    for t, k in segment_of.items():
        members.setdefault(k, []).append(t)
    point, out = p, {}
    for k in sorted(members, reverse=True):
        ts = set(members[k])
        leaves = {x for t in ts for i in plans[t] for x in eqns[i].inputs
                  if isinstance(x, int) and x not in producer} | inputs.get(k, set())
        first = min((at[r] for x in ts | leaves for r in readers.get(x, ()) if at[r] > point),
                    default=None)
        if first is None:
            continue
        out.update({t: first for t in ts})
        point = first
    return out


def _all_readers(prog: Program) -> dict[int, list[int]]:
    readers: dict[int, list[int]] = {}
    for i, e in enumerate(prog.eqns):
        for x in e.inputs:
            if isinstance(x, int):
                readers.setdefault(x, []).append(i)
    return readers


def _cuts(prog: Program, p: int, producer, readers, fused) -> tuple[list[int], set[int]]:
    """Where to cut the forward pass (positions outside loops), and the checkpoints: what
    crosses the cuts to later forward ops. Candidates are the local minima of the bytes
    crossing each position; of the sets "every candidate at or below a bound", the one
    with the least checkpoints plus largest segment (held bytes made in it) is taken."""
    ts = np.array([t for t, i in producer.items() if i <= p and t not in fused], int)
    if not len(ts):
        return [], set()
    made = np.array([producer[t] for t in ts])
    fwd = [[r for r in readers.get(int(t), ()) if r <= p] for t in ts]
    last = np.array([max(r, default=-1) for r in fwd])
    back = np.array([any(r > p for r in readers.get(int(t), ())) for t in ts])
    size = np.array([prog.avals[int(t)].nbytes for t in ts], float)
    diff = np.zeros(p + 2)
    ok = last > made
    np.add.at(diff, made[ok], size[ok])
    np.add.at(diff, last[ok], -size[ok])
    crossing = np.cumsum(diff)[:p + 1]
    inside = np.array([e.loop is not None for e in prog.eqns[:p + 1]])
    minima = np.array([i for i in range(1, p) if not inside[i] and crossing[i] > 0
                       and crossing[i] <= crossing[i - 1] and crossing[i] < crossing[i + 1]], int)
    if len(minima) < 2:
        return [], set()
    best = (float("inf"), [], set())
    for bound in np.unique(crossing[minima]):
        cuts = minima[crossing[minima] <= bound]
        kept = np.zeros(len(ts), bool)
        for c in cuts:
            kept |= (made <= c) & (last > c)
        seg = np.searchsorted(cuts, made)
        spare = back & ~kept
        per = np.bincount(seg[spare], weights=size[spare], minlength=len(cuts) + 1)
        peak = float(size[kept].sum() + per.max())
        if peak < best[0]:
            best = (peak, [int(c) for c in cuts], {int(t) for t in ts[kept]})
    return best[1], best[2]


def _chain(t: int, eqns, producer, keep: set) -> list[int] | None:
    """Eqns (in program order) recomputing `t` from `keep` and the step's inputs; None
    where that needs a value no eqn may recompute, or more than `MAX_SEGMENT` eqns."""
    need, todo, seen = set(), [t], set()
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        i = producer[u]
        if not recomputable(eqns[i], deep=True):
            return None
        need.add(i)
        if len(need) > MAX_SEGMENT:
            return None
        todo += [x for x in eqns[i].inputs
                 if isinstance(x, int) and x in producer and x not in keep]
    return sorted(need)
