"""Shape-moving primitives: broadcast, reshape, transpose, slicing, padding, concat.

They cost no flops; those that only move layout say so (`layout_only`). Those whose
params carry sizes (`broadcast_in_dim`, `reshape`, `iota`, `slice`, `dynamic_slice`)
get a `resize` that rewrites the params for a device's local shapes.
"""
from __future__ import annotations

import math

import numpy as np

from hapsynth.ir.rules.registry import aligned_dims, blk, par, register, rule


def _resize_shape(eqn, in_shapes, out_shapes):
    return {**eqn.params, "shape": tuple(out_shapes[0])}


@register("broadcast_in_dim", resize=_resize_shape, layout_only=True, partial="unary")
def broadcast_in_dim(eqn):
    """Operand dim i -> result dim bdims[i] when not size-1-broadcast; new dims result-only."""
    a, o = eqn.in_avals[0], eqn.out_avals[0]
    src = {r: i for i, r in enumerate(eqn.params["broadcast_dimensions"]) if a.shape[i] == o.shape[r]}
    return rule(*[par(n, [(0, src[d])] if d in src else [], [(0, d)]) for d, n in enumerate(o.shape)])


def reshape_groups(in_shape, out_shape):
    """Minimal groups (in dims, out dims) of non-unit dims whose products match."""
    if 0 in in_shape or 0 in out_shape:
        return []
    a = [d for d, n in enumerate(in_shape) if n != 1]
    b = [d for d, n in enumerate(out_shape) if n != 1]
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        gi, gj = [a[i]], [b[j]]
        pi, pj = in_shape[a[i]], out_shape[b[j]]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                gi.append(a[i]); pi *= in_shape[a[i]]; i += 1
            else:
                gj.append(b[j]); pj *= out_shape[b[j]]; j += 1
        groups.append((gi, gj))
    return groups


@register("reshape", resize=lambda e, i, o: {**e.params, "new_sizes": tuple(o[0])},
          layout_only=True, partial="unary")
def reshape(eqn):
    """Per merge/split group, the major dims share a factor of gcd size (Shardy-style)."""
    a, o = eqn.in_avals[0], eqn.out_avals[0]
    factors = []
    for gi, gj in reshape_groups(a.shape, o.shape):
        di, dj = gi[0], gj[0]
        factors.append(par(math.gcd(a.shape[di], o.shape[dj]), [(0, di)], [(0, dj)]))
    return rule(*factors)


@register("tile", layout_only=True)
def tile(eqn):
    """Dims repeated once are parallel; a tiled dim is blocked (each copy spans it all)."""
    reps = eqn.params["reps"]
    return rule(*[(par if r == 1 else blk)(eqn.out_avals[0].shape[d], [(0, d)] if r == 1 else [],
                                          [(0, d)]) for d, r in enumerate(reps)])


@register("transpose", layout_only=True, partial="unary")
def transpose(eqn):
    perm = eqn.params["permutation"]
    a = eqn.in_avals[0]
    return rule(*[par(a.shape[p], [(0, p)], [(0, d)]) for d, p in enumerate(perm)])


@register("squeeze", layout_only=True, partial="unary")
def squeeze(eqn):
    a = eqn.in_avals[0]
    gone = {d % a.ndim for d in eqn.params["dimensions"]}
    kept = [d for d in range(a.ndim) if d not in gone]
    return rule(*[par(a.shape[d], [(0, d)], [(0, j)]) for j, d in enumerate(kept)])


@register("expand_dims", layout_only=True)
def expand_dims(eqn):  # not a lax primitive today; kept for forward compatibility
    a, o = eqn.in_avals[0], eqn.out_avals[0]
    new = set(eqn.params["dimensions"])
    kept = [d for d in range(o.ndim) if d not in new]
    return rule(*[par(a.shape[i], [(0, i)], [(0, d)]) for i, d in enumerate(kept)])


@register("concatenate", partial="sum")
def concatenate(eqn):
    return rule(*aligned_dims(eqn, skip={eqn.params["dimension"]}))


@register("stack", partial="sum")
def stack(eqn):
    """A new result dim at `axis` (the result's alone); operand dim i is result dim i, or
    i + 1 from `axis` on, on every operand (`jnp.stack`, a primitive since JAX 0.10)."""
    axis = eqn.params["axis"]
    k = len(eqn.in_avals)
    return rule(*[par(n, [(j, i) for j in range(k)], [(0, i + (i >= axis))])
                  for i, n in enumerate(eqn.in_avals[0].shape)])


@register("unstack")
def unstack(eqn):
    """`stack`'s inverse (`jnp.unstack`, and `jnp.stack`'s transpose in a backward pass):
    operand dim `axis` is gone; the others are result dims i, or i - 1 past `axis`, on
    every result."""
    axis, k = eqn.params["axis"], len(eqn.out_avals)
    return rule(*[par(n, [(0, i)], [(j, i - (i > axis)) for j in range(k)])
                  for i, n in enumerate(eqn.in_avals[0].shape) if i != axis])


@register("split")
def split(eqn):
    return rule(*aligned_dims(eqn, skip={eqn.params["axis"]}))


@register("rev")
def rev(eqn):
    return rule(*aligned_dims(eqn, skip=set(eqn.params["dimensions"])))


def _zero_padding(eqn):
    """Padding a partial sum with zeros is linear (the transpose of a slice does it)."""
    value = eqn.inputs[1]
    return "unary" if hasattr(value, "value") and not np.any(np.asarray(value.value)) else None


@register("pad", partial=_zero_padding)
def pad(eqn):
    """Dims with no padding are parallel; the padding value is a scalar."""
    cfg = eqn.params["padding_config"]
    return rule(*aligned_dims(eqn, skip={d for d, c in enumerate(cfg) if tuple(c) != (0, 0, 0)},
                              operands=[0]))


def _full_slice_dims(eqn):
    a = eqn.in_avals[0]
    p = eqn.params
    strides = p["strides"] or (1,) * a.ndim
    return {d for d in range(a.ndim)
            if p["start_indices"][d] == 0 and p["limit_indices"][d] == a.shape[d] and strides[d] == 1}


def _resize_slice(eqn, in_shapes, out_shapes):
    full = _full_slice_dims(eqn)
    limits = tuple(in_shapes[0][d] if d in full else l
                   for d, l in enumerate(eqn.params["limit_indices"]))
    return {**eqn.params, "limit_indices": limits}


@register("slice", resize=_resize_slice, partial="unary")
def slice_(eqn):
    full = _full_slice_dims(eqn)
    return rule(*aligned_dims(eqn, skip=set(range(eqn.out_avals[0].ndim)) - full, operands=[0]))


def _full_dyn_dims(eqn):
    a = eqn.in_avals[0]
    return {d for d in range(a.ndim) if eqn.params["slice_sizes"][d] == a.shape[d]}


def _resize_dynamic_slice(eqn, in_shapes, out_shapes):
    full = _full_dyn_dims(eqn)
    sizes = tuple(in_shapes[0][d] if d in full else s for d, s in enumerate(eqn.params["slice_sizes"]))
    return {**eqn.params, "slice_sizes": sizes}


@register("dynamic_slice", resize=_resize_dynamic_slice)
def dynamic_slice(eqn):
    """Dims taken whole are parallel (their start index clamps to 0)."""
    full = _full_dyn_dims(eqn)
    return rule(*aligned_dims(eqn, skip=set(range(eqn.out_avals[0].ndim)) - full, operands=[0]))


@register("dynamic_update_slice")
def dynamic_update_slice(eqn):
    a, u = eqn.in_avals[0], eqn.in_avals[1]
    full = {d for d in range(a.ndim) if u.shape[d] == a.shape[d]}
    return rule(*aligned_dims(eqn, skip=set(range(a.ndim)) - full, operands=[0, 1]))


@register("iota", resize=_resize_shape, layout_only=True)
def iota(eqn):
    """Dims other than the counting one are parallel; the counting one is blocked."""
    o = eqn.out_avals[0]
    d0 = eqn.params["dimension"]
    return rule(*[(blk if d == d0 else par)(n, [], [(0, d)]) for d, n in enumerate(o.shape)])
