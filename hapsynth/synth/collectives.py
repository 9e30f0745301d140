"""α-β prices of collectives over the cluster's link hierarchy: the one place the
algorithms' formulas live (the cost model prices conversions with them, `hapsynth
profile` fits measured collectives to them).

Pure functions of plain numbers and a :class:`~hapsynth.cluster.Cluster`; no JAX.
Times in seconds, sizes in bytes. A message of ``n`` bytes over a :class:`LinkLevel`
costs ``alpha + n / beta``.

Collectives run over the 1-D mesh of all devices of the cluster, in device index
order.  ``k`` = number of participating devices; with ``k == 1`` (or when a collective
moves no bytes: it is not emitted) everything costs 0.

- *Ring* (all-reduce, all-gather, reduce-scatter): device ``i`` sends to ``i+1 mod k``.
  All ring links are busy in every step, so a step takes the time of the slowest link
  the ring uses — as soon as one neighbour pair crosses hosts the step is bounded by
  the inter-host level ("bottleneck link").  "Slowest" means the largest
  ``alpha + n / beta`` for the step's message, so a high-latency level wins for tiny
  messages.
- ``all_reduce(n)`` = reduce-scatter + all-gather: ``2(k-1)`` steps of ``n/k`` bytes:
  ``2(k-1) * (alpha + n/k / beta)``; or, where that is cheaper (small, latency-bound
  messages: a loss, a norm's statistics), a binary tree, ``2 ceil(log2 k)`` steps of the
  whole message. NCCL chooses between such algorithms per message in the same way.
- *Uneven shards*: a sharded tensor is stored padded to ``M = max(sizes)`` per device
  (docs/design.md).  Two forms per collective:

  ``padded``  the native collective on the padded buffers:
              all-gather / reduce-scatter = ``(k-1) * (alpha + M / beta)``.
  ``grouped`` exact sizes.  ``pbroadcast`` (one broadcast per owner) has no CPU
              lowering, so the lowering emits a **masked psum**: every device writes
              its rows into a zeroed buffer of ``sum(sizes)`` bytes (resp. holds its
              partial sum of all ``sum(sizes)`` bytes) and the buffer is all-reduced;
              a reduce-scatter then slices locally.  Both cost
              ``all_reduce(sum(sizes))`` — about twice the bytes of an even
              all-gather, but no padding.

  ``best`` takes the cheaper (ties: ``padded``).  With ``S = sum(sizes)`` the grouped
  form wins when ``M > alpha*beta + 2S/k``: only for skewed sizes *and* messages well
  above the latency-bandwidth product.
- *All-to-all* (pairwise exchange, padded): ``k-1`` steps; in step ``s`` device ``i``
  sends one block to ``i+s mod k``.  Every block is padded to the largest off-diagonal
  block ``B`` (the self block stays local).  A step takes the time of the slowest link
  used in that step, so the total is ``sum_s max_{links of step s} (alpha + B / beta)``;
  for the presets (hosts are contiguous device ranges) every step crosses hosts when
  there are several, which gives ``(k-1) * (alpha + B / beta_bottleneck)``.

Known limits: no contention between concurrent collectives; ring, tree (all-reduce) and
pairwise exchange only (no hierarchical algorithms); one bandwidth per level (no NIC
sharing among the devices of a host).

Worked example: BERT-base fp32 gradients, ``110e6 * 4 = 440e6`` bytes, all-reduced over
``Cluster.load("hap-v100x16-p100x48")`` (64 devices, 8 hosts; the ring crosses hosts,
so the bottleneck is the 10.4 Gbps = 1.3e9 B/s, 20 µs level)::

    2 * 63 * (20e-6 + 440e6 / 64 / 1.3e9) = 126 * 5.308e-3 s ≈ 0.669 s
"""
from __future__ import annotations

import math
import numbers
from collections import Counter
from functools import lru_cache
from typing import Any, Iterable, Sequence

import numpy as np

from hapsynth.cluster import Cluster, LinkLevel

#: Forms accepted by the sized collectives.
FORMS = ("padded", "grouped", "best")

ALL_GATHER = "all_gather"
ALL_REDUCE = "all_reduce"
REDUCE_SCATTER = "reduce_scatter"
ALL_TO_ALL = "all_to_all"


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
    return tuple(l for l in dict.fromkeys(cluster.links) if l in used)


@lru_cache(maxsize=128)
def _exchange_steps(cluster: Cluster,
                    devices: tuple[int, ...]) -> tuple[tuple[tuple[LinkLevel, ...], int], ...]:
    """Pairwise exchange: (levels used in a step, number of such steps)."""
    k = len(devices)
    steps: Counter = Counter()
    for s in range(1, k):
        used = {cluster.link_between(devices[i], devices[(i + s) % k]) for i in range(k)}
        steps[tuple(l for l in dict.fromkeys(cluster.links) if l in used)] += 1
    return tuple(steps.items())


def _step(levels: Sequence[LinkLevel], nbytes: float, latency: bool = True) -> float:
    """One step over the slowest of `levels`; `latency=False` prices bandwidth alone."""
    if not levels:
        return 0.0
    return max((l.alpha if latency else 0.0) + nbytes / l.beta for l in levels)


# --------------------------------------------------------------------------- validation


def nonneg(x: Any, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{what} must be a number of bytes, got {x!r}")
    x = float(x)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{what} must be finite and non-negative, got {x!r}")
    return x


def device_sizes(cluster: Cluster, sizes: Sequence[Any], what: str = "sizes") -> tuple[float, ...]:
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
        raise TypeError(f"{what} must be a sequence of per-device bytes, got {sizes!r}")
    out = tuple(nonneg(s, f"{what}[{i}]") for i, s in enumerate(sizes))
    if len(out) != cluster.num_devices:
        raise ValueError(f"{what} has {len(out)} entries; cluster {cluster.name!r} has "
                         f"{cluster.num_devices} devices")
    return out


def check_form(form: str) -> str:
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    return form


# --------------------------------------------------------------------------- collectives


def all_reduce(cluster: Cluster, nbytes: float, devices: Iterable[int] | None = None, *,
               latency: bool = True) -> float:
    """All-reduce of ``nbytes`` over ``devices`` (default: all), by ring or tree,
    whichever is cheaper (as NCCL picks per message size); see `all_reduce_form`."""
    return all_reduce_form(cluster, nbytes, devices, latency=latency)[1]


def all_reduce_form(cluster: Cluster, nbytes: float, devices: Iterable[int] | None = None, *,
                    latency: bool = True) -> tuple[str, float]:
    """``(form, seconds)``: ``"ring"``, ``2(k-1) * (alpha + nbytes/k / beta)``, or for
    latency-bound messages ``"tree"``, reduce up and broadcast down a binary tree,
    ``2 ceil(log2 k) * (alpha + nbytes / beta)`` (no pipelining: conservative), both on
    the slowest link the devices use (ties: ring)."""
    devs = _devices(cluster, devices)
    n = nonneg(nbytes, "nbytes")
    k = len(devs)
    if k < 2 or n == 0:
        return "ring", 0.0
    levels = _ring_levels(cluster, devs)
    ring = steps(ALL_REDUCE, k) * _step(levels, n / k, latency)
    tree = tree_steps(k) * _step(levels, n, latency)
    return ("ring", ring) if ring <= tree else ("tree", tree)


def tree_steps(k: int) -> int:
    """Link steps of a binary-tree all-reduce on k devices: up and down, log2 k each."""
    return 2 * math.ceil(math.log2(k)) if k > 1 else 0


def all_reduce_latency(cluster: Cluster) -> float:
    """The latency alone of one all-reduce over all devices (the cheaper algorithm's)."""
    k = cluster.num_devices
    levels = _ring_levels(cluster, _devices(cluster, None))
    alpha = max((l.alpha for l in levels), default=0.0)
    return min(steps(ALL_REDUCE, k), tree_steps(k)) * alpha if k > 1 else 0.0


def steps(collective: str, k: int) -> int:
    """Link steps (each paying one latency) of a collective on k devices: the one place
    the algorithms' step counts live (ring all-reduce 2(k-1); ring all-gather and
    reduce-scatter, pairwise all-to-all k-1)."""
    return {ALL_REDUCE: 2 * (k - 1), ALL_GATHER: k - 1, REDUCE_SCATTER: k - 1,
            ALL_TO_ALL: k - 1}[collective] if k > 1 else 0


def even_terms(collective: str, k: int, nbytes: float) -> tuple[float, float]:
    """(alpha, 1/beta) coefficients of `collective` moving a tensor of `nbytes` in all,
    evenly sharded over k devices on one link level: time = a * alpha + b / beta.
    What `hapsynth profile` fits measured collectives to."""
    per_step = {ALL_REDUCE: nbytes / k, ALL_GATHER: nbytes / k, REDUCE_SCATTER: nbytes / k,
                ALL_TO_ALL: nbytes / k / k}[collective]
    n = steps(collective, k)
    return float(n), n * per_step


def latency_steps(collective: str, form: str | None, k: int) -> int:
    """Latency terms of one conversion as priced: a grouped gather or reduce-scatter is
    a masked all-reduce; free conversions have none."""
    if collective not in (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL):
        return 0
    if form == "tree":
        return tree_steps(k)
    return steps(ALL_REDUCE if form == "grouped" else collective, k)


def _padded_ring(cluster: Cluster, sizes: tuple[float, ...], latency: bool = True) -> float:
    k, m = len(sizes), max(sizes)
    if k < 2 or m == 0:
        return 0.0
    return steps(ALL_GATHER, k) * _step(_ring_levels(cluster, _devices(cluster, None)), m,
                                        latency)


def all_gather(cluster: Cluster, sizes: Sequence[float], form: str = "best") -> float:
    """All-gather of shards of ``sizes`` bytes (one per device, zeros allowed).

    ``padded``: ``(k-1) * (alpha + max(sizes)/beta)``; ``grouped``: masked psum,
    ``all_reduce(sum(sizes))``; ``best``: the cheaper.
    """
    return gather_form(cluster, sizes, form)[1]


def gather_form(cluster: Cluster, sizes: Sequence[float],
                form: str = "best", *, latency: bool = True) -> tuple[str, float]:
    """``(form, seconds)`` of the all-gather; ``form="best"`` picks the cheaper
    (``"padded"`` on ties)."""
    s = device_sizes(cluster, sizes)
    return _choose(check_form(form), _padded_ring(cluster, s, latency),
                   all_reduce(cluster, sum(s), latency=latency))


def reduce_scatter(cluster: Cluster, sizes: Sequence[float], form: str = "best") -> float:
    """Reduce-scatter of a partial sum into shards of ``sizes`` bytes.

    ``padded``: the partial sum is ``k*max(sizes)`` bytes, ``(k-1) * (alpha +
    max(sizes)/beta)``; ``grouped``: all-reduce of ``sum(sizes)`` then a local
    slice; ``best``: the cheaper.
    """
    return reduce_scatter_form(cluster, sizes, form)[1]


def reduce_scatter_form(cluster: Cluster, sizes: Sequence[float],
                        form: str = "best", *, latency: bool = True) -> tuple[str, float]:
    """``(form, seconds)`` of the reduce-scatter (ties: ``"padded"``)."""
    s = device_sizes(cluster, sizes)
    return _choose(check_form(form), _padded_ring(cluster, s, latency),
                   all_reduce(cluster, sum(s), latency=latency))


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
        b = max(nonneg(r, f"send[{i}]") for i, r in enumerate(rows))
    else:
        b = 0.0
        for i, r in enumerate(rows):
            if isinstance(r, (str, bytes)) or not isinstance(r, Iterable):
                raise TypeError(f"send[{i}] must be a row of {k} byte counts, got {r!r}")
            r = list(r)
            if len(r) != k:
                raise ValueError(f"send[{i}] has {len(r)} entries, expected {k}")
            for j, x in enumerate(r):
                x = nonneg(x, f"send[{i}][{j}]")
                if i != j:
                    b = max(b, x)
    return exchange_time(cluster, b)


def exchange_time(cluster: Cluster, block: float, latency: bool = True) -> float:
    """Pairwise exchange of blocks of `block` bytes over all devices."""
    if cluster.num_devices < 2 or block == 0:
        return 0.0
    return sum(n * _step(levels, block, latency)
               for levels, n in _exchange_steps(cluster, _devices(cluster, None)))


def largest_block(t: float, src, dst, same_dim: bool) -> float:
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
    t = nonneg(tensor_bytes, "tensor_bytes")
    src = [nonneg(x, f"src_sizes[{i}]") for i, x in enumerate(src_sizes)]
    dst = [nonneg(x, f"dst_sizes[{i}]") for i, x in enumerate(dst_sizes)]
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
