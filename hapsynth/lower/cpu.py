"""XLA CPU kernel workarounds for ops bound inside a `shard_map` body, with their reasons.

Inside a `shard_map` body XLA CPU does not rewrite two patterns its own partitioner
would, and each falls off the fast library kernels; both were found by profiling the
`shard_map` program against `jit` + `NamedSharding` on the same plan. The fixes are a
swapped dot operands and explicit transposes, so they are applied on every backend.
"""
from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
from jax import lax

from hapsynth import _jax

__all__ = ["keep_dot", "bind", "canonical_conv"]


def keep_dot(ops: Sequence) -> set[int]:
    """Ids of the dots whose result is transposed next (the weight gradients of a
    backward pass). XLA would fold the transpose into the dot, and on CPU the folded dot
    misses the fast matmul library (measured 1.6x slower); `bind` computes these dots
    with their operands swapped, which makes the transposed result directly, so the
    transpose that follows cancels."""
    readers: dict = {}
    for op in ops:
        for x in op.inputs:
            if isinstance(x, int):
                readers.setdefault(x, set()).add(op.primitive.name)
    return {i for i, op in enumerate(ops)
            if op.primitive.name == "dot_general"
            and any("transpose" in readers.get(t, ()) for t in op.outputs)}


def bind(primitive, vals, params, swap: bool = False) -> list:
    """Bind one op; a list of its results. Convolutions go through `canonical_conv`;
    `swap` (a dot of `keep_dot`) binds it by `swapped_dot`."""
    if primitive.name == "conv_general_dilated":
        return [canonical_conv(primitive, vals, params)]
    if swap:
        return [swapped_dot(primitive, vals, params)]
    outs = _jax.bind(primitive, vals, params)
    return list(outs) if primitive.multiple_results else [outs]


def swapped_dot(primitive, vals, params):
    """`dot_general(a, b)` as the transpose of `dot_general(b, a)`. Its reader transposes
    it back, and XLA cancels the two, leaving a plain library dot in row order. Before,
    an optimization barrier kept the dot from the transpose: XLA then gave the transpose
    to the dot's consumers as a layout, and a per-class branch returned the weight
    gradients transposed, copied back in row order outside (the paper MLP: 414 ms against
    62 ms for three 4096x4096 gradients on one core)."""
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    prec = params.get("precision")
    swapped = {**params, "dimension_numbers": ((rc, lc), (rb, lb)),
               "precision": tuple(reversed(prec)) if isinstance(prec, tuple) else prec}
    y = _jax.bind(primitive, [vals[1], vals[0]], swapped)
    nb = len(lb)
    nl, nr = vals[0].ndim - nb - len(lc), vals[1].ndim - nb - len(rc)
    return jnp.transpose(y, (*range(nb), *range(nb + nr, nb + nr + nl), *range(nb, nb + nr)))


def canonical_conv(primitive, vals, params):
    """A convolution bound in the layout XLA's CPU library kernels take (batch, spatial,
    feature; spatial, in, out), with explicit transposes around it. Backward passes
    emit convolutions in other layouts; XLA's own partitioner canonicalises them, but
    inside a `shard_map` body they reach the naive loop emitter (measured 28x slower
    on vgg-small). Barriers keep XLA from folding the transposes back in."""
    dn = params["dimension_numbers"]
    lhs, rhs, out = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    n = len(lhs)
    nhwc = (0, n - 1, *range(1, n - 1))
    hwio = (n - 1, n - 2, *range(n - 2))
    if tuple(lhs) == nhwc and tuple(rhs) == hwio and tuple(out) == nhwc:
        return _jax.bind(primitive, vals, params)
    x = jnp.transpose(vals[0], (lhs[0], *lhs[2:], lhs[1]))
    w = jnp.transpose(vals[1], (*rhs[2:], rhs[1], rhs[0]))
    x, w = lax.optimization_barrier((x, w))
    y = _jax.bind(primitive, [x, w], {**params, "dimension_numbers": type(dn)(
        lhs_spec=nhwc, rhs_spec=hwio, out_spec=nhwc)})
    y = lax.optimization_barrier(y)
    axes = [0] * n
    axes[out[0]], axes[out[1]] = 0, n - 1
    for i, d in enumerate(out[2:]):
        axes[d] = 1 + i
    return jnp.transpose(y, axes)
