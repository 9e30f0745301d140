"""Synthesis: alternate strategy choice and per-class shares (HAP's scheme).

1. The problem: strategies per node and the conversions they need (share-independent),
   the batch classes, the big state tensors' classes, layer ties.
2. Baselines at the same cost model: data parallelism at even (DP-EV) and FLOP/s-
   proportional (DP-CP) shares, and the ideal.
3. Starts (data parallel, or sharding the big state), made to fit memory; local search.
4. Rounds: CP-SAT from the best assignment, local search again, then the shares are
   searched on a grid with strategies fixed; until no improvement.
A data-parallel baseline that fits is kept unless the plan is `min_gain` faster.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from hapsynth import progress
from hapsynth.cluster import Cluster
from hapsynth.ir.graph import Graph
from hapsynth.synth.plan import Plan
from hapsynth.synth.assemble import Choice, assemble
from hapsynth.synth.fsdp import fsdp_choice
from hapsynth.synth.search import (Priced, data_parallel, fit_memory, local_search, share_candidates,
                                   shares_by, state_classes, switch_classes)
from hapsynth.synth.solver import solve
from hapsynth.synth.strategy import batch_classes, layer_ties, link_factors
from hapsynth.synth.structure import Structure, build_structure


class InfeasibleMemory(ValueError):
    """No plan found fits a device class's memory."""


@dataclass(frozen=True)
class Options:
    """How hard to search. `time_limit` is the wall-clock budget in seconds; `min_gain`
    is how much faster than a fitting data-parallel baseline a plan must be predicted
    to replace it (the cost model's measured error is of that order, and data
    parallelism is the simplest program)."""

    time_limit: float = 10.0
    workers: int = 2
    seed: int = 0
    max_rounds: int = 2
    share_layers: bool = True
    max_classes: int = 3
    min_gain: float = 0.05


@dataclass(frozen=True, eq=False)
class Problem:
    """Everything about one planning problem that no assignment or share changes."""

    graph: Graph
    cluster: Cluster
    structure: Structure
    batch: tuple             # the factor classes data parallelism shards (most ops first)
    state_groups: tuple      # per dim of the big state tensors: the classes sharding it
    ties: list | None        # node -> representative node (repeated layers decide once)
    capacity: float          # bytes: the smallest class's memory

    @classmethod
    def build(cls, graph: Graph, cluster: Cluster, num_state_leaves: int, data_inputs,
              options: Options = Options(), batch_only: bool = False) -> "Problem":
        """`batch_only`: strategies sharding the batch classes and none other, all that
        pricing data parallelism reads (a search needs the rest)."""
        uf = link_factors(graph, min_units=cluster.num_devices)
        batch = batch_classes(graph, uf, data_inputs)
        groups = () if batch_only else tuple(
            tuple(g) for g in state_classes(graph, uf, num_state_leaves))
        keep = tuple(dict.fromkeys((*batch, *(c for g in groups for c in g))))
        st = build_structure(graph, num_state_leaves=num_state_leaves,
                             max_classes=0 if batch_only else options.max_classes, uf=uf,
                             keep=keep, roles={c: "the batch" for c in batch})
        ties = layer_ties(graph, st.strategies) if options.share_layers and not batch_only else None
        return cls(graph, cluster, st, batch, groups, ties,
                   min(c.memory for c in cluster.classes))

    def priced(self, shares, only=None) -> Priced:
        return Priced.at(self.structure, self.cluster, shares, self.capacity, only)

    def choice(self, name: str, pr: Priced, assign) -> Choice:
        return Choice(name, pr, tuple(assign), pr.time(assign))

    def data_parallel(self, shares, name: str) -> Choice:
        pr = self.priced(shares)
        return self.choice(name, pr, data_parallel(pr.tables, self.batch))

    def class_moves(self) -> list:
        return ([list(g) for g in self.state_groups] + [list(self.batch)] * bool(self.batch)
                + [[c] for c in (*self.batch, *sum(self.state_groups, ()))])


@dataclass
class Clock:
    start: float = field(default_factory=time.perf_counter)
    mark: float = field(default_factory=time.perf_counter)
    phases: dict = field(default_factory=dict)

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self.mark
        self.mark = now

    @property
    def wall(self) -> float:
        return time.perf_counter() - self.start


class NoDataParallelism(ValueError):
    """Data parallelism would shard no op: no op reads a data input's leading dim."""


def data_parallel_choices(problem: Problem) -> dict[str, Choice]:
    """DP-EV and DP-CP under the same cost model: what a user writes by hand (every data
    input split on its leading dim, evenly or in proportion to FLOP/s, everything the
    batch reaches following it, parameters replicated, gradients all-reduced)."""
    cluster = problem.cluster
    return {"DP-EV": problem.data_parallel(shares_by(cluster, lambda c: 1.0), "DP-EV"),
            "DP-CP": problem.data_parallel(shares_by(cluster, lambda c: c.flops), "DP-CP")}


def baselines(problem: Problem, dp: dict[str, Choice]) -> dict[str, Choice]:
    """The data-parallel choices that are data parallelism: one that shards no op is not
    a baseline (it would be the replicated program under that name)."""
    return {k: b for k, b in dp.items() if b.sharded_ops(problem.structure)}


def no_data_parallelism(problem: Problem, data_inputs) -> NoDataParallelism:
    paths = problem.graph.input_paths
    names = [paths[problem.graph.inputs.index(t)] if paths else f"t{t}" for t in data_inputs]
    return NoDataParallelism(
        "data parallelism shards no op here: "
        + (f"no op reads the leading dim of the data inputs {', '.join(names)}"
           if names else "the step has no data inputs (every argument is fed back as state)"))


def start(problem: Problem, dp: dict[str, Choice], fsdp: Choice | None = None) -> Choice:
    """The best of: data parallelism, "shard the big state tensors on dim d, else the
    batch" (expert parallelism for an MoE), FSDP, each made to fit memory, and
    replicating everything where that fits (a step too small to split), at FLOP/s-
    proportional and at even shares (even shares pad less, which can make a plan fit)."""
    starts = []
    if fsdp is not None:
        pr = fsdp.priced
        a = fsdp.assign if pr.fits(fsdp.assign) else fit_memory(pr, fsdp.assign, problem.ties)
        starts.append(((not pr.fits(a), pr.time(a)), pr, list(a)))
    for b in (dp["DP-CP"], dp["DP-EV"]):
        pr = b.priced
        whole = [0] * len(b.assign)
        if pr.fits(whole):
            starts.append(((False, pr.time(whole)), pr, whole))
        for a in [b.assign] + [switch_classes(pr.tables, b.assign, [*g, *problem.batch])
                               for g in problem.state_groups]:
            if not pr.fits(a):
                a = fit_memory(pr, a, problem.ties)
            starts.append(((not pr.fits(a), pr.time(a)), pr, a))
    _, pr, a = min(starts, key=lambda x: x[0])
    return problem.choice("synthesized", pr, a)


def improve(problem: Problem, best: Choice, options: Options, clock: Clock):
    """Local search, then rounds of CP-SAT and a share grid; returns (choice, CP-SAT stats,
    rounds, CP-SAT wall seconds)."""
    moves = problem.class_moves()
    pr = best.priced
    progress.phase("local search")
    best = problem.choice("synthesized", pr, local_search(
        pr, best.assign, problem.ties, budget=int(40 * options.time_limit), class_moves=moves))
    clock.lap("starts+search")
    stats, rounds, solve_wall = None, 0, 0.0
    for rounds in range(1, options.max_rounds + 1):
        if rounds > 1 and stats.status != "OPTIMAL":
            rounds -= 1
            break  # CP-SAT used its whole budget: another round would too (not the wall
            #        clock: the plan must depend on the seed alone)
        pr = best.priced
        progress.phase("CP-SAT")
        a, stats = solve(pr.tables, list(best.assign), time_limit=0.13 * options.time_limit / rounds,
                         workers=options.workers, wall_limit=options.time_limit / rounds,
                         seed=options.seed, ties=problem.ties,
                         memory=(problem.capacity, pr.memory.constraint_rows(list(best.assign))))
        solve_wall += stats.wall
        a = local_search(pr, a, problem.ties, budget=int(15 * options.time_limit), class_moves=moves)
        if pr.time(a) < best.time:
            best = problem.choice("synthesized", pr, a)
        improved = False
        progress.phase("share grid")
        for cand in share_candidates(problem.cluster):
            trial = problem.priced(cand, only=best.assign)
            t = trial.time(best.assign)
            if t < best.time * (1 - 1e-3) and trial.fits(best.assign):
                best, improved = problem.choice("synthesized", trial, best.assign), True
        if not improved:
            break
        best = problem.choice("synthesized", problem.priced(best.priced.shares), best.assign)
    clock.lap("rounds")
    return best, stats, rounds, solve_wall


def synthesize(graph: Graph, cluster: Cluster, *, num_state_leaves: int, data_inputs,
               options: Options = Options()) -> Plan:
    """The best plan found for `graph` on `cluster` within `options.time_limit`."""
    clock = Clock()
    progress.phase("structure")
    problem = Problem.build(graph, cluster, num_state_leaves, data_inputs, options)
    clock.lap("structure")
    progress.phase("baselines")
    dp = data_parallel_choices(problem)
    base = baselines(problem, dp)
    fsdp = fsdp_choice(problem, dp["DP-EV"]) if "DP-EV" in base else None
    clock.lap("baselines")
    progress.phase("starts")
    best, stats, rounds, solve_wall = improve(problem, start(problem, dp, fsdp), options, clock)
    fitting = [b for b in base.values() if b.priced.fits(b.assign)]
    if fitting:
        dp = min(fitting, key=lambda b: b.time)
        if best.time > dp.time * (1 - options.min_gain):
            best = dp
    need = best.priced.memory.total(best.assign)
    for c in cluster.classes:
        if need > c.memory:
            raise InfeasibleMemory(
                f"no plan found fits device class {c.name!r}: it needs {need / 2**30:.2f} GiB per "
                f"device ({need:.0f} bytes) but has {c.memory / 2**30:.2f} GiB ({c.memory} bytes), "
                f"short by {(need - c.memory) / 2**30:.2f} GiB")
    solver = {"status": stats.status if stats else "NONE",
              "gap": _number(stats and stats.gap), "objective": _number(stats and stats.objective),
              "bound": _number(stats and stats.bound), "solve_seconds": solve_wall,
              "wall": clock.wall, "rounds": rounds, "phases": clock.phases,
              "variables": stats.variables if stats else 0,
              "decisions": len(set(problem.ties)) if problem.ties else len(graph.nodes)}
    return assemble(problem, best, {**base, **({"FSDP": fsdp} if fsdp else {})}, solver)


def data_parallel_plan(graph: Graph, cluster: Cluster, *, num_state_leaves: int, data_inputs,
                       shares=None) -> Plan:
    """Data parallelism as the plan, for comparisons and benchmarks: at FLOP/s-proportional
    shares (DP-CP), or at `shares`, one fraction of the batch per device class."""
    if shares is not None:
        shares = tuple(float(x) for x in shares)
        if len(shares) != cluster.num_classes or min(shares) < 0 or abs(sum(shares) - 1) > 1e-6:
            raise ValueError(f"shares must be {cluster.num_classes} non-negative fractions "
                             f"summing to 1 (one per class), got {shares!r}")
    clock = Clock()
    problem = Problem.build(graph, cluster, num_state_leaves, data_inputs, batch_only=True)
    clock.lap("structure")
    base = baselines(problem, data_parallel_choices(problem))
    clock.lap("baselines")
    if not base:
        raise no_data_parallelism(problem, data_inputs)
    chosen = base["DP-CP"] if shares is None else problem.data_parallel(shares, "DP")
    solver = {"status": "NONE", "gap": None, "objective": None, "bound": None,
              "solve_seconds": 0.0, "wall": clock.wall, "rounds": 0, "phases": clock.phases,
              "variables": 0, "decisions": len(graph.nodes)}
    return assemble(problem, chosen, base, solver)


def _number(x):
    """A finite float, or None (CP-SAT reports NaN when it found nothing)."""
    return None if x is None or x is False or x != x else float(x)


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
    from hapsynth.synth.stages import NotPipelineable

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
    from dataclasses import replace

    from hapsynth.synth.pipeline import plan_pipeline, plan_vshape
    from hapsynth.synth.pipeplan import as_plan
    from hapsynth.synth.stagegroups import islands_differ, stage_groups
    from hapsynth.synth.stages import NotPipelineable, analyse

    def keep(why: str) -> Plan:
        if pipeline is True:
            raise NotPipelineable(f"pipeline=True: {why}")
        if spmd is None:
            raise InfeasibleMemory(f"{unfit}; and no pipeline: {why}")
        return replace(spmd, baselines={**spmd.baselines, "SPMD": spmd.predicted_step_time},
                       solver={**spmd.solver, "pipeline": why})

    if cluster.num_islands < 2:
        return keep(f"cluster {cluster.name!r} has one island (declare islands to pipeline "
                    "across them)")
    if straight is not None and len(straight) > 1:
        return _fastest_pipeline([
            lambda s=s: with_pipeline(graph, cluster, spmd, num_state_leaves=num_state_leaves,
                                      data_inputs=data_inputs, pipeline=pipeline,
                                      min_gain=min_gain, unfit=unfit, straight=[s],
                                      runtime=runtime) for s in straight])
    recorded = {}
    if straight is not None:
        graph, num_state_leaves, recorded = straight[0]
        data_inputs = graph.inputs[num_state_leaves:]
    if graph.batch_dims:
        return keep("the batch is read in microbatch views (a loop over slices)")
    dp = data_parallel_plan(graph, cluster, num_state_leaves=num_state_leaves,
                            data_inputs=data_inputs)
    try:
        regions = analyse(graph, dp.tensor_layouts, dp.op_inputs, num_state_leaves)
    except NotPipelineable as e:
        return keep(f"not pipelineable: {e}")
    progress.phase("pipeline")
    # (one stage over every device, gradient accumulation, is no pipeline to ask for)
    check_runtime(runtime)
    pipe = plan_pipeline(graph, cluster, regions, dp.tensor_layouts, num_state_leaves,
                         whole=pipeline is not True)
    free = None
    import jax

    from hapsynth._jax import moves_across_processes
    if runtime == "auto":
        runtime = "free" if jax.process_count() == 1 or moves_across_processes() else "ticks"
    if runtime == "free":  # (one stage over every device is no pipeline to run free)
        # (stages on equal parts of the islands, and where islands differ in size, a
        # stage per island too)
        unequal = islands_differ(cluster)
        found = [f(graph, cluster, regions, dp.tensor_layouts, num_state_leaves,
                   free_running=True, whole_islands=w, **kw)
                 for w in ((False, True) if unequal else (False,))
                 for f, kw in ((plan_pipeline, {"whole": False}), (plan_vshape, {}))]
        found = [p for p in found if p is not None and p.fits]
        free = min(found, key=lambda p: p.step, default=None)
        if free is not None and (pipe is None or not pipe.fits or free.step < pipe.step):
            pipe = free
    if pipe is None:
        return keep("no stage cut: too few parameters or microbatches for the islands")
    if not pipe.fits:
        parts, _ = stage_groups(cluster, pipe.whole_islands)
        small = cluster.classes[min({cluster.class_of(d) for k in pipe.order for d in parts[k]},
                                    key=lambda c: cluster.classes[c].memory)]
        why = (f"the best pipeline found does not fit memory ({pipe.step:.4g} s): every device "
               f"holds the largest stage's buffers, {pipe.memory[0] / 2**30:.3g} GiB, and "
               f"class {small.name!r} has {small.memory / 2**30:.3g} GiB")
        if pipeline is True:  # memory, not the step's shape: recomputation may still fit it
            raise InfeasibleMemory(f"pipeline=True: {why}")
        return keep(why)
    if spmd is not None and pipeline is not True \
            and pipe.step > spmd.predicted_step_time * (1 - min_gain):
        return keep(spmd_kept(spmd.predicted_step_time, pipe.step, min_gain,
                              f" ({pipe.kind}, {pipe.micros} microbatches)"))
    if spmd is None:
        spmd = replace(dp, predicted_step_time=float("nan"))
    plan = as_plan(pipe, dp, spmd, cluster, runtime="free" if pipe is free else "ticks")
    if recorded:  # how the program it runs is made of the step (`rewrites.program_of`)
        plan = replace(plan, pipeline={**plan.pipeline, **recorded})
    if recorded.get("merged"):  # the limit of the step without its recomputation
        plan = replace(plan, baselines={**plan.baselines, "ideal": min(
            plan.baselines["ideal"], graph.flops / cluster.total_flops)})
    what = ("gradient accumulation over every device" if len(pipe.order) == 1 else
            "pipelined, running free" if pipe is free else "pipelined")
    return replace(plan, solver={**plan.solver, "pipeline": (
        f"{what}: {pipe.step:.4g} s ({pipe.kind}, {pipe.micros} microbatches) vs SPMD-only "
        f"{spmd.predicted_step_time:.4g} s")})
