"""Elementwise primitives: every dim is a parallel factor shared by all operands.

Scalar (rank-0) operands such as literals hold no factor. Costs follow XLA:
one flop per element, transcendentals counted apart, `logistic` expanded on CPU
into exp + three flops.
"""
from __future__ import annotations

from hapsynth.ir.rules.registry import aligned_dims, elements, par, register, rule

ONE_FLOP = (
    "mul", "div", "rem", "max", "min", "abs", "sign",
    "floor", "ceil", "round", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor",
    "eq_to", "lt_to", "le_to",
    "clamp", "is_finite", "square", "shift_left",
    "shift_right_logical", "shift_right_arithmetic", "population_count", "clz", "real",
    "imag", "conj", "complex",
)  # and "add", "add_any", "sub", "neg", "convert_element_type", registered apart with their facts
TRANSCENDENTAL = (
    "exp", "log", "log1p", "expm1", "tanh", "sin", "cos", "tan", "asin", "acos",
    "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "atan2", "sqrt", "rsqrt", "cbrt",
    "pow", "erf", "igamma", "igammac", "bessel_i0e",
    "bessel_i1e", "polygamma", "zeta", "regularized_incomplete_beta", "random_gamma_grad",
)


def elementwise(eqn):
    return rule(*aligned_dims(eqn))


def _one_flop(eqn):
    return elements(eqn), 0.0


# Facts (see registry.py): a partial sum passes through sums and linear unary ops;
# casts and copies only move layout.
register("add", "add_any", "sub", cost=_one_flop, elementwise=True, partial="sum")(elementwise)
register("neg", cost=_one_flop, elementwise=True, partial="unary")(elementwise)
register("convert_element_type", "reduce_precision", cost=_one_flop, elementwise=True,
         layout_only=True, partial="unary")(elementwise)
register("copy", "copy_p", elementwise=True, layout_only=True, partial="unary")(elementwise)
register(*ONE_FLOP, "exp2", cost=_one_flop, elementwise=True)(elementwise)
register(*TRANSCENDENTAL, cost=lambda e: (0.0, elements(e)), elementwise=True)(elementwise)
register("stop_gradient", "sharding_constraint", elementwise=True)(elementwise)

# XLA expands these into polynomials before costing: (flops, transcendentals) per element,
# measured from `cost_analysis()` of one-primitive programs on XLA CPU.
POLYNOMIAL = {"erfc": (60, 1), "erf_inv": (37, 2), "lgamma": (52, 1), "digamma": (73, 1),
              "nextafter": (23, 0)}
for _name, (_f, _t) in POLYNOMIAL.items():
    register(_name, cost=lambda e, f=_f, t=_t: (f * elements(e), t * elements(e)),
             elementwise=True)(elementwise)
register("logistic", cost=lambda e: (3 * elements(e), elements(e)), elementwise=True)(elementwise)
register("select_n", cost=lambda e: ((len(e.inputs) - 2) * elements(e), 0.0),
         elementwise=True)(elementwise)


def _integer_pow_cost(eqn):
    y = abs(int(eqn.params["y"]))
    mults = max(y.bit_length() - 1, 0) + max(bin(y).count("1") - 1, 0)
    return (mults + (1 if eqn.params["y"] < 0 else 0)) * elements(eqn), 0.0


register("integer_pow", cost=_integer_pow_cost, elementwise=True)(elementwise)


@register("bitcast_convert_type")
def bitcast_convert_type(eqn):
    """Leading dims map one to one; a width change adds or drops only a minor dim."""
    a, o = eqn.in_avals[0], eqn.out_avals[0]
    return rule(*[par(a.shape[d], [(0, d)], [(0, d)]) for d in range(min(a.ndim, o.ndim))])


@register("threefry2x32", cost=lambda e: (47.0 * elements(e), 0.0))
def threefry2x32(eqn):
    """Counter-based hashing: each element depends only on its own counter."""
    return rule(*aligned_dims(eqn))


@register("optimization_barrier", "device_put", layout_only=True)
def optimization_barrier(eqn):
    """Identity on each operand: operand i dim d <-> result i dim d (it follows them)."""
    return rule(*[par(n, [(i, d)], [(i, d)]) for i, a in enumerate(eqn.in_avals)
                  for d, n in enumerate(a.shape)])
