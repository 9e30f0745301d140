"""Plans end to end: hs.parallelize(...).plan, baselines, JSON, determinism, bad input."""
from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import pytest

import hapsynth as hs
from hapsynth.cli import main as cli_main
from hapsynth.models import get
from hapsynth.synth.stages import NotPipelineable

CPU26 = hs.Cluster.load("cpu-2-6")


@pytest.fixture(scope="module")
def gpt_plan():
    step, args = get("gpt", "tiny")
    return hs.parallelize(step, cluster=CPU26, time_limit=2, devices="all").plan(*args)


def test_plan_is_never_slower_than_data_parallel_nor_faster_than_ideal(gpt_plan):
    p = gpt_plan
    assert p.predicted_step_time <= min(p.baselines["DP-EV"], p.baselines["DP-CP"]) * (1 + 1e-9)
    assert p.predicted_step_time >= p.baselines["ideal"]
    assert sum(p.ratios.values()) == pytest.approx(1.0)
    assert set(p.ratios) == {"fast", "slow"}
    # shard sizes: every sharded factor is split over the 8 devices and sums to its size
    for units, per_device in p.shard_units.items():
        assert len(per_device) == 8 and sum(per_device) == units


def test_plan_layouts_and_conversions_agree(gpt_plan):
    p = gpt_plan
    assert p.conversions, "a heterogeneous data-parallel step must sync gradients"
    for c in p.conversions:
        assert p.tensor_layouts[c.tensor] == c.src != c.dst
        assert c.seconds > 0 and c.collective in ("all_gather", "all_reduce", "reduce_scatter",
                                                  "all_to_all")
    sharded = [lay for lay in p.tensor_layouts if lay.sharded]
    assert sharded and all(lay.units in p.shard_units for lay in sharded)


def test_plan_json_round_trips_exactly(gpt_plan):
    text = gpt_plan.to_json()
    again = hs.Plan.from_json(text)
    assert again == gpt_plan and again.to_json() == text
    assert "DP-EV" in gpt_plan.summary() and "<table" in gpt_plan._repr_html_()


def test_plans_are_cached_deterministic_and_shape_only():
    step, args = get("mlp", "tiny")
    par = hs.parallelize(step, cluster=CPU26, time_limit=1, devices="all", seed=3)
    p1 = par.plan(*args)
    assert par.plan(*args) is p1  # cached per input signature
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    p2 = hs.parallelize(step, cluster=CPU26, time_limit=1, devices="all", seed=3).plan(*abstract)
    assert p2.strategies == p1.strategies and p2.ratios == p1.ratios
    assert p2.predicted_step_time == p1.predicted_step_time


def test_decorator_form_runs_like_the_plain_step():
    def plain(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return w - 0.1 * g, loss

    step = hs.parallelize(cluster="cpu8-even", time_limit=1)(plain)
    args = (jnp.linspace(-1, 1, 32).reshape(8, 4), jnp.linspace(0, 1, 128).reshape(16, 8))
    plan = step.plan(*args)
    assert plan.cluster == "cpu8-even" and plan.ratios == {"CPU": 1.0}
    got, want = hs.gather(step(*args)), jax.jit(plain)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert jnp.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_infeasible_memory_names_the_class_and_the_bytes():
    small = hs.Cluster.from_toml(
        '[[class]]\ntype = "CPU"\nname = "tiny-mem"\ncount = 8\nhost = 0\nmemory = "64KiB"\n')
    step, args = get("mlp", "tiny")
    with pytest.raises(hs.InfeasibleMemory, match=r"'tiny-mem'.*needs .* GiB .*has 0.00 GiB"):
        hs.parallelize(step, cluster=small, time_limit=1).plan(*args)


def test_unknown_primitive_still_plans_replicated():
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    p = Primitive("hapsynth_test_opaque")
    p.def_impl(lambda x: x + 1)
    p.def_abstract_eval(lambda x: x)
    mlir.register_lowering(p, mlir.lower_fun(lambda x: x + 1, multiple_results=False))

    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.sum(x @ w))(w)
        return w - 0.1 * p.bind(g), loss

    plan = hs.parallelize(step, cluster=CPU26, time_limit=1, devices="all").plan(
        jnp.ones((4, 3)), jnp.ones((16, 4)))
    assert plan.unsupported == {"hapsynth_test_opaque": 1}
    assert "hapsynth_test_opaque" in plan.summary()


def test_cli_plan_json(capsys):
    assert cli_main(["plan", "mlp", "--config", "tiny", "--cluster", "cpu-2-6",
                     "--time-limit", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["predicted_step_time"] <= min(d["baselines"]["DP-EV"], d["baselines"]["DP-CP"]) + 1e-12


def test_explain_names_every_node_strategy_and_conversion(gpt_plan):
    p = gpt_plan
    text = p.explain()
    prims = p.signature.ops
    for k, node in enumerate(p.nodes):
        assert f"node {k} [{node.kind}] {node.strategy}\n" in text
        if node.strategy.startswith("shard"):
            # a strategy names a factor by its letter and size and an op of its own node
            m = re.match(r"shard (the batch \()?([a-z]+\d*)=(\d+) of ([\w-]+)", node.strategy)
            assert m and m.group(4) in {prims[i] for i in node.ops}, node.strategy
        else:
            assert node.strategy in ("replicate", "replicate, carry partial sums")
    for c in p.conversions:
        assert f"t{c.tensor} {c.src} -> {c.dst}: {c.collective} {c.form}" in text
        assert f"{c.seconds * 1e3:.4g} ms" in text
    # a saved plan reads on its own: the names are in the JSON
    saved = json.loads(p.to_json())
    assert [n["strategy"] for n in saved["nodes"]] == list(p.strategies)
    assert hs.Plan.from_json(p.to_json()).explain() == text


def test_a_saved_plan_refuses_another_program_and_names_the_difference():
    step, (params, opt, batch) = get("mlp", "tiny")
    saved = hs.Plan.from_json(
        hs.parallelize(step, cluster=CPU26, time_limit=1, devices="all").plan(
            params, opt, batch).to_json())
    again = hs.parallelize(step, cluster=CPU26, plan=saved)
    assert again.plan(params, opt, batch) is saved
    smaller = jax.tree.map(lambda x: x[:16], batch)
    with pytest.raises(hs.PlanMismatch, match=r"input \d+: the plan is for \[2\]\['\w+'\] "
                                               r"f32\[32,.*the program has .*\[16"):
        again.plan(params, opt, smaller)

    def other(params, opt, batch):  # same arguments, one more op
        p, o, loss = step(params, opt, batch)
        return p, o, loss * 2.0

    with pytest.raises(hs.PlanMismatch, match=r"op \d+: the plan has \w+, the program has \w+"
                                               r"|a program of \d+ ops, this one has \d+"):
        hs.parallelize(other, cluster=CPU26, plan=saved).plan(params, opt, batch)
    with pytest.raises(hs.PlanMismatch, match=r"cluster 'cpu-2-6'.*not for 'cpu8-even'"):
        hs.parallelize(step, cluster="cpu8-even", plan=saved).plan(params, opt, batch)


@pytest.mark.parametrize("cluster", ["cpu-2-6", "cpu8-even"])  # shard_map and gspmd programs
def test_donated_state_is_reused_and_deleted(cluster):
    step, (params, opt, batch) = get("mlp", "tiny")
    ref = jax.jit(step)
    want = ref(*ref(params, opt, batch)[:2], batch)
    par = hs.parallelize(step, cluster=cluster, time_limit=1, devices="all", donate_argnums=(0, 1))
    first = par(params, opt, batch)  # as with jax.jit, donated arguments are not to be reused
    second = par(first[0], first[1], batch)
    donated = jax.tree.leaves(first[:2], is_leaf=lambda v: isinstance(v, hs.Sharded))
    assert donated and all(v.data.is_deleted() for v in donated)
    assert not any(x.is_deleted() for x in jax.tree.leaves(batch))
    for a, b in zip(jax.tree.leaves(hs.gather(second)), jax.tree.leaves(want)):
        assert jnp.allclose(a, b, rtol=1e-4, atol=1e-6)
    _, (params, opt, batch) = get("mlp", "tiny")
    keep = hs.parallelize(step, cluster=cluster, time_limit=1, devices="all")
    out = keep(params, opt, batch)
    keep(out[0], out[1], batch)
    assert not any(v.data.is_deleted() for v in jax.tree.leaves(
        out[:2], is_leaf=lambda v: isinstance(v, hs.Sharded)))


def test_pipeline_option_of_the_contract(gpt_plan):
    """On one island `pipeline="auto"` (the default) and False plan SPMD: `plan.stages ==
    []`; True says why there is no pipeline; anything else names the accepted values."""
    step, args = get("mlp", "tiny")
    for choice in ("auto", False):
        plan = hs.parallelize(step, cluster=CPU26, time_limit=1, pipeline=choice).plan(*args)
        assert plan.stages == [] and "SPMD" not in plan.baselines
    with pytest.raises(NotPipelineable, match="pipeline=True: cluster 'cpu-2-6' has one island"):
        hs.parallelize(step, cluster=CPU26, pipeline=True, time_limit=1).plan(*args)
    with pytest.raises(ValueError, match="pipeline must be 'auto', True or False"):
        hs.parallelize(step, cluster=CPU26, pipeline="yes")
    assert gpt_plan.stages == [] and hs.Plan.from_json(gpt_plan.to_json()).stages == []
