"""Plans that leave devices idle: `Cluster.subset`, the candidates, and a step that runs
faster on the fast class alone, equal to single-device `jit` and exact through save/load."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hapsynth as hs
from hapsynth.cluster.values import Island
from hapsynth.synth.subsets import ALL, candidates


def _islands() -> hs.Cluster:
    return hs.Cluster.simulated(
        [("A100", 2, {"host_ids": [0, 1]}), ("V100", 4, {"host_ids": [2, 2, 3, 3]}),
         ("T4", 2, {"host_ids": [4, 4]})],
        islands={"a": [0, 1], "b": [2, 3], "c": [4]}, name="three")


def test_subset_keeps_order_hosts_links_and_drops_empty_classes_and_islands():
    c = _islands()
    s = c.subset([5, 0, 2, 1])
    assert s.num_devices == 4 and s.class_names == ("A100", "V100")
    assert [c.device_class(i).name for i in (0, 1, 2, 5)] == [s.device_class(k).name
                                                              for k in range(4)]
    assert [s.host_of(k) for k in range(4)] == [c.host_of(i) for i in (0, 1, 2, 5)]
    assert s.links == c.links
    assert s.islands == (Island("a", (0, 1)), Island("b", (2, 3)))
    assert s.link_between(2, 3) == c.link_between(2, 5)
    with pytest.raises(IndexError):
        c.subset([8])
    with pytest.raises(ValueError, match="at least one device"):
        c.subset([])


def test_candidates_are_the_fastest_classes_the_strongest_island_and_host():
    c = _islands()
    got = candidates(c)
    assert (0, 1) in got                         # A100 alone: the fastest class
    assert (0, 1, 2, 3, 4, 5) in got             # A100 + V100: the two fastest
    flops = lambda ds: sum(c.device_class(d).flops for d in ds)
    island = max((c.island_devices(k) for k in range(3)), key=flops)
    host = max(({d for d in range(8) if c.host_of(d) == h} for h in range(5)), key=flops)
    assert tuple(sorted(island)) in got and tuple(sorted(host)) in got
    assert len(got) == len(set(got))
    assert tuple(range(8)) not in got


def _tiny_step():
    """A small MLP step: microseconds of work per device, so gradient sync dominates."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (32, 64)) * 0.1, "w2": jax.random.normal(k2, (64, 8)) * 0.1}
    batch = {"x": jax.random.normal(k3, (16, 32)), "y": jnp.arange(16) % 8}

    def step(params, batch):
        def loss_fn(p):
            logits = jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"]
            rows = jnp.arange(batch["y"].shape[0])
            return -jnp.mean(jax.nn.log_softmax(logits)[rows, batch["y"]])

        loss, g = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda p, d: p - 0.1 * d, params, g), loss

    return step, params, batch


def _fast_and_far() -> hs.Cluster:
    """2 fast devices on one host beside 6 slow ones (4x slower in FLOP/s and memory
    bandwidth: a step this small is memory-bound) behind a slow, high-latency link."""
    return hs.Cluster.simulated(
        [("CPU", 2, {"name": "fast", "flops": "400GFLOP/s", "host": 0}),
         ("CPU", 6, {"name": "slow", "flops": "100GFLOP/s", "mem_bandwidth": "2.5GB/s",
                     "host_ids": [1, 1, 1, 2, 2, 2]})],
        links={"intra_host": {"bandwidth": "10GB/s", "latency": "5us"},
               "inter_host": {"bandwidth": "1Gbps", "latency": "200us"}}, name="fast-and-far")


def test_a_small_step_leaves_far_slow_devices_idle_and_equals_one_device():
    from test_lowering import compare

    step, params, batch = _tiny_step()
    cluster = _fast_and_far()
    par = hs.parallelize(step, cluster=cluster, time_limit=1)
    plan = par.plan(params, batch)
    assert plan.devices == (0, 1), plan.summary()
    every = hs.parallelize(step, cluster=cluster, time_limit=1, devices="all").plan(params, batch)
    assert every.devices is None
    assert plan.baselines[ALL] == pytest.approx(every.predicted_step_time)
    assert plan.predicted_step_time < 0.95 * every.predicted_step_time
    # the whole cluster's honest baselines and limit, not the subset's
    assert plan.baselines["DP-CP"] == pytest.approx(every.baselines["DP-CP"])
    assert plan.baselines["ideal"] == pytest.approx(every.baselines["ideal"])
    assert "2 of 8 devices" in plan.summary() and "6 idle" in plan.summary()
    assert "6 idle" in plan._repr_html_()
    assert set(plan.memory) == {"fast", "slow"} and plan.memory["slow"]["need"] == 0
    assert plan.ratios == {"fast": 1.0, "slow": 0.0}  # every class has a share (the API's)

    ref = jax.jit(step)
    want = got = (params,)
    for _ in range(3):
        want = ref(want[0], batch)
        got = par(got[0], batch)
        compare(hs.gather(got), want)
    stored = jax.tree.leaves(got[0], is_leaf=lambda v: isinstance(v, hs.Sharded))
    assert all(isinstance(v, hs.Sharded) for v in stored)
    assert {d for v in stored for d in v.data.devices()} == set(jax.devices()[:2])

    again = hs.Plan.from_json(plan.to_json())
    assert again == plan
    reused = hs.parallelize(step, cluster=cluster, plan=again)
    compare(hs.gather(reused(params, batch)), ref(params, batch))


def test_a_plan_on_fewer_devices_checks_the_cluster_it_is_applied_to():
    step, params, batch = _tiny_step()
    plan = hs.parallelize(step, cluster=_fast_and_far(), time_limit=1).plan(params, batch)
    assert plan.devices == (0, 1)
    small = hs.Cluster.simulated([("CPU", 1, {"name": "fast"})])
    with pytest.raises(hs.PlanMismatch, match="devices up to 1"):
        hs.parallelize(step, cluster=small, plan=plan).plan(params, batch)


def test_devices_option_is_checked():
    step, _, _ = _tiny_step()
    with pytest.raises(ValueError, match="'auto' or 'all'"):
        hs.parallelize(step, cluster=_fast_and_far(), devices="some")


def test_a_step_that_needs_the_whole_cluster_keeps_it():
    """A compute-bound step: no subset's lower bound can win, none is planned."""
    from test_lowering import CLUSTERS

    step, _, _ = _tiny_step()
    big = {"w1": jnp.zeros((512, 2048)), "w2": jnp.zeros((2048, 8))}
    x = np.zeros((4096, 512), np.float32)
    par = hs.parallelize(step, cluster=CLUSTERS["2+6"](), time_limit=1)
    plan = par.plan(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), big),
                    {"x": jax.ShapeDtypeStruct(x.shape, x.dtype),
                     "y": jax.ShapeDtypeStruct((4096,), jnp.int32)})
    assert plan.devices is None and ALL not in plan.baselines


def test_which_subsets_are_searched():
    """Searched: a subset whose lower bound beats the best plan by min_gain and either
    is under a third of it or data parallelism there beats it too; every other subset costs nothing."""
    from types import SimpleNamespace

    from hapsynth.synth.subsets import on_fewer_devices

    c = hs.Cluster.simulated([("CPU", 2, {"name": "fast", "flops": "300GFLOP/s"}),
                              ("CPU", 6, {"name": "slow", "flops": "100GFLOP/s"})])
    graph = SimpleNamespace(flops=1.2e9)            # ideal 1 ms; the fast pair alone: 2 ms
    searched, probed = [], []

    def run(best_time, dp_time):
        searched.clear(), probed.clear()
        best = SimpleNamespace(predicted_step_time=best_time)

        def plan_on(sub):
            searched.append(sub.num_devices)
            raise ValueError("does not fit")        # nothing wins: `best` comes back

        def probe(sub):
            probed.append(sub.num_devices)
            return dp_time

        assert on_fewer_devices(graph, c, best, plan_on, probe, lambda: None, 0.05) is best

    run(0.0021, 0.0)      # bound 2 ms is not 5% under 2.1 ms: neither probed nor searched
    assert searched == [] and probed == []
    run(0.003, 0.0029)    # some headroom, DP there no better: probed only
    assert probed == [2] and searched == []
    run(0.003, 0.001)     # DP there is better: searched
    assert searched == [2]
    run(0.0045, 1.0)      # 2 ms is not under a third of 4.5 ms: probed, not searched
    assert probed == [2] and searched == []
    run(0.0061, 1.0)      # the bound under a third of the best: searched without asking DP
    assert searched == [2] and probed == []
    with pytest.raises(ValueError, match="nothing fits"):
        on_fewer_devices(graph, c, None, lambda s: (_ for _ in ()).throw(ValueError("no")),
                         lambda s: 0.0, lambda: None, 0.05, unfit=ValueError("nothing fits"))
