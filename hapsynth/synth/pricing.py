"""Price every candidate strategy and every cross-node conversion at given class shares.

One frozen `Tables` per set of shares serves both the CP-SAT model and the plain
evaluator of an assignment (`timing.evaluate`), so the solver's objective and a plan's
reported time are the same numbers. Compute is split at `tail_start` (the optimizer,
after the last contraction): conversions read only on the way to the tail are
*deferred* (they overlap the remaining main compute, see `timing.py` and
`structure.feeds_tail`), the others are paid inline.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import Mapping

import numpy as np

from hapsynth.cluster import Cluster
from hapsynth.ir.graph import Cost, Graph
from hapsynth.ir.layout import R, Layout
from hapsynth.synth import collectives, costmodel
from hapsynth.synth.strategy import Strategy
from hapsynth.synth.structure import Structure, stored_copies
from hapsynth.synth.timing import EvalArrays


def shard_units(units: int, cluster: Cluster, class_shares) -> tuple[int, ...]:
    """Split `units` over devices by per-class shares, class-uniform when possible.

    Each class's devices get the same count (floor or ceil of their exact share) if
    some combination sums exactly; otherwise the largest remainders get one more.
    """
    counts = [cls.count for cls in cluster.classes]
    exact_per_class = [units * class_shares[c] / counts[c] for c in range(len(counts))]
    lo = [int(np.floor(x + 1e-9)) for x in exact_per_class]
    need = units - sum(lo[c] * counts[c] for c in range(len(counts)))
    if need >= 0 and len(counts) <= 12:  # class-uniform: classes whose devices get +1
        best = None
        for mask in range(1 << len(counts)):
            if sum(counts[c] for c in range(len(counts)) if mask >> c & 1) != need:
                continue
            err = sum(abs(lo[c] + (mask >> c & 1) - exact_per_class[c]) for c in range(len(counts)))
            if best is None or err < best[0]:
                best = (err, mask)
        if best is not None:
            return tuple(lo[c] + (best[1] >> c & 1) for c in range(len(counts))
                         for _ in range(counts[c]))
    exact = np.repeat(exact_per_class, counts)
    base = np.floor(exact + 1e-9).astype(int)
    for i in np.argsort(-(exact - base), kind="stable")[:units - int(base.sum())]:
        base[i] += 1
    return tuple(int(b) for b in base)


class Pricer:
    """Prices ops and conversions on one cluster at fixed class shares (memoised).

    `follow`: the factor sizes split by the shares (the batch's); every other size is
    split evenly, so sharded state holds no padding whatever the compute shares (Cephalo's
    decoupling of state from compute). None: every size follows the shares."""

    def __init__(self, cluster: Cluster, class_shares, follow: frozenset | None = None):
        self.cluster = cluster
        self.shares = tuple(float(s) for s in class_shares)
        self.follow = follow
        self._even = tuple(c.count / cluster.num_devices for c in cluster.classes)
        self._units: dict[int, tuple[int, ...]] = {}
        self._conv: dict = {}
        self._op: dict = {}
        self._class_devices = [cluster.class_devices(c) for c in range(cluster.num_classes)]

    def units(self, size: int) -> tuple[int, ...]:
        """Per-device units of a factor of `size` units."""
        if size not in self._units:
            shares = self.shares if self.follow is None or size in self.follow else self._even
            self._units[size] = shard_units(size, self.cluster, shares)
        return self._units[size]

    def priced_units(self) -> dict[int, tuple[int, ...]]:
        return dict(self._units)

    def class_times(self, op, choice) -> tuple[float, ...]:
        """Per class, the busiest device's compute time for this op under `choice`."""
        size = None if choice.factor is None else choice.units
        key = (op.cost, size)
        if key not in self._op:
            self._op[key] = tuple(costmodel.compute_time(self._share(op.cost, size, c), cls)
                                  for c, cls in enumerate(self.cluster.classes))
        return self._op[key]

    def _share(self, cost: Cost, size: int | None, c: int) -> Cost:
        if size is None:
            return cost
        frac = max(self.units(size)[i] for i in self._class_devices[c]) / size
        return Cost(cost.flops * frac, cost.transcendentals * frac, cost.bytes * frac)

    def sizes(self, layout: Layout, nbytes: float):
        """Per-device bytes of a sharded layout (None otherwise)."""
        if layout.sharded:
            return tuple(x * nbytes / layout.units for x in self.units(layout.units))
        return None

    def conversion(self, src: Layout, dst: Layout, nbytes: float, bulk: bool = False) -> tuple:
        """(collective, form, seconds) turning `src` into `dst`; `bulk` prices by bandwidth
        alone (deferred collectives are combined; the group pays one latency)."""
        if src == dst:
            return ("none", None, 0.0)
        key = (src, dst, nbytes, bulk)
        if key not in self._conv:
            self._conv[key] = costmodel.conversion_time(
                self.cluster, src, dst, nbytes, self.sizes(src, nbytes), self.sizes(dst, nbytes),
                latency=not bulk)
        return self._conv[key]


@dataclass(frozen=True)
class Edge:
    """Tensor `tensor` (made by node `src`) converted once to layout `need` if any
    consumer strategy in `consumers` ({node: strategy indices}) is chosen."""

    src: int
    tensor: int
    need: Layout
    layouts: tuple[Layout, ...]     # per src strategy: the tensor's layout
    consumers: Mapping[int, frozenset]
    conversions: Mapping[Layout, tuple]  # produced layout -> (collective, form, seconds)
    deferred: bool
    position: int                   # producer op (deferred) or first consumer op (inline)
    repeat: int = 1                 # times it is paid (a loop's iterations); in `conversions`
    pooled: frozenset = frozenset()  # layouts whose all-reduce is combined with others':
    #                                  priced by bandwidth, the group's latency apart
    last: int = -1                  # the last op reading the converted value (its lifetime's end)
    spans: Mapping[int, tuple] = field(default_factory=dict)  # consumer node -> (first, last) op reading it
    prefetch: bool = False          # stored state (a step input) or a copy of it: may be
    #                                 gathered ahead, once `avail` (its copy op; -1: a step
    #                                 input) is done
    avail: int = -1

    def seconds(self, layout: Layout) -> float:
        return self.conversions.get(layout, (None, None, 0.0))[2]

    def needed(self, assign) -> bool:
        return any(n < 0 or assign[n] in ss for n, ss in self.consumers.items())


@dataclass(frozen=True, eq=False)
class Tables:
    """Priced strategies and conversions of a `Structure` at one set of class shares."""

    structure: Structure
    pricer: Pricer
    main: tuple[tuple[float, ...], ...]      # per node and strategy: compute before the tail
    tail: tuple[tuple[float, ...], ...]      # ... and in the tail
    main_at: tuple[tuple[Mapping[int, float], ...], ...]  # main compute by op position
    edges: tuple[Edge, ...]
    group_latency: float                     # paid once by the deferred collectives
    combined: tuple[tuple[int, ...], ...] = ()  # inline all-reduces issued as one (edge indices)

    @property
    def strategies(self) -> tuple[tuple[Strategy, ...], ...]:
        return self.structure.strategies

    @property
    def shares(self) -> tuple[float, ...]:
        return self.pricer.shares

    @property
    def tail_start(self) -> int:
        return self.structure.tail_start

    @property
    def units(self) -> dict[int, tuple[int, ...]]:
        """Per-device units of every factor size priced so far."""
        return self.pricer.priced_units()

    @cached_property
    def arrays(self) -> EvalArrays:
        return EvalArrays(self)


def price(st: Structure, cluster: Cluster, class_shares, only: list[int] | None = None,
          follow: frozenset | None = None) -> Tables:
    """Price every strategy and conversion of `st` at the given per-class shares (the
    factor sizes in `follow` only, others evenly; None: all, see `Pricer`).

    `only` (a strategy per node) prices just that assignment: enough to evaluate it.
    """
    graph: Graph = st.graph
    pr = Pricer(cluster, class_shares, follow)
    main, tail, main_at = [], [], []
    for n, strats in enumerate(st.strategies):
        rows = ([], [], [])
        for si, strat in enumerate(strats):
            m = tl = 0.0
            at: dict[int, float] = {}
            if only is None or only[n] == si:
                for op_id, ch in strat.choices:
                    t_op = max(pr.class_times(graph.ops[op_id], ch))
                    if op_id >= st.tail_start:
                        tl += t_op
                    elif t_op:
                        m += t_op
                        at[op_id] = t_op
            for row, v in zip(rows, (m, tl, MappingProxyType(at))):
                row.append(v)
        main.append(tuple(rows[0]))
        tail.append(tuple(rows[1]))
        main_at.append(tuple(rows[2]))
    edges = []
    stored = set(st.pairs.values())
    copies = stored_copies(graph, st.pairs)
    for need in st.needs:
        t = need.tensor
        src = st.producer_node[t]
        layouts = tuple(s.layouts.get(t, R) for s in st.strategies[src])
        if only is not None and not any(n < 0 or only[n] in ss for n, ss in need.consumers.items()):
            continue
        nbytes = graph.tensors[t].nbytes
        deferred = need.deferred
        used = set(layouts) if only is None else {layouts[only[src]]}
        convs = {lay: _times(pr.conversion(lay, need.layout, nbytes, deferred), need.repeat)
                 for lay in used}
        if not any(c[2] for c in convs.values()):
            continue
        pos = min(need.ops, default=len(graph.ops))
        if deferred:  # issued when made; a loop's stacked results slice by slice, in the loop
            pos = st.loop_start.get(graph.ops[graph.tensors[t].producer].loop,
                                    graph.tensors[t].producer)
        edges.append(Edge(src, t, need.layout, layouts, need.consumers,
                          MappingProxyType(convs), deferred, pos, need.repeat,
                          last=max(need.ops, default=len(graph.ops)),
                          spans=_spans(graph, need.ops),
                          prefetch=not deferred and (t in copies or t in stored and max(
                              need.ops, default=-1) <= graph.tensors[t].producer),
                          avail=graph.tensors[t].producer if t in copies else -1))
    edges, combined = _combine(edges, graph, pr)
    group_latency = collectives.all_reduce_latency(cluster)
    return Tables(st, pr, tuple(main), tuple(tail), tuple(main_at), tuple(edges), group_latency,
                  combined)


def _spans(graph: Graph, ops) -> MappingProxyType:
    """Per node: the first and last of `ops` in it."""
    out: dict[int, tuple[int, int]] = {}
    for o in ops:
        n = graph.ops[o].node
        a, b = out.get(n, (o, o))
        out[n] = (min(a, o), max(b, o))
    return MappingProxyType(out)


#: XLA's GPU all-reduce combiner merges up to this many bytes into one all-reduce.
COMBINE_BYTES = 30 * 2 ** 20
#: Ops past a group's first read searched for all-reduces that may join it.
COMBINE_WINDOW = 256


def _combine(edges: list[Edge], graph: Graph, pr: Pricer) -> tuple[list[Edge], tuple]:
    """Group the inline all-reduces that XLA's all-reduce combiner issues as one: from
    the first one read, the others whose values do not depend on a group member's result
    (made before it is read, or in the next `COMBINE_WINDOW` ops from other values).
    A group pays one latency (`Tables.combined`); its members' all-reduces are priced
    by bandwidth alone. With one compute stream the reordering this needs costs nothing."""
    cands = sorted((e.position, k) for k, e in enumerate(edges)
                   if not e.deferred and e.repeat == 1
                   and any(c[0] == collectives.ALL_REDUCE for c in e.conversions.values()))
    made_by: dict[int, list[int]] = {}
    for _, k in cands:
        made_by.setdefault(graph.tensors[edges[k].tensor].producer, []).append(k)
    by_made = sorted(made_by.items())  # (producer op, candidates), in program order
    made_ops = [op for op, _ in by_made]
    taken: set[int] = set()
    groups: list[list[int]] = []
    lo = 0  # by_made[:lo] are all taken
    for first, k0 in cands:
        if k0 in taken:
            continue
        group, size = [k0], graph.tensors[edges[k0].tensor].nbytes
        taken.add(k0)

        def join(k) -> bool:
            nonlocal size
            nbytes = graph.tensors[edges[k].tensor].nbytes
            if k in taken or size + nbytes > COMBINE_BYTES:
                return False
            group.append(k)
            taken.add(k)
            size += nbytes
            return True

        while lo < len(by_made) and all(k in taken for k in by_made[lo][1]):
            lo += 1
        for op, ks in by_made[lo:]:
            if op >= first:
                break
            for k in ks:
                join(k)
        ahead = bisect.bisect_left(made_ops, first)
        if ahead == len(made_ops) or made_ops[ahead] >= first + COMBINE_WINDOW:
            end = first  # no all-reduce is made in the window: nothing to walk
        else:
            end = first + COMBINE_WINDOW
        tainted = {edges[k].tensor for k in group}
        for op in graph.ops[first:end]:
            if any(t in tainted for t in op.inputs):
                tainted.update(op.outputs)
                continue
            for k in made_by.get(op.id, ()):
                if join(k):
                    tainted.add(edges[k].tensor)
        if len(group) > 1:
            groups.append(sorted(group, key=lambda k: edges[k].position))
    out = list(edges)
    for g in groups:
        for k in g:
            e = edges[k]
            nbytes = graph.tensors[e.tensor].nbytes
            pooled = frozenset(lay for lay, c in e.conversions.items()
                               if c[0] == collectives.ALL_REDUCE)
            convs = {lay: pr.conversion(lay, e.need, nbytes, True) if lay in pooled else c
                     for lay, c in e.conversions.items()}
            out[k] = replace(e, conversions=MappingProxyType(convs), pooled=pooled)
    return out, tuple(tuple(g) for g in groups)


def paid_groups(tables: Tables, assign) -> list[tuple[int, int, int]]:
    """(position, group, first member paying) of each combined group whose latency
    `assign` pays (some member needed, its producer's layout all-reduced), at the
    group's first member's position."""
    out = []
    for g, members in enumerate(tables.combined):
        paying = [k for k in members
                  if tables.edges[k].layouts[assign[tables.edges[k].src]] in tables.edges[k].pooled
                  and tables.edges[k].needed(assign)]
        if paying:
            out.append((tables.edges[members[0]].position, g, paying[0]))
    return out


def _times(conversion: tuple, n: int) -> tuple:
    collective, form, seconds = conversion
    return collective, form, seconds * n
