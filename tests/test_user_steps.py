"""Train steps written the way users write them (Flax linen / plain JAX, not the zoo).

`hs.inspect` must cover every primitive and count flops within 10% of XLA's.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax

import hapsynth as hs


class TiedLM(nn.Module):
    vocab: int = 96
    d: int = 48
    heads: int = 4
    layers: int = 2

    @nn.compact
    def __call__(self, tokens):
        emb = nn.Embed(self.vocab, self.d)
        x = emb(tokens) + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.d))
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.layers):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(self.heads, use_bias=False)(h, h, mask=mask)
            h = nn.LayerNorm()(x)
            x = x + nn.Dense(self.d)(nn.gelu(nn.Dense(4 * self.d)(h)))
        return emb.attend(nn.LayerNorm()(x))


def transformer_step():
    model = TiedLM()
    tokens = jax.random.randint(jax.random.key(0), (8, 24), 0, 96)
    params = model.init(jax.random.key(1), tokens[:, :-1])
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.1))

    def step(params, opt_state, tokens):
        def loss_fn(p):
            logits = model.apply(p, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), tokens)


class ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        for feat in (16, 32):
            x = nn.relu(nn.Conv(feat, (3, 3))(x))
            x = nn.max_pool(x, (2, 2), (2, 2))
        x = nn.avg_pool(x, (2, 2), (2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def conv_step():
    model = ConvNet()
    x = jax.random.normal(jax.random.key(0), (16, 16, 16, 3))
    y = jax.random.randint(jax.random.key(1), (16,), 0, 10)
    params = model.init(jax.random.key(2), x)
    tx = optax.sgd(0.05, momentum=0.9)

    def step(params, opt_state, x, y):
        def loss_fn(p):
            return optax.softmax_cross_entropy(model.apply(p, x), jax.nn.one_hot(y, 10)).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), x, y)


def optax_step(loss_fn, tx):
    """The usual step around `loss_fn(params, *batch)`: its gradient, an Optax update."""
    def step(params, opt_state, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def mlp_custom_loss_step():
    keys = jax.random.split(jax.random.key(0), 4)
    params = {"enc": {"w": jax.random.normal(keys[0], (32, 64)) * 0.1, "b": jnp.zeros(64)},
              "head": {"w": jax.random.normal(keys[1], (64, 8)) * 0.1, "b": jnp.zeros(8)}}
    x = jax.random.normal(keys[2], (64, 32))
    t = jax.random.normal(keys[3], (64, 8))
    tx = optax.adam(1e-3)

    def loss_fn(p, x, t):  # Huber loss plus an L2 penalty on the weight matrices
        h = jnp.tanh(x @ p["enc"]["w"] + p["enc"]["b"])
        err = h @ p["head"]["w"] + p["head"]["b"] - t
        huber = jnp.where(jnp.abs(err) < 1, 0.5 * err ** 2, jnp.abs(err) - 0.5).mean()
        return huber + 1e-4 * sum(jnp.sum(v["w"] ** 2) for v in p.values())

    return optax_step(loss_fn, tx), (params, tx.init(params), x, t)


def moe_step():
    """A top-1 mixture of experts as MoE code writes it with grouped matmuls: tokens
    sorted by expert, `lax.ragged_dot` over the experts' weights, scattered back."""
    E, d, h, T, C = 4, 32, 512, 64, 8
    k = jax.random.split(jax.random.key(0), 6)
    params = {"router": jax.random.normal(k[0], (d, E)) * 0.3,
              "w1": jax.random.normal(k[1], (E, d, h)) * 0.2,
              "w2": jax.random.normal(k[2], (E, h, d)) * 0.2,
              "out": jax.random.normal(k[3], (d, C)) * 0.2}
    x = jax.random.normal(k[4], (T, d))
    y = jax.random.randint(k[5], (T,), 0, C)
    tx = optax.adam(1e-2)

    def loss_fn(p, x, y):
        logits = x @ p["router"]
        expert = jnp.argmax(logits, -1)
        gate = jnp.take_along_axis(jax.nn.softmax(logits), expert[:, None], 1)
        order = jnp.argsort(expert)
        sizes = jnp.bincount(expert, length=E).astype(jnp.int32)
        hidden = jax.nn.gelu(lax.ragged_dot(x[order], p["w1"], sizes))
        moved = jnp.zeros_like(x).at[order].set(lax.ragged_dot(hidden, p["w2"], sizes))
        z = (x + gate * moved) @ p["out"]
        return optax.softmax_cross_entropy_with_integer_labels(z, y).mean()

    return optax_step(loss_fn, tx), (params, tx.init(params), x, y)


def linalg_step():
    """Regression on spectral features through a learned SPD metric, per example: rfft,
    a batched Cholesky factor, a triangular solve and `jnp.linalg.solve`, `jnp.diagonal`."""
    B, n, m = 32, 16, 4
    k = jax.random.split(jax.random.key(1), 4)
    params = {"a": jax.random.normal(k[0], (n // 2 + 1, m * m)) * 0.1,
              "w": jax.random.normal(k[1], (m, 1)) * 0.3}
    x = jax.random.normal(k[2], (B, n))
    t = jax.random.normal(k[3], (B, m))
    tx = optax.sgd(0.05, momentum=0.9)

    def loss_fn(p, x, t):
        f = jnp.abs(jnp.fft.rfft(x))                       # [B, n/2+1]
        a = (f @ p["a"]).reshape(-1, m, m)
        spd = a @ jnp.swapaxes(a, 1, 2) + 2.0 * jnp.eye(m)  # [B, m, m]
        chol = jnp.linalg.cholesky(spd)
        z = jax.scipy.linalg.solve_triangular(chol, t[..., None], lower=True)[..., 0]
        u = jnp.linalg.solve(spd, t[..., None])[..., 0]
        logdet = 2 * jnp.log(jnp.diagonal(chol, axis1=1, axis2=2)).sum(-1)
        pred = (z * u) @ p["w"]
        return jnp.mean(pred[:, 0] ** 2) + 0.01 * jnp.mean(logdet)

    return optax_step(loss_fn, tx), (params, tx.init(params), x, t)


@pytest.mark.parametrize("make", [transformer_step, conv_step, mlp_custom_loss_step,
                                  linalg_step])
def test_user_step_is_covered_and_costed(make):
    step, args = make()
    report = hs.inspect(step, *args)
    assert report["unsupported"] == {}, report["unsupported"]
    cost = jax.jit(step).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert report["flops"] == pytest.approx(cost["flops"], rel=0.10)


def test_grouped_matmul_step_is_covered():
    """Every primitive of the MoE step has a rule. (Its flops are not XLA's: XLA CPU runs
    `ragged_dot` as a dense product per group, the planner prices the grouped work that
    GPUs and TPUs run.)"""
    step, args = moe_step()
    assert hs.inspect(step, *args)["unsupported"] == {}


@pytest.mark.slow
def test_bert_base_sized_user_step_plans_on_the_hap_cluster():
    """A BERT-base-sized linen model (abstract: nothing allocated) plans on HAP's cluster
    at least as fast as both data-parallel baselines. (Its wall time is a benchmark figure:
    see the README.)"""
    model = TiedLM(vocab=30522, d=768, heads=12, layers=12)
    tokens = jax.ShapeDtypeStruct((32 * 64, 129), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(1),
                            jax.ShapeDtypeStruct((32 * 64, 128), jnp.int32))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.1))

    def step(params, opt_state, tokens):
        def loss_fn(p):
            logits = model.apply(p, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = jax.eval_shape(tx.init, params)
    plan = hs.parallelize(step, cluster="hap-v100x16-p100x48").plan(params, opt_state, tokens)
    assert plan.predicted_step_time <= min(plan.baselines["DP-EV"], plan.baselines["DP-CP"])
    assert plan.predicted_step_time >= plan.baselines["ideal"]
    assert plan.unsupported == {}


def runs_like_one_device(par, step, args, steps: int = 3):
    """`steps` chained steps of `par` equal single-device `jax.jit(step)`."""
    from test_lowering import compare

    ref = jax.jit(step)
    state, want = args[:2], args[:2]
    for _ in range(steps):
        want = ref(*want[:2], *args[2:])
        state = par(*state[:2], *args[2:])
        compare(hs.gather(state), want)


@pytest.mark.parametrize("make,cluster", [
    (conv_step, "2+6"), (mlp_custom_loss_step, "2+6"), (conv_step, "even"),
    (mlp_custom_loss_step, "even"),  # transformers: tests/test_elsewhere.py runs them too
    (linalg_step, "2+6"),  # (moe_step: test_grouped_and_batched_linear_algebra_run_sharded)
    pytest.param(transformer_step, "2+6", marks=pytest.mark.slow),
    pytest.param(transformer_step, "even", marks=pytest.mark.slow)])
def test_user_step_runs_distributed_like_one_device(make, cluster):
    """Three chained distributed steps equal single-device jax.jit, on an even and on a
    heterogeneous cluster (where some dim must be split unevenly)."""
    from test_lowering import CLUSTERS

    step, args = make()
    par = hs.parallelize(step, cluster=CLUSTERS[cluster](), time_limit=1, devices="all")
    runs_like_one_device(par, step, args)
    if cluster == "2+6":
        units = par.plan(*args).shard_units
        assert any(len(set(u)) > 1 for u in units.values())


@pytest.mark.parametrize("make,strategy,sharded", [
    (moe_step, "auto", {"ragged_dot_general"}),
    (linalg_step, "data-parallel", {"fft", "cholesky", "lu", "triangular_solve"})])
def test_grouped_and_batched_linear_algebra_run_sharded(make, strategy, sharded):
    """Grouped matmuls (the experts' hidden dim) and batched Cholesky, LU, triangular
    solves and FFTs (their batch) run sharded over uneven devices and equal one-device
    `jax.jit` over three steps."""
    from test_lowering import CLUSTERS

    from hapsynth.ir import lift

    step, args = make()
    par = hs.parallelize(step, cluster=CLUSTERS["2+6"](), time_limit=1, devices="all",
                         strategy=strategy)
    plan = par.plan(*args)
    _, graph = lift(step, *args)
    ran = {graph.ops[i].primitive for i, f in enumerate(plan.op_factors) if f >= 0}
    assert sharded <= ran, sharded - ran
    runs_like_one_device(par, step, args)
