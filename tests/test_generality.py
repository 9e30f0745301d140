"""Data parallelism survives what train steps do to a batch, and baselines are honest."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hapsynth as hs
from hapsynth.ir import lift, lift_program


def batch_shuffling_step(B, S, D, V, abstract=False):
    """A step that does to its batch what real ones do: next-token slicing, an embedding
    gather whose indices carry the batch, a causal mask from `tril` broadcast against the
    batch, a reshape merging batch and sequence, a concatenation on the feature dim, and
    one-hot targets."""
    def loss_fn(p, ids):
        x_in, y = ids[:, :-1], ids[:, 1:]
        h = p["emb"][x_in] + p["pos"][None]
        mask = jnp.tril(jnp.ones((S, S), bool))
        att = jnp.einsum("bsd,btd->bst", h, h) / np.sqrt(D)
        att = jnp.where(mask[None], att, -1e9)
        h = jax.nn.softmax(att) @ h
        flat = h.reshape(B * S, D)
        feats = jnp.concatenate([flat, flat ** 2], axis=1)
        logits = feats @ p["w"]
        onehot = jax.nn.one_hot(y.reshape(-1), V)
        return -(jax.nn.log_softmax(logits) * onehot).sum(-1).mean()

    tx = optax.adam(1e-3)

    def step(params, opt_state, ids):
        loss, g = jax.value_and_grad(loss_fn)(params, ids)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss

    def init():
        k = jax.random.split(jax.random.key(0), 3)
        params = {"emb": jax.random.normal(k[0], (V, D)) * 0.02,
                  "pos": jax.random.normal(k[1], (S, D)) * 0.02,
                  "w": jax.random.normal(k[2], (2 * D, V)) * 0.02}
        return params, tx.init(params), jax.random.randint(jax.random.key(1), (B, S + 1), 0, V)

    return step, (jax.eval_shape(init) if abstract else init())


def sharded_flops(plan, graph) -> float:
    total = sum(op.cost.flops for op in graph.ops)
    return sum(op.cost.flops for op, f in zip(graph.ops, plan.op_factors) if f >= 0) / total


def test_data_parallelism_follows_the_batch_through_slices_reshapes_and_masks():
    step, args = batch_shuffling_step(16, 8, 16, 64)
    par = hs.parallelize(step, cluster="cpu-2-6", strategy="data-parallel")
    plan = par.plan(*args)
    _, graph = lift(step, *args)
    # everything but the optimizer update (replicated in data parallelism) is sharded
    assert sharded_flops(plan, graph) > 0.95
    assert plan.baseline_ops["DP-EV"] == plan.baseline_ops["DP-CP"] > len(graph.ops) / 2
    assert f"shards {plan.baseline_ops['DP-EV']} of {len(graph.ops)} ops" in plan.summary()
    ref = jax.jit(step)
    got = want = args
    for _ in range(3):
        got, want = par(*got[:2], args[2]), ref(*want[:2], args[2])
    for a, b in zip(jax.tree.leaves(hs.gather(got)), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-6)


def test_honest_data_parallel_baseline_at_paper_size_is_near_the_limit():
    step, args = batch_shuffling_step(2048, 128, 768, 30522, abstract=True)
    plan = hs.parallelize(step, cluster="hap-v100x16-p100x48",
                          strategy="data-parallel").plan(*args)
    assert plan.baselines["DP-EV"] <= 2.5 * plan.baselines["ideal"]
    assert plan.baselines["DP-CP"] <= plan.baselines["DP-EV"]


def test_a_batch_of_ids_is_data_not_state():
    """`step(params, ids) -> (params, loss)`: the loss is one leaf like the ids, but not
    their shape, so the ids are the data the step is parallelised over."""
    V, D = 64, 16

    def step(params, ids):
        def loss(p):
            return ((p["tok"][ids[:, :-1]] @ p["w"]) ** 2).mean()

        val, g = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), val

    params = {"tok": jnp.ones((V, D)) / D, "w": jnp.ones((D, V)) / V}
    ids = jnp.arange(32 * 9).reshape(32, 9) % V
    par = hs.parallelize(step, cluster="cpu-2-6", strategy="data-parallel")
    plan = par.plan(params, ids)
    assert plan.state_leaves == 2 and plan.baseline_ops["DP-CP"] > 0
    got, want = hs.gather(par(params, ids)), jax.jit(step)(params, ids)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_data_parallelism_that_shards_nothing_is_an_error_not_a_result():
    def step(w):  # no data: every argument is state
        val, g = jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(w) ** 2))(w)
        return w - 0.1 * g, val

    w = jnp.linspace(-1, 1, 64).reshape(8, 8)
    with pytest.raises(hs.NoDataParallelism, match="no data inputs"):
        hs.parallelize(step, cluster="cpu-2-6", strategy="data-parallel").plan(w)
    plan = hs.parallelize(step, cluster="cpu-2-6", time_limit=1).plan(w)
    assert "DP-EV" not in plan.baselines and "data parallelism does not apply" in plan.summary()


def test_microbatches_of_a_gradient_accumulation_are_fed_split_and_sharded():
    """`[32, D] -> [4, 8, D]` and a scan over the 4: data parallelism splits each
    microbatch (the minor part of the batch dim), the batch fed already split, and the
    gradients are summed across microbatches before one all-reduce."""
    D = 16

    def step(w, batch):
        def body(g, x):
            return g + jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w), None

        g, _ = jax.lax.scan(body, jnp.zeros_like(w), batch.reshape(4, 8, D))
        return w - 0.1 * g / 4, jnp.sum(g)

    w = jnp.linspace(-1, 1, D * D).reshape(D, D)
    batch = jnp.sin(jnp.arange(32 * D, dtype=jnp.float32)).reshape(32, D)
    par = hs.parallelize(step, cluster="cpu-2-6", strategy="data-parallel")
    plan = par.plan(w, batch)
    low = par.lowered(w, batch)
    assert low.prog.input_views[1] == ((4, 8, D), 1)
    body = [op for op in lift_program(low.prog).ops if op.loop is not None]
    assert all(f >= 0 for op, f in zip(body, (plan.op_factors[op.id] for op in body))
               if op.primitive == "dot_general")
    (sync,) = [c for c in plan.conversions if c.collective == "all_reduce" and c.nbytes > 4]
    assert sync.repeat == 1 and sync.deferred  # once, after the microbatches
    got = want = (w, batch)
    for _ in range(3):
        got, want = par(got[0], batch), jax.jit(step)(want[0], batch)
    for a, b in zip(jax.tree.leaves(hs.gather(got)), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
