"""A step planned once: on process zero only (the others get its plan), or read back
from the plan cache (`hapsynth/plancache.py`) where a run before filed one."""
from __future__ import annotations

import warnings
from dataclasses import replace

import jax

from hapsynth import progress
from hapsynth.plancache import PlanCache
from hapsynth.synth import recompute
from hapsynth.synth.plan import Plan
from hapsynth.synth.rewrites import checked_program, program_of


def synthesize_once(prog, cluster, cache: PlanCache | None = None, **kw) -> tuple[Plan, object]:
    """`plan_program` on process 0 only, or the plan `cache` holds for it; with several
    processes the plan is shared."""
    from hapsynth.lower.moves import from_process_zero

    plan = None
    if jax.process_index() == 0:
        plan, done = cached_plan(cache, prog, cluster, **kw) if cache else \
            recompute.plan_program(prog, cluster, **kw)
    if jax.process_count() > 1:
        plan = Plan.from_json(from_process_zero(plan and plan.to_json()))
        done = program_of(plan, prog)
    return plan, done


def cached_plan(cache: PlanCache, prog, cluster, **kw) -> tuple[Plan, object]:
    """`plan_program`, unless `cache` holds a plan made for this program, cluster and
    options (read back and checked: `plan.solver["cached"]` names its file); a plan made
    is filed there."""
    key = cache.key(prog, cluster, kw)
    plan = cache.get(key)
    if plan is not None:
        try:
            done = checked_program(plan, prog, cluster)
        except Exception as err:  # noqa: BLE001 (planned again, and the file replaced)
            warnings.warn(f"hapsynth plan cache: {cache.path(key)} does not fit this step "
                          f"({err}); planning again", stacklevel=3)
        else:
            progress.phase("plan cache")
            return replace(plan, solver={**plan.solver, "cached": str(cache.path(key))}), done
    plan, done = recompute.plan_program(prog, cluster, **kw)
    cache.put(key, plan)
    return plan, done
