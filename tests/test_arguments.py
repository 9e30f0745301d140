"""A parallelized step takes its arguments as `jax.jit` takes them: Python scalars (a
learning rate, a step count, a flag) are traced values, not constants (a new value runs
the same plan), and a call with the wrong number of arguments fails naming the argument."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hapsynth as hs
from test_lowering import compare

TX = optax.sgd(1.0)


def _loss(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def lr_step(params, opt, batch, lr):
    """An MLP step whose learning rate is an argument."""
    loss, g = jax.value_and_grad(_loss)(params, batch)
    upd, opt = TX.update(g, opt, params)
    return optax.apply_updates(params, jax.tree.map(lambda u: lr * u, upd)), opt, loss


def count_step(params, opt, batch, t, warm):
    """The learning rate from a step count `t` (an int) and a `warm` flag (a bool)."""
    lr = jnp.where(warm, 0.5 / (1 + t), 0.1)
    return lr_step(params, opt, batch, lr)


def _args():
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k[0], (16, 32)) * 0.1, "b1": jnp.zeros(32),
              "w2": jax.random.normal(k[1], (32, 4)) * 0.1}
    batch = (jax.random.normal(k[2], (64, 16)), jax.random.normal(k[3], (64, 4)))
    return params, TX.init(params), batch


def _cluster() -> hs.Cluster:
    return hs.Cluster.simulated([("A100", 2), ("V100", 6)])


def _chained(par, step, scalars_per_step):
    """Steps of `par` and of `jax.jit(step)` fed the same scalars, state fed back: equal."""
    params, opt, batch = _args()
    got, want, ref = (params, opt), (params, opt), jax.jit(step)
    for scalars in scalars_per_step:
        got = par(*got[:2], batch, *scalars)
        want = ref(*want[:2], batch, *scalars)
        compare(hs.gather(got), want)


def test_a_python_float_learning_rate_runs_like_jit_and_a_new_value_plans_nothing():
    par = hs.parallelize(lr_step, cluster=_cluster(), time_limit=1)
    _chained(par, lr_step, [(0.1,), (0.03,)])
    assert len(par._plans) == 1 and len(par._lowered) == 1  # 0.03: the plan made for 0.1
    params, opt, batch = _args()
    assert par.plan(params, opt, batch, 0.5) is par.plan(params, opt, batch, 0.1)
    assert type(par.lowered(params, opt, batch, 0.5)).__name__ == "Lowered"  # SPMD
    (lr,) = [x for x in par.plan(params, opt, batch, 0.1).signature.inputs
             if x.startswith("[3]")]
    assert lr.endswith("f32[]")  # traced as jit types it, not a constant


def test_an_int_step_count_and_a_bool_flag_run_like_jit():
    par = hs.parallelize(count_step, cluster=_cluster(), time_limit=1)
    _chained(par, count_step, [(0, True), (1, True), (2, False)])
    assert len(par._plans) == 1


def test_numpy_scalars_run_like_jit():
    par = hs.parallelize(lr_step, cluster=_cluster(), time_limit=1)
    _chained(par, lr_step, [(np.float32(0.1),), (np.float32(0.2),)])
    assert len(par._plans) == 1


def test_a_missing_argument_is_named():
    params, opt, batch = _args()
    par = hs.parallelize(count_step, cluster=_cluster(), time_limit=1)
    with pytest.raises(TypeError, match=r"count_step\(\) missing 1 required positional "
                                        r"argument: 'warm'"):
        par(params, opt, batch, 0)
    with pytest.raises(TypeError, match=r"missing 3 required positional arguments: "
                                        r"'batch', 't' and 'warm'"):
        par.plan(params, opt)
    assert not par._plans  # nothing planned for a wrong call


def test_an_extra_argument_is_named():
    params, opt, batch = _args()
    par = hs.parallelize(lr_step, cluster=_cluster(), time_limit=1)
    par(params, opt, batch, 0.1)  # planned for four arguments
    with pytest.raises(TypeError, match=r"lr_step\(\) takes 4 positional arguments "
                                        r"\(params, opt, batch, lr\) but 5 were given: "
                                        r"argument 4 \(int 7\) is extra"):
        par(params, opt, batch, 0.1, 7)


def test_a_leaf_that_is_no_array_is_named():
    params, opt, batch = _args()
    par = hs.parallelize(lr_step, cluster=_cluster(), time_limit=1)
    with pytest.raises(TypeError, match=r"argument \[3\] of type str is not an array"):
        par(params, opt, batch, "0.1")


@pytest.mark.parametrize("runtime,kind", [("ticks", "Pipelined"), ("free", "FreeRunning")])
def test_a_pipeline_takes_a_python_float_too(runtime, kind):
    """`lower.lower` picks each pipeline runtime by the plan; each reads the scalar."""
    from test_pipeline import two_islands

    par = hs.parallelize(lr_step, cluster=two_islands(), pipeline=True,
                         pipeline_runtime=runtime, time_limit=1)
    _chained(par, lr_step, [(0.1,), (0.2,)])
    params, opt, batch = _args()
    assert type(par.lowered(params, opt, batch, 0.3)).__name__ == kind
    assert len(par._plans) == 1
