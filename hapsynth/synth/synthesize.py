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
from dataclasses import dataclass, field, replace

from hapsynth import progress
from hapsynth.cluster import Cluster
from hapsynth.ir.graph import Graph
from hapsynth.synth.plan import Plan
from hapsynth.synth.assemble import Choice, assemble
from hapsynth.synth.fsdp import fsdp_choice
from hapsynth.synth.search import (Priced, data_parallel, fit_memory, hold_copies, local_search,
                                   share_candidates, shares_by, state_classes, switch_classes)
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
    batch_units: frozenset = frozenset()  # factor sizes the batch classes split in

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
                   min(c.memory for c in cluster.classes), frozenset(uf.units(c) for c in batch))

    def priced(self, shares, only=None, even_state: bool = True) -> Priced:
        """Priced at `shares` for the batch; with `even_state` every other factor (the
        state's dims, a tensor-parallel split) evenly: padded storage then holds no
        padding, whatever the batch shares (False: everything at `shares`)."""
        return Priced.at(self.structure, self.cluster, shares, self.capacity, only,
                         self.batch_units if even_state else None)

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
        a = hold_copies(pr, a)
        if pr.time(a) < best.time:
            best = problem.choice("synthesized", pr, a)
        improved = False
        progress.phase("share grid")
        for cand in share_candidates(problem.cluster):
            for even in (True, False):
                trial = problem.priced(cand, only=best.assign, even_state=even)
                t = trial.time(best.assign)
                if t < best.time * (1 - 1e-3) and trial.fits(best.assign):
                    best, improved = problem.choice("synthesized", trial, best.assign), True
        if not improved:
            break
        best = problem.choice("synthesized", problem.priced(
            best.priced.shares, even_state=best.priced.even_state), best.assign)
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
    unfit(best, cluster)
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


def fsdp_plan(graph: Graph, cluster: Cluster, *, num_state_leaves: int, data_inputs) -> Plan:
    """The FSDP baseline (ZeRO-3 at even shares, `fsdp.py`) as the plan: what a user
    forcing sharded state gets, to compare or to rely on."""
    clock = Clock()
    problem = Problem.build(graph, cluster, num_state_leaves, data_inputs)
    clock.lap("structure")
    base = baselines(problem, data_parallel_choices(problem))
    if "DP-EV" not in base:
        raise no_data_parallelism(problem, data_inputs)
    fsdp = fsdp_choice(problem, base["DP-EV"])
    clock.lap("baselines")
    if fsdp is None:
        raise ValueError("strategy='fsdp': no state leaf of this step can be sharded (no "
                         "state argument is updated from a sharded gradient)")
    chosen = replace(fsdp, name="FSDP", time=fsdp.priced.time(fsdp.assign))
    unfit(chosen, cluster, "strategy='fsdp' (ZeRO-3) does not fit")
    solver = {"status": "NONE", "gap": None, "objective": None, "bound": None,
              "solve_seconds": 0.0, "wall": clock.wall, "rounds": 0, "phases": clock.phases,
              "variables": 0, "decisions": len(graph.nodes)}
    return assemble(problem, chosen, {**base, "FSDP": fsdp}, solver)


def unfit(choice: Choice, cluster: Cluster, what: str = "no plan found fits") -> None:
    """Raise `InfeasibleMemory` naming the device class `choice` overflows by most."""
    need = choice.priced.memory.total(choice.assign)
    for c in sorted(cluster.classes, key=lambda c: c.memory):  # (the one short by most)
        if need > c.memory:
            raise InfeasibleMemory(
                f"{what} device class {c.name!r}: it needs {need / 2**30:.2f} GiB per "
                f"device ({need:.0f} bytes) but has {c.memory / 2**30:.2f} GiB ({c.memory} bytes), "
                f"short by {(need - c.memory) / 2**30:.2f} GiB")


def _number(x):
    """A finite float, or None (CP-SAT reports NaN when it found nothing)."""
    return None if x is None or x is False or x != x else float(x)
