"""Rematerialization (`hapsynth/ir/remat.py`): a step whose activations no plan can hold
is planned with cheap ones recomputed in the backward pass, and still computes what
the step as written computes."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from elsewhere import get

import hapsynth as hs
from hapsynth.ir.remat import cannot_fit, describe, peak_bytes, rematerialize
from hapsynth.ir.trace import evaluate, trace


@functools.lru_cache(maxsize=None)
def _programs(name="nnx_gpt"):
    step, args = get(name, "tiny")
    prog = trace(step, *args)
    return step, args, prog, rematerialize(prog)


def _mlp_step(params, x, y):
    """Two GELU layers with a layer norm and a softmax loss, SGD: plain JAX."""
    def loss(p):
        h = x
        for w in p:
            h = jax.nn.gelu(h @ w)
            h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
        return -(jax.nn.log_softmax(h) * y).sum(-1).mean()
    val, g = jax.value_and_grad(loss)(params)
    return [w - 0.1 * d for w, d in zip(params, g)], val


def test_recomputed_program_computes_the_same_and_holds_less():
    rng = np.random.default_rng(0)
    params = [jnp.asarray(rng.normal(size=(64, 64)) / 8, jnp.float32) for _ in range(2)]
    x = jnp.asarray(rng.normal(size=(32, 64)), jnp.float32)
    y = jax.nn.one_hot(jnp.arange(32) % 64, 64)
    prog = trace(_mlp_step, params, x, y)
    again = rematerialize(prog)
    assert again is not None
    assert peak_bytes(again) < 0.75 * peak_bytes(prog)
    flat = jax.tree.leaves((params, x, y))
    want, got = evaluate(prog, flat), evaluate(again, flat)
    for a, b in zip(prog.outputs, again.outputs):
        np.testing.assert_array_equal(np.asarray(got[b]), np.asarray(want[a]))
    # every copy reads what it does not make itself through an optimization barrier,
    # so that XLA cannot merge it with the forward op it repeats
    copies = [e for e in again.eqns if e.source.endswith("(recomputed)")]
    assert copies
    made_by = {t: e for e in again.eqns for t in e.outputs}
    copied = {t for e in copies for t in e.outputs}
    for e in copies:
        for x in e.inputs:
            if isinstance(x, int) and x not in copied:  # step inputs too: no op repeats
                assert x in made_by and made_by[x].name == "optimization_barrier", e.name


def test_paper_size_transformer_holds_far_less():
    step, args = get("nnx_gpt", "paper")
    prog = trace(step, *args)
    again = rematerialize(prog)
    assert peak_bytes(again) < 0.6 * peak_bytes(prog)
    step, args = get("scan_gpt", "paper")
    assert rematerialize(trace(step, *args)) is None  # checkpointed already: nothing to gain


def test_a_target_recomputes_only_as_much_as_it_needs():
    _, _, prog, full = _programs()
    target = (peak_bytes(prog) + peak_bytes(full)) / 2
    light = rematerialize(prog, target)
    assert peak_bytes(full) <= peak_bytes(light) <= target * 1.05
    assert peak_bytes(light) < peak_bytes(prog)
    assert describe(prog, light, target)["recomputed"] < describe(prog, full, None)["recomputed"]


def test_cannot_fit_counts_devices_used_together():
    _, _, prog, _ = _programs()
    peak = peak_bytes(prog)
    assert cannot_fit(prog, [peak / 8 * 0.9] * 8)
    assert not cannot_fit(prog, [peak / 8 * 1.1] * 8)
    # four big devices hold it alone, whatever the small ones have
    assert not cannot_fit(prog, [peak / 4 * 1.1] * 4 + [1.0] * 4)


def _tight_cluster(prog, fraction):
    """8 CPU devices with memory for the step's inputs and `fraction` of its peak / 8."""
    inputs = sum(prog.avals[t].nbytes for t in prog.inputs)
    return hs.Cluster.simulated([("CPU", 8, {"memory": int(inputs + fraction * peak_bytes(prog) / 8)})])


@pytest.mark.slow  # ~45 s; test_recomputes_only_what_the_memory_needs_first runs one by default
def test_a_step_too_big_as_written_is_planned_recomputed_and_equals_one_device():
    from test_lowering import compare

    step, args, prog, again = _programs()
    cluster = _tight_cluster(prog, 0.2)
    with pytest.raises(hs.InfeasibleMemory, match="CPU"):  # as written, nothing fits
        hs.parallelize(step, cluster=cluster, time_limit=1, remat=False).plan(*args)
    par = hs.parallelize(step, cluster=cluster, time_limit=1)
    plan = par.plan(*args)
    assert plan.remat is not None and plan.remat["recomputed"] > 0, plan.summary()
    assert peak_bytes(again) <= plan.remat["peak_after"] < plan.remat["peak_before"]
    assert plan.memory["CPU"]["need"] <= plan.memory["CPU"]["capacity"]
    assert "recomputed in the backward pass" in plan.summary()
    assert "recomputed in the backward pass" in plan._repr_html_()

    ref = jax.jit(step)
    got = want = args
    for _ in range(3):
        want = ref(want[0], args[1])
        got = par(got[0], args[1])
        compare(hs.gather(got), want)

    again_plan = hs.Plan.from_json(plan.to_json())
    assert again_plan == plan
    reused = hs.parallelize(step, cluster=cluster, plan=again_plan)
    compare(hs.gather(reused(*args)), ref(*args))


def test_recomputes_only_what_the_memory_needs_first():
    """A cluster short of room for the step as written, with room for it once its largest
    activations are recomputed: only those are, and a saved plan is applied to the same
    rewritten program."""
    params, x, y = _mlp_data(0)
    prog = trace(_mlp_step, params, x, y)
    state = sum(w.nbytes for w in params)
    cluster = hs.Cluster.simulated([("CPU", 8, {"memory": int(state + 0.8 * peak_bytes(prog) / 8)})])
    par = hs.parallelize(_mlp_step, cluster=cluster, time_limit=1)
    plan = par.plan(params, x, y)
    full = rematerialize(prog)
    assert plan.remat["target"] is not None
    assert 0 < plan.remat["recomputed"] < describe(prog, full, None)["recomputed"]
    assert peak_bytes(full) < plan.remat["peak_after"] <= plan.remat["target"]
    _three_steps_and_reload(par, plan, cluster, params, x, y)


def _mlp_data(seed):
    rng = np.random.default_rng(seed)
    params = [jnp.asarray(rng.normal(size=(64, 64)) / 8, jnp.float32) for _ in range(2)]
    x = jnp.asarray(rng.normal(size=(1024, 64)), jnp.float32)
    return params, x, jax.nn.one_hot(jnp.arange(1024) % 64, 64)


def _three_steps_and_reload(par, plan, cluster, params, x, y):
    """3 chained steps of `par` equal `jit(_mlp_step)`; so does the plan reloaded."""
    from test_lowering import compare

    ref = jax.jit(_mlp_step)
    want, got = (params,), (params,)
    for _ in range(3):
        want, got = ref(want[0], x, y), par(got[0], x, y)
        compare(hs.gather(got), want)
    reused = hs.parallelize(_mlp_step, cluster=cluster, plan=hs.Plan.from_json(plan.to_json()))
    compare(hs.gather(reused(params, x, y)), ref(params, x, y))


def test_too_big_even_recomputed_says_so():
    step, args, prog, _ = _programs()
    inputs = sum(prog.avals[t].nbytes for t in prog.inputs)
    cluster = hs.Cluster.simulated([("CPU", 8, {"memory": inputs // 8})])
    with pytest.raises(hs.InfeasibleMemory, match="with activations recomputed"):
        hs.parallelize(step, cluster=cluster, time_limit=1).plan(*args)


def test_remat_option_is_checked():
    step, _, _, _ = _programs()
    with pytest.raises(ValueError, match="remat must be"):
        hs.parallelize(step, cluster=hs.Cluster.load("cpu8-even"), remat="always")


@pytest.mark.slow
def test_a_recomputed_step_is_pipelined_and_equals_one_device():
    """pipeline=True on two islands whose memory holds twice the step's inputs and few
    of its activations (SPMD-only needs the step recomputed): the pipeline runs the
    recomputed step, and 3 steps of it equal one device. (A pipeline rarely needs
    recomputing itself: it holds a microbatch's activations, and every device holds the
    largest stage's state, sums and buffers and the whole batch, which recomputing does
    not shrink.)"""
    from test_pipeline import _three_steps

    _, x, y = _mlp_data(0)
    rng = np.random.default_rng(0)  # wide enough that activations outweigh the batch
    params = [jnp.asarray(rng.normal(size=(64, 512)) / 8, jnp.float32),
              jnp.asarray(rng.normal(size=(512, 64)) / 20, jnp.float32)]
    prog = trace(_mlp_step, params, x, y)
    def islands(memory):
        return hs.Cluster.simulated([("A100", 4, {"memory": memory}), ("V100", 4, {"memory": memory})],
                                    devices_per_host=4, islands={"a": ["A100"], "b": ["V100"]},
                                    links={"inter_island": {"bandwidth": "10Gbps",
                                                            "latency": "50us"}})
    state = int(sum(prog.avals[t].nbytes for t in prog.inputs))
    with pytest.raises(hs.InfeasibleMemory, match=r"pipeline=True: .* every device holds .* "
                                                  r"class '(A100|V100)' has"):
        hs.parallelize(_mlp_step, cluster=islands(state), pipeline=True,
                       time_limit=1).plan(params, x, y)
    cluster = islands(2 * state)
    with pytest.raises(hs.InfeasibleMemory, match="no plan found fits"):
        hs.parallelize(_mlp_step, cluster=cluster, pipeline=False, time_limit=1,
                       remat=False).plan(params, x, y)
    plan, _ = _three_steps(_mlp_step, (params, x, y), cluster)
    assert len(plan.stages) == 2 and plan.remat["recomputed"] > 0


def _fast_but_small(params, x, y):
    """2 fast devices that hold `_mlp_step` only recomputed (room for 60% of its peak
    activations), beside 6 devices 20x slower behind a slow link that hold anything."""
    prog = trace(_mlp_step, params, x, y)
    state = sum(w.nbytes for w in params)
    return hs.Cluster.simulated(
        [("CPU", 2, {"name": "fast", "flops": "400GFLOP/s", "host": 0,
                     "memory": int(state + 0.3 * peak_bytes(prog))}),
         ("CPU", 6, {"name": "slow", "flops": "20GFLOP/s", "mem_bandwidth": "1GB/s",
                     "host_ids": [1, 1, 1, 2, 2, 2]})],
        links={"intra_host": {"bandwidth": "10GB/s", "latency": "5us"},
               "inter_host": {"bandwidth": "1Gbps", "latency": "200us"}}, name="fast-but-small")


def test_recomputing_lets_the_fast_devices_hold_the_step_alone():
    """The step fits as written only with rows on the slow devices; recomputed, the fast
    ones hold it alone, and that plan is kept because it prices faster."""
    params, x, y = _mlp_data(1)
    cluster = _fast_but_small(params, x, y)
    written = hs.parallelize(_mlp_step, cluster=cluster, time_limit=1,
                             remat=False).plan(params, x, y)
    assert written.remat is None and written.ratios["slow"] > 0
    par = hs.parallelize(_mlp_step, cluster=cluster, time_limit=1)
    plan = par.plan(params, x, y)
    assert plan.remat is not None and plan.remat["recomputed"] > 0, plan.summary()
    assert plan.devices == (0, 1) and plan.ratios["slow"] == 0
    assert plan.predicted_step_time < 0.95 * written.predicted_step_time
    assert plan.remat["peak_after"] <= plan.remat["target"] < plan.remat["peak_before"]
    _three_steps_and_reload(par, plan, cluster, params, x, y)


def test_the_sooner_plan_is_kept_and_a_pipeline_reports_the_best_spmd_only_time():
    from dataclasses import replace

    from hapsynth.synth.choose import sooner

    step, args, _, _ = _programs()
    base = hs.parallelize(step, cluster=hs.Cluster.load("cpu8-even"), time_limit=1).plan(*args)
    stage = {"island": "a", "devices": [0], "forward": 1.0, "backward": 1.0}
    pipe = replace(base, predicted_step_time=1.5, stages=[stage, stage],
                   baselines={**base.baselines, "SPMD": 10.0}, solver={"pipeline": "pipelined"})
    spmd = replace(base, predicted_step_time=1.8, baselines={**base.baselines, "SPMD": 1.8})
    kept = sooner(pipe, spmd, "auto", 0.05)
    assert kept.stages and kept.baselines["SPMD"] == 1.8
    assert "recomputed 1.8 s" in kept.solver["pipeline"]
    # a pipeline under min_gain faster than SPMD alone is not worth its complexity...
    close = replace(pipe, predicted_step_time=1.75)
    assert not sooner(close, spmd, "auto", 0.05).stages
    assert sooner(spmd, close, "auto", 0.05) == spmd
    # ...unless asked for; and the faster SPMD plan wins among SPMD plans
    assert sooner(close, spmd, True, 0.05).stages
    assert sooner(spmd, replace(spmd, predicted_step_time=1.7), False, 0.05).predicted_step_time == 1.7
    assert sooner(spmd, None, "auto", 0.05) is spmd


def _tied_lm_step(params, ids, targets):
    """A language model whose output layer reuses its embedding (vocab far wider than
    the model), residual GELU blocks, a final norm, SGD: plain JAX."""
    def loss(p):
        h = p["tok"][ids]
        for w1, w2 in p["blocks"]:
            h = h + jax.nn.gelu(h @ w1) @ w2
        h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
        logp = jax.nn.log_softmax(h @ p["tok"].T)
        return -jnp.take_along_axis(logp, targets[..., None], -1).mean()
    val, g = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda w, d: w - 0.1 * d, params, g), val


def test_a_recomputed_step_keeps_no_dead_ops_and_its_stages_where_its_layers_are():
    """Recomputing leaves nothing dead (a forward activation made only for the backward,
    now recomputed there, is dropped: priced, it would cost what XLA never runs), and the
    stage analysis of the recomputed step cuts as little as the step's own: a value
    recomputed from forward ones ranks with them, so the tied embedding's gradient from
    the output layer is made there, not where the embedding is stored (the logits'
    cotangent, vocab wide, crossed every cut)."""
    from hapsynth.ir import lift_program
    from hapsynth.synth.pipeline import _crossing
    from hapsynth.synth.stages import analyse
    from hapsynth.synth.synthesize import data_parallel_plan
    from test_pipeline import two_islands

    k = jax.random.split(jax.random.key(0), 6)
    width, vocab, batch, seq = 16, 512, 8, 8
    params = {"tok": 0.1 * jax.random.normal(k[0], (vocab, width)),
              "blocks": [(0.1 * jax.random.normal(k[1 + 2 * b], (width, 4 * width)),
                          0.1 * jax.random.normal(k[2 + 2 * b], (4 * width, width)))
                         for b in range(2)]}
    ids = jax.random.randint(k[5], (batch, seq), 0, vocab)
    args = (params, ids, jnp.roll(ids, 1, axis=1))
    n = len(jax.tree.leaves(params))
    prog = trace(_tied_lm_step, *args)
    again = rematerialize(prog)
    assert again is not None
    read = {x for e in again.eqns for x in e.inputs if isinstance(x, int)} | set(again.outputs)
    assert all(any(o in read for o in e.outputs) for e in again.eqns)
    cluster = two_islands()
    most = []
    for p in (prog, again):
        graph = lift_program(p)
        dp = data_parallel_plan(graph, cluster, num_state_leaves=n, data_inputs=graph.inputs[n:])
        r = analyse(graph, dp.tensor_layouts, dp.op_inputs, n)
        most.append(float(_crossing(graph, r, r.cut_points()).max()))
    logits = batch * seq * vocab * 4
    assert most[0] < logits / 4 and most[1] <= 2 * most[0], (most, logits)


def test_checkpointing_by_segments_computes_the_same_and_holds_less_than_cheap_recomputation():
    """`ir/checkpoint.py`: the forward pass cut where little crosses, each segment
    recomputed (contractions too) before its backward; the same results, a lower peak
    than recomputing the cheap activations alone, and the backward pass reads its
    parameters through copies (gathered again there when stored sharded)."""
    from hapsynth.ir.checkpoint import checkpointed

    step, args, prog, cheap = _programs()
    again = checkpointed(prog)
    assert again is not None
    assert peak_bytes(again) < 0.8 * peak_bytes(cheap)
    flat = jax.tree.leaves(args)
    want, got = evaluate(prog, flat), evaluate(again, flat)
    for a, b in zip(prog.outputs, again.outputs):
        np.testing.assert_array_equal(np.asarray(got[b]), np.asarray(want[a]))
    copies = [e for e in again.eqns if e.source.endswith("(recomputed)")]
    assert any(e.name == "dot_general" for e in copies)  # contractions are recomputed
    # after the first copy, the backward's products read weights more through copies than not
    weights = {t for t in again.inputs if len(again.avals[t].shape) == 2}
    copy_of = {e.outputs[0]: e.inputs[0] for e in again.eqns if e.name == "optimization_barrier"}
    first = min(i for i, e in enumerate(again.eqns) if e.name == "optimization_barrier")
    reads = [x for e in again.eqns[first:] if e.name == "dot_general" for x in e.inputs]
    through_copies = sum(copy_of.get(x) in weights for x in reads)
    direct = sum(x in weights for x in reads)
    assert through_copies > direct, (through_copies, direct)
