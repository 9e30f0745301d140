"""Plans kept on disk between runs (`hapsynth/plancache.py`): a rerun reads its plan
back, runs it like one-device `jit`, and nothing else is mistaken for it."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

import hapsynth as hs
from hapsynth.synth import recompute
from hapsynth.ir import trace
from hapsynth.models import get
from hapsynth.plancache import ENV, PlanCache, program_key
from test_pipeline import two_islands
from test_user_steps import runs_like_one_device


def mixed() -> hs.Cluster:
    return hs.Cluster.simulated([("A100", 4), ("V100", 4)], devices_per_host=4)


def _no_planning(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("planned again")
    monkeypatch.setattr(recompute, "plan_program", refuse)


def _fields(plan) -> dict:
    d = json.loads(plan.to_json())
    d["solver"].pop("cached", None)
    return d


def _planned(plan) -> dict:
    """The plan less its solver's record (wall times differ from one planning to the next)."""
    return {k: v for k, v in _fields(plan).items() if k != "solver"}


@pytest.mark.parametrize("model,cluster,options", [
    pytest.param("gpt", mixed, {}, marks=pytest.mark.slow),  # (the mlp case reads back the same)
    pytest.param("gpt", two_islands, {"pipeline": True}, marks=pytest.mark.slow),
    ("mlp", two_islands, {"pipeline": True})])
def test_a_rerun_reads_its_plan_back(tmp_path, monkeypatch, model, cluster, options):
    """The second `parallelize` of a step plans nothing: it reads the plan filed by the
    first (the same plan, field for field; its summary names the file) and runs it like
    one-device `jit` (a pipeline too, rebuilt from the file alone)."""
    step, args = get(model, "tiny")
    first = hs.parallelize(step, cluster=cluster(), plan_cache=tmp_path, **options).plan(*args)
    assert "cached" not in first.solver and len(list(tmp_path.glob("*.json"))) == 1
    assert bool(first.stages) == bool(options)
    _no_planning(monkeypatch)
    par = hs.parallelize(step, cluster=cluster(), plan_cache=tmp_path, **options)
    again = par.plan(*args)
    assert _fields(again) == _fields(first)
    assert again.solver["cached"] == str(next(tmp_path.glob("*.json")))
    assert "read from the plan cache" in again.summary()
    runs_like_one_device(par, step, args)


def test_the_cache_tells_programs_clusters_and_options_apart(tmp_path):
    """Keys differ where a plan could: an op's params alone (a sum over rows or columns
    of a square matrix: same types, same wiring), the cluster, an option; and agree for
    the same step traced again."""
    def step(axis):
        def f(w, x):
            loss = jnp.sum(jnp.tanh(x @ w).sum(axis=axis) ** 2)
            return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w).sum(axis=axis) ** 2))(w), loss
        return f

    w, x = jnp.ones((16, 16)), jnp.ones((16, 16))
    rows, cols = trace(step(0), w, x), trace(step(1), w, x)
    assert [e.name for e in rows.eqns] == [e.name for e in cols.eqns]
    assert program_key(rows) != program_key(cols)
    assert program_key(rows) == program_key(trace(step(0), w, x))
    cache, opts = PlanCache(tmp_path), {"min_gain": 0.05, "pipeline": "auto"}
    k = cache.key(rows, mixed(), opts)
    assert k == cache.key(rows, mixed(), dict(opts))
    assert k != cache.key(rows, mixed(), {**opts, "min_gain": 0.0})
    other = hs.Cluster.simulated([("A100", 4), ("P100", 4)], devices_per_host=4)
    assert k != cache.key(rows, other, opts)
    slower = hs.Cluster.simulated([("A100", 4), ("V100", 4)], devices_per_host=2)
    assert k != cache.key(rows, slower, opts)  # (the same devices, on more hosts)


def test_a_damaged_or_foreign_file_is_planned_again(tmp_path, monkeypatch):
    """A file that does not read back as a plan, or holds another program's plan, is
    warned of, planned again and replaced."""
    step, args = get("mlp", "tiny")
    first = hs.parallelize(step, cluster=mixed(), plan_cache=tmp_path).plan(*args)
    (path,) = tmp_path.glob("*.json")
    path.write_text(path.read_text()[:100])
    with pytest.warns(UserWarning, match="cannot be read back"):
        again = hs.parallelize(step, cluster=mixed(), plan_cache=tmp_path).plan(*args)
    assert _planned(again) == _planned(first) and "cached" not in again.solver
    assert _planned(hs.Plan.from_json(path.read_text())) == _planned(first)
    gpt, gargs = get("gpt", "tiny")
    path.write_text(hs.parallelize(gpt, cluster=mixed()).plan(*gargs).to_json())
    with pytest.warns(UserWarning, match="does not fit this step"):
        again = hs.parallelize(step, cluster=mixed(), plan_cache=tmp_path).plan(*args)
    assert _planned(again) == _planned(first)
    assert _planned(hs.Plan.from_json(path.read_text())) == _planned(first)


def test_the_environment_names_the_folder_and_false_turns_it_off(tmp_path, monkeypatch):
    step, args = get("mlp", "tiny")
    monkeypatch.setenv(ENV, str(tmp_path / "env"))
    hs.parallelize(step, cluster=mixed(), plan_cache=False).plan(*args)
    assert not (tmp_path / "env").exists()
    hs.parallelize(step, cluster=mixed()).plan(*args)
    assert len(list((tmp_path / "env").glob("*.json"))) == 1
    _no_planning(monkeypatch)
    assert hs.parallelize(step, cluster=mixed()).plan(*args).solver["cached"]


def test_constant_operands_and_the_code_are_in_the_key(tmp_path, monkeypatch):
    """A pad by zero and a pad by one are other programs (a rule reads the value: a
    partial sum passes through the first), as are steps closing over other PRNG keys; a
    change to hapsynth's code files nothing under the old key."""
    from hapsynth import plancache

    def step(value):
        def f(w, x):
            g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
            return w - 0.1 * jax.lax.pad(g, value, ((0, 0, 0), (0, 0, 0))), jnp.sum(w)
        return f

    w, x = jnp.ones((8, 8)), jnp.ones((16, 8))
    zero, one = trace(step(0.0), w, x), trace(step(1.0), w, x)
    assert program_key(zero) != program_key(one)
    def noisy(key):  # (a typed PRNG key closed over: no NumPy array of its own)
        def f(w, x):
            noise = jax.random.normal(key, x.shape)
            return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh((x + noise) @ w) ** 2))(w), jnp.sum(w)
        return f

    three = program_key(trace(noisy(jax.random.key(3)), w, x))
    assert three == program_key(trace(noisy(jax.random.key(3)), w, x))
    assert three != program_key(trace(noisy(jax.random.key(4)), w, x))
    cache = PlanCache(tmp_path)
    before = cache.key(zero, mixed(), {})
    plancache._code.cache_clear()
    monkeypatch.setattr(plancache, "_code", lambda: "other code")
    assert cache.key(zero, mixed(), {}) != before


def test_a_folder_that_cannot_be_written_keeps_the_plan(tmp_path):
    """Planning is not lost to a cache folder that cannot be made (a file is in the
    way): a warning, the plan, nothing left behind; a cache that is not a folder is an
    error that says so."""
    (tmp_path / "file").write_text("")
    step, args = get("mlp", "tiny")
    with pytest.warns(UserWarning, match="cannot write"):
        plan = hs.parallelize(step, cluster=mixed(), plan_cache=tmp_path / "file" / "sub").plan(*args)
    assert plan.predicted_step_time > 0 and sorted(tmp_path.iterdir()) == [tmp_path / "file"]
    for bad in (True, ""):
        with pytest.raises(ValueError, match="plan_cache must be a folder"):
            hs.parallelize(step, cluster=mixed(), plan_cache=bad)
