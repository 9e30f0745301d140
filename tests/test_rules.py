"""Every sharding rule is proven by execution on uneven shards (incl. zero-size ones)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.extend import random as jax_random

from hapsynth.ir.graph import Factor, Rule
from hapsynth.ir.rules import REGISTRY, rule_for
from hapsynth.ir.trace import evaluate, trace
from rulecheck import check_eqn, check_factor, split_sizes

K = jax.random.split(jax.random.key(0), 8)


def r(i, *shape, dtype=jnp.float32):
    return jax.random.normal(K[i], shape, dtype)


def ints(i, hi, *shape):
    return jax.random.randint(K[i], shape, 0, hi)


NHWC = ("NHWC", "HWIO", "NHWC")
CASES = {
    "binary": (lambda a, b: a * b + a / (b * b + 1) - jnp.maximum(a, b), r(0, 6, 5), r(1, 6, 5)),
    "unary": (lambda a: jnp.tanh(a) + jnp.exp(a) + jax.nn.sigmoid(a) + lax.erf(a) + jnp.abs(a),
              r(0, 7, 3)),
    "scalar_literal": (lambda a: 2.0 * a + 1.0, r(0, 6, 5)),
    "compare_select": (lambda a, b: jnp.where(a > b, a, b ** 3), r(0, 6, 5), r(1, 6, 5)),
    "clamp_pow": (lambda a: jnp.clip(a, -0.5, 0.5) + jnp.abs(a) ** 1.5 + lax.rsqrt(a * a + 1),
                  r(0, 9, 2)),
    "convert": (lambda a: (a > 0).astype(jnp.float32) + a.astype(jnp.int32), r(0, 6, 5)),
    "broadcast": (lambda a, b: a[:, None, :] + b[None, :, None] + jnp.ones((1, 1, 4)),
                  r(0, 6, 4), r(1, 5)),
    "broadcast_size1": (lambda a: jnp.broadcast_to(a, (6, 5)), r(0, 1, 5)),
    "reshape_merge": (lambda a: a.reshape(30, 4) * 2, r(0, 6, 5, 4)),
    "reshape_split": (lambda a: a.reshape(6, 5, 2, 2) * 2, r(0, 30, 4)),
    "reshape_gcd": (lambda a: a.reshape(6, 2) * 2, r(0, 4, 3)),
    "reshape_units": (lambda a: a.reshape(1, 6, 1, 5) * 2, r(0, 6, 5)),
    "transpose": (lambda a: jnp.transpose(a, (2, 0, 1)) * 2, r(0, 6, 5, 4)),
    "squeeze": (lambda a: jnp.squeeze(a, 1) * 2, r(0, 6, 1, 5)),
    "concat_split": (lambda a, b: jnp.split(jnp.concatenate([a, b], 1), [3], 1)[1] * 2,
                     r(0, 6, 3), r(1, 6, 4)),
    "pad": (lambda a: jnp.pad(a, ((0, 0), (1, 2))) * 2, r(0, 6, 5)),
    "stack": (lambda a, b: jnp.stack([a, b], 1) * 2, r(0, 6, 5), r(1, 6, 5)),
    "unstack": (lambda a: [x * 2 for x in jnp.unstack(a, axis=1)], r(0, 6, 3, 5)),
    "stack_grad": (lambda a, b: jax.grad(lambda a, b: jnp.sum(jnp.stack([a, b], 2) ** 2),
                                         (0, 1))(a, b), r(0, 6, 5), r(1, 6, 5)),
    "slice": (lambda a: a[:, 1:4] * 2, r(0, 6, 5)),
    "dynamic_slice": (lambda a, i: lax.dynamic_slice(a, (0, i), (6, 2)), r(0, 6, 5),
                      jnp.int32(2)),
    "dynamic_update_slice": (lambda a, u, i: lax.dynamic_update_slice(a, u, (0, i)),
                             r(0, 6, 5), r(1, 6, 2), jnp.int32(1)),
    "iota": (lambda a: a + lax.broadcasted_iota(jnp.float32, (6, 5), 1), r(0, 6, 5)),
    "rev": (lambda a: jnp.flip(a, 1) * 2, r(0, 6, 5)),
    "reductions": (lambda a: (a.sum(1), a.max(0), a.min(1), jnp.prod(a, 0), (a > 0).all(1),
                              (a > 0).any(0)), r(0, 6, 5)),
    "argmax": (lambda a: jnp.argmax(a, 1), r(0, 6, 5)),
    "bitwise_reductions": (lambda a: (lax.reduce_xor_p.bind(a, axes=(1,)), lax.reduce_or_p.bind(a, axes=(0,)),
                                      lax.reduce_and_p.bind(a, axes=(1,))), ints(0, 64, 6, 5)),
    "cumsum": (lambda a: jnp.cumsum(a, 1) + lax.cummax(a, 0), r(0, 6, 5)),
    "sort": (lambda a: jnp.sort(a, 1), r(0, 6, 5)),
    "argsort": (lambda a: jnp.argsort(a, 0), r(0, 6, 5)),
    "top_k": (lambda a: lax.top_k(a, 2), r(0, 6, 5)),
    "matmul": (lambda a, b: a @ b, r(0, 6, 5), r(1, 5, 7)),
    "batched_dot": (lambda a, b: jnp.einsum("bij,bjk->bik", a, b), r(0, 3, 6, 5), r(1, 3, 5, 4)),
    "two_contracting": (lambda a, b: jnp.einsum("ijk,jkl->il", a, b), r(0, 6, 5, 3), r(1, 5, 3, 4)),
    "conv": (lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=NHWC),
             r(0, 5, 6, 6, 3), r(1, 3, 3, 3, 7)),
    "conv_nchw_strided": (lambda x, w: lax.conv_general_dilated(x, w, (2, 2), "VALID"),
                          r(0, 5, 3, 7, 7), r(1, 6, 3, 3, 3)),
    "conv_grouped": (lambda x, w: lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=NHWC, feature_group_count=2),
        r(0, 5, 6, 6, 4), r(1, 3, 3, 2, 6)),
    "conv_grads": (lambda x, w: jax.grad(lambda x, w: jnp.sum(lax.conv_general_dilated(
        x, w, (2, 2), "SAME", dimension_numbers=NHWC) ** 2), (0, 1))(x, w),
        r(0, 5, 8, 8, 3), r(1, 3, 3, 3, 4)),
    "maxpool": (lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1),
                                            "VALID"), r(0, 5, 6, 6, 3)),
    "avgpool": (lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1),
                                            "VALID"), r(0, 5, 6, 6, 3)),
    "maxpool_grad": (lambda x: jax.grad(lambda x: jnp.sum(lax.reduce_window(
        x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") ** 2))(x), r(0, 5, 6, 6, 3)),
    "embedding": (lambda e, i: e[i], r(0, 11, 4), ints(1, 11, 6, 5)),
    "embedding_grad": (lambda e, i, g: jax.vjp(lambda e: e[i], e)[1](g)[0],
                       r(0, 11, 4), ints(1, 11, 6, 5), r(2, 6, 5, 4)),
    "take_along_axis": (lambda a, i: jnp.take_along_axis(a, i, 1), r(0, 6, 5), ints(1, 5, 6, 2)),
    "take_along_axis_grad": (lambda a, i, g: jax.vjp(lambda a: jnp.take_along_axis(a, i, 1), a)[1](g)[0],
                             r(0, 6, 5), ints(1, 5, 6, 2), r(2, 6, 2)),
    "scatter_set": (lambda a, i, u: a.at[i].set(u), r(0, 7, 4), ints(1, 7, 5), r(2, 5, 4)),
    "scatter_max": (lambda a, i, u: a.at[i].max(u), r(0, 7, 4), ints(1, 7, 5), r(2, 5, 4)),
    "scatter_sub": (lambda a, i, u: a.at[i].subtract(u), r(0, 7, 4), ints(1, 7, 5), r(2, 5, 4)),
    "searchsorted": (lambda a, b: [jnp.searchsorted(a, b, side=s, method="compare_all")
                                   for s in ("left", "right")], r(0, 7), r(1, 6, 5)),
    "diagonal": (lambda a: jnp.diagonal(a, axis1=1, axis2=2) * 2, r(0, 4, 5, 5)),
    "fft": (lambda a: (jnp.fft.rfft(a).real, jnp.fft.fft2(a.astype(jnp.complex64)).imag),
            r(0, 6, 4, 8)),
    "irfft": (lambda a: jnp.fft.irfft(jnp.fft.rfft(a), n=8), r(0, 6, 8)),
    "cholesky": (lambda a: jnp.linalg.cholesky(a @ jnp.swapaxes(a, 1, 2) + 4 * jnp.eye(4)),
                 r(0, 6, 4, 4)),
    "triangular_solve": (lambda a, b: (
        lax.linalg.triangular_solve(jnp.tril(a) + 4 * jnp.eye(4), b, left_side=True, lower=True),
        lax.linalg.triangular_solve(jnp.triu(a) + 4 * jnp.eye(4), jnp.swapaxes(b, 1, 2),
                                    left_side=False, lower=False)), r(0, 6, 4, 4), r(1, 6, 4, 5)),
    "linalg_solve_grad": (lambda a, b: jax.grad(lambda a, b: jnp.sum(jnp.linalg.solve(
        a + 4 * jnp.eye(4), b) ** 2), (0, 1))(a, b), r(0, 6, 4, 4), r(1, 6, 4, 3)),
    "ragged_dot": (lambda x, w: lax.ragged_dot(x, w, jnp.array([3, 0, 5], jnp.int32)),
                   r(0, 8, 6), r(1, 3, 6, 4)),
    "ragged_dot_grads": (lambda x, w: jax.grad(lambda x, w: jnp.sum(lax.ragged_dot(
        x, w, jnp.array([3, 0, 5], jnp.int32)) ** 2), (0, 1))(x, w), r(0, 8, 6), r(1, 3, 6, 4)),
    "qr_eigh_svd": (lambda a: (jnp.linalg.qr(a)[1], jnp.linalg.eigvalsh(a + jnp.swapaxes(a, 1, 2)),
                               jnp.linalg.svd(a, compute_uv=False)), r(0, 6, 4, 4)),
    "one_hot": (lambda i: jax.nn.one_hot(i, 7), ints(0, 7, 6, 5)),
    "softmax_xent": (lambda z, y: jnp.mean(-jnp.sum(jax.nn.log_softmax(z) * jax.nn.one_hot(y, 5), -1)),
                     r(0, 6, 5), ints(1, 5, 6)),
    "layernorm_grad": (lambda x: jax.grad(lambda x: jnp.sum(
        ((x - x.mean(-1, keepdims=True)) * lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)) ** 2))(x),
        r(0, 6, 5)),
    "random_bits": (lambda k: jax.random.bits(jax.random.wrap_key_data(k, impl="threefry2x32"), (6, 5)),
                    jnp.array([0, 42], jnp.uint32)),
    "threefry": (lambda k, c: jax_random.threefry_2x32(k, c) * 3,
                 jnp.array([0, 42], jnp.uint32), jnp.arange(12, dtype=jnp.uint32)),
    "bitcast": (lambda a: lax.bitcast_convert_type(a, jnp.int32) + 1, r(0, 6, 5)),
    "tile": (lambda a: jnp.tile(a, (1, 3, 1)) * 2, r(0, 6, 1, 5)),
}


def _run_case(name):
    fn, *args = CASES[name]
    prog = trace(fn, *args)
    env = evaluate(prog, jax.tree.leaves(args))
    return prog, sum(check_eqn(e, env) for e in prog.eqns)


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_by_execution(name):
    prog, checked = _run_case(name)
    assert checked > 0, f"{name}: no shardable factor was exercised"
    unknown = sorted({e.name for e in prog.eqns if not rule_for(e).supported})
    assert not unknown, f"{name}: no rule for {unknown} (replicated fallback)"


def test_case_table_covers_the_registry_where_it_can():
    """Each registered primitive appears in some case (or is listed here with a reason)."""
    seen = set()
    for name in CASES:
        fn, *args = CASES[name]
        seen |= {e.name for e in trace(fn, *args).eqns}
    not_exercised = set(REGISTRY) - seen
    # Aliases, rare math and forward-compatible names are covered by shared rule functions.
    shared = {REGISTRY[p].rule for p in seen}
    orphans = sorted(p for p in not_exercised if REGISTRY[p].rule not in shared)
    allowed = {"scan", "while", "cond", "random_seed", "random_wrap",
               "random_unwrap", "random_split", "random_fold_in", "rng_bit_generator",
               "rng_uniform", "optimization_barrier", "device_put", "expand_dims",
               "select_and_gather_add",
               # a loop region's markers are never bound: test_ir and test_loops run them
               "loop_slice", "loop_carry", "loop_stack"}
    assert set(orphans) <= allowed, orphans


def test_split_sizes_uneven_with_zero():
    assert split_sizes(9, [5, 3, 1, 0]) == [5, 3, 1, 0]
    assert sum(split_sizes(7, [1, 0, 2, 4])) == 7 and split_sizes(7, [1, 0, 2, 4])[1] == 0


def test_a_wrong_rule_is_caught():
    """The harness is not vacuous: claiming a reduced dim is parallel must fail."""
    prog = trace(lambda a: a.sum(1), r(0, 6, 5))
    env = evaluate(prog, [r(0, 6, 5)])
    eqn = prog.eqns[0]
    bogus = Factor(5, "parallel", ((0, 1),), ((0, 0),))
    vals = [env[x] for x in eqn.inputs]
    with pytest.raises(AssertionError):
        check_factor(eqn, vals, [env[eqn.outputs[0]]], bogus, [2, 2, 1, 0])
    good = rule_for(eqn)
    assert any(f.kind == "reduction" for f in good.factors)


def test_contraction_rules_have_expected_kinds():
    prog = trace(lambda a, b: a @ b, r(0, 6, 5), r(1, 5, 7))
    rule: Rule = rule_for(prog.eqns[0])
    kinds = sorted((f.kind, f.size) for f in rule.factors)
    assert kinds == [("parallel", 6), ("parallel", 7), ("reduction", 5)]
    emb = trace(lambda e, i, g: jax.vjp(lambda e: e[i], e)[1](g)[0], r(0, 11, 4), ints(1, 11, 6, 5),
                r(2, 6, 5, 4))
    sc = [e for e in emb.eqns if e.name == "scatter-add"][0]
    kinds = sorted((f.kind, f.size) for f in rule_for(sc).factors)
    # batch of updates -> partial sum; feature dim parallel; vocab dim blocked
    assert ("reduction", 6) in kinds and ("reduction", 5) in kinds and ("parallel", 4) in kinds
    assert ("blocked", 11) in kinds
