"""Price every candidate strategy and every cross-node layout conversion.

One set of tables serves both the CP-SAT model and the plain evaluator of an
assignment, so the solver's objective and a plan's reported time are the same
numbers. Time model (one compute stream, one communication stream per device):

- the *main* part runs ops in program order; each op takes the time of its slowest
  device; a conversion an op needs is paid inline, before it;
- conversions feeding the *tail* (the optimizer, after the last contraction) are
  issued when their producer finishes and overlap the remaining main compute, one
  at a time in issue order (XLA's latency-hiding scheduler can do no better with
  one collective stream);
- step = max(main end, last deferred conversion end) + tail compute.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from hapsynth.ir.graph import Graph
from hapsynth.synth import costmodel
from hapsynth.synth.cluster import Cluster
from hapsynth.synth.strategy import R, Strategy, link_factors, node_strategies

CONTRACTIONS = {"dot_general", "conv_general_dilated"}


def shard_units(units: int, cluster: Cluster, class_shares) -> tuple[int, ...]:
    """Split `units` over devices by per-class shares, class-uniform when possible.

    Each class's devices get the same count (floor or ceil of their exact share) if
    some combination sums exactly; otherwise the largest remainders get one more.
    """
    per_dev = []
    for c, cls in enumerate(cluster.classes):
        per_dev += [units * class_shares[c] / cls.count] * cls.count
    exact = np.asarray(per_dev)
    counts = [cls.count for cls in cluster.classes]
    lo = [int(np.floor(units * class_shares[c] / counts[c] + 1e-9)) for c in range(len(counts))]
    need = units - sum(lo[c] * counts[c] for c in range(len(counts)))
    # class-uniform: choose classes that get +1 per device so totals match exactly
    if need >= 0 and len(counts) <= 12:
        best = None
        for mask in range(1 << len(counts)):
            add = sum(counts[c] for c in range(len(counts)) if mask >> c & 1)
            if add == need:
                err = sum(abs(lo[c] + (mask >> c & 1) - units * class_shares[c] / counts[c])
                          for c in range(len(counts)))
                if best is None or err < best[0]:
                    best = (err, mask)
        if best is not None:
            out = []
            for c in range(len(counts)):
                out += [lo[c] + (best[1] >> c & 1)] * counts[c]
            return tuple(out)
    base = np.floor(exact + 1e-9).astype(int)
    rem = units - int(base.sum())
    for i in np.argsort(-(exact - base), kind="stable")[:rem]:
        base[i] += 1
    return tuple(int(b) for b in base)


@dataclass
class Tables:
    """Per node and strategy: main/tail compute; conversions as `Edge`s."""

    strategies: list[list[Strategy]]
    main: list[list[float]]                   # compute in the main part
    tail: list[list[float]]                   # compute in the tail
    main_at: list[list[dict[int, float]]]     # main compute by op position (overlap model)
    edges: list = field(default_factory=list)
    tail_start: int = 0
    units: dict = field(default_factory=dict)  # factor size -> per-device units
    group_latency: float = 0.0  # paid once by the deferred (combined) collectives


@dataclass
class Edge:
    """Tensor `tensor` (made by node `src`) converted once to layout `need` if any
    consumer strategy in `consumers` ({node: strategy indices}) is chosen."""

    src: int
    tensor: int
    need: object
    layouts: list            # per src strategy: the tensor's layout
    consumers: dict
    cost: dict               # layout -> seconds
    deferred: bool
    position: int            # producer op index (deferred) or first consumer op (inline)


class Pricer:
    """Prices layouts, ops and conversions on one cluster at fixed class shares."""

    def __init__(self, graph: Graph, cluster: Cluster, class_shares):
        self.graph, self.cluster = graph, cluster
        self.shares = tuple(class_shares)
        self._units: dict[int, tuple[int, ...]] = {}
        self._conv: dict = {}
        self.dev_class = [cluster.class_of(i) for i in range(cluster.num_devices)]
        # Deferred collectives are combined into a few large ones (XLA's combiner):
        # price them by bandwidth alone and pay one all-reduce latency for the group.
        self.bulk = replace(cluster, links=tuple(replace(l, alpha=0.0) for l in cluster.links))
        self.group_latency = costmodel.all_reduce(cluster, 1.0) if cluster.num_devices > 1 else 0.0

    def units(self, size: int) -> tuple[int, ...]:
        if size not in self._units:
            self._units[size] = shard_units(size, self.cluster, self.shares)
        return self._units[size]

    def op_time(self, op, choice) -> float:
        if choice.factor is None:
            return max(costmodel.compute_time(op.cost, c) for c in self.cluster.classes)
        size = op.rule.factors[choice.factor].size
        u = self.units(size)
        worst = 0.0
        for c, cls in enumerate(self.cluster.classes):
            mx = max(u[i] for i in range(len(u)) if self.dev_class[i] == c)
            if mx:
                frac = mx / size
                scaled = type(op.cost)(op.cost.flops * frac, op.cost.transcendentals * frac,
                                       op.cost.bytes * frac)
                worst = max(worst, costmodel.compute_time(scaled, cls))
        return worst

    def sizes(self, layout, nbytes: float):
        if isinstance(layout, tuple):
            u = self.units(layout[2])
            return tuple(x * nbytes / layout[2] for x in u)
        return None

    def convert(self, src, dst, nbytes: float, bulk: bool = False) -> float:
        if src == dst or dst is None or src is None:
            return 0.0
        key = (src, dst, nbytes, bulk)
        if key not in self._conv:
            s = src if not isinstance(src, tuple) else ("S", src[1])
            d = dst if not isinstance(dst, tuple) else ("S", dst[1])
            _, _, t = costmodel.conversion_time(self.bulk if bulk else self.cluster, s, d, nbytes,
                                                self.sizes(src, nbytes), self.sizes(dst, nbytes))
            self._conv[key] = t
        return self._conv[key]


def state_pairs(graph: Graph, num_state_leaves: int) -> dict[int, int]:
    """input tensor -> output tensor for state leaves (the step's fixed point)."""
    return {graph.inputs[i]: graph.outputs[i] for i in range(num_state_leaves)
            if graph.outputs[i] is not None}


def build_tables(graph: Graph, cluster: Cluster, class_shares, *, num_state_leaves: int = 0,
                 max_classes: int = 6, uf=None, keep=()) -> Tables:
    pr = Pricer(graph, cluster, class_shares)
    uf = uf or link_factors(graph)
    contraction_at = [op.id for op in graph.ops if op.primitive in CONTRACTIONS]
    tail_start = (max(contraction_at) + 1) if contraction_at else len(graph.ops)
    producer_node = {t.id: graph.ops[t.producer].node for t in graph.tensors if t.producer is not None}
    pairs = state_pairs(graph, num_state_leaves)
    strategies, main, tail, main_at = [], [], [], []
    needs: dict = {}  # (source tensor, need) -> {"consumers": {node: set}, "ops": set}
    for node in graph.nodes:
        strats = node_strategies(graph, node, uf, max_classes, keep)
        strategies.append(strats)
        m_row, t_row, at_row = [], [], []
        for si, st in enumerate(strats):
            m = tl = 0.0
            at: dict[int, float] = {}
            for op_id, ch in st.choices:
                op = graph.ops[op_id]
                for i, t in enumerate(op.inputs):
                    if t is None or ch.inputs[i] is None:
                        continue
                    src_t = pairs.get(t, t)  # a state input is laid out like its update
                    if src_t not in producer_node:
                        continue  # data inputs are fed in whatever layout is needed
                    rec = needs.setdefault((src_t, ch.inputs[i]), {"consumers": {}, "ops": set()})
                    rec["consumers"].setdefault(node.id, set()).add(si)
                    rec["ops"].add(op_id)
                t_op = pr.op_time(op, ch)
                if op_id >= tail_start:
                    tl += t_op
                else:
                    m += t_op
                    at[op_id] = at.get(op_id, 0.0) + t_op
            m_row.append(m); t_row.append(tl); at_row.append(at)
        main.append(m_row); tail.append(t_row); main_at.append(at_row)
    # outputs the user reads (not state) must end replicated
    state_outs = set(pairs.values())
    for t in graph.outputs:
        if t is not None and t not in state_outs and t in producer_node:
            needs.setdefault((t, R), {"consumers": {}, "ops": set()})["consumers"][-1] = {0}
    tables = Tables(strategies, main, tail, main_at, [], tail_start)
    for (t, need), rec in needs.items():
        src = producer_node[t]
        layouts = [st.layouts.get(t, R) for st in strategies[src]]
        nbytes = graph.tensors[t].nbytes
        deferred = bool(rec["ops"]) and min(rec["ops"]) >= tail_start
        cost = {lay: pr.convert(lay, need, nbytes, deferred) for lay in set(layouts)}
        if not any(cost.values()):
            continue
        pos = graph.tensors[t].producer if deferred else min(rec["ops"], default=len(graph.ops))
        tables.edges.append(Edge(src, t, need, layouts, rec["consumers"], cost, deferred, pos))
    tables.units = dict(pr._units)
    tables.group_latency = pr.group_latency
    return tables


def edge_needed(e: Edge, assign) -> bool:
    return any(n < 0 or assign[n] in ss for n, ss in e.consumers.items())


def evaluate(tables: Tables, assign: list[int]) -> dict:
    """Step time of an assignment (strategy index per node), with its breakdown."""
    main = sum(tables.main[n][s] for n, s in enumerate(assign))
    tail = sum(tables.tail[n][s] for n, s in enumerate(assign))
    inline = 0.0
    events = []  # (position, seconds) of deferred conversions
    main_by_pos: dict[int, float] = {}
    for n, s in enumerate(assign):
        for p, t in tables.main_at[n][s].items():
            main_by_pos[p] = main_by_pos.get(p, 0.0) + t
    for e in tables.edges:
        c = e.cost[e.layouts[assign[e.src]]]
        if not c or not edge_needed(e, assign):
            continue
        if e.deferred:
            events.append((e.position, c))
        else:
            inline += c
            main_by_pos[e.position] = main_by_pos.get(e.position, 0.0) + c
    main_end = main + inline
    comm_free = 0.0
    if events:
        events.append((-1, tables.group_latency))
        positions = sorted(main_by_pos)
        cum = np.cumsum([main_by_pos[p] for p in positions])
        for p, c in sorted(events):
            k = np.searchsorted(positions, p, side="right")
            ready = float(cum[k - 1]) if k else 0.0
            comm_free = max(comm_free, ready) + c
    deferred_total = sum(c for _, c in events)
    step = max(main_end, comm_free) + tail
    return {"step": step, "compute": main + tail, "inline_comm": inline,
            "deferred_comm": deferred_total, "exposed_comm": max(0.0, comm_free - main_end)}


def data_parallel(tables: Tables, batch) -> list[int]:
    """Data parallelism: every node shards the batch class if it holds it, else replicates."""
    return [next((i for i, s in enumerate(st) if s.klass == batch), 0) for st in tables.strategies]
