"""Reductions, scans, sorts and windowed ops.

A reduced dim of `reduce_sum/max/min/...` is a reduction factor combining with the
same monoid; kept dims are parallel. Dims an op reorders along (sort, top_k,
cumulative ops, `argmax`'s reduced dim, non-trivial windows) are blocked.
"""
from __future__ import annotations

import math

from hapsynth.ir.rules.registry import aligned_dims, blk, par, red, register, rule

_MONOID = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "reduce_prod": "prod",
           "reduce_and": "and", "reduce_or": "or", "reduce_xor": "xor"}


def _reduced_minus_kept(eqn):
    return float(eqn.in_avals[0].size - eqn.out_avals[0].size)


def _kept_and_reduced(eqn, reduce_kind):
    a = eqn.in_avals[0]
    axes = {d % max(a.ndim, 1) for d in eqn.params["axes"]}
    factors, j = [], 0
    for d, n in enumerate(a.shape):
        if d in axes:
            factors.append(red(n, [(0, d)], [], reduce_kind) if reduce_kind else blk(n, [(0, d)]))
        else:
            factors.append(par(n, [(0, d)], [(r, j) for r in range(len(eqn.out_avals))]))
            j += 1
    return rule(*factors)


def _reduce(eqn):
    return _kept_and_reduced(eqn, _MONOID[eqn.name])


def _reduce_cost(eqn):
    return _reduced_minus_kept(eqn), 0.0


register("reduce_sum", cost=_reduce_cost, partial="unary")(_reduce)  # linear: carries a partial sum
register(*(p for p in _MONOID if p != "reduce_sum"), cost=_reduce_cost)(_reduce)


# XLA lowers argmax to a variadic (value, index) reduce: nine flops per step on CPU.
@register("argmax", "argmin", cost=lambda e: (9.0 * _reduced_minus_kept(e), 0.0))
def argmax(eqn):
    return _kept_and_reduced(eqn, None)


def _scan_cost(eqn):
    # XLA CPU lowers cumulative ops to a log-depth scan: about 2 flops per element per level.
    n = eqn.in_avals[0].shape[eqn.params["axis"]] if eqn.in_avals[0].ndim else 1
    return 2.0 * eqn.in_avals[0].size * max(math.ceil(math.log2(max(n, 2))), 1), 0.0


@register("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", cost=_scan_cost)
def cumulative(eqn):
    return rule(*aligned_dims(eqn, skip={eqn.params["axis"]}))


def _sort_cost(eqn):
    d = eqn.params["dimension"]
    n = eqn.in_avals[0].shape[d] if eqn.in_avals[0].ndim else 1
    return float(eqn.in_avals[0].size * max(math.ceil(math.log2(max(n, 2))), 1)), 0.0


@register("sort", cost=_sort_cost)
def sort(eqn):
    return rule(*aligned_dims(eqn, skip={eqn.params["dimension"]}))


@register("top_k")
def top_k(eqn):
    a = eqn.in_avals[0]
    axis = eqn.params.get("axis", a.ndim - 1) % a.ndim
    return rule(*[(blk if d == axis else par)(n, [(0, d)], [(0, d), (1, d)])
                  for d, n in enumerate(a.shape)])


def _trivial_window_dims(eqn, ndim):
    p = eqn.params
    dil = lambda key: p.get(key) or (1,) * ndim  # noqa: E731
    return {d for d in range(ndim)
            if p["window_dimensions"][d] == 1 and p["window_strides"][d] == 1
            and tuple(p["padding"][d]) == (0, 0) and dil("base_dilation")[d] == 1
            and dil("window_dilation")[d] == 1}


def _window_cost(eqn):
    w = math.prod(eqn.params["window_dimensions"])
    return float(eqn.out_avals[0].size * max(w - 1, 0)), 0.0


@register("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
          cost=_window_cost)
def reduce_window(eqn):
    nd = eqn.out_avals[0].ndim
    return rule(*aligned_dims(eqn, skip=set(range(nd)) - _trivial_window_dims(eqn, nd)))


def _select_scatter_cost(eqn):
    # XLA CPU: a compare-and-select chain over the window per source element plus the
    # scatter; fitted on max-pool gradients (2x2 windows: 31 flops per source element).
    w = math.prod(eqn.params["window_dimensions"])
    return float(eqn.in_avals[0].size * (7 * w + 3)), 0.0


@register("select_and_scatter_add", "select_and_gather_add", cost=_select_scatter_cost)
def select_and_scatter_add(eqn):
    nd = eqn.out_avals[0].ndim
    skip = set(range(nd)) - _trivial_window_dims(eqn, nd)
    return rule(*[(blk if d in skip else par)(n, [(0, d), (1, d)], [(0, d)])
                  for d, n in enumerate(eqn.out_avals[0].shape)])
