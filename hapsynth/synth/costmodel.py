"""Cost model: compute time per device class and α-β prices of the layout conversions.

Pure functions of plain numbers and a :class:`~hapsynth.synth.cluster.Cluster`;
no JAX.  All times are in seconds, all sizes in bytes.

Model
-----
* **Compute** (:func:`compute_time`): a roofline per device class,
  ``max((flops + TRANSCENDENTAL_FLOPS * transcendentals) / class.flops,
  bytes / class.mem_bandwidth)``.  A transcendental is priced as
  :data:`TRANSCENDENTAL_FLOPS` = 4 flops: XLA's cost convention counts one
  elementwise FP op as one flop, and on the GPUs of interest the special function
  units deliver 16 exp/log/sin/rsqrt results per clock per SM against 64 FP32
  lane results (CUDA arithmetic-instruction throughput, compute capability 6.0 to
  8.0), i.e. one transcendental occupies about the time of four elementwise flops.
  Transcendentals mostly sit in memory-bound ops (softmax, GELU, norms), where the
  bytes term dominates anyway, so the constant rarely decides anything.
* **Links** (α-β): a message of ``n`` bytes over a :class:`LinkLevel` costs
  ``alpha + n / beta``.
* **Collectives** run over the 1-D mesh of all devices of the cluster, in device
  index order.  ``k`` = number of participating devices; with ``k == 1`` (or
  when a collective moves no bytes: it is not emitted) everything costs 0.

  - *Ring* (all-reduce, all-gather, reduce-scatter): device ``i`` sends to
    ``i+1 mod k``.  All ring links are busy in every step, so a step takes the
    time of the slowest link the ring uses — as soon as one neighbour pair
    crosses hosts the step is bounded by the inter-host level ("bottleneck
    link").  "Slowest" means the largest ``alpha + n / beta`` for the step's
    message, so a high-latency level wins for tiny messages.
  - ``all_reduce(n)`` = reduce-scatter + all-gather: ``2(k-1)`` steps of ``n/k``
    bytes: ``2(k-1) * (alpha + n/k / beta)``.
  - *Uneven shards* (DESIGN.md "Uneven shards in JAX"): a sharded tensor is
    stored padded to ``M = max(sizes)`` per device.  Two forms per collective:

    ``padded``  the native collective on the padded buffers:
                all-gather / reduce-scatter = ``(k-1) * (alpha + M / beta)``.
    ``grouped`` exact sizes.  ``pbroadcast`` (one broadcast per owner) has no CPU
                lowering, so the lowering emits a **masked psum**: every device
                writes its rows into a zeroed buffer of ``sum(sizes)`` bytes
                (resp. holds its partial sum of all ``sum(sizes)`` bytes) and
                the buffer is all-reduced; a reduce-scatter then slices locally.
                Both cost ``all_reduce(sum(sizes))`` — about twice the bytes of
                an even all-gather, but no padding.

    ``best`` takes the cheaper (ties: ``padded``).  With ``S = sum(sizes)`` the
    grouped form wins when ``M > alpha*beta + 2S/k``: only for skewed sizes *and*
    messages well above the latency-bandwidth product.
  - *All-to-all* (pairwise exchange, padded): ``k-1`` steps; in step ``s``
    device ``i`` sends one block to ``i+s mod k``.  Every block is padded to the
    largest off-diagonal block ``B`` (the self block stays local).  A step takes
    the time of the slowest link used in that step, so the total is
    ``sum_s max_{links of step s} (alpha + B / beta)``; for the presets (hosts are
    contiguous device ranges) every step crosses hosts when there are several,
    which gives ``(k-1) * (alpha + B / beta_bottleneck)``.
* **Conversions** (:func:`conversion_time`) follow the table in DESIGN.md:
  ``S→R`` all-gather, ``P→R`` all-reduce, ``P→S`` reduce-scatter, ``S(i)→S(j)``
  and ``S(d)→S(d)`` with different sizes all-to-all; ``R→S`` (local slice),
  ``R→P`` (keep the value on one device, zeros elsewhere), ``S→P`` (each device
  keeps its rows, zeros elsewhere: the sum over devices is the full value) and
  identical layouts are free.

Known limitations
-----------------
* No contention: concurrent collectives (or a collective and compute sharing
  memory bandwidth) are priced as if each had the links to itself.
* Ring and pairwise exchange only: no hierarchical (intra-host reduce, then
  inter-host), tree, or double-binary-tree algorithms, which NCCL may choose and
  which are cheaper on multi-host clusters for latency-bound messages.
* One bandwidth per level: all inter-host pairs are equal, no NIC sharing among
  the devices of a host (8 GPUs sending at once over one NIC get ``beta`` each).
* Overlap of communication with compute is not modelled here; the synthesizer
  decides what may overlap.

Worked example
--------------
BERT-base fp32 gradients, ``110e6 * 4 = 440e6`` bytes, all-reduced over HAP's
cluster ``Cluster.load("hap-v100x16-p100x48")`` (64 devices, 8 hosts; the ring
crosses hosts, so the bottleneck is the 10.4 Gbps = 1.3e9 B/s, 20 µs level)::

    2 * 63 * (20e-6 + 440e6 / 64 / 1.3e9) = 126 * 5.308e-3 s ≈ 0.669 s

which is the "~0.6 s" of DESIGN.md (``all_reduce(cluster, 440e6)``).
"""
from __future__ import annotations

import numpy as np

import math
import numbers
from collections import Counter
from functools import lru_cache
from typing import Any, Iterable, Sequence

from ..ir.graph import Cost
from .cluster import Cluster, LinkLevel

__all__ = [
    "TRANSCENDENTAL_FLOPS",
    "FORMS",
    "compute_time",
    "class_compute_times",
    "ring_links",
    "ring_step_time",
    "all_reduce",
    "all_gather",
    "gather_form",
    "reduce_scatter",
    "reduce_scatter_form",
    "all_to_all",
    "all_to_all_blocks",
    "parse_layout",
    "conversion_time",
    "bytes_per_device",
]

#: Flops charged per transcendental (exp, log, tanh, rsqrt, ...): see the module docstring.
TRANSCENDENTAL_FLOPS = 4.0

#: Forms accepted by the sized collectives.
FORMS = ("padded", "grouped", "best")

# Collective names returned by :func:`conversion_time`.
ALL_GATHER = "all_gather"
ALL_REDUCE = "all_reduce"
REDUCE_SCATTER = "reduce_scatter"
ALL_TO_ALL = "all_to_all"
NONE = "none"          # identical layouts
SLICE = "slice"        # R -> S: each device keeps its rows
MASK = "mask"          # R -> P: the value on one device, zeros elsewhere
ZERO_PAD = "zero_pad"  # S -> P: each device's rows in a zero tensor of the full shape


# --------------------------------------------------------------------------- compute


def compute_time(cost: Cost, device_class: Any, *,
                 transcendental_flops: float = TRANSCENDENTAL_FLOPS) -> float:
    """Roofline time of ``cost`` on one device of ``device_class``.

    ``max((flops + transcendental_flops * transcendentals) / device_class.flops,
    bytes / device_class.mem_bandwidth)``; ``device_class`` is any object with
    ``flops`` (FLOP/s) and ``mem_bandwidth`` (bytes/s), e.g. a ``DeviceClass``.
    """
    flops = float(cost.flops) + transcendental_flops * float(cost.transcendentals)
    for name, v in (("flops", cost.flops), ("transcendentals", cost.transcendentals),
                    ("bytes", cost.bytes)):
        if not math.isfinite(float(v)) or v < 0:
            raise ValueError(f"cost.{name} must be finite and non-negative, got {v!r}")
    return max(flops / device_class.flops, float(cost.bytes) / device_class.mem_bandwidth)


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


# --------------------------------------------------------------------------- links


def _devices(cluster: Cluster, devices: Iterable[int] | None) -> tuple[int, ...]:
    if devices is None:
        return tuple(range(cluster.num_devices))
    out = tuple(devices)
    for d in out:
        cluster.host_of(d)  # validates the index
    if len(set(out)) != len(out):
        raise ValueError(f"devices must be distinct, got {out!r}")
    return out


@lru_cache(maxsize=128)
def _ring_levels(cluster: Cluster, devices: tuple[int, ...]) -> tuple[LinkLevel, ...]:
    k = len(devices)
    if k < 2:
        return ()
    used = {cluster.link_between(devices[i], devices[(i + 1) % k]) for i in range(k)}
    return tuple(l for l in cluster.links if l in used)


@lru_cache(maxsize=128)
def _exchange_steps(cluster: Cluster,
                    devices: tuple[int, ...]) -> tuple[tuple[tuple[LinkLevel, ...], int], ...]:
    """Pairwise exchange: (levels used in a step, number of such steps)."""
    k = len(devices)
    hosts = [cluster.host_of(d) for d in devices]
    steps: Counter = Counter()
    for s in range(1, k):
        same = cross = False
        for i in range(k):
            if hosts[i] == hosts[(i + s) % k]:
                same = True
            else:
                cross = True
        levels = tuple(l for l, u in zip(cluster.links, (same, cross)) if u)
        steps[levels] += 1
    return tuple(steps.items())


def ring_links(cluster: Cluster, devices: Iterable[int] | None = None) -> tuple[LinkLevel, ...]:
    """The link levels used by the ring over ``devices`` (default: all, in index order)."""
    return _ring_levels(cluster, _devices(cluster, devices))


def _step(levels: Sequence[LinkLevel], nbytes: float) -> float:
    return max(l.time(nbytes) for l in levels) if levels else 0.0


def ring_step_time(cluster: Cluster, nbytes: float,
                   devices: Iterable[int] | None = None) -> float:
    """Time of one ring step moving ``nbytes`` per device: the slowest link used."""
    return _step(ring_links(cluster, devices), _nonneg(nbytes, "nbytes"))


# --------------------------------------------------------------------------- validation


def _nonneg(x: Any, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{what} must be a number of bytes, got {x!r}")
    x = float(x)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{what} must be finite and non-negative, got {x!r}")
    return x


def _sizes(cluster: Cluster, sizes: Sequence[Any], what: str = "sizes") -> tuple[float, ...]:
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
        raise TypeError(f"{what} must be a sequence of per-device bytes, got {sizes!r}")
    out = tuple(_nonneg(s, f"{what}[{i}]") for i, s in enumerate(sizes))
    if len(out) != cluster.num_devices:
        raise ValueError(f"{what} has {len(out)} entries; cluster {cluster.name!r} has "
                         f"{cluster.num_devices} devices")
    return out


def _form(form: str) -> str:
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    return form


# --------------------------------------------------------------------------- collectives


def all_reduce(cluster: Cluster, nbytes: float, devices: Iterable[int] | None = None) -> float:
    """Ring all-reduce of ``nbytes`` over ``devices`` (default: all):
    ``2(k-1) * (alpha + nbytes/k / beta)`` on the slowest link of the ring."""
    devs = _devices(cluster, devices)
    n = _nonneg(nbytes, "nbytes")
    k = len(devs)
    if k < 2 or n == 0:
        return 0.0
    return 2 * (k - 1) * _step(_ring_levels(cluster, devs), n / k)


def _padded_ring(cluster: Cluster, sizes: tuple[float, ...]) -> float:
    k, m = len(sizes), max(sizes)
    if k < 2 or m == 0:
        return 0.0
    return (k - 1) * _step(_ring_levels(cluster, _devices(cluster, None)), m)


def all_gather(cluster: Cluster, sizes: Sequence[float], form: str = "best") -> float:
    """All-gather of shards of ``sizes`` bytes (one per device, zeros allowed).

    ``padded``: ``(k-1) * (alpha + max(sizes)/beta)``; ``grouped``: masked psum,
    ``all_reduce(sum(sizes))``; ``best``: the cheaper.
    """
    return gather_form(cluster, sizes, form)[1]


def gather_form(cluster: Cluster, sizes: Sequence[float],
                form: str = "best") -> tuple[str, float]:
    """``(form, seconds)`` of the all-gather; ``form="best"`` picks the cheaper
    (``"padded"`` on ties)."""
    s = _sizes(cluster, sizes)
    return _choose(_form(form), _padded_ring(cluster, s), all_reduce(cluster, sum(s)))


def reduce_scatter(cluster: Cluster, sizes: Sequence[float], form: str = "best") -> float:
    """Reduce-scatter of a partial sum into shards of ``sizes`` bytes.

    ``padded``: the partial sum is ``k*max(sizes)`` bytes, ``(k-1) * (alpha +
    max(sizes)/beta)``; ``grouped``: all-reduce of ``sum(sizes)`` then a local
    slice; ``best``: the cheaper.
    """
    return reduce_scatter_form(cluster, sizes, form)[1]


def reduce_scatter_form(cluster: Cluster, sizes: Sequence[float],
                        form: str = "best") -> tuple[str, float]:
    """``(form, seconds)`` of the reduce-scatter (ties: ``"padded"``)."""
    s = _sizes(cluster, sizes)
    return _choose(_form(form), _padded_ring(cluster, s), all_reduce(cluster, sum(s)))


def _choose(form: str, padded: float, grouped: float) -> tuple[str, float]:
    if form == "padded":
        return "padded", padded
    if form == "grouped":
        return "grouped", grouped
    return ("padded", padded) if padded <= grouped else ("grouped", grouped)


def all_to_all(cluster: Cluster, send: Sequence[Any]) -> float:
    """Padded pairwise-exchange all-to-all.

    ``send``: a ``k×k`` matrix, ``send[i][j]`` = bytes device ``i`` sends to ``j``;
    or a length-``k`` sequence, ``send[i]`` = bytes device ``i`` sends to *each*
    other device.  Blocks are padded to the largest off-diagonal block ``B``; step
    ``s`` (``s = 1..k-1``, device ``i`` → ``i+s mod k``) costs
    ``max(alpha + B/beta)`` over the link levels it uses.
    """
    k = cluster.num_devices
    if isinstance(send, (str, bytes)) or not isinstance(send, Iterable):
        raise TypeError(f"send must be a k×k matrix or a length-k sequence, got {send!r}")
    rows = list(send)
    if len(rows) != k:
        raise ValueError(f"send has {len(rows)} rows; cluster {cluster.name!r} has {k} devices")
    if k < 2:
        return 0.0
    if all(isinstance(r, numbers.Real) and not isinstance(r, bool) for r in rows):
        b = max(_nonneg(r, f"send[{i}]") for i, r in enumerate(rows))
    else:
        b = 0.0
        for i, r in enumerate(rows):
            if isinstance(r, (str, bytes)) or not isinstance(r, Iterable):
                raise TypeError(f"send[{i}] must be a row of {k} byte counts, got {r!r}")
            r = list(r)
            if len(r) != k:
                raise ValueError(f"send[{i}] has {len(r)} entries, expected {k}")
            for j, x in enumerate(r):
                x = _nonneg(x, f"send[{i}][{j}]")
                if i != j:
                    b = max(b, x)
    return _exchange_time(cluster, b)


def _exchange_time(cluster: Cluster, block: float) -> float:
    """Pairwise exchange of blocks of `block` bytes over all devices."""
    if cluster.num_devices < 2 or block == 0:
        return 0.0
    return sum(n * _step(levels, block)
               for levels, n in _exchange_steps(cluster, _devices(cluster, None)))


def _largest_block(t: float, src, dst, same_dim: bool) -> float:
    """Largest off-diagonal entry of `all_to_all_blocks(t, src, dst, same_dim)` (numpy)."""
    src, dst = np.asarray(src, float), np.asarray(dst, float)
    if t == 0 or len(src) < 2:
        return 0.0
    if same_dim:
        a_hi, b_hi = np.cumsum(src), np.cumsum(dst)
        m = np.minimum(a_hi[:, None], b_hi[None, :]) - np.maximum((a_hi - src)[:, None],
                                                                  (b_hi - dst)[None, :])
        m = np.maximum(m, 0.0)
    else:
        m = np.outer(src, dst) / t
    np.fill_diagonal(m, 0.0)
    return float(m.max())


def all_to_all_blocks(tensor_bytes: float, src_sizes: Sequence[float],
                      dst_sizes: Sequence[float], same_dim: bool) -> list[list[float]]:
    """The ``k×k`` send matrix of a resharding of a ``tensor_bytes`` tensor.

    ``same_dim=False`` (``S(i)→S(j)``, ``i≠j``): device ``a`` holds a fraction
    ``src[a]/T`` of dim ``i`` and device ``b`` needs ``dst[b]/T`` of dim ``j``, so
    ``a`` sends ``src[a]*dst[b]/T`` bytes to ``b``.  ``same_dim=True``
    (``S(d)→S(d)`` with new sizes): rows are contiguous ranges in device order and
    ``a`` sends ``b`` the overlap of its old range with ``b``'s new range.
    """
    t = _nonneg(tensor_bytes, "tensor_bytes")
    src = [_nonneg(x, f"src_sizes[{i}]") for i, x in enumerate(src_sizes)]
    dst = [_nonneg(x, f"dst_sizes[{i}]") for i, x in enumerate(dst_sizes)]
    if len(src) != len(dst):
        raise ValueError(f"src_sizes and dst_sizes differ in length: {len(src)} vs {len(dst)}")
    k = len(src)
    if t == 0:
        return [[0.0] * k for _ in range(k)]
    if not same_dim:
        return [[a * b / t for b in dst] for a in src]
    out = [[0.0] * k for _ in range(k)]
    a_lo = 0.0
    for a in range(k):
        a_hi = a_lo + src[a]
        b_lo = 0.0
        for b in range(k):
            b_hi = b_lo + dst[b]
            out[a][b] = max(0.0, min(a_hi, b_hi) - max(a_lo, b_lo))
            b_lo = b_hi
        a_lo = a_hi
    return out


# --------------------------------------------------------------------------- conversions


def parse_layout(layout: Any) -> tuple:
    """``"R"`` → ``("R",)``, ``"P"`` → ``("P",)``, ``("S", d)`` → ``("S", d)``."""
    if layout in ("R", "P"):
        return (layout,)
    if (isinstance(layout, (tuple, list)) and len(layout) == 1 and layout[0] in ("R", "P")):
        return (layout[0],)
    if (isinstance(layout, (tuple, list)) and len(layout) == 2 and layout[0] == "S"
            and isinstance(layout[1], numbers.Integral) and not isinstance(layout[1], bool)
            and layout[1] >= 0):
        return ("S", int(layout[1]))
    raise ValueError(f"layout must be 'R', 'P' or ('S', dim) with dim >= 0, got {layout!r}")


def _shard_sizes(cluster: Cluster, sizes: Any, tensor_bytes: float, what: str) -> tuple[float, ...]:
    if sizes is None:
        raise ValueError(f"{what} are required for a sharded layout")
    s = _sizes(cluster, sizes, what)
    total = sum(s)
    if abs(total - tensor_bytes) > 1e-6 * max(tensor_bytes, 1.0):
        raise ValueError(f"{what} sum to {total!r} bytes, but the tensor has {tensor_bytes!r}")
    return s


def conversion_time(cluster: Cluster, src: Any, dst: Any, tensor_bytes: float,
                    src_sizes: Sequence[float] | None = None,
                    dst_sizes: Sequence[float] | None = None, *,
                    form: str = "best") -> tuple[str, str | None, float]:
    """``(collective, form, seconds)`` to turn layout ``src`` into ``dst``.

    Layouts: ``"R"``, ``"P"``, ``("S", d)``.  ``src_sizes`` / ``dst_sizes``: the
    per-device bytes of a sharded ``src`` / ``dst`` (summing to ``tensor_bytes``;
    ignored otherwise).  ``form`` applies to all-gather and reduce-scatter
    (``"best"`` picks the cheaper).  Returned collectives and forms:

    ==============  ==================  =====================
    src → dst       collective          form
    ==============  ==================  =====================
    same layout     ``none``            None
    S → R           ``all_gather``      padded / grouped
    P → R           ``all_reduce``      ``ring``
    P → S           ``reduce_scatter``  padded / grouped
    S(i) → S(j)     ``all_to_all``      ``padded``
    S(d) → S(d)     ``all_to_all``      ``padded`` (new sizes)
    R → S           ``slice``           None (free)
    R → P           ``mask``            None (free)
    S → P           ``zero_pad``        None (free)
    ==============  ==================  =====================
    """
    s, d = parse_layout(src), parse_layout(dst)
    t = _nonneg(tensor_bytes, "tensor_bytes")
    _form(form)
    ss = _shard_sizes(cluster, src_sizes, t, "src_sizes") if s[0] == "S" else None
    ds = _shard_sizes(cluster, dst_sizes, t, "dst_sizes") if d[0] == "S" else None
    if s[0] == "S" and d[0] == "S":
        if s == d and ss == ds:
            return NONE, None, 0.0
        b = _largest_block(t, ss, ds, same_dim=(s == d))
        return ALL_TO_ALL, "padded", _exchange_time(cluster, b)
    if s == d:
        return NONE, None, 0.0
    if s[0] == "S":
        if d[0] == "R":
            f, sec = gather_form(cluster, ss, form)
            return ALL_GATHER, f, sec
        return ZERO_PAD, None, 0.0  # S -> P
    if s[0] == "P":
        if d[0] == "R":
            return ALL_REDUCE, "ring", all_reduce(cluster, t)
        f, sec = reduce_scatter_form(cluster, ds, form)  # P -> S
        return REDUCE_SCATTER, f, sec
    # s is R
    if d[0] == "S":
        return SLICE, None, 0.0
    return MASK, None, 0.0  # R -> P


# --------------------------------------------------------------------------- memory


def bytes_per_device(total_bytes: float, layout: Any, sizes: Sequence[float] | None = None,
                     *, num_devices: int | None = None, padded: bool = False
                     ) -> tuple[float, ...]:
    """Bytes of a ``total_bytes`` tensor held by each device under ``layout``.

    ``R`` and ``P``: every device holds the whole tensor (the number of devices
    comes from ``sizes`` or ``num_devices``).  ``("S", d)``: device ``i`` holds
    ``total_bytes * sizes[i] / sum(sizes)``, so ``sizes`` may be bytes, fractions or
    row counts.  ``padded=True`` gives what the lowering actually stores: every
    device holds a buffer of the largest shard.
    """
    lay = parse_layout(layout)
    t = _nonneg(total_bytes, "total_bytes")
    if sizes is not None:
        sz = tuple(_nonneg(x, f"sizes[{i}]") for i, x in enumerate(sizes))
        if num_devices is not None and num_devices != len(sz):
            raise ValueError(f"num_devices={num_devices} but sizes has {len(sz)} entries")
    if lay[0] in ("R", "P"):
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
