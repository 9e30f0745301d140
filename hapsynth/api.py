"""The public API: what users import as `hapsynth as hs` (parallelize, inspect).

`parallelize` binds a train step to a cluster; a call flattens its arguments once
(`args.Arguments`: their signature is the plan's key), plans on first use of a signature
(`synth.once.synthesize_once`: trace, then `synth.recompute.plan_program`) and runs the
plan's runtime (`lower.lower`: SPMD, tick-loop pipeline or free-running).
"""
from __future__ import annotations

import functools

import jax

from hapsynth import progress
from hapsynth.args import Arguments, check_arity, donated_leaves, state_arity
from hapsynth.cluster import Cluster
from hapsynth.ir import inspect as _inspect
from hapsynth.ir import trace
from hapsynth.ir.views import fold_batch_splits
from hapsynth.lower import lower
from hapsynth.lower.devices import local_devices
from hapsynth.plancache import PlanCache
from hapsynth.synth.choose import check_devices, check_pipeline, check_remat, check_strategy
from hapsynth.synth.once import synthesize_once
from hapsynth.synth.pipechoice import check_runtime
from hapsynth.synth.plan import Plan
from hapsynth.synth.rewrites import checked_program


def inspect(train_step, *example_args) -> dict:
    """IR coverage and cost of `train_step(*example_args)`; see `hapsynth.ir.report.inspect`."""
    return _inspect(train_step, *example_args)


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
        check_strategy(strategy)
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
        return self._plan(Arguments(args))

    def lowered(self, *args):
        """The runtime for these arguments' signature (planned on first use): `Lowered`,
        `Pipelined` or `FreeRunning`, as `lower.lower` picks by the plan."""
        return self._runtime(Arguments(args))

    def shard(self, *args):
        """`args` stored as the step reads them: each device gets only its own rows of a
        sharded batch. Returns the same pytree with `hs.Sharded` leaves."""
        a = Arguments(args)
        return self._runtime(a).shard(*a.values())

    def load(self, load, *args):
        """`args` stored as the step reads them, where each leaf given as a
        `jax.ShapeDtypeStruct` is read by `load(path, dim, start, stop)` for this process's
        devices only (multi-host data loading: a process reads just its devices' rows)."""
        a = Arguments(args)
        return self._runtime(a).load(load, *a.values())

    def __call__(self, *args):
        """Run one distributed step; arguments may be global arrays or previous outputs,
        and Python scalars (traced, as `jax.jit` traces them: a new value is not a new plan)."""
        a = Arguments(args)
        return self._runtime(a).run(a.leaves)

    # -- one signature's plan and runtime, made on first use ---------------------------
    def _runtime(self, a: Arguments):
        low = self._lowered.get(a.key)
        if low is None:
            plan = self._plan(a)
            low = self._lowered[a.key] = lower(self._programs[a.key], plan,
                                               local_devices(self.cluster),
                                               donate=donated_leaves(a.args, self.donate_argnums))
        return low

    def _plan(self, a: Arguments) -> Plan:
        if a.key not in self._plans:
            check_arity(self.train_step, a.args)  # (a wrong call fails naming the argument)
            with progress.reporting(self.verbose):
                self._plans[a.key], self._programs[a.key] = self._planned(a.abstract())
        return self._plans[a.key]

    def _planned(self, args) -> tuple[Plan, object]:
        """The plan for abstract `args`, and the program it runs: the step traced (its
        leading `state_arity` arguments are state), then planned once, or checked against
        the plan given."""
        progress.phase("trace")
        k = state_arity(self.train_step, args)
        nstate = len(jax.tree.leaves(args[:k]))
        prog = trace(self.train_step, *args)
        prog = fold_batch_splits(prog, range(nstate, len(prog.inputs)))
        progress.phase("lift")
        if self.given_plan is not None:
            return self.given_plan, checked_program(self.given_plan, prog, self.cluster)
        return synthesize_once(prog, self.cluster, self.plan_cache, num_state_leaves=nstate,
                               **self.options)


def parallelize(train_step=None, *, cluster, donate_argnums=(), **options):
    """`hs.parallelize(step, cluster=...)` or `@hs.parallelize(cluster=...)`.

    `donate_argnums` as in `jax.jit`: those arguments' buffers (e.g. params and optimizer
    state fed back from the previous step) are reused by the step and deleted. `plan=` a
    saved `hs.Plan` uses it instead of synthesising; it must be for this very program.
    Other options: `time_limit`, `seed`, `workers`, `min_gain`, `strategy` ("auto",
    "data-parallel", or "fsdp": ZeRO-3, the FSDP baseline as the plan), `shares` (data-parallel only), `pipeline` ("auto": a pipeline across
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
