"""Cost model: compute time per device class, and the price of each layout conversion.

Pure functions of plain numbers and a :class:`~hapsynth.cluster.Cluster`; no JAX.
All times are in seconds, all sizes in bytes.

* **Compute** (:func:`compute_time`): a roofline per device class,
  ``max((flops + TRANSCENDENTAL_FLOPS * transcendentals) / class.flops,
  bytes / class.mem_bandwidth)``, or the sum of the two on device types in
  :data:`SERIAL_TYPES` (see there).  A transcendental is priced as
  :data:`TRANSCENDENTAL_FLOPS` = 4 flops: XLA's cost convention counts one
  elementwise FP op as one flop, and on the GPUs of interest the special function
  units deliver 16 exp/log/sin/rsqrt results per clock per SM against 64 FP32
  lane results (CUDA arithmetic-instruction throughput, compute capability 6.0 to
  8.0), i.e. one transcendental occupies about the time of four elementwise flops.
  Transcendentals mostly sit in memory-bound ops (softmax, GELU, norms), where the
  bytes term dominates anyway, so the constant rarely decides anything.
* **Conversions** (:func:`conversion_time`), priced by the α-β collectives of
  :mod:`hapsynth.synth.collectives`: ``S→R`` all-gather, ``P→R`` all-reduce, ``P→S``
  reduce-scatter, ``S(i)→S(j)`` and ``S(d)→S(d)`` with different sizes all-to-all;
  ``R→S`` (local slice), ``R→P`` (keep the value on one device, zeros elsewhere),
  ``S→P`` (each device keeps its rows, zeros elsewhere: the sum over devices is the
  full value) and identical layouts are free.
* Overlap of communication with compute is not modelled here; `timing.py` decides
  what may overlap.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from hapsynth.cluster import Cluster
from hapsynth.ir.graph import Cost
from hapsynth.ir.layout import Layout
from hapsynth.synth.collectives import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER,
                                        all_reduce_form, check_form, device_sizes, exchange_time,
                                        gather_form, largest_block, nonneg, reduce_scatter_form)

#: Flops charged per transcendental (exp, log, tanh, rsqrt, ...): see the module docstring.
TRANSCENDENTAL_FLOPS = 4.0

#: Device types that do not overlap an op's memory traffic with its arithmetic, priced at
#: the sum of the two terms: XLA's CPU runtime, one Eigen thread per device, streams a
#: matmul's operands in and out between its arithmetic. Measured, one core: [r, 4096] @
#: [4096, 4096] takes 16.5 / 26.2 / 85 ms at r = 32 / 64 / 256 against 9.8 / 19.5 / 78 ms
#: of arithmetic at its square-matmul peak, the 67 MB weight costing about the same
#: ~6.6 ms whatever r. GPUs hide one under the other (many warps in flight): the larger.
SERIAL_TYPES = frozenset({"CPU"})

# Free conversions returned by :func:`conversion_time` (collectives: see collectives.py).
NONE = "none"          # identical layouts
SLICE = "slice"        # R -> S: each device keeps its rows
MASK = "mask"          # R -> P: the value on one device, zeros elsewhere
ZERO_PAD = "zero_pad"  # S -> P: each device's rows in a zero tensor of the full shape


# --------------------------------------------------------------------------- compute


def compute_time(cost: Cost, device_class: Any, *,
                 transcendental_flops: float = TRANSCENDENTAL_FLOPS) -> float:
    """Roofline time of ``cost`` on one device of ``device_class``.

    ``max((flops + transcendental_flops * transcendentals) / device_class.flops,
    bytes / device_class.mem_bandwidth)`` (their sum if its ``type`` is in
    :data:`SERIAL_TYPES`); ``device_class`` is any object with ``flops`` (FLOP/s) and
    ``mem_bandwidth`` (bytes/s), e.g. a ``DeviceClass``.
    """
    flops = float(cost.flops) + transcendental_flops * float(cost.transcendentals)
    for name, v in (("flops", cost.flops), ("transcendentals", cost.transcendentals),
                    ("bytes", cost.bytes)):
        if not math.isfinite(float(v)) or v < 0:
            raise ValueError(f"cost.{name} must be finite and non-negative, got {v!r}")
    arithmetic = flops / device_class.flops
    memory = float(cost.bytes) / device_class.mem_bandwidth
    if getattr(device_class, "type", None) in SERIAL_TYPES:
        return arithmetic + memory
    return max(arithmetic, memory)


def class_compute_times(cluster: Cluster, costs: Cost | Sequence[Cost], *,
                        transcendental_flops: float = TRANSCENDENTAL_FLOPS) -> tuple[float, ...]:
    """:func:`compute_time` per class of ``cluster``.

    ``costs``: one :class:`Cost` for all classes, or one per class (the cost of that
    class's local share).  A node's time is the ``max`` of the result.
    """
    if isinstance(costs, Cost):
        costs = (costs,) * cluster.num_classes
    costs = tuple(costs)
    if len(costs) != cluster.num_classes:
        raise ValueError(f"expected {cluster.num_classes} costs (one per class), got {len(costs)}")
    return tuple(compute_time(c, k, transcendental_flops=transcendental_flops)
                 for c, k in zip(costs, cluster.classes))


# --------------------------------------------------------------------------- conversions


def _layout(layout: Any) -> Layout:
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a hapsynth Layout (R, P or S(dim, units)), "
                         f"got {layout!r}")
    return layout


def _shard_sizes(cluster: Cluster, sizes: Any, tensor_bytes: float, what: str) -> tuple[float, ...]:
    if sizes is None:
        raise ValueError(f"{what} are required for a sharded layout")
    s = device_sizes(cluster, sizes, what)
    total = sum(s)
    if abs(total - tensor_bytes) > 1e-6 * max(tensor_bytes, 1.0):
        raise ValueError(f"{what} sum to {total!r} bytes, but the tensor has {tensor_bytes!r}")
    return s


def conversion_time(cluster: Cluster, src: Any, dst: Any, tensor_bytes: float,
                    src_sizes: Sequence[float] | None = None,
                    dst_sizes: Sequence[float] | None = None, *,
                    form: str = "best", latency: bool = True) -> tuple[str, str | None, float]:
    """``(collective, form, seconds)`` to turn layout ``src`` into ``dst``.

    Layouts: :class:`~hapsynth.ir.layout.Layout` values.  ``src_sizes`` / ``dst_sizes``: the
    per-device bytes of a sharded ``src`` / ``dst`` (summing to ``tensor_bytes``;
    ignored otherwise).  ``form`` applies to all-gather and reduce-scatter
    (``"best"`` picks the cheaper).  ``latency=False`` prices bandwidth alone (collectives
    that a backend combines into one pay one latency for the group).  Returned
    collectives and forms:

    ==============  ==================  =====================
    src → dst       collective          form
    ==============  ==================  =====================
    same layout     ``none``            None
    S → R           ``all_gather``      padded / grouped
    P → R           ``all_reduce``      ``ring`` / ``tree``
    P → S           ``reduce_scatter``  padded / grouped
    S(i) → S(j)     ``all_to_all``      ``padded``
    S(d) → S(d)     ``all_to_all``      ``padded`` (new sizes)
    R → S           ``slice``           None (free)
    R → P           ``mask``            None (free)
    S → P           ``zero_pad``        None (free)
    ==============  ==================  =====================
    """
    s, d = _layout(src), _layout(dst)
    t = nonneg(tensor_bytes, "tensor_bytes")
    check_form(form)
    ss = _shard_sizes(cluster, src_sizes, t, "src_sizes") if s.sharded else None
    ds = _shard_sizes(cluster, dst_sizes, t, "dst_sizes") if d.sharded else None
    if s.sharded and d.sharded:
        if s.dim == d.dim and ss == ds:
            return NONE, None, 0.0
        b = largest_block(t, ss, ds, same_dim=(s.dim == d.dim))
        return ALL_TO_ALL, "padded", exchange_time(cluster, b, latency)
    if s == d:
        return NONE, None, 0.0
    if s.sharded:
        if d.replicated:
            f, sec = gather_form(cluster, ss, form, latency=latency)
            return ALL_GATHER, f, sec
        return ZERO_PAD, None, 0.0  # S -> P
    if s.partial:
        if d.replicated:
            return (ALL_REDUCE, *all_reduce_form(cluster, t, latency=latency))
        f, sec = reduce_scatter_form(cluster, ds, form, latency=latency)  # P -> S
        return REDUCE_SCATTER, f, sec
    # s is R
    if d.sharded:
        return SLICE, None, 0.0
    return MASK, None, 0.0  # R -> P


# --------------------------------------------------------------------------- memory


def bytes_per_device(total_bytes: float, layout: Any, sizes: Sequence[float] | None = None,
                     *, num_devices: int | None = None, padded: bool = False
                     ) -> tuple[float, ...]:
    """Bytes of a ``total_bytes`` tensor held by each device under ``layout``.

    ``R`` and ``P``: every device holds the whole tensor (the number of devices
    comes from ``sizes`` or ``num_devices``).  ``S``: device ``i`` holds
    ``total_bytes * sizes[i] / sum(sizes)``, so ``sizes`` may be bytes, fractions or
    row counts.  ``padded=True`` gives what the lowering actually stores: every
    device holds a buffer of the largest shard.
    """
    lay = _layout(layout)
    t = nonneg(total_bytes, "total_bytes")
    if sizes is not None:
        sz = tuple(nonneg(x, f"sizes[{i}]") for i, x in enumerate(sizes))
        if num_devices is not None and num_devices != len(sz):
            raise ValueError(f"num_devices={num_devices} but sizes has {len(sz)} entries")
    if not lay.sharded:
        if sizes is None:
            if num_devices is None:
                raise ValueError("give sizes or num_devices for an R or P layout")
            return (t,) * int(num_devices)
        return (t,) * len(sz)
    if sizes is None:
        raise ValueError("sizes are required for a sharded layout")
    total = sum(sz)
    if total == 0:
        if t == 0:
            return (0.0,) * len(sz)
        raise ValueError("sizes are all zero for a non-empty sharded tensor")
    out = tuple(t * x / total for x in sz)
    if padded:
        return (max(out),) * len(out)
    return out
