"""Layout conversions between segments, inside the `shard_map` body, in the plan's forms.

Each runs outside any branch (collectives in divergent branches would deadlock) on
stored values (values.py): an S value is device i's rows padded to the largest shard.
`units` is the plan's `shard_units` (per-device units of each split); the geometry of a
tensor follows from its layout, its global shape and `units`.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from hapsynth.ir.layout import P, R, Layout
from hapsynth.lower.values import AXIS, Geometry

__all__ = ["convert", "all_to_all", "to_rows", "sum_together"]


def convert(v, src: Layout, dst: Layout, shape, units, form: str | None = None):
    """`v` stored in `src` -> stored in `dst`, with the collective form the plan chose
    ("padded" or "grouped" where the plan priced one; None: the default)."""
    if src == dst:
        return v
    idx = lax.axis_index(AXIS)
    if src.kind == "S" and dst.kind == "S" and src.dim != dst.dim:
        return all_to_all(v, src, dst, shape, units)
    if src.kind == "S" and dst.kind == "R" and form == "grouped":
        return lax.psum(convert(v, src, P, shape, units), AXIS)  # masked psum
    if src.kind == "P" and dst.kind == "S" and form == "padded":
        g = Geometry.of(dst, shape, units)
        blocks = to_rows(v, g, dst.dim, shape[dst.dim])
        return lax.psum_scatter(blocks, AXIS, scatter_dimension=dst.dim, tiled=True)
    if src.kind == "S" and dst.kind != "P":  # padded all-gather, then drop the padding
        g = Geometry.of(src, shape, units)
        full = lax.all_gather(v, AXIS, axis=src.dim, tiled=True)
        v = jnp.take(full, jnp.asarray(g.compact_index()), axis=src.dim)
        src = R
    if src.kind == "P" and dst.kind != "P":
        v, src = lax.psum(v, AXIS), R
    if src == dst:
        return v
    if src.kind == "R" and dst.kind == "S":
        g = Geometry.of(dst, shape, units)
        pad = [(0, 0)] * v.ndim
        pad[dst.dim] = (0, g.pad)
        off = jnp.asarray(g.offsets, jnp.int32)[idx]
        return lax.dynamic_slice_in_dim(jnp.pad(v, pad), off, g.pad, axis=dst.dim)
    if src.kind == "R" and dst.kind == "P":
        return jnp.where(idx == 0, v, jnp.zeros_like(v))
    if src.kind == "S" and dst.kind == "P":  # own rows in place, zeros elsewhere
        g = Geometry.of(src, shape, units)
        rows = jnp.asarray(g.rows, jnp.int32)[idx]
        keep = lax.broadcasted_iota(jnp.int32, v.shape, src.dim) < rows
        v = jnp.where(keep, v, jnp.zeros_like(v))
        full = [*shape]
        full[src.dim] = shape[src.dim] + g.pad
        z = lax.dynamic_update_slice_in_dim(jnp.zeros(full, v.dtype), v,
                                            jnp.asarray(g.offsets, jnp.int32)[idx], src.dim)
        return lax.slice_in_dim(z, 0, shape[src.dim], axis=src.dim)
    raise NotImplementedError(f"conversion {src} -> {dst}")


def all_to_all(v, src: Layout, dst: Layout, shape, units):
    """S(a) -> S(b): padded all-to-all; each device sends block j of its rows to j."""
    gs, gd = Geometry.of(src, shape, units), Geometry.of(dst, shape, units)
    blocks = to_rows(v, gd, dst.dim, shape[dst.dim])                 # b: k * M_dst
    moved = lax.all_to_all(blocks, AXIS, split_axis=dst.dim, concat_axis=src.dim,
                           tiled=True)                                # a: k * M_src
    return jnp.take(moved, jnp.asarray(gs.compact_index()), axis=src.dim)


def to_rows(v, geom: Geometry, dim: int, rows_full: int):
    """Lay the full `dim` out as k blocks of `geom.pad` rows (device i's rows, then zeros)."""
    k = len(geom.rows)
    idx = np.full((k, geom.pad), rows_full, np.int32)  # index rows_full = a zero row
    for i, (o, r) in enumerate(zip(geom.offsets, geom.rows)):
        idx[i, :r] = np.arange(o, o + r)
    pad = [(0, 0)] * v.ndim
    pad[dim] = (0, 1)
    return jnp.take(jnp.pad(v, pad), jnp.asarray(idx.reshape(-1)), axis=dim)


def sum_together(keys, env) -> dict:
    """P -> R for several tensors in one psum per dtype (flattened, concatenated): a
    backend may run a combined all-reduce buffer by buffer (gloo pays its latency per
    buffer), so the gradients of a step are summed as one bucket. `env[t]` is
    (value, layout); returns {key: summed value} for dtypes with two or more keys."""
    by_dtype: dict = {}
    for key in keys:
        by_dtype.setdefault(jnp.dtype(env[key[0]][0].dtype), []).append(key)
    out = {}
    for group in by_dtype.values():
        if len(group) < 2:
            continue
        vals = [env[k[0]][0] for k in group]
        total = lax.psum(jnp.concatenate([v.reshape(-1) for v in vals]), AXIS)
        at = 0
        for k, v in zip(group, vals):
            out[k] = total[at:at + v.size].reshape(v.shape)
            at += v.size
    return out
