"""The emulation harness of `hapsynth bench hetero`: slow-device knob, launcher, profile."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import hapsynth as hs
from hapsynth import launch, profile
from hapsynth.lower.program import Lowered
from hapsynth.models import get
from test_lowering import CLUSTERS, compare


def test_work_repeat_keeps_values_and_really_runs():
    """Device i runs each segment work_repeat[i] times (a runtime count): the results are
    unchanged, and the repeats are not eliminated by XLA: perturbing their operands
    (flag=True) changes the results exactly when some device repeats."""
    step, args = get("mlp", "tiny")
    par = hs.parallelize(step, cluster=CLUSTERS["2+6"](), time_limit=1)
    plan = par.plan(*args)
    prog = par._programs[next(iter(par._programs))]
    slow = Lowered(prog, plan, par.cluster.jax_devices(), work_repeat=(1, 1) + (3,) * 6)
    assert slow.emulating and slow.mode == "shard_map"
    got, want = args[:2], args[:2]
    for _ in range(2):
        want = jax.jit(step)(*want[:2], args[2])
        got = slow(*got[:2], args[2])
        compare(hs.gather(got), want)
    ref = jax.jit(step)(*args)
    for repeat, changes in (((1,) * 8, False), ((1, 1) + (2,) * 6, True),
                            ((2,) + (1,) * 7, True)):
        slow.set_work_repeat(repeat, flag=True)
        out = hs.gather(slow(*args))
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
        assert (not diff <= 1e-3) == changes, (repeat, diff)  # NaN counts as changed


def test_work_repeat_is_checked():
    step, args = get("mlp", "tiny")
    par = hs.parallelize(step, cluster="cpu8-even", time_limit=1)
    plan = par.plan(*args)
    prog = par._programs[next(iter(par._programs))]
    with pytest.raises(ValueError, match="work_repeat needs 8 integers"):
        Lowered(prog, plan, par.cluster.jax_devices(), work_repeat=(1, 2))
    with pytest.raises(ValueError, match="work_repeat needs 8 integers"):
        Lowered(prog, plan, par.cluster.jax_devices()).set_work_repeat((1,) * 8)


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
