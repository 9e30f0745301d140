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
    pricer: object = None
    memory_model: object = None  # built on first use (synth/memory.py)
    _arrays: object = None       # built on first `evaluate`


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
        self._op: dict = {}
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
        """Time of the op: its slowest class (devices wait for each other at collectives)."""
        return max(self.class_times(op, choice))

    def class_times(self, op, choice) -> tuple[float, ...]:
        """Per class, the busiest device's compute time for this op."""
        size = None if choice.factor is None else op.rule.factors[choice.factor].size
        key = (op.cost, size)
        if key not in self._op:
            self._op[key] = self._class_times(op, size)
        return self._op[key]

    def _class_times(self, op, size) -> tuple[float, ...]:
        if size is None:
            return tuple(costmodel.compute_time(op.cost, c) for c in self.cluster.classes)
        u = self.units(size)
        out = []
        for c, cls in enumerate(self.cluster.classes):
            frac = max(u[i] for i in range(len(u)) if self.dev_class[i] == c) / size
            scaled = type(op.cost)(op.cost.flops * frac, op.cost.transcendentals * frac,
                                   op.cost.bytes * frac)
            out.append(costmodel.compute_time(scaled, cls))
        return tuple(out)

    def sizes(self, layout, nbytes: float):
        if isinstance(layout, tuple):
            u = self.units(layout[2])
            return tuple(x * nbytes / layout[2] for x in u)
        return None

    def convert(self, src, dst, nbytes: float, bulk: bool = False) -> float:
        return self.conversion(src, dst, nbytes, bulk)[2]

    def conversion(self, src, dst, nbytes: float, bulk: bool = False) -> tuple:
        """(collective, form, seconds) turning layout src into dst."""
        if src == dst or dst is None or src is None:
            return ("none", None, 0.0)
        key = (src, dst, nbytes, bulk)
        if key not in self._conv:
            s = src if not isinstance(src, tuple) else ("S", src[1])
            d = dst if not isinstance(dst, tuple) else ("S", dst[1])
            self._conv[key] = costmodel.conversion_time(
                self.bulk if bulk else self.cluster, s, d, nbytes,
                self.sizes(src, nbytes), self.sizes(dst, nbytes))
        return self._conv[key]


def state_pairs(graph: Graph, num_state_leaves: int) -> dict[int, int]:
    """input tensor -> output tensor for state leaves (the step's fixed point)."""
    return {graph.inputs[i]: graph.outputs[i] for i in range(num_state_leaves)
            if graph.outputs[i] is not None}


@dataclass
class Structure:
    """What does not depend on shard sizes: strategies and which layouts are needed."""

    graph: Graph
    strategies: list[list[Strategy]]
    needs: dict          # (source tensor, layout) -> {"consumers": {node: set}, "ops": set}
    producer_node: dict
    tail_start: int
    pairs: dict          # state input tensor -> state output tensor
    num_state_leaves: int = 0


def build_structure(graph: Graph, *, num_state_leaves: int = 0, max_classes: int = 3,
                    uf=None, keep=()) -> Structure:
    uf = uf or link_factors(graph)
    contraction_at = [op.id for op in graph.ops if op.primitive in CONTRACTIONS]
    tail_start = (max(contraction_at) + 1) if contraction_at else len(graph.ops)
    producer_node = {t.id: graph.ops[t.producer].node for t in graph.tensors if t.producer is not None}
    pairs = state_pairs(graph, num_state_leaves)
    strategies, needs = [], {}
    for node in graph.nodes:
        strats = node_strategies(graph, node, uf, max_classes, keep)
        strategies.append(strats)
        for si, st in enumerate(strats):
            for op_id, ch in st.choices:
                for i, t in enumerate(graph.ops[op_id].inputs):
                    if t is None or ch.inputs[i] is None:
                        continue
                    src_t = pairs.get(t, t)  # a state input is laid out like its update
                    if src_t not in producer_node:
                        continue  # data inputs are fed in whatever layout is needed
                    rec = needs.setdefault((src_t, ch.inputs[i]), {"consumers": {}, "ops": set()})
                    rec["consumers"].setdefault(node.id, set()).add(si)
                    rec["ops"].add(op_id)
    state_outs = set(pairs.values())
    for t in graph.outputs:  # outputs the user reads (not state) must end replicated
        if t is not None and t not in state_outs and t in producer_node:
            needs.setdefault((t, R), {"consumers": {}, "ops": set()})["consumers"][-1] = {0}
    return Structure(graph, strategies, needs, producer_node, tail_start, pairs, num_state_leaves)


def price(st: Structure, cluster: Cluster, class_shares, only: list[int] | None = None) -> Tables:
    """Price every strategy and conversion of `st` at the given per-class shares.

    `only` (a strategy per node) prices just that assignment: enough to `evaluate` it.
    """
    graph = st.graph
    pr = Pricer(graph, cluster, class_shares)
    main, tail, main_at = [], [], []
    for n, strats in enumerate(st.strategies):
        m_row, t_row, at_row = [], [], []
        for si, strat in enumerate(strats):
            if only is not None and only[n] != si:
                m_row.append(0.0); t_row.append(0.0); at_row.append({})
                continue
            m = tl = 0.0
            at: dict[int, float] = {}
            for op_id, ch in strat.choices:
                t_op = pr.op_time(graph.ops[op_id], ch)
                if op_id >= st.tail_start:
                    tl += t_op
                elif t_op:
                    m += t_op
                    at[op_id] = t_op
            m_row.append(m); t_row.append(tl); at_row.append(at)
        main.append(m_row); tail.append(t_row); main_at.append(at_row)
    tables = Tables(st.strategies, main, tail, main_at, [], st.tail_start)
    for (t, need), rec in st.needs.items():
        src = st.producer_node[t]
        layouts = [s.layouts.get(t, R) for s in st.strategies[src]]
        if only is not None and not any(n < 0 or only[n] in ss for n, ss in rec["consumers"].items()):
            continue
        nbytes = graph.tensors[t].nbytes
        deferred = bool(rec["ops"]) and min(rec["ops"]) >= st.tail_start
        used = set(layouts) if only is None else {layouts[only[src]]}
        cost = {lay: pr.convert(lay, need, nbytes, deferred) for lay in used}
        if not any(cost.values()):
            continue
        pos = graph.tensors[t].producer if deferred else min(rec["ops"], default=len(graph.ops))
        tables.edges.append(Edge(src, t, need, layouts, rec["consumers"], cost, deferred, pos))
    tables.units = dict(pr._units)
    tables.group_latency = pr.group_latency
    tables.pricer = pr
    return tables


def build_tables(graph: Graph, cluster: Cluster, class_shares, *, num_state_leaves: int = 0,
                 max_classes: int = 3, uf=None, keep=()) -> Tables:
    """Structure and prices in one call."""
    return price(build_structure(graph, num_state_leaves=num_state_leaves, max_classes=max_classes,
                                 uf=uf, keep=keep), cluster, class_shares)


def edge_needed(e: Edge, assign) -> bool:
    return any(n < 0 or assign[n] in ss for n, ss in e.consumers.items())


class _Arrays:
    """Tables as numpy arrays, so one assignment evaluates in about a millisecond."""

    def __init__(self, tables: Tables):
        N = len(tables.strategies)
        S = max(len(st) for st in tables.strategies)
        self.rows = np.arange(N)
        self.main = np.zeros((N, S))
        self.tail = np.zeros((N, S))
        self.at = []
        for n, per in enumerate(tables.main_at):
            self.main[n, :len(per)] = tables.main[n]
            self.tail[n, :len(per)] = tables.tail[n]
            self.at.append([(np.fromiter(d.keys(), int, len(d)), np.fromiter(d.values(), float, len(d)))
                            for d in per])
        E = len(tables.edges)
        self.src = np.array([e.src for e in tables.edges], int)
        self.cost = np.zeros((E, S))
        for k, e in enumerate(tables.edges):
            self.cost[k, :len(e.layouts)] = [e.cost.get(lay, 0.0) for lay in e.layouts]
        self.deferred = np.array([e.deferred for e in tables.edges], bool)
        self.position = np.array([e.position for e in tables.edges], int)
        self.always = np.array([k for k, e in enumerate(tables.edges) if -1 in e.consumers], int)
        trig = [[[] for _ in st] for st in tables.strategies]
        for k, e in enumerate(tables.edges):
            for n, ss in e.consumers.items():
                if n >= 0:
                    for s_ in ss:
                        trig[n][s_].append(k)
        self.triggers = [[np.array(t, int) for t in row] for row in trig]
        top = max([int(p.max()) for row in self.at for p, _ in row if len(p)] +
                  [int(self.position.max()) if E else 0])
        self.n_pos = top + 1


def evaluate(tables: Tables, assign: list[int]) -> dict:
    """Step time of an assignment (strategy index per node), with its breakdown.

    Main compute and inline conversions run in program order; deferred conversions
    queue on one stream from their producer's end (f = max(f, ready) + c, in issue
    order); step = max(main end, stream end) + tail.
    """
    ar = getattr(tables, "_arrays", None)
    if ar is None:
        ar = tables._arrays = _Arrays(tables)
    a = np.asarray(assign, int)
    main = float(ar.main[ar.rows, a].sum())
    tail = float(ar.tail[ar.rows, a].sum())
    needed = np.zeros(len(ar.src), bool)
    needed[ar.always] = True
    trig = [ar.triggers[n][s] for n, s in enumerate(assign)]
    if trig:
        needed[np.concatenate(trig)] = True
    c = ar.cost[np.arange(len(ar.src)), a[ar.src]] * needed if len(ar.src) else np.zeros(0)
    inline_mask = ~ar.deferred & (c > 0)
    inline = float(c[inline_mask].sum())
    main_end = main + inline
    ev = ar.deferred & (c > 0)
    comm_free, deferred_total = 0.0, 0.0
    if ev.any():
        by_pos = np.zeros(ar.n_pos)
        pos = [ar.at[n][s][0] for n, s in enumerate(assign)]
        val = [ar.at[n][s][1] for n, s in enumerate(assign)]
        np.add.at(by_pos, np.concatenate(pos), np.concatenate(val))
        np.add.at(by_pos, ar.position[inline_mask], c[inline_mask])
        cum = np.cumsum(by_pos)
        ev_pos = np.concatenate([[-1], ar.position[ev]])
        ev_c = np.concatenate([[tables.group_latency], c[ev]])
        order = np.lexsort((ev_c, ev_pos))
        ev_pos, ev_c = ev_pos[order], ev_c[order]
        ready = np.where(ev_pos >= 0, cum[np.clip(ev_pos, 0, None)], 0.0)
        C = np.cumsum(ev_c)
        comm_free = float(C[-1] + max(0.0, float(np.max(ready - (C - ev_c)))))
        deferred_total = float(C[-1])
    step = max(main_end, comm_free) + tail
    return {"step": step, "compute": main + tail, "inline_comm": inline,
            "deferred_comm": deferred_total, "exposed_comm": max(0.0, comm_free - main_end)}


def data_parallel(tables: Tables, batch) -> list[int]:
    """Data parallelism: every node shards the batch class if it holds it, else replicates."""
    return [next((i for i, s in enumerate(st) if s.klass == batch), 0) for st in tables.strategies]
