"""The measurement harness (`hapsynth_bench`): slow-device emulation, launcher, profile."""
from __future__ import annotations

import time

import jax
import numpy as np
import pytest

import hapsynth as hs
from hapsynth import profile
from hapsynth.lower.devices import local_devices
from hapsynth.lower.program import Lowered
from hapsynth.models import get
from hapsynth_bench import launch
from hapsynth_bench.emulation import WorkRepeat
from test_lowering import CLUSTERS, compare


@pytest.mark.slow  # the harness's knob: `hapsynth bench hetero` exercises it end to end
def test_work_repeat_keeps_values_and_really_runs():
    """Device i runs each segment counts[i] times (a runtime count): the results are
    unchanged, and the repeats are not eliminated by XLA: perturbing their operands
    (flag=True) changes the results exactly when some device repeats. Counts change
    without recompiling."""
    step, args = get("mlp", "tiny")
    par = hs.parallelize(step, cluster=CLUSTERS["2+6"](), time_limit=1, devices="all")
    plan = par.plan(*args)
    prog = par._programs[next(iter(par._programs))]
    emulate = WorkRepeat((1, 1) + (3,) * 6)
    slow = Lowered(prog, plan, local_devices(par.cluster), branch_hook=emulate)
    assert slow.mode == "shard_map"
    got, want = args[:2], args[:2]
    for _ in range(2):
        want = jax.jit(step)(*want[:2], args[2])
        got = slow(*got[:2], args[2])
        compare(hs.gather(got), want)
    ref = jax.jit(step)(*args)
    for repeat, changes in (((1,) * 8, False), ((1, 1) + (2,) * 6, True),
                            ((2,) + (1,) * 7, True)):
        emulate.set(repeat, flag=True)
        out = hs.gather(slow(*args))
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
        assert (not diff <= 1e-3) == changes, (repeat, diff)  # NaN counts as changed
    assert slow._fn._cache_size() == 1  # one compilation for every count


def test_the_harness_prices_each_class_at_the_rate_it_runs_at():
    """`hapsynth bench pipeline`'s calibration: the fast class from its step alone, the
    slow one from that plus r - 1 repeats as the probe measured them."""
    from hapsynth_bench.pipeline_bench import class_rates

    # a step priced 1 s that runs in 0.5 s: twice the priced rate; repeats as dear as
    # first runs (0.25 s of the probe's 0.5 priced s): the slow device at r:1
    fast, slow = class_rates(1.0, 0.5, 0.5, 0.25, 2)
    assert fast == pytest.approx(2.0) and slow == pytest.approx(1.0)
    assert class_rates(1.0, 0.5, 0.5, 0.25, 3)[1] == pytest.approx(2 / 3)
    # a repeat costing 1.5x a first run: the slow device runs at 2.5:1, not 2:1
    fast, slow = class_rates(1.0, 0.5, 0.5, 0.375, 2)
    assert fast / slow == pytest.approx(2.5)


def test_work_repeat_is_checked():
    """Bad counts are rejected; with a branch hook even an even plan is `shard_map`."""
    step, args = get("mlp", "tiny")
    par = hs.parallelize(step, cluster="cpu8-even", strategy="data-parallel")
    plan = par.plan(*args)
    prog = par._programs[next(iter(par._programs))]
    with pytest.raises(ValueError, match="work_repeat needs 8 integers"):
        Lowered(prog, plan, local_devices(par.cluster), branch_hook=WorkRepeat((1, 2)))
    emulate = WorkRepeat((1,) * 8)
    for bad in ((1,) * 7, (1,) * 7 + (0,)):
        with pytest.raises(ValueError, match="work_repeat needs 8 integers"):
            emulate.set(bad)
    assert par.lowered(*args).mode == "gspmd"
    low = Lowered(prog, plan, local_devices(par.cluster), branch_hook=emulate)
    assert low.mode == "shard_map"
    compare(hs.gather(low(*args)), jax.jit(step)(*args))


class _Recorder:
    """A branch hook that records what `wrap` is given and adds the extra input's value
    to every floating result (so a changed input shows without recompiling)."""

    def __init__(self):
        self.value, self.calls = 0.0, []

    def inputs(self, mesh):
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        return (jax.device_put(np.float32(self.value), rep),)

    def wrap(self, branch, entry, extra):
        self.calls.append(tuple(entry))

        def wrapped(*a):
            return tuple(v + extra[0].astype(v.dtype) if jax.numpy.issubdtype(
                v.dtype, jax.numpy.floating) else v for v in branch(*a))
        return wrapped


def test_branch_hook_wraps_every_branch():
    step, args = get("mlp", "tiny")
    par = hs.parallelize(step, cluster=CLUSTERS["2+6"](), strategy="data-parallel")
    plan = par.plan(*args)
    prog = par._programs[next(iter(par._programs))]
    hook = _Recorder()
    low = Lowered(prog, plan, local_devices(par.cluster), branch_hook=hook)
    ref = jax.jit(step)(*args)
    compare(hs.gather(low(*args)), ref)
    groups = len(low.group_rep)
    assert len(hook.calls) >= groups >= 2
    assert any(any(e) for e in hook.calls)  # the step's own inputs are flagged
    hook.value = 1.0
    out = hs.gather(low(*args))
    assert not all(np.allclose(np.asarray(a), np.asarray(b))
                   for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
    assert low._fn._cache_size() == 1


def test_data_parallel_at_given_shares():
    step, args = get("mlp", "tiny")
    cluster = CLUSTERS["2+6"]()
    plan = hs.parallelize(step, cluster=cluster, strategy="data-parallel",
                          shares=(0.5, 0.5)).plan(*args)
    assert plan.chosen == "DP" and plan.ratios == {"fast": 0.5, "slow": 0.5}
    batch_units = plan.shard_units[max(plan.shard_units)]
    assert sum(batch_units[:2]) * 2 >= sum(batch_units) - 2  # half the batch on 2 fast devices
    with pytest.raises(ValueError, match="summing to 1"):
        hs.parallelize(step, cluster=cluster, strategy="data-parallel",
                       shares=(0.7, 0.7)).plan(*args)


def _whoami():
    import os

    return {"processes": jax.process_count(), "devices": len(jax.devices()),
            "local": len(jax.local_devices()),
            "cores": [sorted(os.sched_getaffinity(0))],
            "sum": float(jax.jit(lambda: 1.0)())}


@pytest.mark.slow
def test_launcher_runs_pinned_single_device_processes():
    out = launch.run("test_emulation:_whoami", processes=2, timeout=120,
                     pin=len(launch.cores()) >= 2)
    assert out["processes"] == 2 and out["devices"] == 2 and out["local"] == 1
    if len(launch.cores()) >= 2:
        assert len(out["cores"][0]) == 1


def _moved():
    """Process 1's device holds what process 0's made, moved by `jax.device_put`."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from hapsynth._jax import moves_across_processes

    on = [NamedSharding(Mesh(np.array([d]), ("x",)), PartitionSpec()) for d in jax.devices()]
    made = jax.jit(lambda: jax.numpy.arange(1000.0), out_shardings=on[0])()
    moved = jax.device_put(made, on[1])
    total = jax.jit(lambda v: v.sum(), out_shardings=on[1])(moved)  # on process 1
    back = jax.device_put(total, on[0])
    return {"moves": moves_across_processes(),
            "sum": [float(s.data) for s in back.addressable_shards]}


@pytest.mark.slow
def test_launcher_processes_move_arrays_when_asked():
    """With `transfers` (the pipeline bench's default), an array made on process 0's
    device reaches process 1's by `jax.device_put`; without it JAX refuses the move."""
    import numpy as np

    out = launch.run("test_emulation:_moved", processes=2, timeout=120, pin=False,
                     transfers=True)
    assert out["moves"] and out["sum"] == [float(np.arange(1000.0).sum())]
    with pytest.raises(RuntimeError, match="cross.host"):
        launch.run("test_emulation:_moved", processes=2, timeout=120, pin=False)


def _barrier():
    import time

    from hapsynth._jax import process_barrier
    if jax.process_index() == 1:
        time.sleep(1.5)
    t0 = time.perf_counter()
    process_barrier("test-barrier")
    return {"waited": time.perf_counter() - t0}


@pytest.mark.slow
def test_processes_wait_for_each_other_at_a_barrier():
    """Process 0 reaches the barrier 1.5 s before process 1 and waits there (the harness
    lines up its processes so before each timed step)."""
    out = launch.run("test_emulation:_barrier", processes=2, timeout=120, pin=False)
    assert out["waited"] > 1.0


def _agree():
    import zlib

    from jax.experimental import multihost_utils as mh

    rank = jax.process_index()
    got = launch.agreed({"rank": rank, "measured": 0.1 + rank})

    from hapsynth.synth.choose import make_plan
    from hapsynth.ir import lift

    step, args = get("mlp", "tiny", devices=2)
    _, graph = lift(step, *args)
    n = len(jax.tree.leaves(args[:2]))
    cluster = hs.Cluster.simulated([("CPU", 1, {"name": "fast", "flops": 1e11}),
                                    ("CPU", 1, {"name": "slow", "flops": 5e10})])

    def make():  # process 0 plans; the others must not (they would plan apart)
        if rank:
            raise AssertionError("only process 0 plans")
        return make_plan(graph, cluster, num_state_leaves=n, data_inputs=graph.inputs[n:],
                         time_limit=2)

    plan = launch.agreed_plan(make)
    seen = mh.process_allgather(np.array([got["rank"], zlib.crc32(plan.to_json().encode())],
                                         np.int64))
    return {"ranks": seen[:, 0].tolist(), "plans": seen[:, 1].tolist()}


@pytest.mark.slow
def test_processes_plan_once_and_share_what_plans_are_made_from():
    """Every process gets process 0's measurements and plan (two processes that plan
    apart may run different programs, which gloo aborts on)."""
    out = launch.run("test_emulation:_agree", processes=2, timeout=300, pin=False)
    assert out["ranks"] == [0, 0]
    assert out["plans"][0] == out["plans"][1]


def _boom():
    raise RuntimeError("task failed on purpose")


@pytest.mark.slow
def test_launcher_reports_a_failing_process():
    with pytest.raises(RuntimeError, match="task failed on purpose"):
        launch.run("test_emulation:_boom", processes=2, timeout=120, pin=False)


def test_profile_writes_a_cluster_that_loads():
    result = {"compute": profile.compute(), "links": profile.links(sizes=(1 << 12, 1 << 18))}
    c, ln = result["compute"], result["links"]
    assert c["flops"] == max(c["matmul_flops"].values()) > 1e8
    assert c["mem_bandwidth"] > 1e8
    assert ln["devices"] == 8 and ln["latency"] > 0 and ln["bandwidth"] > 0
    cluster = hs.Cluster.from_toml(profile.to_toml(result, name="here"))
    assert cluster.name == "here" and cluster.num_devices == 8
    assert cluster.classes[0].flops == pytest.approx(c["flops"], rel=1e-5)
    # as islands: each a host, joined by the measured link at the inter-island level
    isl = hs.Cluster.from_toml(profile.to_toml(result, name="isl", islands=2))
    assert isl.num_islands == 2 and isl.num_devices == 8
    assert [len(isl.island_devices(k)) for k in range(2)] == [4, 4]
    assert isl.inter_island.beta == pytest.approx(ln["bandwidth"], rel=1e-5)
    assert isl.link_between(0, 7) == isl.inter_island
    with pytest.raises(ValueError, match="3 equal islands"):
        profile.to_toml(result, islands=3)


class _Growing:
    """A program whose calls numbered in `grow` each touch 64 MB of new memory and take
    `slow` seconds longer (the cost of growing a heap)."""

    def __init__(self, grow, slow: float = 0.0):
        self.grow, self.slow, self.calls, self.kept = set(grow), slow, 0, []

    def shard(self, *args):
        return args

    def __call__(self, *args):
        self.calls += 1
        if self.calls in self.grow:
            self.kept.append(np.ones(64 << 20, np.uint8))
            time.sleep(self.slow)
        return args


def test_steps_are_timed_once_the_heap_stops_growing():
    """`_time_steps` rotates untimed until no step takes new memory (a GPU's caching
    allocator has its pool after its first steps; glibc's heap, fragmented by programs
    of different buffers, grew for several rounds), then times `reps` rounds."""
    from hapsynth_bench.hetero import STEADY_BYTES, _time_steps

    assert 64 << 20 > 4 * STEADY_BYTES
    args = (np.zeros(1), np.zeros(1), np.zeros(1))
    a, b = _Growing(range(1, 8)), _Growing(())
    times = _time_steps({"a": (a, args), "b": (b, args)}, reps=3, warmup=2)
    # 3 calls before the rotation, 4 untimed rounds still growing, 1 steady, 3 timed
    assert a.calls == b.calls == 3 + 4 + 1 + 3
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())


def test_a_step_that_grows_the_heap_is_timed_again():
    """After a steady round the heap can still grow now and then (the paper MLP's
    pipelined step, 5 of 12 rounds); such a step is not counted but timed again, so
    that the median is of steps as a program run alone takes them."""
    from hapsynth_bench.hetero import _time_steps

    args = (np.zeros(1), np.zeros(1), np.zeros(1))
    # calls 1-3 before the rotation, 4 steady; of the timed 5, 6, 7, ... 6 and 7 grow
    a, b = _Growing({1, 2, 3, 6, 7}, slow=0.2), _Growing(())
    times = _time_steps({"a": (a, args), "b": (b, args)}, reps=3, warmup=2)
    assert a.calls == b.calls == 3 + 1 + 5  # 5, 8, 9 are the three steady steps
    assert times["a"] < 0.1  # counted, steps 6 and 7 made the median 0.2 s
