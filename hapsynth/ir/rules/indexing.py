"""Gather and scatter, described by their dimension numbers.

- index batch dims (one per looked-up index) are parallel between indices and result
  (gather) or indices and updates; for scatter-add they are a *sum* reduction (each
  device adds its own updates: a partial sum, the embedding-gradient pattern);
- explicit batching dims (`operand_batching_dims`, as in `take_along_axis`) are
  parallel across operand, indices and result: the batch stays sharded;
- window dims taken whole are parallel between operand and result/updates;
- dims indexed into are blocked (a shard would miss rows other devices own).
"""
from __future__ import annotations

from hapsynth.ir.rules.registry import blk, par, red, register, rule


def _gather_offset_map(dn, operand_ndim):
    """Operand dims that appear as offset (window) dims in the result, in order."""
    return [d for d in range(operand_ndim)
            if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]


def _gather_full_window(eqn):
    dn = eqn.params["dimension_numbers"]
    a = eqn.in_avals[0]
    return {d for d in _gather_offset_map(dn, a.ndim)
            if eqn.params["slice_sizes"][d] == a.shape[d] and d not in dn.start_index_map}


def _resize_gather(eqn, in_shapes, out_shapes):
    full = _gather_full_window(eqn)
    sizes = tuple(in_shapes[0][d] if d in full else s for d, s in enumerate(eqn.params["slice_sizes"]))
    return {**eqn.params, "slice_sizes": sizes}


@register("gather", resize=_resize_gather)
def gather(eqn):
    dn = eqn.params["dimension_numbers"]
    a, o = eqn.in_avals[0], eqn.out_avals[0]
    offset = _gather_offset_map(dn, a.ndim)
    full = _gather_full_window(eqn)
    factors = []
    for od, d in zip(dn.offset_dims, offset):
        factors.append((par if d in full else blk)(o.shape[od], [(0, d)], [(0, od)]))
    batch_out = [d for d in range(o.ndim) if d not in dn.offset_dims]
    for k, od in enumerate(batch_out):  # k-th index batch dim (index vector dim is last)
        pos = [(1, k)]
        if k in dn.start_indices_batching_dims:
            pos.append((0, dn.operand_batching_dims[dn.start_indices_batching_dims.index(k)]))
        factors.append(par(o.shape[od], pos, [(0, od)]))
    factors += [blk(a.shape[d], [(0, d)]) for d in dn.start_index_map if d in dn.collapsed_slice_dims]
    return rule(*factors)


_SCATTER_REDUCE = {"scatter-add": "sum", "scatter_add": "sum", "scatter-min": "min",
                   "scatter_min": "min", "scatter-max": "max", "scatter_max": "max"}


def _scatter_cost(eqn):
    return (0.0 if eqn.name == "scatter" else float(eqn.in_avals[2].size)), 0.0


@register("scatter-add", "scatter_add", "scatter-sub", "scatter_sub", "scatter-mul",
          "scatter_mul", "scatter-min", "scatter_min", "scatter-max", "scatter_max", "scatter",
          cost=_scatter_cost)
def scatter(eqn):
    """Operands (operand, indices, updates) -> result shaped like operand."""
    dn = eqn.params["dimension_numbers"]
    a, u = eqn.in_avals[0], eqn.in_avals[2]
    window = [d for d in range(a.ndim)
              if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
    factors = []
    for ud, d in zip(dn.update_window_dims, window):
        whole = u.shape[ud] == a.shape[d] and d not in dn.scatter_dims_to_operand_dims
        factors.append((par if whole else blk)(u.shape[ud], [(0, d), (2, ud)], [(0, d)]))
    scatter_dims = [d for d in range(u.ndim) if d not in dn.update_window_dims]
    monoid = _SCATTER_REDUCE.get(eqn.name)
    for k, ud in enumerate(scatter_dims):
        if k in dn.scatter_indices_batching_dims:
            od = dn.operand_batching_dims[dn.scatter_indices_batching_dims.index(k)]
            factors.append(par(u.shape[ud], [(0, od), (1, k), (2, ud)], [(0, od)]))
        elif monoid:
            factors.append(red(u.shape[ud], [(1, k), (2, ud)], [], monoid))
        else:  # overwrite / multiply: which update wins depends on all of them
            factors.append(blk(u.shape[ud], [(1, k), (2, ud)]))
    factors += [blk(a.shape[d], [(0, d)]) for d in dn.scatter_dims_to_operand_dims
                if d in dn.inserted_window_dims]
    return rule(*factors)
