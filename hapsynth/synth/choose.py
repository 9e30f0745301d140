"""Which plan of a step is kept: SPMD on every device, SPMD on fewer devices, data
parallelism, or a pipeline across islands (`make_plan`); and of two plans of one step,
as written and with activations recomputed, the faster (`sooner`).

`recompute.py` decides which programs of the step are planned (as written, recomputed,
its own recomputation undone) and asks `make_plan` for each.
"""
from __future__ import annotations

from dataclasses import replace

import jax

from hapsynth.cluster import Cluster
from hapsynth.synth.pipechoice import spmd_kept, with_pipeline
from hapsynth.synth.plan import Plan
from hapsynth.synth.subsets import on_fewer_devices
from hapsynth.synth.synthesize import (InfeasibleMemory, NoDataParallelism, Options,
                                       data_parallel_plan, fsdp_plan, synthesize)

STRATEGIES = ("auto", "data-parallel", "fsdp")


def check_strategy(strategy) -> None:
    """`strategy` is "auto" (synthesised), "data-parallel" or "fsdp" (ZeRO-3: the FSDP
    baseline as the plan)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def check_pipeline(pipeline) -> None:
    """`pipeline` is "auto" (a pipeline across islands only when it prices better than the
    best SPMD-only plan), True (a pipeline, or an error saying why not) or False."""
    if not (pipeline == "auto" or isinstance(pipeline, bool)):
        raise ValueError(f"pipeline must be 'auto', True or False, got {pipeline!r}")


def check_devices(devices) -> None:
    """`devices` is "auto" (the plan may leave slow or far devices idle when it prices
    faster without them) or "all" (every device takes part)."""
    if devices not in ("auto", "all"):
        raise ValueError(f"devices must be 'auto' or 'all', got {devices!r}")


def check_remat(remat) -> None:
    """`remat` is "auto" (recompute cheap activations when no plan holds them, or when
    that lets a faster plan hold them) or False."""
    if remat not in ("auto", False):
        raise ValueError(f"remat must be 'auto' or False, got {remat!r}")


def considers_pipeline(cluster, pipeline, strategy: str = "auto") -> bool:
    return pipeline is True or pipeline == "auto" and strategy == "auto" and cluster.num_islands > 1


def make_plan(graph, cluster, *, num_state_leaves: int, data_inputs, strategy: str = "auto",
              shares=None, pipeline=False, straight=None, pipeline_runtime="auto",
              **options) -> Plan:
    """A synthesized plan (`strategy="auto"`, `options` as in `synthesize.Options`), or data
    parallelism (`"data-parallel"`, at FLOP/s-proportional `shares` unless given); with
    `pipeline` ("auto" or True) a pipeline across islands is considered too, cut in
    `straight` when given: (graph, state leaves, what its plan records) of the step with
    its loops written out (`ir/unroll.py`), one or more ways (`with_pipeline`)."""
    check_pipeline(pipeline)
    if considers_pipeline(cluster, pipeline, strategy):
        try:
            spmd, unfit = make_plan(graph, cluster, num_state_leaves=num_state_leaves,
                                    data_inputs=data_inputs, strategy=strategy, shares=shares,
                                    **options), None
        except InfeasibleMemory as err:
            spmd, unfit = None, err
        return with_pipeline(graph, cluster, spmd, num_state_leaves=num_state_leaves,
                             data_inputs=data_inputs, pipeline=pipeline, straight=straight,
                             min_gain=options.get("min_gain", Options.min_gain), unfit=unfit,
                             runtime=pipeline_runtime)
    check_strategy(strategy)
    if strategy == "data-parallel":
        return data_parallel_plan(graph, cluster, num_state_leaves=num_state_leaves,
                                  data_inputs=data_inputs, shares=shares)
    if shares is not None:
        raise ValueError("shares= applies to strategy='data-parallel' only")
    if strategy == "fsdp":
        return fsdp_plan(graph, cluster, num_state_leaves=num_state_leaves,
                         data_inputs=data_inputs)
    return spmd_plan(graph, cluster, num_state_leaves=num_state_leaves,
                     data_inputs=data_inputs, **options)


def spmd_plan(graph, cluster, *, num_state_leaves: int, data_inputs, devices="auto",
              **options) -> Plan:
    """The synthesized SPMD plan on every device, or (`devices="auto"`, one process) on
    fewer of them where that prices `min_gain` faster or only that fits
    (`subsets.on_fewer_devices`)."""
    check_devices(devices)

    def plan_on(c: Cluster) -> Plan:
        return synthesize(graph, c, num_state_leaves=num_state_leaves, data_inputs=data_inputs,
                          options=Options(**options))

    try:
        best, unfit = plan_on(cluster), None
    except InfeasibleMemory as err:
        best, unfit = None, err
    if devices == "all" or jax.process_count() > 1:  # every process must hold part of the mesh
        if best is None:
            raise unfit
        return best

    def baselines_of(c: Cluster = cluster) -> Plan | None:
        return data_parallel_or_none(graph, c, num_state_leaves, data_inputs)

    def probe(c: Cluster) -> float:
        return fitting_data_parallel(graph, c, num_state_leaves, data_inputs)

    return on_fewer_devices(graph, cluster, best, plan_on, probe, baselines_of,
                            options.get("min_gain", Options.min_gain), unfit)


def data_parallel_or_none(graph, cluster, num_state_leaves, data_inputs) -> Plan | None:
    try:
        return data_parallel_plan(graph, cluster, num_state_leaves=num_state_leaves,
                                  data_inputs=data_inputs)
    except NoDataParallelism:
        return None


def fitting_data_parallel(graph, cluster, num_state_leaves, data_inputs) -> float:
    """Data parallelism's best fitting time on `cluster` (infinity when none fits)."""
    return dp_prices(data_parallel_or_none(graph, cluster, num_state_leaves, data_inputs),
                     cluster)[0]


def dp_prices(dp: Plan | None, cluster: Cluster) -> tuple[float, float]:
    """Data parallelism's best time on `cluster` that fits, and its best time memory aside
    (infinity where there is none), from `dp`'s baselines."""
    cap = min(k.memory for k in cluster.classes)
    times = [(dp.baselines[k], dp.baseline_memory[k] <= cap) for k in ("DP-EV", "DP-CP")
             if dp and k in dp.baselines and k in dp.baseline_memory]
    return (min((t for t, fits in times if fits), default=float("inf")),
            min((t for t, _ in times), default=float("inf")))


def spmd_time(plan: Plan) -> float:
    """The plan's time, or for a pipeline the SPMD-only plan's (infinity: none fits)."""
    t = plan.baselines.get("SPMD", float("nan")) if plan.stages else plan.predicted_step_time
    return float("inf") if t != t else t


def sooner(plan: Plan, other: Plan | None, pipeline, min_gain: float) -> Plan:
    """The faster of two plans of one step (as written, recomputed); a pipeline only when
    `min_gain` faster than SPMD alone (unless `pipeline` is True). The kept plan's
    `baselines["SPMD"]` is the better of the two SPMD-only times."""
    if other is None:
        return plan

    def price(p: Plan) -> float:
        gain = 1 - min_gain if p.stages and pipeline is not True else 1.0
        return p.predicted_step_time / gain

    best = min((plan, other), key=price)
    if not any("SPMD" in p.baselines for p in (plan, other)):  # (no pipeline was asked for)
        return best
    alone = min(spmd_time(plan), spmd_time(other))
    alone = alone if alone < float("inf") else float("nan")
    return replace(best, baselines={**best.baselines, "SPMD": alone},
                   solver=_why_kept(best, plan, other, alone, min_gain))


def _why_kept(best: Plan, plan: Plan, other: Plan, alone: float, min_gain: float) -> dict:
    """`best.solver`, saying why no pipeline was kept where one of the two had one (or
    was asked why not), and where the SPMD-only time beside a kept pipeline comes from."""
    solver = best.solver
    piped = [p for p in (plan, other) if p.stages]
    why = [p.solver["pipeline"] for p in (plan, other) if p.solver.get("pipeline")]
    if not best.stages and "SPMD" not in best.baselines and "pipeline" not in solver and (
            piped or why):  # a plan made without pipelines in view: why none was kept
        solver = {**solver, "pipeline": why[0] if not piped else spmd_kept(
            best.predicted_step_time, piped[0].predicted_step_time, min_gain)}
    if best.stages and alone < spmd_time(best):
        solver = {**solver, "pipeline": f"{solver.get('pipeline', '')}; SPMD-only with "
                                        f"activations recomputed {alone:.4g} s"}
    return solver
