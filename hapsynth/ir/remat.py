"""Rematerialization of a traced step: recompute cheap activations in the backward pass
instead of holding them across the memory peak (what `jax.checkpoint` with a
"save the contractions" policy does, applied after differentiation).

The peak of a train step sits where the forward pass ends: every activation the
backward pass reads is live there. An activation made by a cheap op (elementwise, a
layout change, a reduction, an embedding lookup) from values held anyway (the step's
inputs, results of contractions kept across the peak) can be recomputed just before its
first backward reader instead. Each recomputation reads its inputs through an
`optimization_barrier`, as `jax.checkpoint` does, so that XLA does not merge it with the
forward op again. Loop regions are kept as they are; their bodies are never copied.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from hapsynth import _jax
from hapsynth.ir.fusion import fused_away
from hapsynth.ir.rules import cost_for
from hapsynth.ir.rules.registry import facts
from hapsynth.ir.trace import Eqn, Program, loops_of

#: Cheap to recompute beyond the elementwise and layout-only ops: reductions (a norm's
#: statistics) and lookups that read held tensors (an embedding table, the ids).
RECOMPUTABLE = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin",
                "gather", "dynamic_slice", "slice", "concatenate", "pad", "select_n", "clamp",
                "rev", "squeeze", "expand_dims"}
MAX_CHAIN = 48  # eqns recomputed for one activation at most


def recomputable(e: Eqn, deep: bool = False) -> bool:
    """Cheap enough to recompute (`deep`: any deterministic op outside a loop, contractions
    included, as `jax.checkpoint` saving nothing recomputes: `ir/checkpoint.py`)."""
    if e.loop is not None or e.name in _jax.LOOP_MARKERS or e.primitive.multiple_results:
        return False
    f = facts(e.name)
    if deep:
        return not (f.block is not None or e.primitive is _jax.BARRIER
                    or "callback" in e.name or "rng" in e.name)
    return (f.follower and not f.free) or e.name in RECOMPUTABLE


def _last_reads(prog: Program) -> dict[int, int]:
    """Tensor id -> index of its last reader (a loop region's reads last to its end)."""
    end_of = {lp.id: lp.end - 1 for lp in prog.loops}
    last: dict[int, int] = {}
    for i, e in enumerate(prog.eqns):
        at = i if e.loop is None else end_of[e.loop]
        for x in e.inputs:
            if isinstance(x, int):
                last[x] = max(last.get(x, -1), at)
    for x in prog.outputs:
        if isinstance(x, int):
            last[x] = len(prog.eqns)
    return last


def live_profile(prog: Program) -> np.ndarray:
    """Bytes of intermediates live after each eqn (inputs and constants not counted, nor
    what XLA fuses into its one reader: as `synth/memory.py` counts them)."""
    last = _last_reads(prog)
    fused = fused_away(prog, [cost_for(e) for e in prog.eqns])
    diff = np.zeros(len(prog.eqns) + 2)
    for i, e in enumerate(prog.eqns):
        for t in e.outputs:
            if t in last and t not in fused:
                diff[i] += prog.avals[t].nbytes
                diff[last[t] + 1] -= prog.avals[t].nbytes
    return np.cumsum(diff)[:len(prog.eqns)]


def peak_bytes(prog: Program) -> float:
    prof = live_profile(prog)
    return float(prof.max()) if len(prof) else 0.0


def rematerialize(prog: Program, target: float | None = None,
                  rounds: int = 4) -> Program | None:
    """`prog` with cheap activations recomputed after the memory peak, or None when that
    lowers the peak by nothing. With a `target` (bytes), only as many as bring the peak
    there (the largest first); without, all. Repeats while the (moved) peak falls by 5%
    or more and is above `target`."""
    out, best = None, peak_bytes(prog)
    for _ in range(rounds):
        if target is not None and best <= target:
            break
        nxt = _one_round(out or prog, target)
        if nxt is None:
            break
        peak = peak_bytes(nxt)
        if peak > best * 0.95:
            break
        out, best = nxt, peak
    return out


def _one_round(prog: Program, target: float | None = None) -> Program | None:
    eqns, avals = prog.eqns, prog.avals
    n = len(eqns)
    if not n:
        return None
    profile = live_profile(prog)
    p = int(np.argmax(profile))
    at_peak = float(profile[p])  # estimated as recomputations are chosen
    producer = {t: i for i, e in enumerate(eqns) for t in e.outputs}
    readers: dict[int, list[int]] = {}
    for i, e in enumerate(eqns):
        for x in e.inputs:
            if isinstance(x, int):
                readers.setdefault(x, []).append(i)
    last = _last_reads(prog)
    size = lambda t: avals[t].nbytes
    fused = fused_away(prog, [cost_for(e) for e in eqns])  # (never held)
    held = {t for t, i in producer.items()
            if i <= p and last.get(t, -1) > p and t not in fused}  # across the peak

    def chain(t: int, held_now: set) -> tuple[list[int], set[int]] | None:
        """Eqns (in program order) recomputing t from held tensors, and the tensors it
        must hold that are not held today."""
        need, new, todo, seen = set(), set(), [t], set()
        while todo:
            u = todo.pop()
            if u in seen:
                continue
            seen.add(u)
            i = producer[u]
            need.add(i)
            if len(need) > MAX_CHAIN:
                return None
            for x in eqns[i].inputs:
                if not isinstance(x, int) or x not in producer or x in held_now:
                    continue
                if recomputable(eqns[producer[x]]):
                    todo.append(x)
                else:
                    new.add(x)
        return sorted(need), new

    def siblings(new: set, skip: set) -> list[int]:
        """Held tensors made from `new` by recomputable ops before the peak."""
        found, todo, seen = [], list(new), set()
        while todo and len(seen) < 4 * MAX_CHAIN:
            for r in readers.get(todo.pop(), ()):
                if r > p or r in seen or not recomputable(eqns[r]):
                    continue
                seen.add(r)
                found += [o for o in eqns[r].outputs if o in held_now and o not in skip]
                todo += eqns[r].outputs
        return list(dict.fromkeys(found))

    plans: dict[int, list[int]] = {}
    held_now, pinned = set(held), set()  # pinned: read by an accepted recomputation
    usable = lambda t: (t not in prog.outputs and t not in pinned and t not in plans
                        and recomputable(eqns[producer[t]]))
    for t in sorted(held, key=size, reverse=True):
        if target is not None and at_peak <= target:
            break
        if not usable(t):
            continue
        c = chain(t, held_now - {t})
        if c is None:
            continue
        group, new = {t: c[0]}, c[1]
        if new and sum(size(x) for x in new) >= size(t):
            # several activations made from the same new tensor may pay for it together
            # (a softmax's exp and its normalised probabilities, from the scores)
            for u in siblings(new, {t}):
                cu = chain(u, (held_now - {t, u} - set(group)) | new) if usable(u) else None
                if cu is not None and cu[1] <= new:
                    group[u] = cu[0]
            if sum(size(x) for x in new) >= sum(size(u) for u in group):
                continue
        plans.update(group)
        at_peak -= sum(size(u) for u in group) - sum(size(x) for x in new - held_now)
        held_now = (held_now - set(group)) | new
        pinned |= {x for need in group.values() for i in need for x in eqns[i].inputs
                   if isinstance(x, int)}
    if not plans:
        return None
    return _rewrite(prog, plans, readers, p)


def _rewrite(prog: Program, plans: dict[int, list[int]], readers, p: int,
             where: dict[int, int] | None = None, deep: bool = False,
             copies: dict[int, set] | None = None, ahead: dict[int, set] | None = None
             ) -> Program:
    """Insert each activation's recomputation before its first reader after the peak
    (before the loop region that reader runs in; `where`: at the index given) and point
    the later readers at it. `deep` (`ir/checkpoint.py`): the step inputs a recomputation
    reads are copied there and every later reader reads the copy (a parameter sharded
    between steps is gathered again for the backward pass, not held gathered from the
    forward; `copies`: more step inputs copied so, per insertion index; `ahead`: step
    inputs a recomputation reads from the copy made at an earlier index instead)."""
    eqns, avals = list(prog.eqns), list(prog.avals)
    start_of = {lp.id: lp.start for lp in prog.loops}
    made = {t for e in eqns for t in e.outputs}
    at: dict[int, list[int]] = {}
    for t in plans:
        if where is not None:
            at.setdefault(where[t], []).append(t)
            continue
        first = min(r for r in readers[t] if r > p)
        e = eqns[first]
        at.setdefault(start_of[e.loop] if e.loop is not None else first, []).append(t)
    renamed: dict[int, dict[int, int]] = {}  # insertion index -> {old tensor: copy}
    inserted: dict[int, list[Eqn]] = {}
    copied: dict[int, int] = {}  # step input -> its latest copy so far

    def fresh(aval) -> int:
        avals.append(aval)
        return len(avals) - 1

    for here in sorted(set(at) | set(copies or {})):
        ts = at.get(here, [])
        ren = {x: copied[x] for x in (ahead or {}).get(here, ()) if x in copied}
        new: list[Eqn] = []
        todo = sorted({i for t in ts for i in plans[t]})
        cloned_outs = {o for i in todo for o in eqns[i].outputs}
        leaves = sorted(({x for i in todo for x in eqns[i].inputs
                          if isinstance(x, int) and x not in cloned_outs}
                         | (copies or {}).get(here, set())) - set(ren))
        for x in leaves:  # the barrier keeps XLA from merging the copy with the original
            # (inputs too: a copy reading only inputs would be the very same op)
            y = fresh(avals[x])
            new.append(Eqn(_jax.BARRIER, {}, (x,), (y,), (avals[x],), (avals[x],),
                           source="remat"))
            ren[x] = y
            if x not in made:
                copied[x] = y
        for i in todo:
            e = eqns[i]
            outs = tuple(fresh(avals[o]) for o in e.outputs)
            ren.update(zip(e.outputs, outs))
            new.append(replace(e, inputs=tuple(ren.get(x, x) if isinstance(x, int) else x
                                               for x in e.inputs), outputs=outs,
                               source=(e.source + " (recomputed)").strip()))
        inserted[here] = new
        renamed[here] = {t: ren[t] for t in ts}
        if deep:
            renamed[here].update({x: ren[x] for x in leaves if x not in made})
    # readers after the peak read the copy made at or before them
    points = sorted(renamed)
    out: list[Eqn] = []
    for i, e in enumerate(eqns):
        out.extend(inserted.get(i, ()))
        if i > p:
            sub = {}
            for w in points:
                if w <= i:  # (a loop's readers: the copy is made before the loop starts)
                    sub.update(renamed[w])
            if sub and any(isinstance(x, int) and x in sub for x in e.inputs):
                e = replace(e, inputs=tuple(sub.get(x, x) if isinstance(x, int) else x
                                            for x in e.inputs))
        out.append(e)
    out = _drop_dead(out, prog.outputs, {id(e) for new in inserted.values() for e in new}, deep)
    params = {lp.id: (lp.length, lp.reverse) for lp in prog.loops}
    return replace(prog, eqns=tuple(out), avals=tuple(avals), loops=loops_of(out, params))


def _drop_dead(eqns: list[Eqn], outputs, inserted: set, deep: bool = False) -> list[Eqn]:
    """`eqns` less those whose results nothing reads, among the inserted ones and the
    recomputable originals: an activation made in the forward pass only for the backward,
    now recomputed there, or a copy whose readers a later copy took over (dead, XLA
    drops them; the stage analysis and the prices would not)."""
    live = {o for o in outputs if isinstance(o, int)}
    kept = []
    for e in reversed(eqns):
        if not (id(e) in inserted or recomputable(e, deep)) or any(o in live for o in e.outputs):
            kept.append(e)
            live.update(x for x in e.inputs if isinstance(x, int))
    kept.reverse()
    return kept


def describe(before: Program, after: Program, target: float | str | None) -> dict:
    """What `rematerialize(before, target)` did, for `Plan.remat`: its target (to do it
    again on a saved plan's program; "segments": `checkpoint.checkpointed(before)`), ops
    recomputed, peak bytes before and after."""
    return {"target": target,
            "recomputed": sum(e.source.endswith("(recomputed)") for e in after.eqns)
            - sum(e.source.endswith("(recomputed)") for e in before.eqns),
            "peak_before": peak_bytes(before), "peak_after": peak_bytes(after)}


def undone(before: Program, after: Program) -> dict:
    """For `Plan.remat`: the step's own recomputation undone (`ir/cse.py`: `after` is
    `merge_recomputed(before)`), ops merged, peak bytes before and after."""
    return {"undone": True, "merged": len(before.eqns) - len(after.eqns),
            "peak_before": peak_bytes(before), "peak_after": peak_bytes(after)}


def room(capacities, held: float = 0.0) -> float:
    """The most activation bytes devices of these memory capacities can hold together,
    each also holding `held` bytes: sharded tensors are stored padded alike on every
    device, so devices used together hold at most (how many) x (the smallest one's)."""
    caps = sorted(capacities, reverse=True)
    return max([(k + 1) * (c - held) for k, c in enumerate(caps)] + [0.0])


def cannot_fit(prog: Program, capacities) -> bool:
    """True when no plan can hold `prog`'s peak activations on these devices."""
    return peak_bytes(prog) > room(capacities)
