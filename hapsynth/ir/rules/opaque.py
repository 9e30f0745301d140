"""Primitives kept whole on every device, by design (not fallbacks).

Control flow (`scan`, `while`, `cond`) is one opaque node with replicated operands;
its cost is that of its bodies (a scan's body times its length). Random-bit
generators are replicated where their bits depend on the *global* shape (a device
must generate the whole tensor and slice its rows); JAX's partitionable threefry
`random_bits` is the exception: each element's bits depend on its own index only.
"""
from __future__ import annotations

from hapsynth import _jax
from hapsynth.ir.rules.registry import cost_for, par, register, replicated, rule
from hapsynth.ir.trace import flatten

CONTROL_FLOW_NOTE = "control flow: planned as one opaque node with replicated operands"
RANDOM_NOTE = "random bits depend on the global shape: generated whole, then sliced"


def body_cost(jaxpr, consts=()) -> tuple[float, float]:
    """(flops, transcendentals) of an open jaxpr, inlined and dead-code-eliminated."""
    costs = [cost_for(e) for e in flatten(jaxpr, consts, lift_loops=False)[0]]
    return sum(c.flops for c in costs), sum(c.transcendentals for c in costs)


def control_flow_cost(eqn) -> tuple[float, float]:
    """(flops, transcendentals) of scan/while/cond: the work really done.

    A scan's body counts `length` times (XLA's cost analysis counts any loop body
    once; the planner needs the real work). A while loop's trip count is unknown,
    so its body and condition count once; a cond counts its costliest branch.
    """
    bodies = [body_cost(j, c) for j, c in _jax.sub_jaxprs(eqn)]
    if not bodies:
        return 0.0, 0.0
    if eqn.name == "scan":
        n = eqn.params["length"]
        return n * bodies[0][0], n * bodies[0][1]
    if eqn.name == "cond":
        return max(bodies, key=lambda c: c[0])
    return sum(c[0] for c in bodies), sum(c[1] for c in bodies)


@register("scan", "while", "cond", cost=control_flow_cost)
def control_flow(eqn):
    return replicated(CONTROL_FLOW_NOTE)


def _hash_cost(per_element):
    # XLA expands threefry hashing into ~50 integer ops per output element.
    return lambda e: (per_element * e.out_avals[0].size, 0.0)


@register("random_fold_in", "random_split", cost=_hash_cost(55.0))
@register("random_seed", "random_wrap", "random_unwrap", "rng_bit_generator", "rng_uniform")
def random(eqn):
    return replicated(RANDOM_NOTE)


def _bits_block(eqn, vals, out_shapes, starts):
    """A device's block of the bits, made without the rest (partitionable threefry)."""
    return [_jax.random_bits_block(vals[0], eqn.params["bit_width"], eqn.out_avals[0].shape,
                                   tuple(out_shapes[0]), starts[0])]


@register("random_bits", cost=_hash_cost(47.0), block=_bits_block)
def random_bits(eqn):
    """With JAX's partitionable threefry each element's bits depend only on its global
    index: every dim is parallel (a device makes its own block, `_bits_block`)."""
    if not _jax.partitionable_bits(eqn):
        return replicated(RANDOM_NOTE)
    return rule(*[par(n, [], [(0, d)]) for d, n in enumerate(eqn.out_avals[0].shape)])
