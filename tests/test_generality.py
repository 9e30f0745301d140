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
    plan = hs.parallelize(step, cluster="cpu-2-6", time_limit=1, devices="all").plan(w)
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

    w, batch = _weights_and_batch(D)
    par = hs.parallelize(step, cluster="cpu-2-6", strategy="data-parallel")
    plan = par.plan(w, batch)
    low = par.lowered(w, batch)
    assert low.prog.input_views[1] == ((4, 8, D), 1)
    body = [op for op in lift_program(low.prog).ops if op.loop is not None]
    assert all(f >= 0 for op, f in zip(body, (plan.op_factors[op.id] for op in body))
               if op.primitive == "dot_general")
    (sync,) = [c for c in plan.conversions if c.collective == "all_reduce" and c.nbytes > 4]
    assert sync.repeat == 1 and sync.deferred  # once, after the microbatches
    _assert_steps_equal_jit(par, step, w, batch, steps=3)


def _weights_and_batch(D):
    """A [D, D] weight and a [32, D] batch, deterministic."""
    return (jnp.linspace(-1, 1, D * D).reshape(D, D),
            jnp.sin(jnp.arange(32 * D, dtype=jnp.float32)).reshape(32, D))


def _assert_steps_equal_jit(par, step, w, batch, steps: int):
    """`steps` chained distributed steps `(w, batch) -> (w, ...)` equal `jax.jit`'s."""
    got = want = (w, batch)
    for _ in range(steps):
        got, want = par(got[0], batch), jax.jit(step)(want[0], batch)
    for a, b in zip(jax.tree.leaves(hs.gather(got)), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


def _fori_step(D, first_outside=True, stride=8):
    """big_vision's accumulation: microbatch 0 by a static slice, the next ones by a
    `dynamic_slice` at `i * stride` in a `fori_loop`."""
    loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)

    def step(w, batch):
        lo = 1 if first_outside else 0
        g0 = jax.grad(loss)(w, batch[:8]) if first_outside else jnp.zeros_like(w)

        def body(i, g):
            x = jax.lax.dynamic_slice(batch, (i * stride, 0), (8, D))
            return g + jax.grad(loss)(w, x)

        g = jax.lax.fori_loop(lo, 4, body, g0)
        return w - 0.1 * g / 4, jnp.sum(g)
    return step


@pytest.mark.parametrize("first_outside", [True, False])
def test_microbatches_taken_by_dynamic_slice_in_a_fori_loop_are_fed_split(first_outside):
    """Blocks of 8 rows, one by a static slice and the rest by a loop's `dynamic_slice`:
    the batch is fed as `[4, 8, D]`, each block a read of that view, and data
    parallelism splits every microbatch."""
    D = 16
    step = _fori_step(D, first_outside)
    w, batch = _weights_and_batch(D)
    par = hs.parallelize(step, cluster="cpu-2-6", strategy="data-parallel")
    plan = par.plan(w, batch)
    low = par.lowered(w, batch)
    assert low.prog.input_views[1] == ((4, 8, D), 1)
    assert "dynamic_slice" not in {op.primitive for op in lift_program(low.prog).ops}
    dots = [(op, plan.op_factors[op.id]) for op in lift_program(low.prog).ops
            if op.primitive == "dot_general"]
    assert dots and all(f >= 0 for _, f in dots), "every microbatch's matmuls are sharded"
    _assert_steps_equal_jit(par, step, w, batch, steps=3)


def test_overlapping_dynamic_slices_are_not_taken_for_blocks():
    """Windows 4 rows apart overlap: no view, the step still planned and equal to jit."""
    D = 16
    step = _fori_step(D, first_outside=False, stride=4)
    w, batch = _weights_and_batch(D)
    par = hs.parallelize(step, cluster="cpu-2-6", time_limit=1, devices="all")
    low = par.lowered(w, batch)
    assert not any(low.prog.input_views or ())
    _assert_steps_equal_jit(par, step, w, batch, steps=1)


def test_a_cond_is_planned_through_both_branches_under_one_plan():
    """`lax.cond` choosing a gradient step or an accumulate-only step (as
    `optax.MultiSteps` and `apply_if_finite` do): its branches' ops are ops of the plan,
    sharded on the batch like the rest, and three distributed steps equal `jax.jit`."""
    D = 16

    def step(w, acc, x):
        g = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        ok = jnp.isfinite(jnp.sum(g)) & (jnp.sum(jnp.abs(x)) > 1.0)
        new_w, new_acc = jax.lax.cond(ok, lambda a: (w - 0.1 * (a + g), jnp.zeros_like(a)),
                                      lambda a: (w, a + jnp.tanh(x @ w).T @ x), acc)
        return new_w, new_acc, jnp.sum(g)

    w = jnp.linspace(-1, 1, D * D).reshape(D, D)
    acc = jnp.zeros((D, D))
    x = jnp.sin(jnp.arange(32 * D, dtype=jnp.float32)).reshape(32, D)
    report = hs.inspect(step, w, acc, x)
    assert "cond" not in report["primitives"] and "select_n" in report["primitives"]
    par = hs.parallelize(step, cluster="cpu-2-6", strategy="data-parallel")
    plan = par.plan(w, acc, x)
    graph = lift_program(par.lowered(w, acc, x).prog)
    dots = [plan.op_factors[op.id] for op in graph.ops if op.primitive == "dot_general"]
    assert len(dots) >= 4 and all(f >= 0 for f in dots), "both branches' matmuls are sharded"
    got = want = (w, acc)
    for k in range(3):
        xk = x * (k + 1) if k < 2 else x * 0.0  # the last step takes the other branch
        got, want = par(*got[:2], xk), jax.jit(step)(*want[:2], xk)
        for a, b in zip(jax.tree.leaves(hs.gather(got)), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


def test_block_reads_twice_in_one_loop_and_a_loop_that_never_runs():
    """Two `dynamic_slice`s of the batch in one loop body are two slices of the view
    (the loop region stays whole); `fori_loop(1, 1, ...)` (one microbatch: the loop never
    runs) leaves the batch as it is. Both equal `jax.jit`."""
    D = 16
    loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)

    def twice(w, batch):
        def body(i, g):
            x = jax.lax.dynamic_slice(batch, (i * 8, 0), (8, D))
            y = jax.lax.dynamic_slice(batch, (i * 8, 0), (8, D))
            return g + jax.grad(loss)(w, x) + jax.grad(loss)(w, 2 * y)
        g = jax.lax.fori_loop(0, 4, body, jnp.zeros_like(w))
        return w - 0.1 * g, jnp.sum(jnp.abs(g))

    def never(w, batch):
        g0 = jax.grad(loss)(w, batch[:8])
        g = jax.lax.fori_loop(1, 1, lambda i, g: g + jax.grad(loss)(
            w, jax.lax.dynamic_slice(batch, (i * 8, 0), (8, D))), g0)
        return w - 0.1 * g, jnp.sum(jnp.abs(g))

    w, batch = _weights_and_batch(D)
    for step, view in ((twice, ((4, 8, D), 1)), (never, None)):
        par = hs.parallelize(step, cluster="cpu-2-6", time_limit=1, devices="all")
        assert (par.lowered(w, batch).prog.input_views or (None, None))[1] == view
        _assert_steps_equal_jit(par, step, w, batch, steps=2)


def test_bf16_gradients_are_summed_in_bf16_where_they_are_made():
    """Mixed precision (bf16 compute, f32 master weights): the gradients' all-reduce is on
    the bf16 values as the backward pass makes them (half the bytes, overlapping it), not
    on their f32 up-casts made after it, and the step still equals one device's."""
    def loss_fn(p, x, y):
        h = jnp.tanh(x.astype(jnp.bfloat16) @ p["w1"])
        return ((h @ p["w2"]).astype(jnp.float32) - y) ** 2

    def step(params, x, y):
        p16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
        loss, g = jax.value_and_grad(lambda p: loss_fn(p, x, y).mean())(p16)
        g = jax.tree.map(lambda v: v.astype(jnp.float32), g)
        return jax.tree.map(lambda p, d: p - 0.1 * d, params, g), loss

    k = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k[0], (512, 512)) / 16,
              "w2": jax.random.normal(k[1], (512, 256)) / 16}
    x, y = jax.random.normal(k[2], (256, 512)), jax.random.normal(k[3], (256, 256))
    par = hs.parallelize(step, cluster="cpu-2-6", strategy="data-parallel")
    plan = par.plan(params, x, y)
    _, graph = lift(step, params, x, y)
    synced = [c for c in plan.conversions if c.deferred and c.collective == "all_reduce"]
    assert {str(graph.tensors[c.tensor].dtype) for c in synced} == {"bfloat16"}
    assert sum(c.nbytes for c in synced) == 2 * (512 * 512 + 512 * 256)
    got, want = hs.gather(par(params, x, y)), jax.jit(step)(params, x, y)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=2e-2, atol=2e-3)


def test_frozen_weights_passed_beside_the_batch_are_not_taken_for_it():
    """LoRA: the frozen base weights are an argument that is not state, like the batch,
    and their dim 0 is as long as the batch. Data parallelism splits the batch only:
    every op reading a base weight reads it whole, only the adapters' gradients are
    summed across devices, and the step equals one device's."""
    D, B, R_ = 64, 64, 4
    ks = jax.random.split(jax.random.key(0), 5)
    base = {"w1": jax.random.normal(ks[0], (D, D)) / 8, "w2": jax.random.normal(ks[1], (D, 8)) / 8}
    lora = {"a": jax.random.normal(ks[2], (D, R_)) / 8, "b": jnp.zeros((R_, D))}
    x, y = jax.random.normal(ks[3], (B, D)), jax.random.normal(ks[4], (B, 8))
    tx = optax.adam(1e-2)

    def step(lora, opt, base, x, y):
        def loss(lr):
            return ((jnp.tanh(x @ (base["w1"] + lr["a"] @ lr["b"])) @ base["w2"] - y) ** 2).mean()
        val, g = jax.value_and_grad(loss)(lora)
        upd, opt = tx.update(g, opt, lora)
        return optax.apply_updates(lora, upd), opt, val

    args = (lora, tx.init(lora), base, x, y)
    par = hs.parallelize(step, cluster="cpu-2-6", strategy="data-parallel")
    plan = par.plan(*args)
    _, graph = lift(step, *args)
    frozen = set(graph.inputs[-4:-2])
    reads = [n for op in graph.ops for t, n in zip(op.inputs, plan.op_inputs[op.id]) if t in frozen]
    assert reads and all(n is not None and n.kind == "R" for n in reads)
    batch = set(graph.inputs[-2:])
    assert all(n.kind == "S" for op in graph.ops
               for t, n in zip(op.inputs, plan.op_inputs[op.id]) if t in batch)
    # the partial sums are carried through the products to the adapters' gradients, as
    # hand-written data parallelism sums them: no D x D gradient crosses devices
    moved = [graph.tensors[c.tensor].shape for c in plan.conversions]
    assert (D, D) not in moved and (D, R_) in moved and (R_, D) in moved
    got, want = args, args
    for _ in range(2):
        got, want = par(*got[:2], *args[2:]), jax.jit(step)(*want[:2], *args[2:])
        for a, b in zip(jax.tree.leaves(hs.gather(got)), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=1e-5)
