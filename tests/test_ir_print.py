"""The IR prints readably: one pinned string per rule family, and ops, tensors, factors.

Letters name factors in factor order (`a` = factors[0], ...); a dim with no factor
prints `1` (size 1) or `_` (kept whole). See `hapsynth/ir/graph.py`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive

from hapsynth.ir import lift
from hapsynth.ir.graph import Factor, Rule
from hapsynth.ir.rules import rule_for
from hapsynth.ir.trace import trace


def f32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def i32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def printed(primitive, fn, *args) -> str:
    """The printed rule of the (only) `primitive` eqn of `fn(*args)`."""
    eqns = [e for e in trace(fn, *args).eqns if e.name == primitive]
    assert len(eqns) == 1, [e.name for e in trace(fn, *args).eqns]
    return str(rule_for(eqns[0]))


# ---- elementwise ----------------------------------------------------------------------

def test_elementwise_add():
    assert printed("add", lambda a, b: a + b, f32(4, 8), f32(4, 8)) == "([a,b],[a,b])->([a,b])"


def test_elementwise_with_a_scalar_literal():
    assert printed("mul", lambda a: a * 2.0, f32(4, 8)) == "([a,b],[])->([a,b])"


# ---- contraction ----------------------------------------------------------------------

def test_batched_matmul():
    assert printed("dot_general", lambda a, b: a @ b, f32(2, 6, 5), f32(2, 5, 7)) == \
        "([a,b,d],[a,d,c])->([a,b,c]) sum={d}"


def test_conv_nhwc():
    conv = lambda x, w: lax.conv_general_dilated(  # noqa: E731
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    assert printed("conv_general_dilated", conv, f32(5, 6, 6, 3), f32(3, 3, 3, 7)) == \
        "([a,_,_,c],[_,_,c,b])->([a,_,_,b]) sum={c}"


# ---- structural -----------------------------------------------------------------------

def test_reshape_merging_dims():
    assert printed("reshape", lambda a: a.reshape(30, 4), f32(6, 5, 4)) == "([a,_,b])->([a,b])"


def test_transpose():
    assert printed("transpose", lambda a: jnp.transpose(a, (2, 0, 1)), f32(6, 5, 4)) == \
        "([b,c,a])->([a,b,c])"


def test_broadcast_in_dim():
    assert printed("broadcast_in_dim", lambda a: jnp.broadcast_to(a, (3, 6, 4)), f32(6, 1)) == \
        "([b,1])->([a,b,c])"


# ---- reduction ------------------------------------------------------------------------

def test_reduce_sum_over_one_axis():
    assert printed("reduce_sum", lambda a: a.sum(1), f32(6, 5)) == "([a,b])->([a]) sum={b}"


def test_argmax_blocks_its_axis():
    assert printed("argmax", lambda a: jnp.argmax(a, 1), f32(6, 5)) == "([a,b])->([a]) blocked={b}"


# ---- indexing -------------------------------------------------------------------------

def test_embedding_gather():
    assert printed("gather", lambda e, i: e[i], f32(11, 4), i32(6, 5)) == \
        "([d,a],[b,c,1])->([b,c,a]) blocked={d}"


def test_embedding_scatter_add():
    grad = lambda e, i, g: jax.vjp(lambda e: e[i], e)[1](g)[0]  # noqa: E731
    assert printed("scatter-add", grad, f32(11, 4), i32(6, 5), f32(6, 5, 4)) == \
        "([d,a],[b,c,1],[b,c,a])->([_,a]) sum={b,c} blocked={d}"


# ---- opaque ---------------------------------------------------------------------------

def test_while_is_replicated_with_its_reason():
    def step(w, x):
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)),
                              (0, x))[1]

    assert printed("while", step, f32(8, 8), f32(8)) == \
        "replicated (control flow: planned as one opaque node with replicated operands)"


def test_a_scans_loop_markers_map_iteration_dims_onto_stacked_ones():
    def step(w, xs):
        return lax.scan(lambda c, x: (jnp.tanh(c @ w + x), c), jnp.zeros((4, 8)), xs)

    args = (f32(8, 8), f32(6, 4, 8))
    assert printed("loop_slice", step, *args) == "([a,b,c])->([b,c]) blocked={a}"
    assert printed("loop_carry", step, *args) == "([a,b],[a,b])->([a,b])"
    assert printed("loop_stack", step, *args) == "([a,b])->([_,a,b])"


def test_unknown_primitive_is_unsupported():
    mystery = Primitive("hapsynth_print_mystery")
    mystery.def_abstract_eval(lambda x: x)  # tracing needs no more
    assert printed("hapsynth_print_mystery", lambda x: mystery.bind(x * 2), f32(4, 3)) == "unsupported"


# ---- ops, tensors, factors ------------------------------------------------------------

def test_ops_tensors_and_factors_print_on_one_line():
    _, graph = lift(lambda a, b: (a @ b) * 2.0, f32(8, 6, 5), jax.ShapeDtypeStruct((5, 7), jnp.bfloat16))
    assert graph.describe() == "\n".join([
        "op 0 dot_general(t0, t1) -> t2  ([a,b,d],[d,c])->([a,b,c]) sum={d}",
        "op 1 mul(t2, lit) -> t3  ([a,b,c],[])->([a,b,c])",
        "  t0 f32[8,6,5]",
        "  t1 bf16[5,7]",
        "  t2 f32[8,6,7]",
        "  t3 f32[8,6,7]",
    ])
    assert graph.describe([1]).splitlines() == [
        "op 1 mul(t2, lit) -> t3  ([a,b,c],[])->([a,b,c])", "  t2 f32[8,6,7]", "  t3 f32[8,6,7]"]
    assert [repr(f) for f in graph.ops[0].rule.factors] == [
        "par:8 (0,0) -> (0,0)", "par:6 (0,1) -> (0,1)", "par:7 (1,1) -> (0,2)", "sum:5 (0,2),(1,0) -> -"]


def test_a_hand_built_rule_prints_without_shapes():
    rule = Rule((Factor(4, "parallel", ((0, 1),), ((0, 0),)), Factor(3, "blocked", ((0, 0),))))
    assert str(rule) == "([b,a])->([a]) blocked={b}"
    assert str(Rule((Factor(4, "parallel", ((0, 1),), ((0, 0),)),))) == "([?,a])->([a])"


def test_rules_of_equal_shapes_compare_equal():
    prog = trace(lambda a, b, c: (a + b, a + c), f32(4, 8), f32(4, 8), f32(1, 8))
    same, broadcast = (rule_for(e) for e in prog.eqns if e.name == "add")
    assert same == rule_for(trace(lambda a, b: a + b, f32(4, 8), f32(4, 8)).eqns[0])
    assert same != broadcast and str(broadcast) == "([a,b],[1,b])->([a,b])"
