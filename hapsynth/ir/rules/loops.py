"""The markers of a loop region (`trace.Loop`): each dim of an iteration's slice is the
same dim, one further in, of the stacked tensor; the scanned-over axis is never sharded
(it is time, not space). A partial sum stays partial through all three."""
from __future__ import annotations

from hapsynth.ir.rules.registry import aligned_dims, blk, par, register, rule


def _one_slice(eqn):
    """An iteration reads one slice and writes one: not the whole stacked operand."""
    small = eqn.out_avals[0] if eqn.name == "loop_slice" else eqn.in_avals[0]
    return 0.0, 0.0, 2.0 * small.size * getattr(small.dtype, "itemsize", 4)


@register("loop_slice", layout_only=True, partial="unary", cost=_one_slice)
def loop_slice(eqn):
    """X[L, *s] -> x[*s], iteration i's slice."""
    x = eqn.out_avals[0]
    return rule(blk(eqn.in_avals[0].shape[0], [(0, 0)]),
                *[par(n, [(0, d + 1)], [(0, d)]) for d, n in enumerate(x.shape)])


@register("loop_stack", layout_only=True, partial="unary", cost=_one_slice)
def loop_stack(eqn):
    """y[*s] -> Y[L, *s], the iterations' results stacked."""
    return rule(*[par(n, [(0, d)], [(0, d + 1)]) for d, n in enumerate(eqn.in_avals[0].shape)])


@register("loop_carry", elementwise=True, partial="accumulate", free=True)
def loop_carry(eqn):
    """(init, carry_out) -> carry_in: all three laid out alike, a fixed point."""
    return rule(*aligned_dims(eqn))
