"""An even plan as plain `jax.jit`: the plan's layouts as `NamedSharding` constraints.

A plan with even shards everywhere needs no branches; XLA's own partitioner (GSPMD)
then makes the cheapest program, as it would for hand-written data or tensor
parallelism. Partial sums stay unconstrained (they have no `NamedSharding`).
"""
from __future__ import annotations

from typing import Iterable

import jax
import jax.numpy as jnp
from jax import lax

from hapsynth.ir.layout import Layout
from hapsynth.ir.trace import Program, evaluate, value_of
from hapsynth.lower.values import spec
from hapsynth.synth.plan import Plan

__all__ = ["is_even", "named", "body"]


def is_even(plan: Plan, units: dict, boundary: Iterable[Layout]) -> bool:
    """Every split the plan uses is even, and no input or output (`boundary`) is a
    partial sum: the plan can be lowered without branches."""
    used = {t.units for t in (*plan.tensor_layouts,
                              *(n for ins in plan.op_inputs for n in ins if n)) if t.sharded}
    return all(len(set(units[u])) == 1 for u in used) and all(
        lay.kind != "P" for lay in boundary)


def named(mesh, layout: Layout) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(mesh, spec(layout, 0))


def body(prog: Program, plan: Plan, mesh):
    """The program at global shapes, each R/S tensor constrained to its plan layout."""
    def place(t, v):
        lay = plan.tensor_layouts[t]
        return v if lay.kind == "P" else lax.with_sharding_constraint(v, named(mesh, lay))

    def run(*flat):
        env = evaluate(prog, flat, place)
        return tuple(jnp.asarray(value_of(env, o)) for o in prog.outputs)
    return run
