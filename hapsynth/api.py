"""The public API: what users import as `hapsynth as hs` (parallelize, inspect, gather)."""
from __future__ import annotations

import functools
import warnings
from dataclasses import replace

import jax

from hapsynth import progress
from hapsynth.cluster import Cluster
from hapsynth.ir import inspect as _inspect
from hapsynth.ir import lift_program, trace
from hapsynth.ir.cse import merge_recomputed
from hapsynth.ir.remat import cannot_fit, describe, rematerialize, room, undone
from hapsynth.ir.signature import of_graph
from hapsynth.ir.unroll import unroll, unrollable, written_out
from hapsynth.ir.views import fold_batch_splits
from hapsynth.lower.devices import local_devices
from hapsynth.lower.freerun import FreeRunning
from hapsynth.lower.pipeline import Pipelined
from hapsynth.lower.program import Lowered
from hapsynth.lower.values import Sharded
from hapsynth.plancache import PlanCache
from hapsynth.synth.plan import Plan
from hapsynth.synth.subsets import candidates, on_fewer_devices
from hapsynth.synth.synthesize import (InfeasibleMemory, NoDataParallelism, Options,
                                       check_runtime, data_parallel_plan, spmd_kept, synthesize,
                                       with_pipeline)

STRATEGIES = ("auto", "data-parallel")


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


def inspect(train_step, *example_args) -> dict:
    """IR coverage and cost of `train_step(*example_args)`; see `hapsynth.ir.report.inspect`."""
    return _inspect(train_step, *example_args)


def _abstract(x):
    if isinstance(x, Sharded):
        return jax.ShapeDtypeStruct(x.shape, x.data.dtype)
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _abstract_tree(args):
    return jax.tree.map(_abstract, args, is_leaf=lambda v: isinstance(v, Sharded))


def signature_of(args) -> tuple:
    """What a plan depends on: the pytree structure, shapes and dtypes of the arguments
    (a `Sharded` leaf counts as the array it stands for). Cheap: called every step."""
    leaves, tree = jax.tree.flatten(args, is_leaf=_is_sharded)
    return _signature(leaves, tree)


def _signature(leaves, tree) -> tuple:
    return tree, tuple((tuple(x.shape), x.dtype) for x in leaves)


def _is_sharded(v) -> bool:
    return isinstance(v, Sharded)


def state_arity(train_step, args) -> int:
    """How many leading arguments are state: the output's leading elements with the same
    pytree structure, shapes and dtypes (params, opt_state) are fed back as the next
    step's arguments. (A batch of token ids is one leaf like the loss, but not its shape.)"""
    out = jax.eval_shape(train_step, *args)
    if not isinstance(out, (tuple, list)):
        return 0

    def same(a, b) -> bool:
        la, ta = jax.tree.flatten(a, is_leaf=_is_sharded)
        lb, tb = jax.tree.flatten(b, is_leaf=_is_sharded)
        return ta == tb and all(tuple(x.shape) == tuple(y.shape) and x.dtype == y.dtype
                                for x, y in zip(la, lb))

    k = 0
    while k < min(len(out), len(args)) and same(out[k], args[k]):
        k += 1
    return k


def from_process_zero(text: str | None) -> str:
    """Process 0's string on every process: with several `jax.distributed` processes
    a plan is synthesised once and shared, since every process must run the same program."""
    if jax.process_count() == 1:
        return text
    import numpy as np

    from hapsynth.lower.moves import broadcast

    data = np.frombuffer(text.encode(), np.uint8) if jax.process_index() == 0 else None
    n = int(broadcast(np.int32(0 if data is None else data.size)))
    return bytes(broadcast(np.zeros(n, np.uint8) if data is None else data)).decode()


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
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "data-parallel":
        return data_parallel_plan(graph, cluster, num_state_leaves=num_state_leaves,
                                  data_inputs=data_inputs, shares=shares)
    if shares is not None:
        raise ValueError("shares= applies to strategy='data-parallel' only")
    devices = options.pop("devices", "auto")
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


def plan_program(prog, cluster, *, num_state_leaves: int, remat="auto",
                 **kw) -> tuple[Plan, object]:
    """`make_plan` for a traced step, and the program the plan runs: the step as written
    or, with `remat="auto"`, with cheap activations recomputed in the backward pass
    (`ir/remat.py`; `plan.remat` says so) when no plan holds them, or when that lets the
    faster devices hold the step alone and prices faster (`faster_recomputed`)."""
    check_remat(remat)

    lift, merge = _by_program(lift_program), _by_program(merge_recomputed)

    def plan_of(p, **override) -> Plan:
        graph = lift(p)
        straight = None
        options = {**kw, **override}
        if considers_pipeline(cluster, options.get("pipeline", False),
                              options.get("strategy", "auto")):
            u = written_out(p, num_state_leaves)
            unrolled = {"unrolled": num_state_leaves} if u else {}
            q, n = u or (p, num_state_leaves)
            merged = merge(q) if p is prog else None
            if u or merged is not None:
                straight = [(lift_program(q) if u else graph, n, unrolled)]
            if merged is not None:  # the step's own recomputation undone, stages cut in it
                straight.append((lift_program(merged), n, {**unrolled, "merged": True}))
        return make_plan(graph, cluster, num_state_leaves=num_state_leaves,
                         data_inputs=graph.inputs[num_state_leaves:], straight=straight,
                         **options)

    if remat is False:
        plan = plan_of(prog)
        return plan, program_of(plan, prog, merge)
    memories = [cluster.device_class(i).memory for i in range(cluster.num_devices)]
    hopeless = cannot_fit(prog, memories)  # no plan holds it as written: skip that try
    if not hopeless:
        try:
            plan = plan_of(prog)
        except InfeasibleMemory as err:
            unfit = err
        else:
            again, target = faster_recomputed(prog, plan, cluster, num_state_leaves, lift, **kw)
            if again is not None:
                try:
                    other = replace(plan_of(again), remat=describe(prog, again, target))
                except InfeasibleMemory:
                    other = None
                plan = sooner(plan, other, kw.get("pipeline", False),
                              kw.get("min_gain", Options.min_gain))
            pair = undone_program(prog, num_state_leaves, merge)  # (SPMD runs it so too)
            if pair is not None and kw.get("pipeline", False) is not True:
                try:
                    other = replace(plan_of(pair[1], pipeline=False), remat={
                        **undone(*pair),
                        **({"unrolled": num_state_leaves} if prog.loops else {})})
                except InfeasibleMemory:
                    other = None
                plan = sooner(plan, other, kw.get("pipeline", False),
                              kw.get("min_gain", Options.min_gain))
            return plan, program_of(plan, prog, merge)
    # as little recomputation as the memory may need (data parallelism holds the state
    # whole on every device), then all of it
    state = sum(prog.avals[t].nbytes for t in prog.inputs[:num_state_leaves])
    target = 0.9 * room(memories, state)
    light, full = rematerialize(prog, target), rematerialize(prog)
    tries = [(p, t) for p, t in ((light, target), (full, None)) if p is not None]
    if light is not None and full is not None and len(light.eqns) == len(full.eqns):
        tries = [(full, None)]
    if not tries:  # nothing cheap to recompute
        if hopeless:
            return plan_of(prog), prog  # raises, naming the device class and the shortfall
        raise unfit
    for again, t in tries:
        try:
            plan = replace(plan_of(again), remat=describe(prog, again, t))
        except InfeasibleMemory as err:
            unfit = err
            continue
        if t is not None and plan.devices is not None and full is not None:
            # the light rewrite left devices idle: would all of it let every device work?
            graph = lift_program(full)
            every = fitting_data_parallel(graph, cluster, num_state_leaves,
                                          graph.inputs[num_state_leaves:])
            if every < plan.predicted_step_time * (1 - kw.get("min_gain", Options.min_gain)):
                other = replace(plan_of(full), remat=describe(prog, full, None))
                if other.predicted_step_time < plan.predicted_step_time:
                    return other, program_of(other, prog, merge)  # (data parallelism fits there: so does this plan)
        return plan, program_of(plan, prog, merge)
    raise InfeasibleMemory(f"{unfit} (with activations recomputed in the backward pass)")


def faster_recomputed(prog, plan: Plan, cluster: Cluster, num_state_leaves: int,
                      lift=lift_program, *,
                      strategy="auto", devices="auto", min_gain=Options.min_gain, **_):
    """When `plan` fits only because the step's activations are spread over more (or
    slower) devices than its work needs: `prog` with as much recomputed as lets the
    faster devices hold it, and the memory target it was recomputed to (None: all), if
    data parallelism there then prices `min_gain` faster than `plan` (than its SPMD-only
    time, for a pipeline); else (None, None)."""
    if strategy == "data-parallel" or plan.remat:
        return None, None
    best = (spmd_time(plan) * (1 - min_gain), None, None)  # a pipeline's SPMD-only too
    flops = plan.baselines.get("ideal", 0.0) * cluster.total_flops
    state = sum(prog.avals[t].nbytes for t in prog.inputs[:num_state_leaves])
    whole = tuple(range(cluster.num_devices))
    subsets = [whole] + ([] if devices == "all" or jax.process_count() > 1 else candidates(cluster))
    graph, full = lift(prog), ()
    for devs in subsets:
        sub = cluster if devs == whole else cluster.subset(devs)
        if flops / sub.total_flops >= best[0] or devs == plan.devices:
            continue  # too few FLOP/s even without recomputing, or where the plan runs

        @functools.lru_cache(maxsize=None)
        def price_on(p, sub=sub):
            g = lift(p)
            return fitting_data_parallel(g, sub, num_state_leaves, g.inputs[num_state_leaves:])

        # data parallelism as written there, memory aside (the plan has the whole cluster's)
        dp = plan if devs == whole else data_parallel_or_none(
            graph, sub, num_state_leaves, graph.inputs[num_state_leaves:])
        fitting, alone = dp_prices(dp, sub)
        if fitting < float("inf") or alone >= best[0]:
            continue  # it fits as written there, or is not faster even without recomputing
        full = rematerialize(prog) if full == () else full
        if full is None or price_on(full) == float("inf"):
            continue  # not even all of it recomputed fits there: nor does less
        if price_on(full) < best[0]:
            best = (price_on(full), full, None)
        target = 0.9 * room([sub.device_class(d).memory for d in range(sub.num_devices)], state)
        light = rematerialize(prog, target)  # less recomputed: faster, when it fits
        if light is not None and price_on(light) < best[0]:
            best = (price_on(light), light, target)
    return best[1], best[2]


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
    return replace(best, baselines={**best.baselines, "SPMD": alone}, solver=solver)


def synthesize_once(prog, cluster, cache: PlanCache | None = None, **kw) -> tuple[Plan, object]:
    """`plan_program` on process 0 only, or the plan `cache` holds for it; with several
    processes the plan is shared."""
    plan = None
    if jax.process_index() == 0:
        plan, done = cached_plan(cache, prog, cluster, **kw) if cache else plan_program(
            prog, cluster, **kw)
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
    plan, done = plan_program(prog, cluster, **kw)
    cache.put(key, plan)
    return plan, done


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


def _by_program(fn):
    """`fn` of a program, computed once per program object (kept alive with its result,
    so that its id stays its own)."""
    memo: dict = {}

    def cached(p):
        if id(p) not in memo:
            memo[id(p)] = p, fn(p)
        return memo[id(p)][1]
    return cached


def program_of(plan: Plan, prog, merge=merge_recomputed):
    """The program `plan` runs: `prog`, rewritten the way it was when planned (`merge`:
    `merge_recomputed`, or a cache of it)."""
    if plan.remat and plan.remat.get("undone"):
        prog = undone_program(prog, plan.remat.get("unrolled"), merge)[1]
    elif plan.remat:
        prog = rematerialize(prog, plan.remat["target"])
    unrolled = plan.pipeline.get("unrolled") if plan.pipeline else None
    prog = prog if unrolled is None else unroll(prog, unrolled)
    return merge(prog) if plan.pipeline and plan.pipeline.get("merged") else prog


def donated_leaves(args, donate_argnums) -> list[int]:
    """Flat leaf indices of the arguments `donate_argnums` names (as in `jax.jit`)."""
    nums = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    for i in nums:
        if not -len(args) <= i < len(args):
            raise ValueError(f"donate_argnums has {i}, but the step takes {len(args)} arguments")
    counts = [len(jax.tree.leaves(a, is_leaf=_is_sharded)) for a in args]
    starts = [sum(counts[:i]) for i in range(len(args))]
    return [starts[i] + k for i in sorted({n % len(args) for n in nums}) for k in range(counts[i])]


class Parallelized:
    """A train step bound to a cluster: `.plan(*args)` synthesises (cached per signature)."""

    def __init__(self, train_step, cluster: Cluster, *, donate_argnums=(), time_limit: float = 10.0,
                 seed: int = 0, workers: int = 2, strategy: str = "auto", shares=None,
                 min_gain: float = 0.05, plan: Plan | None = None, verbose: bool | None = None,
                 pipeline="auto", devices="auto", remat="auto", pipeline_runtime="auto",
                 plan_cache=None):
        self.train_step = train_step
        self.plan_cache = PlanCache.of(plan_cache)
        self.given_plan = plan  # a saved plan to use instead of synthesising (checked)
        self.cluster = cluster if isinstance(cluster, Cluster) else Cluster.load(cluster)
        self.donate_argnums = donate_argnums
        self.verbose = verbose  # progress bar: None = when a person watches (TTY, notebook)
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        check_pipeline(pipeline)
        check_runtime(pipeline_runtime)
        check_devices(devices)
        check_remat(remat)
        self.options = {"time_limit": time_limit, "seed": seed, "workers": workers,
                        "strategy": strategy, "shares": shares,
                        "min_gain": min_gain, "pipeline": pipeline, "devices": devices,
                        "remat": remat, "pipeline_runtime": pipeline_runtime}
        self._plans: dict = {}
        self._programs: dict = {}
        self._lowered: dict = {}
        functools.update_wrapper(self, train_step)

    def plan(self, *args) -> Plan:
        """The plan for these arguments (arrays or `jax.ShapeDtypeStruct`s); no devices needed."""
        key = signature_of(args)
        if key not in self._plans:
            with progress.reporting(self.verbose):
                self._plan(key, _abstract_tree(args))
        return self._plans[key]

    def _plan(self, key, args) -> None:
        progress.phase("trace")
        k = state_arity(self.train_step, args)
        nstate = len(jax.tree.leaves(args[:k]))
        prog = trace(self.train_step, *args)
        prog = fold_batch_splits(prog, range(nstate, len(prog.inputs)))
        progress.phase("lift")
        if self.given_plan is not None:
            prog = checked_program(self.given_plan, prog, self.cluster)
            self._plans[key] = self.given_plan
        else:
            self._plans[key], prog = synthesize_once(prog, self.cluster, self.plan_cache,
                                                     num_state_leaves=nstate, **self.options)
        self._programs[key] = prog

    def lowered(self, *args) -> Lowered:
        """The compiled program for these arguments' signature (planned on first use)."""
        key = signature_of(args)
        if key not in self._lowered:
            plan = self.plan(*args)
            if plan.stages and plan.pipeline.get("runtime") == "free":
                self._lowered[key] = FreeRunning(self._programs[key], plan,
                                                 local_devices(self.cluster),
                                                 donate=donated_leaves(args, self.donate_argnums))
                return self._lowered[key]
            if plan.stages:
                self._lowered[key] = Pipelined(self._programs[key], plan,
                                               local_devices(self.cluster),
                                               donate=donated_leaves(args, self.donate_argnums))
                return self._lowered[key]
            self._lowered[key] = Lowered(self._programs[key], plan, local_devices(self.cluster),
                                         donate=donated_leaves(args, self.donate_argnums))
        return self._lowered[key]

    def shard(self, *args):
        """`args` stored as the step reads them: each device gets only its own rows of a
        sharded batch. Returns the same pytree with `hs.Sharded` leaves."""
        return self.lowered(*args).shard(*args)

    def load(self, load, *args):
        """`args` stored as the step reads them, where each leaf given as a
        `jax.ShapeDtypeStruct` is read by `load(path, dim, start, stop)` for this process's
        devices only (multi-host data loading: a process reads just its devices' rows)."""
        return self.lowered(*args).load(load, *args)

    def __call__(self, *args):
        """Run one distributed step; arguments may be global arrays or previous outputs."""
        leaves, tree = jax.tree.flatten(args, is_leaf=_is_sharded)
        low = self._lowered.get(_signature(leaves, tree))
        return (low or self.lowered(*args)).run(leaves)


def parallelize(train_step=None, *, cluster, donate_argnums=(), **options):
    """`hs.parallelize(step, cluster=...)` or `@hs.parallelize(cluster=...)`.

    `donate_argnums` as in `jax.jit`: those arguments' buffers (e.g. params and optimizer
    state fed back from the previous step) are reused by the step and deleted. `plan=` a
    saved `hs.Plan` uses it instead of synthesising; it must be for this very program.
    Other options: `time_limit`, `seed`, `workers`, `min_gain`, `strategy` ("auto" or
    "data-parallel"), `shares` (data-parallel only), `pipeline` ("auto": a pipeline across
    the cluster's islands when it prices faster than the best SPMD-only plan; True: a
    pipeline; False: SPMD only), `devices` ("auto": the plan may leave the slowest class,
    or all but the strongest island or host, idle when it prices faster that way; "all":
    every device works), `remat` ("auto": when no plan holds the step's activations, or when
    the faster devices hold them alone only so, cheap ones are recomputed in the backward
    pass; False: never), `verbose` (a progress bar while
    planning: None shows it when run in a terminal or a notebook, not in CI),
    `plan_cache` (a folder where plans are kept between runs and read back for the same
    program, cluster and options; None: the folder `HAPSYNTH_PLAN_CACHE` names, if set;
    False: none; see `hapsynth.plancache`)."""
    if train_step is None:
        return lambda fn: Parallelized(fn, cluster, donate_argnums=donate_argnums, **options)
    return Parallelized(train_step, cluster, donate_argnums=donate_argnums, **options)
