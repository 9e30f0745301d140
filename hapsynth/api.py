"""The public API (DESIGN.md "Public API"): what users import as `hapsynth as hs`."""
from __future__ import annotations

import functools

import jax

from hapsynth.ir import inspect as _inspect
from hapsynth.ir import lift
from hapsynth.lower.program import Lowered
from hapsynth.lower.values import Sharded
from hapsynth.synth.cluster import Cluster
from hapsynth.synth.plan import Plan
from hapsynth.synth.synthesize import synthesize


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
    pytree structure (params, opt_state) are fed back as the next step's arguments."""
    out = jax.eval_shape(train_step, *args)
    if not isinstance(out, (tuple, list)):
        return 0
    k = 0
    while k < min(len(out), len(args)) and \
            jax.tree.structure(out[k]) == jax.tree.structure(args[k]):
        k += 1
    return k


def from_process_zero(text: str | None) -> str:
    """Process 0's string on every process: with several `jax.distributed` processes
    a plan is synthesised once and shared, since every process must run the same program."""
    if jax.process_count() == 1:
        return text
    import numpy as np
    from jax.experimental import multihost_utils as mh

    data = np.frombuffer(text.encode(), np.uint8) if jax.process_index() == 0 else None
    n = int(mh.broadcast_one_to_all(np.int32(0 if data is None else data.size)))
    buf = np.zeros(n, np.uint8) if data is None else data
    return bytes(np.asarray(mh.broadcast_one_to_all(buf))).decode()


def synthesize_once(graph, cluster, **options) -> Plan:
    """`synthesize` on process 0 only; with several processes the plan is shared."""
    plan = synthesize(graph, cluster, **options) if jax.process_index() == 0 else None
    if jax.process_count() > 1:
        plan = Plan.from_json(from_process_zero(plan and plan.to_json()))
    return plan


class Parallelized:
    """A train step bound to a cluster: `.plan(*args)` synthesises (cached per signature)."""

    def __init__(self, train_step, cluster: Cluster, *, donate_argnums=(), time_limit: float = 10.0,
                 seed: int = 0, workers: int = 2, strategy: str = "auto", shares=None,
                 min_gain: float = 0.05):
        self.train_step = train_step
        self.cluster = cluster if isinstance(cluster, Cluster) else Cluster.load(cluster)
        self.donate_argnums = donate_argnums
        self.options = {"time_limit": time_limit, "seed": seed, "workers": workers,
                        "strategy": strategy, "shares": shares,
                        "min_gain": min_gain}
        self._plans: dict = {}
        self._programs: dict = {}
        self._lowered: dict = {}
        functools.update_wrapper(self, train_step)

    def plan(self, *args) -> Plan:
        """The plan for these arguments (arrays or `jax.ShapeDtypeStruct`s); no devices needed."""
        key = signature_of(args)
        if key not in self._plans:
            args = _abstract_tree(args)
            k = state_arity(self.train_step, args)
            nstate = len(jax.tree.leaves(args[:k]))
            prog, graph = lift(self.train_step, *args)
            self._programs[key] = prog
            self._plans[key] = synthesize_once(graph, self.cluster, num_state_leaves=nstate,
                                               data_inputs=graph.inputs[nstate:], **self.options)
        return self._plans[key]

    def lowered(self, *args) -> Lowered:
        """The compiled program for these arguments' signature (planned on first use)."""
        key = signature_of(args)
        if key not in self._lowered:
            plan = self.plan(*args)
            self._lowered[key] = Lowered(self._programs[key], plan, self.cluster.jax_devices())
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
    """`hs.parallelize(step, cluster=...)` or `@hs.parallelize(cluster=...)`."""
    if train_step is None:
        return lambda fn: Parallelized(fn, cluster, donate_argnums=donate_argnums, **options)
    return Parallelized(train_step, cluster, donate_argnums=donate_argnums, **options)
