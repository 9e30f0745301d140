"""A pipeline run free (`lower/freerun.py`): a program per stage and phase, dispatched in
the schedule's order, values moved between stages by `jax.device_put`."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

import hapsynth as hs
import twoprocs
from hapsynth.args import state_arity
from hapsynth.lower.devices import local_devices
from hapsynth.lower.freerun import FreeRunning
from hapsynth.models import get
from hapsynth.synth import pipeline as P
from hapsynth.synth.pipeplan import as_plan
from test_lowering import compare
from test_pipeline import _regions, four_islands, two_islands

WORKER = Path(__file__).with_name("freerun_worker.py")


def _free_plan(step, args, cluster, shape: str, whole_islands: bool = False):
    """The best pipeline priced free-running of that shape ("straight" or "V") as a plan
    run free (`whole_islands`: a stage per island, whatever their sizes)."""
    graph, dp, regions, n = _regions(step, args, cluster)
    if shape == "V":
        pipe = P.plan_vshape(graph, cluster, regions, dp.tensor_layouts, n, free_running=True,
                             whole_islands=whole_islands)
    else:
        pipe = P.plan_pipeline(graph, cluster, regions, dp.tensor_layouts, n, whole=False,
                               free_running=True, whole_islands=whole_islands)
    return pipe, as_plan(pipe, dp, dp, cluster, runtime="free")


def _equals_jit(par, step, args, steps: int = 3):
    """`steps` chained steps of `par` equal one-device `jax.jit(step)`; the last result."""
    k = state_arity(step, args)
    got = want = args
    for _ in range(steps):
        want = jax.jit(step)(*want[:k], *args[k:])
        got = par(*got[:k], *args[k:])
        compare(hs.gather(got), want, rtol=2e-3)
    return got


def unequal_islands(a: int = 2, b: int = 4) -> hs.Cluster:
    """An island of `a` A100s and one of `b` V100s, joined by 10 Gbps."""
    return hs.Cluster.simulated([("A100", a), ("V100", b)], devices_per_host=2,
                                islands={"a": ["A100"], "b": ["V100"]},
                                links={"inter_island": {"bandwidth": "10Gbps", "latency": "50us"}})


def test_once_per_step_work_returns_only_what_is_read_elsewhere():
    """The rounds after the microbatches (the optimizer) keep their intermediates inside
    their program: together they return the new state and what crosses between rounds,
    not every value they make (the paper MLP's optimizer returned 14x its state, 3.3 GB a
    step, and took 612 ms where it is priced at 66), and the stored state is what they
    made, not a copy."""
    step, args = get("mlp", "tiny")
    cluster = two_islands()
    _, plan = _free_plan(step, args, cluster, "straight")
    low = hs.parallelize(step, cluster=cluster, plan=plan).lowered(*args)
    returned = []
    for key, fn in list(low._post.items()):
        low._post[key] = lambda *a, fn=fn: returned.append(fn(*a)) or returned[-1]
    new_state = jax.tree.leaves(low(*args)[:state_arity(step, args)])
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(args[:state_arity(step, args)]))
    made = [v for out in returned for v in out.values()]
    assert state_bytes <= sum(v.nbytes for v in made) <= 1.05 * state_bytes + 1024
    assert all(any(leaf is v for v in made) for leaf in new_state if leaf.size > 1)


@pytest.mark.parametrize("model,shape", [
    ("mlp", "straight"), ("gpt", "V"),
    pytest.param("bert", "V", marks=pytest.mark.slow),  # (gpt's V runs in make test)
    pytest.param("gpt", "straight", marks=pytest.mark.slow),
    pytest.param("bert", "straight", marks=pytest.mark.slow)])
def test_free_running_pipelines_equal_one_device(model, shape):
    """3 steps equal `jax.jit` on one device; 2 stages over two islands of 4 devices, or a
    V (the first and last stages on one island: GPT's tied embedding stays there)."""
    step, args = get(model, "tiny")
    cluster = two_islands()
    pipe, plan = _free_plan(step, args, cluster, shape)
    assert plan.pipeline["runtime"] == "free"
    assert len(plan.stages) == (3 if shape == "V" else 2)
    if shape == "V":
        assert plan.stages[0]["devices"] == plan.stages[2]["devices"] != plan.stages[1]["devices"]
        assert plan.stages[1]["ops"] > 0 and plan.stages[0]["ops"] + plan.stages[2]["ops"] > 0
        assert plan.schedule().place == (0, 1, 0)  # its table and picture: two groups
        assert plan.schedule().bubble() == pytest.approx(plan.pipeline["bubble"])
        # the island running both ends is busy with both
        busy = [pipe.micros * (f + b) + t for f, b, t in zip(pipe.forward, pipe.backward, pipe.tail)]
        ends = cluster.classes[cluster.class_of(plan.stages[0]["devices"][0])].name
        assert plan.breakdown["compute_per_class"][ends] == pytest.approx(busy[0] + busy[2])
    par = hs.parallelize(step, cluster=cluster, plan=hs.Plan.from_json(plan.to_json()))
    low = par.lowered(*args)
    assert isinstance(low, FreeRunning)
    k = state_arity(step, args)
    # stored as the program reads them, the arguments come back exactly
    for a, b in zip(jax.tree.leaves(hs.gather(par.shard(*args))), jax.tree.leaves(args)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    got = _equals_jit(par, step, args)
    # each state leaf comes back whole on the devices of the stage storing it
    devices = local_devices(cluster)
    for p, leaf in enumerate(jax.tree.leaves(got[:k])):
        want_devs = {devices[d] for d in plan.stages[low.owner[p]]["devices"]}
        assert leaf.sharding.device_set == want_devs and leaf.sharding.is_fully_replicated


def test_each_work_runs_after_what_it_reads_in_its_group_s_simulated_order():
    """The dispatch order: each work after the works whose values it reads (sends, and its
    own forward for a backward), and on each group of devices the works in the order the
    free-running simulation ran them (a device runs what it is given in that order)."""
    step, args = get("bert", "tiny")
    cluster = two_islands()
    pipe, plan = _free_plan(step, args, cluster, "V")
    par = hs.parallelize(step, cluster=cluster, plan=plan)
    low = par.lowered(*args)
    assert sorted(low.order) == sorted({(s, m, ph) for s in range(3) for m in range(pipe.micros)
                                        for ph in "FB"})
    at = {w: i for i, w in enumerate(low.order)}
    for s, m, ph in low.order:
        for a, pha in low.sources[(s, ph)]:
            assert at[(a, m, pha)] < at[(s, m, ph)]
    assert (2, "B") in {src for srcs in low.sources.values() for src in srcs}
    group = pipe.schedule.group
    for g in {group(s) for s in range(3)}:
        simulated = [(x.stage, x.micro, x.phase) for x in sorted(
            pipe.schedule.slots, key=lambda x: x.start) if group(x.stage) == g]
        assert [w for w in low.order if group(w[0]) == g] == simulated


def test_runtime_free_is_planned_where_it_prices_better_and_runs():
    """`pipeline_runtime="free"` adds the free-running pipelines (V shapes too) to the
    candidates: the plan prices no worse than the tick loop's, says which runtime runs
    it and round-trips through JSON."""
    step, args = get("gpt", "tiny")
    cluster = two_islands()
    ticks = hs.parallelize(step, cluster=cluster, pipeline=True, time_limit=1,
                           pipeline_runtime="ticks").plan(*args)
    free = hs.parallelize(step, cluster=cluster, pipeline=True, time_limit=1,
                          pipeline_runtime="free").plan(*args)
    assert ticks.pipeline["runtime"] == "ticks"
    assert free.pipeline["runtime"] == "free"
    assert free.predicted_step_time < ticks.predicted_step_time
    assert "running free" in free.solver["pipeline"]
    assert "run free: each stage's next work once its inputs are there" in free.summary()
    assert json.loads(free.to_json())["pipeline"]["runtime"] == "free"
    assert hs.Plan.from_json(free.to_json()) == free
    assert hs.parallelize(step, cluster=cluster, pipeline=True,
                          time_limit=1).plan(*args).pipeline["runtime"] == "free"  # ("auto")
    with pytest.raises(ValueError, match="pipeline_runtime"):
        hs.parallelize(step, cluster=cluster, pipeline_runtime="async")


@pytest.mark.slow  # BERT over four islands (~20 s)
def test_stages_holding_uneven_rows_run_free():
    """Four islands, the first mixing an A100 and a V100 (3 rows and 1 of a microbatch):
    each device of that stage runs its own rows in a branch of its own, what it keeps and
    sends padded to the most and, leaving the stage, gathered in the rows' order; 3 steps
    equal one-device `jit`."""
    step, args = get("bert", "tiny")
    cluster = four_islands()
    _, plan = _free_plan(step, args, cluster, "straight")
    assert [len(set(st["rows"])) for st in plan.stages] == [2, 1, 1, 1]
    par = hs.parallelize(step, cluster=cluster, plan=plan)
    assert isinstance(par.lowered(*args), FreeRunning)
    _equals_jit(par, step, args)


def _program(step, args, cluster, plan):
    par = hs.parallelize(step, cluster=cluster, plan=plan)
    par.plan(*args)
    return par._programs[next(iter(par._programs))], plan


@pytest.mark.slow  # two processes (~20 s each)
@pytest.mark.parametrize("devices", ["2", "3", "2,6"])
def test_two_processes_run_a_pipeline_free(devices):
    """An island per `jax.distributed` process: every process dispatches every work, each
    runs on its own devices, and values cross between the processes by `jax.device_put`;
    3 steps of GPT (its tied embedding copied across) equal one-device `jit` on both.
    With 3 devices a process, a microbatch's 8 rows are uneven (3, 3, 2): what crosses is
    re-laid on the sender's devices as the receiver's take it, and crosses as it lies.
    With 2 devices on one process and 6 on the other, what crosses goes a piece per
    receiving device (`lower/moves.py`), and the plan and results are shared over
    processes of unequal device counts."""
    outs = twoprocs.run(lambda ports: [[str(WORKER), str(i), str(ports[0]), str(ports[1 + i]),
                                        "gpt", devices] for i in range(2)], n=3)
    counts = [int(c) for c in devices.split(",")] * 2
    for rc, out in outs:
        assert rc == 0, out[-3000:]
        line = [ln for ln in out.splitlines() if ln.startswith("MAXERR")][-1]
        assert float(line.split()[1]) < 2e-3, line
        assert "RUNTIME free" in line and "LOWERED FreeRunning" in line, line
        plan = [ln for ln in out.splitlines() if ln.startswith("PLAN")][-1]
        rows = json.loads(plan.split("ROWS ")[1])
        assert sorted(map(len, rows)) == sorted(counts[:2]), plan
        assert ([3, 3, 2] in rows) == (devices == "3"), plan


@pytest.mark.slow  # the harness's knob (~15 s): `hapsynth bench pipeline` measures with it
def test_a_branch_hook_repeats_the_works_of_a_stage_run_free():
    """Under `WorkRepeat` (the harness's slow device) each device runs its stage's works
    and rounds `counts[i]` times: the values are unchanged, and perturbing the repeats'
    operands changes them exactly when some device repeats; counts change without
    recompiling."""
    from hapsynth_bench.emulation import WorkRepeat

    step, args = get("mlp", "tiny")
    cluster = two_islands()
    pipe, plan = _free_plan(step, args, cluster, "straight")
    par = hs.parallelize(step, cluster=cluster, plan=plan)
    par.plan(*args)
    prog = par._programs[next(iter(par._programs))]
    emulate = WorkRepeat((1,) * 4 + (3,) * 4)
    slow = FreeRunning(prog, plan, local_devices(cluster), branch_hook=emulate)
    got = want = args
    for _ in range(2):
        want = jax.jit(step)(*want[:2], args[2])
        got = slow(*got[:2], args[2])
        compare(hs.gather(got), want)
    ref = jax.jit(step)(*args)
    for repeat, changes in (((1,) * 8, False), ((1,) * 4 + (2,) * 4, True),
                            ((2,) + (1,) * 7, True)):
        emulate.set(repeat, flag=True)
        out = hs.gather(slow(*args))
        diff = max(float(abs(jax.numpy.max(jax.numpy.abs(a - b))))
                   for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
        assert (not diff <= 1e-3) == changes, (repeat, diff)
    assert all(fn._cache_size() == 1 for fn in slow._works.values())


@pytest.mark.slow  # traces two outside models (~25 s)
@pytest.mark.parametrize("name", ["linen_transformer", "nnx_gpt"])
def test_outside_models_run_free_equal_one_device(name):
    """Train steps written elsewhere (`tests/elsewhere`: a Flax linen transformer, an NNX
    GPT) run as a V, free: 3 steps equal one-device `jit`."""
    from elsewhere import get as outside

    step, args = outside(name, "tiny")
    cluster = two_islands()
    pipe, plan = _free_plan(step, args, cluster, "V")
    par = hs.parallelize(step, cluster=cluster, plan=plan)
    assert isinstance(par.lowered(*args), FreeRunning)
    _equals_jit(par, step, args)


def test_scan_over_layers_runs_free_equal_one_device(monkeypatch):
    """A step scanning over its stacked layers is cut written out (`ir.unroll`) and run
    free: 3 steps equal one-device `jit`; each stacked parameter and Adam moment comes
    back as `StagedRows`, each row whole on the devices of its layer's stage, where the
    next step reads it (the rows are not stacked or moved); shard then gather restacks
    exactly what was given. (Its recomputation kept: undone, the best cut holds both
    layers on one stage, test_a_steps_own_recomputation_is_undone_in_a_pipeline.)"""
    from test_elsewhere import get as elsewhere

    monkeypatch.setattr("hapsynth.synth.recompute.merge_recomputed", lambda prog: None)
    step, args = elsewhere("scan_gpt")
    cluster = two_islands()
    par = hs.parallelize(step, cluster=cluster, pipeline=True, time_limit=1,
                         pipeline_runtime="free")
    plan = par.plan(*args)
    assert plan.pipeline["runtime"] == "free"
    assert plan.pipeline["unrolled"] == len(jax.tree.leaves(args[:2]))
    low = par.lowered(*args)
    assert isinstance(low, FreeRunning)
    got = _equals_jit(par, step, args)
    k = state_arity(step, args)
    rows = [x for x in jax.tree.leaves(got[:k], is_leaf=lambda v: isinstance(v, hs.Staged))
            if isinstance(x, hs.StagedRows)]
    assert len(rows) == 3 * 12  # 12 layer-stacked parameters, each with two Adam moments
    devices = local_devices(cluster)
    for x in rows:
        assert len(set(x.stages)) == 2  # the layers over both stages
        for row, s in zip(x.rows, x.stages):
            assert row.sharding.device_set == {devices[d] for d in plan.stages[s]["devices"]}
    leaves = jax.tree.leaves(got, is_leaf=lambda v: isinstance(v, hs.Staged))
    inputs = low._inputs(leaves)
    assert all(any(r is i for i in inputs) for x in rows for r in x.rows)
    stored = par.shard(*args)
    assert isinstance(stored[0]["layers"]["attn"]["w_qkv"], hs.StagedRows)
    for a, b in zip(jax.tree.leaves(args), jax.tree.leaves(hs.gather(stored))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("model", [pytest.param("unrolled_gpt", marks=pytest.mark.slow), "scan_gpt"])
def test_a_steps_own_recomputation_is_undone_in_a_pipeline(model, monkeypatch):
    """A GPT whose blocks are under `jax.checkpoint` (a Python loop over the layers, or a
    scan written out) is also cut with its recomputation undone (`ir/cse.py`): the
    stages then keep their activations and run fewer ops, and the plan says so. 3 steps
    equal one-device `jit`, from the plan and from its JSON (which rebuilds the same
    program)."""
    from test_elsewhere import get as elsewhere

    step, args = elsewhere(model)
    cluster = two_islands()

    def plan_of():
        return hs.parallelize(step, cluster=cluster, pipeline=True, time_limit=1,
                              pipeline_runtime="free")
    par = plan_of()
    plan = par.plan(*args)
    assert plan.pipeline["merged"] is True
    _equals_jit(par, step, args)
    again = hs.parallelize(step, cluster=cluster, plan=hs.Plan.from_json(plan.to_json()))
    _equals_jit(again, step, args)
    monkeypatch.setattr("hapsynth.synth.recompute.merge_recomputed", lambda prog: None)
    kept = plan_of().plan(*args)  # the recomputation as written
    assert "merged" not in kept.pipeline
    assert sum(st["ops"] for st in plan.stages) < sum(st["ops"] for st in kept.stages)


@pytest.mark.parametrize("model,shape,v100s", [
    pytest.param("mlp", "straight", 4, marks=pytest.mark.slow),
    pytest.param("gpt", "V", 4, marks=pytest.mark.slow),
    ("mlp", "straight", 6), ("gpt", "V", 6)])
def test_stages_of_unequal_device_counts_run_free(model, shape, v100s):
    """Islands of 2 A100s and 4 or 6 V100s, a stage on each whole island (the tick loop's
    mesh would cut the larger in parts): what crosses lies split on the sender's devices
    and each receiving device takes its own rows; with 6 V100s their rows are uneven
    (3, 3, 3, 3, 2, 2 or 2, 2, 1, 1, 1, 1). 3 steps equal one-device `jit`. The tick
    loop refuses the plan, saying why."""
    step, args = get(model, "tiny")
    cluster = unequal_islands(2, v100s)
    pipe, plan = _free_plan(step, args, cluster, shape, whole_islands=True)
    sizes = [len(st["devices"]) for st in plan.stages]
    assert sorted(set(sizes)) == [2, v100s] and pipe.whole_islands
    assert any(len(set(st["rows"])) > 1 for st in plan.stages) == (v100s == 6)
    assert sizes == ([2, v100s] if shape == "straight" else [sizes[0], sizes[1], sizes[0]])
    par = hs.parallelize(step, cluster=cluster, plan=hs.Plan.from_json(plan.to_json()))
    assert isinstance(par.lowered(*args), FreeRunning)
    _equals_jit(par, step, args)
    with pytest.raises(ValueError, match="runs free only"):
        as_plan(pipe, plan, plan, cluster, runtime="ticks")


@pytest.mark.parametrize("model,shape", [("mlp", "straight"), ("gpt", "V")])
def test_donated_state_is_reused_by_the_rounds(model, shape):
    """`donate_argnums` as in `jax.jit`: each donated state leaf its stage alone holds is
    given up to the round of once-per-step ops reading it last (the optimizer's new
    state may take its buffer), so the arguments passed are deleted after the step;
    those several stages read are kept (Adam's count; GPT's tied embedding, read on
    both ends of the V). Not donated, nothing is deleted. 3 steps equal one-device
    `jit` either way."""
    step, args = get(model, "tiny")
    cluster = two_islands()
    _, plan = _free_plan(step, args, cluster, shape)
    k = state_arity(step, args)
    for donate in ((0, 1), ()):
        par = hs.parallelize(step, cluster=cluster, plan=plan, donate_argnums=donate)
        got, want = par.shard(*args), args
        for _ in range(3):
            before = jax.tree.leaves(got[:k])
            want = jax.jit(step)(*want[:k], *args[k:])
            got = par(*got[:k], *args[k:])
            compare(hs.gather(got), want, rtol=2e-3)
            gone = [x.is_deleted() for x in before]
            alone = [len(h) == 1 for h in par.lowered(*args)._holders]
            assert gone == (alone if donate else [False] * len(gone))
            assert sum(alone) == len(alone) - (1 if shape == "straight" else 2)


@pytest.mark.slow  # traces two outside models, straight and V (~40 s)
@pytest.mark.parametrize("name", ["linen_transformer", "nnx_gpt"])
def test_outside_models_run_free_on_unequal_islands(name):
    """Train steps written elsewhere (a Flax linen transformer, an NNX GPT) over islands
    of 2 and 6 devices, a stage per whole island (the V100s' rows uneven), straight and
    V, their state donated: 3 steps equal one-device `jit`."""
    from elsewhere import get as outside

    cluster = unequal_islands(2, 6)
    for shape in ("straight", "V"):
        step, args = outside(name, "tiny")  # (donated by the last run, as with jax.jit)
        _, plan = _free_plan(step, args, cluster, shape, whole_islands=True)
        assert any(len(set(st["rows"])) > 1 for st in plan.stages)
        _equals_jit(hs.parallelize(step, cluster=cluster, plan=plan, donate_argnums=(0, 1)),
                    step, args)
