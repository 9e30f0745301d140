"""One registry keyed by primitive name: everything hapsynth knows about a primitive.

Each entry describes a primitive once, where its rule module registers it:
- `rule(eqn) -> Rule`: its factors (see `ir/graph.py`);
- `cost(eqn) -> (flops, transcendentals)` in XLA's `cost_analysis()` convention (or
  `(flops, transcendentals, bytes)` where the op touches less than its operands);
- `resize(eqn, in_shapes, out_shapes) -> params`: the params to evaluate the
  primitive at *local* (per-device) shapes. Only primitives whose params carry
  sizes need one; the default keeps the params as they are;
- facts the later stages ask about (`facts(name)` answers for any name):
  `elementwise` (its rule is the elementwise one), `layout_only` (it only moves
  layout: no arithmetic), `follower` (either of those: coarsening lets it join
  its operands' node), `partial` (a partial sum may be carried through it, its
  all-reduce postponed, where that cannot cost more: "unary" for linear ops that
  keep or shrink one operand, "sum" for sums of partial sums, "accumulate" for a loop's
  carry, partial from a whole initial value, "linear" for contractions, linear in each
  operand: one partial operand, the others whole, where the result is smaller (a LoRA
  weight's gradient times the other adapter)) and `contraction`
  (a dot or convolution), `free` (moves no data, as a loop's carry: costs nothing);
- `block(eqn, operands, local shapes, starts)`: for the few primitives whose values
  depend on where a block lies in the whole (random bits), its evaluation there.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from hapsynth import _jax
from hapsynth.ir.graph import BLOCKED, PARALLEL, REDUCTION, Cost, Factor, Rule


def _no_cost(eqn):
    return 0.0, 0.0


UNSUPPORTED = Rule((), supported=False)


@dataclass(frozen=True)
class Entry:
    rule: Callable
    cost: Callable = _no_cost
    resize: Callable | None = None
    elementwise: bool = False
    layout_only: bool = False
    partial: str | Callable | None = None  # None, a mode above, or eqn -> one
    contraction: bool = False
    free: bool = False          # moves no data (XLA aliases the result): costs nothing
    block: Callable | None = None  # (eqn, operands, local shapes, starts) -> results

    @property
    def follower(self) -> bool:
        """Coarsening: joins the node of the operands it reads (leads no node)."""
        return self.elementwise or self.layout_only


REGISTRY: dict[str, Entry] = {}
_UNKNOWN = Entry(lambda eqn: UNSUPPORTED)  # no rule: replicated fallback, no facts


def register(*names: str, cost: Callable = _no_cost, resize: Callable | None = None,
             elementwise: bool = False, layout_only: bool = False, partial: str | None = None,
             contraction: bool = False, free: bool = False, block: Callable | None = None):
    """Decorator: register a rule function, with its cost and facts, for primitive names."""
    assert partial in (None, "unary", "sum", "accumulate", "linear") or callable(partial), partial

    def deco(rule_fn):
        for name in names:
            REGISTRY[name] = Entry(rule_fn, cost, resize, elementwise, layout_only, partial,
                                   contraction, free, block)
        return rule_fn

    return deco


def facts(name: str) -> Entry:
    """The registry entry of a primitive; an unknown one gets an entry with no facts."""
    return REGISTRY.get(name, _UNKNOWN)


def partial_of(eqn) -> str | None:
    """How a partial sum may pass through this eqn (the modes above) or None."""
    p = facts(eqn.name).partial
    return p(eqn) if callable(p) else p


def rule_for(eqn) -> Rule:
    """The eqn's rule, knowing its operand and result shapes (for printing)."""
    return replace(facts(eqn.name).rule(eqn), operand_shapes=tuple(a.shape for a in eqn.in_avals),
                   result_shapes=tuple(a.shape for a in eqn.out_avals))


def cost_for(eqn) -> Cost:
    """Cost of one eqn; bytes are the non-literal operands plus the results."""
    entry = facts(eqn.name)
    if entry.free:
        return Cost()
    cost = entry.cost(eqn)  # (flops, transcendentals), or with the bytes it really moves
    if len(cost) == 3:
        return Cost(*map(float, cost))
    return Cost(float(cost[0]), float(cost[1]), plain_bytes(eqn))


def plain_bytes(eqn) -> float:
    """Bytes of the eqn's non-literal operands and its results."""
    nbytes = sum(_nbytes(a) for a, x in zip(eqn.in_avals, eqn.inputs) if isinstance(x, int))
    return float(nbytes + sum(_nbytes(a) for a in eqn.out_avals))


def _nbytes(aval) -> int:
    itemsize = getattr(aval.dtype, "itemsize", 4)
    return aval.size * itemsize


def evaluate_block(eqn, vals, out_shapes, starts) -> list:
    """`eqn` on local operands `vals`, giving results of `out_shapes`; `starts()` gives,
    per result, the global start of the block along each dim (only the primitives whose
    values depend on where they are, random bits, ask for it)."""
    entry = facts(eqn.name)
    if entry.block is not None:
        return list(entry.block(eqn, vals, out_shapes, starts()))
    outs = _jax.bind(eqn.primitive, vals, local_params(eqn, [np.shape(v) for v in vals],
                                                       out_shapes))
    return list(outs) if eqn.primitive.multiple_results else [outs]


def local_params(eqn, in_shapes, out_shapes) -> dict:
    """Params for evaluating `eqn` on operands of `in_shapes` giving `out_shapes`."""
    entry = facts(eqn.name)
    if entry.resize is None:
        return dict(eqn.params)
    return entry.resize(eqn, tuple(map(tuple, in_shapes)), tuple(map(tuple, out_shapes)))


# ---- small helpers shared by the rule modules -------------------------------------

def out_size(eqn, i: int = 0) -> int:
    return eqn.out_avals[i].size


def par(size, operands=(), results=()) -> Factor:
    return Factor(int(size), PARALLEL, tuple(operands), tuple(results))


def red(size, operands=(), results=(), reduce="sum") -> Factor:
    return Factor(int(size), REDUCTION, tuple(operands), tuple(results), reduce)


def blk(size, operands=(), results=()) -> Factor:
    return Factor(int(size), BLOCKED, tuple(operands), tuple(results))


def rule(*factors: Factor, note: str = "") -> Rule:
    """A Rule keeping only factors that can matter (size > 1)."""
    return Rule(tuple(f for f in factors if f.size > 1), note=note)


def replicated(note: str) -> Rule:
    """A deliberate replicated-only rule (not a fallback: the reason is recorded)."""
    return Rule((), supported=True, note=note)


def aligned_dims(eqn, skip: set[int] = frozenset(), operands=None) -> list[Factor]:
    """One parallel factor per result dim, shared by every operand of the same rank.

    `skip` dims become blocked. Used by ops whose operands and results line up dim for
    dim (elementwise, sort, cumsum, concatenate, ...).
    """
    shape = eqn.out_avals[0].shape
    ops = range(len(eqn.in_avals)) if operands is None else operands
    factors = []
    for d, n in enumerate(shape):
        # operands of lower rank, or size 1 where the result is larger, are broadcast
        o = [(i, d) for i in ops if eqn.in_avals[i].ndim == len(shape)
             and (d in skip or eqn.in_avals[i].shape[d] == n)]
        r = [(j, d) for j, a in enumerate(eqn.out_avals) if a.ndim == len(shape)]
        factors.append(blk(n, o, r) if d in skip else par(n, o, r))
    return factors


def elements(eqn) -> float:
    return float(out_size(eqn))


def prod(xs) -> int:
    return int(np.prod(xs, dtype=np.int64)) if len(xs) else 1
