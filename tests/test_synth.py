"""Synthesizer pieces so far: shard sizes, strategies, pricing, and the CP-SAT model."""
from __future__ import annotations

import jax
import pytest

import hapsynth as hs
from hapsynth.ir import lift
from hapsynth.models import get
from hapsynth.ir.layout import P, R
from hapsynth.synth.pricing import price, shard_units
from hapsynth.synth.search import data_parallel
from hapsynth.synth.solver import solve
from hapsynth.synth.strategy import batch_classes, link_factors
from hapsynth.synth.structure import build_structure
from hapsynth.synth.timeline import timeline
from hapsynth.synth.timing import evaluate


def build_tables(graph, cluster, shares, **kw):
    return price(build_structure(graph, **kw), cluster, shares)


def test_shard_units_sum_and_prefer_class_uniform_sizes():
    cl = hs.Cluster.load("cpu-2-6")  # 2 fast (4x) + 6 slow devices
    shares = [2 * 4 / 14, 6 / 14]
    u = shard_units(28, cl, shares)
    assert sum(u) == 28 and u == (8, 8, 2, 2, 2, 2, 2, 2)
    u = shard_units(30, cl, shares)  # not divisible: still sums, sizes stay within one unit
    assert sum(u) == 30 and max(u[2:]) - min(u[2:]) <= 1
    assert shard_units(3, hs.Cluster.load("cpu8-even"), [1.0]).count(0) == 5  # zero shards are legal


def _dp_setup(model, cluster_name):
    cluster = hs.Cluster.load(cluster_name)
    step, args = get(model, "tiny")
    _, graph = lift(step, *args)
    nstate = len(jax.tree.leaves(args[:2]))
    uf = link_factors(graph)
    b = batch_classes(graph, uf, graph.inputs[nstate:])
    return cluster, graph, nstate, uf, b


def test_data_parallel_pricing_syncs_each_gradient_once():
    """DP on an even cluster: exactly the gradients (and the loss) are all-reduced, once each."""
    cluster, graph, nstate, uf, b = _dp_setup("mlp", "cpu8-even")
    tables = build_tables(graph, cluster, [1.0], num_state_leaves=nstate, uf=uf, keep=b)
    dp = data_parallel(tables, b)
    synced = [e for e in tables.edges if e.needed(dp) and e.seconds(e.layouts[dp[e.src]])]
    assert all((e.layouts[dp[e.src]], e.need) == (P, R) for e in synced)
    step, args = get("mlp", "tiny")
    param_bytes = sum(x.size * 4 for x in jax.tree.leaves(args[0]))
    assert sum(graph.tensors[e.tensor].nbytes for e in synced) == param_bytes + 4  # + the loss
    got = evaluate(tables, dp)
    assert got.deferred_comm > 0 and got.step >= got.compute


@pytest.mark.parametrize("model", ["mlp", pytest.param("gpt", marks=pytest.mark.slow)])
def test_solver_objective_matches_evaluator_and_beats_its_hint(model):
    cluster, graph, nstate, uf, b = _dp_setup(model, "cpu-2-6")
    shares = [c.count * c.flops / cluster.total_flops for c in cluster.classes]
    tables = build_tables(graph, cluster, shares, num_state_leaves=nstate, uf=uf, keep=b)
    dp = data_parallel(tables, b)
    assign, stats = solve(tables, dp, time_limit=4, workers=2, seed=0)
    assert stats.status in ("OPTIMAL", "FEASIBLE")
    ours, hint = evaluate(tables, assign).step, evaluate(tables, dp).step
    assert ours <= hint * (1 + 1e-6)
    assert stats.objective == pytest.approx(ours, rel=1e-3)
    assert stats.bound <= stats.objective + 1e-12
    assert ours >= graph.flops / cluster.total_flops  # never faster than the ideal


def _bn_step(params, x, y):
    """Two dense layers with batch-statistics normalisation, as BatchNorm computes it."""
    def norm(h):
        m = h.mean(0)
        v = (h * h).mean(0) - m * m
        return (h - m) * jax.lax.rsqrt(v + 1e-5)

    def loss(p):
        h = jax.nn.relu(norm(x @ p["w1"]))
        h = jax.nn.relu(norm(h @ p["w2"]))
        return ((h @ p["w3"] - y) ** 2).mean()

    l, g = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), l


def _bn_tables(monkeypatch=None, combine=True):
    import jax.numpy as jnp

    from hapsynth.synth import pricing
    params = {"w1": jnp.ones((32, 64)), "w2": jnp.ones((64, 64)), "w3": jnp.ones((64, 8))}
    _, graph = lift(_bn_step, params, jnp.ones((256, 32)), jnp.ones((256, 8)))
    cluster = hs.Cluster.load("hap-v100x16-p100x48")
    uf = link_factors(graph)
    b = batch_classes(graph, uf, graph.inputs[3:])
    if not combine:
        monkeypatch.setattr(pricing, "_combine", lambda edges, graph, pr: (edges, ()))
    tables = build_tables(graph, cluster, [0.4, 0.6], num_state_leaves=3, uf=uf, keep=b)
    return graph, tables, data_parallel(tables, b)


def test_independent_inline_all_reduces_pay_one_latency(monkeypatch):
    """A normalisation's mean and mean of squares are all-reduced as one (XLA's combiner):
    the group pays one latency, its members bandwidth alone; a member never depends on
    another's result; the solver's objective still equals the evaluator's."""
    graph, tables, dp = _bn_tables()
    assert tables.combined
    cons = graph.consumers()

    def reach(t):
        seen, todo = set(), [t]
        while todo:
            for o in cons.get(todo.pop(), ()):
                for u in graph.ops[o].outputs:
                    if u not in seen:
                        seen.add(u)
                        todo.append(u)
        return seen

    for g in tables.combined:
        ts = [tables.edges[k].tensor for k in g]
        assert all(u not in reach(t) for t in ts for u in ts)
    _, plain, _ = _bn_tables(monkeypatch, combine=False)
    paid = [k for g in tables.combined for k in g
            if tables.edges[k].needed(dp) and tables.edges[k].layouts[dp[tables.edges[k].src]]
            in tables.edges[k].pooled]
    groups = {g for g, members in enumerate(tables.combined) if set(members) & set(paid)}
    assert len(paid) > len(groups) > 0
    by_key = {(e.tensor, e.need): e for e in plain.edges}
    saved = sum(by_key[(tables.edges[k].tensor, tables.edges[k].need)].seconds(
        tables.edges[k].layouts[dp[tables.edges[k].src]])
        - tables.edges[k].seconds(tables.edges[k].layouts[dp[tables.edges[k].src]]) for k in paid)
    saved -= len(groups) * tables.group_latency
    assert saved > 0
    assert evaluate(plain, dp).inline_comm - evaluate(tables, dp).inline_comm == pytest.approx(saved)
    assign, stats = solve(tables, dp, time_limit=2, workers=2, seed=0)
    assert stats.objective == pytest.approx(evaluate(tables, assign).step, rel=1e-3)
    spans, ev = timeline(tables, dp, ("V100", "P100")), evaluate(tables, dp)
    assert max(s.end for s in spans) == pytest.approx(ev.step, rel=1e-9)
    assert sum(s.seconds for s in spans if s.kind == "collective" and s.lane == "V100") \
        == pytest.approx(ev.inline_comm, rel=1e-9)
    assert sum("combined" in s.label for s in spans if s.lane == "V100") == len(groups)
