"""Linear algebra and Fourier transforms: leading (batch) dims parallel, each matrix's or
transform's own dims whole, as XLA runs them one matrix or signal at a time.

Costs are the textbook flop counts (XLA's `cost_analysis()` gives none, or a nominal one,
for most of these).
"""
from __future__ import annotations

import math

from hapsynth.ir.rules.registry import blk, par, prod, register, rule


def batched(eqn, core: int = 2, free: tuple = ()):
    """The first `ndim - core` dims of operand 0 are batch dims, the leading dims of every
    operand and result; the rest are blocked. `free`: (operand dim, result dim) pairs of
    operand 1 that are parallel as well (a right-hand side's columns)."""
    nb = eqn.in_avals[0].ndim - core
    factors = [par(eqn.in_avals[0].shape[d],
                   [(i, d) for i, a in enumerate(eqn.in_avals) if a.ndim > d],
                   [(j, d) for j, a in enumerate(eqn.out_avals) if a.ndim > d])
               for d in range(nb)]
    factors += [par(eqn.in_avals[1].shape[d], [(1, d)], [(0, r)]) for d, r in free]
    factors += [blk(eqn.in_avals[0].shape[d], [(0, d)]) for d in range(nb, nb + core)]
    return rule(*factors)


def _matrices(eqn) -> tuple[int, int, int]:
    """(matrices in the batch, rows, columns) of operand 0."""
    a = eqn.in_avals[0]
    return prod(a.shape[:-2]), a.shape[-2], a.shape[-1]


def _cubic(scale: float):
    def cost(eqn):
        b, m, n = _matrices(eqn)
        return scale * b * m * n * min(m, n), 0.0
    return cost


register("cholesky", cost=_cubic(1 / 3))(batched)
register("lu", cost=_cubic(2 / 3))(batched)
register("qr", "geqrf", "householder_product", cost=_cubic(4 / 3))(batched)
register("eigh", cost=_cubic(9.0))(batched)
register("svd", cost=_cubic(12.0))(batched)


def _solve_cost(eqn):
    b, m, _ = _matrices(eqn)
    return float(b * m * m * eqn.in_avals[1].shape[-1 if eqn.params["left_side"] else -2]), 0.0


@register("triangular_solve", cost=_solve_cost)
def triangular_solve(eqn):
    """a [..., m, m], b [..., m, n] (left side; [..., n, m] else): b's n columns (rows)
    are solved apart."""
    d = eqn.in_avals[1].ndim - (1 if eqn.params["left_side"] else 2)
    return batched(eqn, free=((d, d),))


def _fft_cost(eqn):
    n = prod(eqn.params["fft_lengths"])
    size = max(eqn.in_avals[0].size, eqn.out_avals[0].size)
    return 8.0 * size * max(math.log2(max(n, 2)), 1.0), 0.0


@register("fft", cost=_fft_cost)
def fft(eqn):
    """The transform's trailing dims whole (a real transform's last differs in size)."""
    a, o = eqn.in_avals[0], eqn.out_avals[0]
    nb = a.ndim - len(eqn.params["fft_lengths"])
    return rule(*[par(a.shape[d], [(0, d)], [(0, d)]) for d in range(nb)],
                *[blk(a.shape[d], [(0, d)], [(0, d)] if o.shape[d] == a.shape[d] else [])
                  for d in range(nb, a.ndim)])
