"""Bytes each op moves once XLA has fused it: elementwise chains do not go through memory.

XLA's loop fusion puts an elementwise or layout op (and a slice, gather, select, ...)
into the kernel of the op that reads its result, and a reduction reads its fused
operand straight from the producer's inputs.  Such an intermediate is never written
nor read back, so neither its producer nor its reader pays for its bytes.  Only
producers with a single reader are taken as fused (several readers: XLA keeps the
result when duplicating the producer into each would cost more).  The estimate is
checked against XLA's own `cost_analysis()` of the compiled step (`tests/test_fusion.py`).
"""
from __future__ import annotations

from dataclasses import replace

from hapsynth import _jax
from hapsynth.ir.graph import Cost
from hapsynth.ir.rules.registry import facts, plain_bytes
from hapsynth.ir.trace import Program

#: Fused into their reader, beyond the elementwise and layout ops of the registry.
PRODUCERS = frozenset({"select_n", "clamp", "slice", "dynamic_slice", "concatenate", "pad",
                       "rev", "gather", "squeeze", "expand_dims", "iota"})
#: Read a fused operand, but their own result is written (a fusion's root).
ROOTS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                   "reduce_or", "argmax", "argmin"})
_BARRIERS = frozenset({"optimization_barrier", "device_put", *_jax.LOOP_MARKERS})


def _fusible(e) -> bool:
    if e.name in _BARRIERS or e.primitive.multiple_results:
        return False
    f = facts(e.name)
    return (f.follower and not f.free) or e.name in PRODUCERS


def _fusions(prog: Program, costs: list[Cost]):
    """(producer eqn, its result, reader eqn) for each intermediate XLA fuses into its one
    reader: never written to memory nor read back."""
    readers: dict[int, list[int]] = {}
    for i, e in enumerate(prog.eqns):
        for x in e.inputs:
            if isinstance(x, int):
                readers.setdefault(x, []).append(i)
    outputs = {x for x in prog.outputs if isinstance(x, int)}
    for i, e in enumerate(prog.eqns):
        if not _fusible(e) or costs[i].bytes == 0:
            continue
        t = e.outputs[0]
        if t in outputs or len(set(readers.get(t, ()))) != 1:
            continue
        r = readers[t][0]
        reader = prog.eqns[r]
        if reader.loop != e.loop or not (_fusible(reader) or reader.name in ROOTS):
            continue
        if costs[r].bytes != plain_bytes(reader):
            continue
        yield i, t, r, len(readers[t])


def fused_costs(prog: Program, costs: list[Cost]) -> list[Cost]:
    """`costs` (one per eqn) less the bytes of intermediates fused away.  A reader whose
    cost names fewer bytes than its operands (it touches part of one) is left as is."""
    saved = [0.0] * len(costs)
    for i, t, r, reads in _fusions(prog, costs):
        nbytes = prog.avals[t].nbytes
        saved[i] += nbytes
        saved[r] += nbytes * reads
    return [c if s == 0 else replace(c, bytes=max(0.0, c.bytes - s)) for c, s in zip(costs, saved)]


def fused_away(prog: Program, costs: list[Cost]) -> set[int]:
    """Intermediates that take no memory of their own: fused into their reader, or an
    `optimization_barrier`'s copy of a step input (remat's, `ir/remat.py`: XLA aliases it
    to the input's buffer)."""
    made = {t for e in prog.eqns for t in e.outputs}
    aliases = {y for e in prog.eqns if e.primitive is _jax.BARRIER
               for x, y in zip(e.inputs, e.outputs) if isinstance(x, int) and x not in made}
    return {t for _, t, _, _ in _fusions(prog, costs)} | aliases
