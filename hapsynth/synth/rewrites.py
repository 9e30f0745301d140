"""The program a plan runs: the traced step, rewritten the way it was when planned.

A plan records its rewrites (`plan.remat`: activations recomputed to a memory target, or
the step's own recomputation undone; `plan.pipeline`: loops written out, recomputation
merged), so a plan read back from a file, or shared by process zero, is applied to the
same program it was made for (`program_of`, `checked_program`).
"""
from __future__ import annotations

from hapsynth.cluster import Cluster
from hapsynth.ir import lift_program
from hapsynth.ir.cse import merge_recomputed
from hapsynth.ir.checkpoint import checkpointed
from hapsynth.ir.remat import rematerialize
from hapsynth.ir.signature import of_graph
from hapsynth.ir.unroll import unroll, unrollable
from hapsynth.synth.plan import Plan


def program_of(plan: Plan, prog, merge=merge_recomputed):
    """The program `plan` runs: `prog`, rewritten the way it was when planned (`merge`:
    `merge_recomputed`, or a cache of it)."""
    if plan.remat and plan.remat.get("undone"):
        prog = undone_program(prog, plan.remat.get("unrolled"), merge)[1]
    elif plan.remat and plan.remat["target"] == "segments":
        prog = checkpointed(prog)
    elif plan.remat:
        prog = rematerialize(prog, plan.remat["target"])
    unrolled = plan.pipeline.get("unrolled") if plan.pipeline else None
    prog = prog if unrolled is None else unroll(prog, unrolled)
    return merge(prog) if plan.pipeline and plan.pipeline.get("merged") else prog


def checked_program(plan: Plan, prog, cluster: Cluster):
    """The program `plan` runs (`program_of`), after checking the plan was made for it and
    for `cluster` (`PlanMismatch` names what differs)."""
    done = program_of(plan, prog)
    plan.check(of_graph(lift_program(done)), cluster)
    return done


def undone_program(prog, num_state_leaves: int | None, merge=merge_recomputed):
    """(`prog`, its loops written out where it has any, every leaf still fed whole as
    the step takes it; that with its own recomputation undone by `merge`, `ir/cse.py`'s
    `merge_recomputed` or a cache of it), or None where no matmul repeats."""
    if prog.loops:
        if num_state_leaves is None or not unrollable(prog, num_state_leaves):
            return None
        prog = unroll(prog)  # (no leaf fed as rows: the step's own signature)
    merged = merge(prog)
    return None if merged is None else (prog, merged)


def by_program(fn):
    """`fn` of a program, computed once per program object (kept alive with its result,
    so that its id stays its own)."""
    memo: dict = {}

    def cached(p):
        if id(p) not in memo:
            memo[id(p)] = p, fn(p)
        return memo[id(p)][1]
    return cached
