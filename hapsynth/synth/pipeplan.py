"""A priced pipeline as a `Plan`: its stages, schedule and tick table, what each device
class does and holds, and the SPMD plans it was weighed against."""
from __future__ import annotations

from dataclasses import replace

from hapsynth.cluster import Cluster
from hapsynth.synth.lockstep import ticks
from hapsynth.synth.pipeprice import Pipeline
from hapsynth.synth.plan import Plan, class_memory
from hapsynth.synth.stagegroups import islands_differ, islands_of, part_name, stage_groups

__all__ = ["as_plan", "RUNTIMES"]

#: How a pipeline plan runs: "ticks", one SPMD program stepping its schedule's tick table
#: (`lower.pipeline.Pipelined`: every stage meets the others at each tick's crossing,
#: across processes too); "free", a program per stage and phase, each dispatched once its
#: inputs are there (`lower.freerun.FreeRunning`: priced free-running; one process).
RUNTIMES = ("ticks", "free")


def as_plan(pipe: Pipeline, dp: Plan, spmd: Plan, cluster: Cluster, runtime: str = "ticks") -> Plan:
    """The pipeline as a `Plan`: the data-parallel plan's layouts (each stage runs its ops
    at them, per microbatch), the pipeline's price, stages and schedule; `spmd` (the best
    SPMD-only plan) gives the baselines, with its own time as "SPMD". `runtime`: "ticks"
    (one SPMD program stepping the schedule's tick table, `lower.pipeline.Pipelined`) or
    "free" (a program per stage and phase, each run once its inputs are there,
    `lower.freerun.FreeRunning`: `pipe` priced free-running; it may run several stages on
    one group of devices)."""
    _check_runtime(pipe, cluster, runtime)
    islands, of = stage_groups(cluster, pipe.whole_islands)
    names = [c.name for c in cluster.classes]
    ratios, busy, need = _per_class(pipe, cluster, islands, names)
    compute = max(pipe.micros * (f + b) for f, b in zip(pipe.forward, pipe.backward))
    return replace(
        dp, predicted_step_time=float(pipe.step), chosen="pipeline", ratios=ratios,
        breakdown={"compute": compute, "inline_comm": float(pipe.head + sum(pipe.send)
                                                            + sum(pipe.send_back)),
                   "deferred_comm": float(max(pipe.tail)),
                   "exposed_comm": float(pipe.step - compute),
                   "compute_per_class": busy,
                   "idle_per_class": {n: float(pipe.step - b) for n, b in busy.items()}},
        baselines={**spmd.baselines, "SPMD": spmd.predicted_step_time},
        baseline_memory=spmd.baseline_memory, baseline_ops=spmd.baseline_ops,
        baseline_busy=spmd.baseline_busy,
        # (a pipeline's device holds state, sums, kept activations and mailboxes in the
        # flat buffers its runtime allocates, priced as one)
        memory={n: class_memory(cluster.classes[c].memory, buffers=need[n])
                for c, n in enumerate(names)},
        solver={**spmd.solver}, timeline=(), stages=_stages(pipe, cluster, islands, of),
        pipeline=_schedule(pipe, runtime), conversions=())


def _check_runtime(pipe: Pipeline, cluster: Cluster, runtime: str) -> None:
    """Raises where `runtime` cannot run `pipe`: the tick loop runs one stage per group
    of devices, each group as large as the others."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    if pipe.place and runtime != "free":
        raise ValueError(f"a pipeline running several stages on one group of devices "
                         f"({pipe.order}) runs free only (runtime='free'), not in ticks")
    if pipe.whole_islands and runtime != "free" and islands_differ(cluster):
        raise ValueError("a pipeline whose stages hold islands of unequal device counts "
                         f"({[len(d) for d in islands_of(cluster)]}) runs free only "
                         "(runtime='free'), not in ticks")


def _per_class(pipe: Pipeline, cluster: Cluster, islands, names) -> tuple[dict, dict, dict]:
    """Per device class (by name): its share of the work (by the rows its devices hold),
    its busiest stage's seconds a step, and the most bytes one of its devices needs."""
    busy_stage = [pipe.micros * (f + b) + t
                  for f, b, t in zip(pipe.forward, pipe.backward, pipe.tail)]
    # (a group of devices running several stages, a V's, is busy with all of them)
    busy_stage = [sum(x for k, x in zip(pipe.order, busy_stage) if k == pipe.order[s])
                  for s in range(len(busy_stage))]
    work = sum(f + b for f, b in zip(pipe.forward, pipe.backward)) or 1.0
    ratios = dict.fromkeys(names, 0.0)
    busy = dict.fromkeys(names, 0.0)
    need = dict.fromkeys(names, 0)
    for s, k in enumerate(pipe.order):  # a class may hold parts of several stages
        for d, rows in zip(islands[k], pipe.rows[s]):  # the rows it holds, whole
            n = cluster.classes[cluster.class_of(d)].name
            ratios[n] += float((pipe.forward[s] + pipe.backward[s]) / work
                               * rows / max(sum(pipe.rows[s]), 1))
            busy[n] = max(busy[n], float(busy_stage[s]))
            need[n] = max(need[n], int(pipe.memory[s]))
    return ratios, busy, need


def _stages(pipe: Pipeline, cluster: Cluster, islands, of) -> list[dict]:
    """`Plan.stages`: per stage its devices, first rank, rows, price and memory."""
    return [{"island": part_name(cluster, islands, of, k), "devices": list(islands[k]),
             "from_rank": 0 if s == 0 else int(pipe.cuts[s - 1]),
             "rows": list(pipe.rows[s]), "forward": float(pipe.forward[s]),
             "backward": float(pipe.backward[s]), "tail": float(pipe.tail[s]),
             "memory": int(pipe.memory[s]), "ops": int(pipe.ops[s]),
             "in_flight": int(pipe.schedule.in_flight[s])}
            for s, k in enumerate(pipe.order)]


def _schedule(pipe: Pipeline, runtime: str) -> dict:
    """`Plan.pipeline`: the microbatches, schedule, tick table and crossings."""
    sch = pipe.schedule
    return {"micros": pipe.micros, "schedule": pipe.kind, "cuts": [int(c) for c in pipe.cuts],
            "table": [list(t) for t in ticks(sch)],
            "slots": [[x.stage, x.micro, x.phase, x.start, x.end] for x in sch.slots],
            "makespan": float(sch.makespan), "bubble": float(sch.bubble()),
            "head": float(pipe.head), "send": [float(x) for x in pipe.send],
            "send_back": [float(x) for x in pipe.send_back],
            "by_kind": {k: float(v) for k, v in pipe.by_kind.items()},
            "delay": int(pipe.delay), "runtime": runtime}
