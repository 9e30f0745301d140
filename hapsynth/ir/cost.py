"""Costs that need more than one eqn: control-flow bodies, and whole programs."""
from __future__ import annotations

from hapsynth import _jax
from hapsynth.ir.graph import Cost
from hapsynth.ir.rules import cost_for
from hapsynth.ir.trace import flatten


def body_cost(jaxpr, consts=()) -> Cost:
    """Summed cost of an (open) jaxpr, inlined and dead-code-eliminated."""
    eqns = flatten(jaxpr, consts)[0]
    costs = [cost_for(e) for e in eqns]
    return Cost(sum(c.flops for c in costs), sum(c.transcendentals for c in costs),
                sum(c.bytes for c in costs))


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
        return n * bodies[0].flops, n * bodies[0].transcendentals
    if eqn.name == "cond":
        top = max(bodies, key=lambda c: c.flops)
        return top.flops, top.transcendentals
    return sum(c.flops for c in bodies), sum(c.transcendentals for c in bodies)
