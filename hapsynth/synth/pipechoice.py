"""Whether a pipeline across islands is kept over the best SPMD-only plan (`with_pipeline`).

The step is made ready to cut (`_ready`), the candidates searched (`_best`: in one tick
loop, `_tick_loop`; priced free-running, `_free_running`), the best one judged against
SPMD (`_not_kept`, `_unfit_why`, `spmd_kept`), and the plan of the kept one written with
what was decided (`_piped_plan`); where SPMD is kept, `Asked.keep` says why.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import jax

from hapsynth import progress
from hapsynth._jax import moves_across_processes
from hapsynth.cluster import Cluster
from hapsynth.ir.graph import Graph
from hapsynth.synth.pipeline import plan_pipeline, plan_vshape
from hapsynth.synth.pipeplan import as_plan
from hapsynth.synth.pipeprice import Pipeline
from hapsynth.synth.plan import Plan
from hapsynth.synth.stagegroups import islands_differ, stage_groups
from hapsynth.synth.stages import NotPipelineable, Regions, analyse
from hapsynth.synth.synthesize import InfeasibleMemory, data_parallel_plan


def spmd_kept(spmd: float, pipe: float, min_gain: float, how: str = "") -> str:
    """Why SPMD was kept over the best pipeline: it prices better, or the pipeline's gain
    is below `min_gain`."""
    if pipe >= spmd:
        return f"SPMD prices better: {spmd:.4g} s vs the best pipeline's {pipe:.4g} s{how}"
    return (f"SPMD kept: the best pipeline's {pipe:.4g} s{how} is {1 - pipe / spmd:.1%} "
            f"faster than SPMD's {spmd:.4g} s, under min_gain {min_gain:.0%}")


def check_runtime(runtime) -> None:
    """`pipeline_runtime` is "auto", "ticks" or "free" (see `with_pipeline`)."""
    if runtime not in ("auto", "ticks", "free"):
        raise ValueError(f"pipeline_runtime must be 'auto', 'ticks' or 'free', got {runtime!r}")


def _fastest_pipeline(tries) -> Plan:
    """The fastest pipeline plan of `tries` (calls of `with_pipeline` on one step written
    out alternative ways); where none pipelines, the first's plan, or its error."""
    plans, errors = [], []
    for t in tries:
        try:
            plans.append(t())
        except (InfeasibleMemory, NotPipelineable) as err:
            errors.append(err)
    piped = [p for p in plans if p.stages]
    if piped:
        return min(piped, key=lambda p: p.predicted_step_time)
    if plans:
        return plans[0]
    raise errors[0]


@dataclass(frozen=True)
class Asked:
    """What `with_pipeline` was asked: `pipeline` ("auto" or True), the best SPMD-only plan
    (None where none fits, `unfit` saying why) and the gain a pipeline must price."""
    pipeline: object
    spmd: Plan | None
    unfit: InfeasibleMemory | None
    min_gain: float

    def keep(self, why: str) -> Plan:
        """The SPMD-only plan, saying `why` it is kept; an error saying why where a pipeline
        was asked for (`pipeline=True`) or no SPMD-only plan fits."""
        if self.pipeline is True:
            raise NotPipelineable(f"pipeline=True: {why}")
        if self.spmd is None:
            raise InfeasibleMemory(f"{self.unfit}; and no pipeline: {why}")
        return replace(self.spmd, baselines={**self.spmd.baselines,
                                             "SPMD": self.spmd.predicted_step_time},
                       solver={**self.spmd.solver, "pipeline": why})


@dataclass(frozen=True)
class Step:
    """The step made ready to cut: its graph and state leaves, what its plan records of how
    it was written out (`straight`), its data-parallel plan (layouts) and its regions."""
    graph: Graph
    num_state_leaves: int
    recorded: dict
    dp: Plan
    regions: Regions


def _ready(graph: Graph, cluster: Cluster, num_state_leaves: int, data_inputs,
           straight: list[tuple[Graph, int, dict]] | None) -> Step | str:
    """The step (as `straight[0]` writes it out, where given) ready to cut, or why it
    cannot be cut."""
    recorded = {}
    if straight is not None:
        graph, num_state_leaves, recorded = straight[0]
        data_inputs = graph.inputs[num_state_leaves:]
    if graph.batch_dims:
        return "the batch is read in microbatch views (a loop over slices)"
    dp = data_parallel_plan(graph, cluster, num_state_leaves=num_state_leaves,
                            data_inputs=data_inputs)
    try:
        regions = analyse(graph, dp.tensor_layouts, dp.op_inputs, num_state_leaves)
    except NotPipelineable as e:
        return f"not pipelineable: {e}"
    return Step(graph, num_state_leaves, recorded, dp, regions)


def _tick_loop(step: Step, cluster: Cluster, pipeline) -> Pipeline | None:
    """The best pipeline run in one tick loop (`Pipelined`); one stage over every device
    (gradient accumulation) among them unless `pipeline=True`."""
    # (one stage over every device, gradient accumulation, is no pipeline to ask for)
    return plan_pipeline(step.graph, cluster, step.regions, step.dp.tensor_layouts,
                         step.num_state_leaves, whole=pipeline is not True)


def _runs_free(runtime: str) -> bool:
    """Whether free-running pipelines are candidates: `runtime` "free", or "auto" where this
    process drives every device or `jax.device_put` moves arrays between processes."""
    if runtime == "auto":
        runtime = "free" if jax.process_count() == 1 or moves_across_processes() else "ticks"
    return runtime == "free"


def _free_running(step: Step, cluster: Cluster) -> Pipeline | None:
    """The fastest fitting pipeline priced free-running (`FreeRunning`), straight or in a V
    shape; None where none fits. (One stage over every device is no pipeline to run free.)"""
    # (stages on equal parts of the islands, and where islands differ in size, a
    # stage per island too)
    unequal = islands_differ(cluster)
    found = [f(step.graph, cluster, step.regions, step.dp.tensor_layouts, step.num_state_leaves,
               free_running=True, whole_islands=w, **kw)
             for w in ((False, True) if unequal else (False,))
             for f, kw in ((plan_pipeline, {"whole": False}), (plan_vshape, {}))]
    found = [p for p in found if p is not None and p.fits]
    return min(found, key=lambda p: p.step, default=None)


def _best(step: Step, cluster: Cluster, pipeline, runtime: str) -> tuple[Pipeline | None, bool]:
    """The best pipeline candidate and whether it runs free (else in a tick loop): the
    free-running one where it fits and the tick loop's does not, or it is faster."""
    pipe = _tick_loop(step, cluster, pipeline)
    if not _runs_free(runtime):
        return pipe, False
    free = _free_running(step, cluster)
    if free is not None and (pipe is None or not pipe.fits or free.step < pipe.step):
        return free, True
    return pipe, False


def _unfit_why(pipe: Pipeline, cluster: Cluster) -> str:
    """Why the best pipeline found is refused for memory: its largest stage's buffers per
    device against the smallest class among its stages' devices."""
    parts, _ = stage_groups(cluster, pipe.whole_islands)
    small = cluster.classes[min({cluster.class_of(d) for k in pipe.order for d in parts[k]},
                                key=lambda c: cluster.classes[c].memory)]
    return (f"the best pipeline found does not fit memory ({pipe.step:.4g} s): every device "
            f"holds the largest stage's buffers, {pipe.memory[0] / 2**30:.3g} GiB, and "
            f"class {small.name!r} has {small.memory / 2**30:.3g} GiB")


def _not_kept(asked: Asked, pipe: Pipeline | None, cluster: Cluster) -> str | None:
    """Why the best pipeline `pipe` is not kept over SPMD (None where it is): none found,
    it does not fit, or it is not `min_gain` faster unless `pipeline=True`."""
    if pipe is None:
        return "no stage cut: too few parameters or microbatches for the islands"
    if not pipe.fits:
        why = _unfit_why(pipe, cluster)
        if asked.pipeline is True:  # memory, not the step's shape: recomputation may still fit it
            raise InfeasibleMemory(f"pipeline=True: {why}")
        return why
    spmd = asked.spmd
    if spmd is not None and asked.pipeline is not True \
            and pipe.step > spmd.predicted_step_time * (1 - asked.min_gain):
        return spmd_kept(spmd.predicted_step_time, pipe.step, asked.min_gain,
                         f" ({pipe.kind}, {pipe.micros} microbatches)")
    return None


def _piped_plan(step: Step, cluster: Cluster, pipe: Pipeline, free: bool,
                spmd: Plan | None) -> Plan:
    """The plan of the kept pipeline: how its program is made of the step (`recorded`),
    the SPMD-only time beside it and what was decided (`solver["pipeline"]`)."""
    if spmd is None:
        spmd = replace(step.dp, predicted_step_time=float("nan"))
    plan = as_plan(pipe, step.dp, spmd, cluster, runtime="free" if free else "ticks")
    recorded = step.recorded
    if recorded:  # how the program it runs is made of the step (`rewrites.program_of`)
        plan = replace(plan, pipeline={**plan.pipeline, **recorded})
    if recorded.get("merged"):  # the limit of the step without its recomputation
        plan = replace(plan, baselines={**plan.baselines, "ideal": min(
            plan.baselines["ideal"], step.graph.flops / cluster.total_flops)})
    what = ("gradient accumulation over every device" if len(pipe.order) == 1 else
            "pipelined, running free" if free else "pipelined")
    return replace(plan, solver={**plan.solver, "pipeline": (
        f"{what}: {pipe.step:.4g} s ({pipe.kind}, {pipe.micros} microbatches) vs SPMD-only "
        f"{spmd.predicted_step_time:.4g} s")})


def with_pipeline(graph: Graph, cluster: Cluster, spmd: Plan | None, *, num_state_leaves: int,
                  data_inputs, pipeline, min_gain: float = 0.05,
                  unfit: InfeasibleMemory | None = None,
                  straight: list[tuple[Graph, int, dict]] | None = None,
                  runtime: str = "auto") -> Plan:
    """`pipeline="auto"`: a pipeline across the cluster's islands when it prices `min_gain`
    faster than `spmd` (the best SPMD-only plan; None when none fits) and fits (a pipeline
    is the more complex program, as data parallelism is kept over a plan barely faster),
    or one stage over every device in microbatches (gradient accumulation across the
    islands) where that prices better still; `True`: the pipeline of two stages or more
    whatever it prices (an error saying why when there is none). The plan's
    `baselines["SPMD"]` is the SPMD-only time; `solver["pipeline"]` says what was decided.
    `straight`: (graph, state leaves, what its plan's `pipeline` records) of the step
    made ready to cut, one or more ways: its loops written out (`pipeline["unrolled"]`:
    the state leaves `ir.unroll` was given), its own recomputation undone
    (`pipeline["merged"]`); the fastest pipeline of them is kept. `runtime`:
    "ticks", pipelines run in one tick loop (`Pipelined`); "free", pipelines priced
    free-running, V shapes and stages on whole islands of unequal sizes among them, are
    candidates too (`FreeRunning`); "auto",
    as "free" where this process drives every device or `jax.device_put` moves arrays
    between processes, else as "ticks". The plan's `pipeline["runtime"]` says which runs
    it (`synth.pipeplan.RUNTIMES`)."""
    asked = Asked(pipeline, spmd, unfit, min_gain)
    if cluster.num_islands < 2:
        return asked.keep(f"cluster {cluster.name!r} has one island (declare islands to "
                          "pipeline across them)")
    if straight is not None and len(straight) > 1:
        return _fastest_pipeline([
            lambda s=s: with_pipeline(graph, cluster, spmd, num_state_leaves=num_state_leaves,
                                      data_inputs=data_inputs, pipeline=pipeline,
                                      min_gain=min_gain, unfit=unfit, straight=[s],
                                      runtime=runtime) for s in straight])
    step = _ready(graph, cluster, num_state_leaves, data_inputs, straight)
    if isinstance(step, str):
        return asked.keep(step)
    progress.phase("pipeline")
    check_runtime(runtime)
    pipe, free = _best(step, cluster, pipeline, runtime)
    why = _not_kept(asked, pipe, cluster)
    if why is not None:
        return asked.keep(why)
    return _piped_plan(step, cluster, pipe, free, spmd)
