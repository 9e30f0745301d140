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
