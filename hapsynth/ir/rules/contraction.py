"""Contractions: `dot_general` and `conv_general_dilated`.

Batch and free dims are parallel; contracted dims (and a convolution's input
features) are sum-reductions, so sharding them yields a partial sum. Convolution
windows are blocked (a shard would need halo rows).
"""
from __future__ import annotations

import numpy as np

from hapsynth.ir.rules.registry import blk, par, prod, red, register, replicated, rule


def _dot_cost(eqn):
    (lc, _), _ = eqn.params["dimension_numbers"]
    k = prod([eqn.in_avals[0].shape[d] for d in lc])
    return 2.0 * eqn.out_avals[0].size * k, 0.0


@register("dot_general", cost=_dot_cost, contraction=True, partial="linear")
def dot_general(eqn):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ls, rs = eqn.in_avals[0].shape, eqn.in_avals[1].shape
    lfree = [d for d in range(len(ls)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rs)) if d not in rc and d not in rb]
    factors = [par(ls[l], [(0, l), (1, r)], [(0, k)]) for k, (l, r) in enumerate(zip(lb, rb))]
    k = len(lb)
    factors += [par(ls[l], [(0, l)], [(0, k + i)]) for i, l in enumerate(lfree)]
    k += len(lfree)
    factors += [par(rs[r], [(1, r)], [(0, k + i)]) for i, r in enumerate(rfree)]
    factors += [red(ls[l], [(0, l), (1, r)]) for l, r in zip(lc, rc)]
    return rule(*factors)


def _conv_specs(eqn):
    dn = eqn.params["dimension_numbers"]
    return dn.lhs_spec, dn.rhs_spec, dn.out_spec


def valid_taps(in_size, window, out_size, stride, pad_lo, lhs_dil, rhs_dil) -> int:
    """Count (output position, window tap) pairs that read a real input element.

    This is how XLA's cost analysis counts a convolution: taps landing in padding
    or in the holes of a dilated input do no work.
    """
    o = np.arange(out_size)[:, None]
    k = np.arange(window)[None, :]
    p = o * stride + k * rhs_dil - pad_lo
    ok = (p >= 0) & (p <= (in_size - 1) * lhs_dil) & (p % lhs_dil == 0)
    return int(ok.sum())


def _conv_cost(eqn):
    lhs_spec, rhs_spec, out_spec = _conv_specs(eqn)
    p = eqn.params
    ls, rs, os_ = eqn.in_avals[0].shape, eqn.in_avals[1].shape, eqn.out_avals[0].shape
    n_sp = len(lhs_spec) - 2
    lhs_dil = p.get("lhs_dilation") or (1,) * n_sp
    rhs_dil = p.get("rhs_dilation") or (1,) * n_sp
    taps = 1
    for s in range(n_sp):
        taps *= valid_taps(ls[lhs_spec[2 + s]], rs[rhs_spec[2 + s]], os_[out_spec[2 + s]],
                           p["window_strides"][s], p["padding"][s][0], lhs_dil[s], rhs_dil[s])
    in_feat = ls[lhs_spec[1]] // p["feature_group_count"]
    return 2.0 * os_[out_spec[0]] * os_[out_spec[1]] * in_feat * taps, 0.0


@register("conv_general_dilated", cost=_conv_cost, contraction=True, partial="linear")
def conv_general_dilated(eqn):
    """Batch and output features parallel, input features a sum (ungrouped convs only)."""
    lhs_spec, rhs_spec, out_spec = _conv_specs(eqn)
    ls, rs = eqn.in_avals[0].shape, eqn.in_avals[1].shape
    fgc, bgc = eqn.params["feature_group_count"], eqn.params["batch_group_count"]
    factors = []
    if bgc == 1:
        factors.append(par(ls[lhs_spec[0]], [(0, lhs_spec[0])], [(0, out_spec[0])]))
    if fgc == 1 and bgc == 1:
        factors.append(par(rs[rhs_spec[0]], [(1, rhs_spec[0])], [(0, out_spec[1])]))
        factors.append(red(ls[lhs_spec[1]], [(0, lhs_spec[1]), (1, rhs_spec[1])]))
    return rule(*factors)


def _ragged_parts(eqn):
    """(contracting pairs, batch pairs, lhs free dims, rhs free dims, the lhs ragged
    dim, the rhs group dims) of a `ragged_dot_general`."""
    dn = eqn.params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = dn.dot_dimension_numbers
    group = tuple(dn.rhs_group_dimensions)
    ls, rs = eqn.in_avals[0].shape, eqn.in_avals[1].shape
    lfree = [d for d in range(len(ls)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rs)) if d not in rc and d not in rb and d not in group]
    return list(zip(lc, rc)), list(zip(lb, rb)), lfree, rfree, dn.lhs_ragged_dimensions[0], group


def _ragged_cost(eqn):
    """Each lhs row meets one group's matrix: 2 flops per lhs element per rhs free
    element."""
    _, _, _, rfree, _, _ = _ragged_parts(eqn)
    rs = eqn.in_avals[1].shape
    return 2.0 * eqn.in_avals[0].size * prod([rs[d] for d in rfree]), 0.0


@register("ragged_dot_general", cost=_ragged_cost, contraction=True)
def ragged_dot_general(eqn):
    """A grouped matmul (`lax.ragged_dot`, mixture-of-experts layers): the lhs rows are
    cut into groups by `group_sizes`, so the ragged dim and the groups are whole; free
    dims are parallel, as in `dot_general`. Contracted dims are whole too: a partial sum
    would hold `group_sizes` on one device alone (zeros elsewhere). A ragged
    non-contracting dim (rows meet their group's rhs) lays the result out as
    `dot_general` does; a ragged contracting dim (a weight's gradient) puts the groups
    first."""
    pairs, batch, lfree, rfree, ragged, group = _ragged_parts(eqn)
    ls, rs = eqn.in_avals[0].shape, eqn.in_avals[1].shape
    if batch or (ragged in lfree) != bool(group):
        return replicated("ragged_dot_general: ragged batch dims, or batch dims")
    lead = 0 if group else 1  # the groups' result dim, for a ragged contracting dim
    factors = [blk(eqn.in_avals[2].shape[0], [(2, 0)] + [(1, d) for d in group],
                   [] if group else [(0, 0)])]
    factors += [(blk if l == ragged else par)(ls[l], [(0, l)], [(0, lead + i)])
                for i, l in enumerate(lfree)]
    factors += [par(rs[r], [(1, r)], [(0, lead + len(lfree) + i)]) for i, r in enumerate(rfree)]
    factors += [blk(ls[l], [(0, l), (1, r)]) for l, r in pairs]
    return rule(*factors)
