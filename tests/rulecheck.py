"""Prove sharding rules by execution: split a factor, run locally, combine, compare.

For a factor of size n split into per-device chunks (uneven, zeros allowed):
- operands holding the factor get their chunk of rows (chunk * dim/n rows);
- under a sum-reduction, operands not holding it are partial sums: the whole value
  on device 0, zeros elsewhere; otherwise they are replicated;
- results of a parallel factor are concatenated along the mapped dims; results of
  a reduction factor are combined with its monoid.
"""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from hapsynth.ir.graph import PARALLEL, REDUCTION
from hapsynth.ir.rules import evaluate_block, rule_for
from hapsynth.ir.trace import value_of

COMBINE = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply,
           "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}  # bool: logical


def split_sizes(n: int, weights) -> list[int]:
    """Largest-remainder split of n into parts proportional to weights."""
    w = np.asarray(weights, float)
    raw = n * w / w.sum()
    base = np.floor(raw).astype(int)
    for i in np.argsort(-(raw - base), kind="stable")[: n - base.sum()]:
        base[i] += 1
    return [int(b) for b in base]


def _chunk(x, dim, start, stop):
    idx = [slice(None)] * x.ndim
    idx[dim] = slice(start, stop)
    return x[tuple(idx)]


def check_factor(eqn, vals, full_outs, factor, sizes, rtol=2e-5, atol=2e-5):
    """Run eqn on per-device shards of `factor` and compare with the full results."""
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    per_dev = []
    for dev, c in enumerate(sizes):
        lo = int(offsets[dev])
        ins = []
        for i, v in enumerate(vals):
            dims = [d for (o, d) in factor.operands if o == i]
            if dims:
                for d in dims:
                    s = v.shape[d] // factor.size
                    v = _chunk(v, d, lo * s, (lo + c) * s)
            elif factor.kind == REDUCTION and factor.reduce == "sum" and dev > 0:
                v = jnp.zeros_like(v)  # a partial sum: the whole value lives on device 0
            ins.append(v)
        out_shapes = []
        for j, a in enumerate(eqn.out_avals):
            shape = list(a.shape)
            for (r, d) in factor.results:
                if r == j:
                    shape[d] = c * (a.shape[d] // factor.size)
            out_shapes.append(shape)
        starts = [[lo * (a.shape[d] // factor.size) if (j, d) in factor.results else 0
                   for d in range(len(a.shape))] for j, a in enumerate(eqn.out_avals)]
        outs = evaluate_block(eqn, ins, out_shapes, lambda: starts)
        for o, shape in zip(outs, out_shapes):
            assert tuple(o.shape) == tuple(shape), (eqn.name, factor, o.shape, shape)
        per_dev.append([np.asarray(o) for o in outs])
    for j, full in enumerate(full_outs):
        parts = [p[j] for p in per_dev]
        dims = [d for (r, d) in factor.results if r == j]
        if factor.kind == PARALLEL and dims:
            got = np.concatenate(parts, axis=dims[0])
        elif factor.kind == REDUCTION:
            got = parts[0]
            for p in parts[1:]:
                got = COMBINE[factor.reduce](got, p)
        else:
            for p in parts:
                _compare(eqn, factor, p, full, rtol, atol)
            continue
        _compare(eqn, factor, got, full, rtol, atol)


def _compare(eqn, factor, got, full, rtol, atol):
    full = np.asarray(full)
    assert got.shape == full.shape, (eqn.name, factor, got.shape, full.shape)
    if np.issubdtype(full.dtype, np.floating):
        np.testing.assert_allclose(got, full, rtol=rtol, atol=atol,
                                   err_msg=f"{eqn.name} factor {factor}")
    else:
        np.testing.assert_array_equal(got, full, err_msg=f"{eqn.name} factor {factor}")


SPLITS = ([5, 3, 1, 0], [1, 0, 2, 4])


def check_eqn(eqn, env, splits=SPLITS) -> int:
    """Check every shardable factor of eqn under each split; returns factors checked."""
    vals = [value_of(env, x) for x in eqn.inputs]
    vals = [jnp.asarray(v) for v in vals]
    full = [env[t] for t in eqn.outputs]
    r = rule_for(eqn)
    n = 0
    for fi in r.shardable():
        f = r.factors[fi]
        for w in splits:
            check_factor(eqn, vals, full, f, split_sizes(f.size, w))
        n += 1
    return n
