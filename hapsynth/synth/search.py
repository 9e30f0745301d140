"""Searching assignments (one strategy per node) at fixed shares: starts, a memory fit,
and a local search whose every move is confirmed by the full evaluator."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from hapsynth.cluster import Cluster
from hapsynth.synth.memory import MemoryModel
from hapsynth.synth.pricing import Tables, price
from hapsynth.synth.strategy import CARRY
from hapsynth.synth.structure import Structure, stored_copies
from hapsynth.synth.timing import evaluate


@dataclass(frozen=True, eq=False)
class Priced:
    """One set of class shares: its tables, its memory model, and the memory to fit in."""

    tables: Tables
    capacity: float

    @classmethod
    def at(cls, st: Structure, cluster: Cluster, shares, capacity: float,
           only=None, follow: frozenset | None = None) -> "Priced":
        """Priced at `shares` (for the factor sizes in `follow`; see `pricing.Pricer`);
        `only` (an assignment) prices just what it uses."""
        return cls(price(st, cluster, shares, only, follow), capacity)

    @cached_property
    def memory(self) -> MemoryModel:
        return MemoryModel(self.tables)

    @property
    def shares(self) -> tuple[float, ...]:
        return self.tables.shares

    @property
    def even_state(self) -> bool:
        """Are sizes other than the batch's split evenly (state unpadded)?"""
        return self.tables.pricer.follow is not None

    def time(self, assign) -> float:
        return evaluate(self.tables, assign).step

    def fits(self, assign) -> bool:
        return self.memory.total(assign) <= self.capacity


def shares_by(cluster: Cluster, speed) -> tuple[float, ...]:
    """Per-class shares proportional to `speed(class)` times its device count."""
    w = [c.count * speed(c) for c in cluster.classes]
    return tuple(x / sum(w) for x in w)


def share_candidates(cluster: Cluster) -> list[tuple[float, ...]]:
    """Per-class shares between FLOP/s-proportional, bandwidth-proportional and even."""
    flops = shares_by(cluster, lambda c: c.flops)
    bw = shares_by(cluster, lambda c: c.mem_bandwidth)
    even = shares_by(cluster, lambda c: 1.0)
    out = []
    for g in (0.0, 0.5, 1.0):                    # flops -> bandwidth
        mix = tuple((1 - g) * a + g * b for a, b in zip(flops, bw))
        for lam in (0.0, 0.25, 0.5):             # -> even
            out.append(tuple((1 - lam) * a + lam * e for a, e in zip(mix, even)))
    return list(dict.fromkeys(out))


def switch_classes(tables: Tables, assign, classes) -> list[int]:
    """Every node holding one of `classes` shards the first it holds; others keep theirs."""
    out = list(assign)
    for n, strats in enumerate(tables.strategies):
        ks = [s.klass for s in strats]
        for c in classes:
            if c in ks:
                out[n] = ks.index(c)
                break
    return out


def data_parallel(tables: Tables, batch) -> list[int]:
    """Every node shards a batch class if it holds one (`batch`: the classes, most ops
    first), else replicates: partial sums (gradients) are all-reduced where they are made,
    as `jit` with a batch-sharded input does, or carried on where that is cheaper (XLA
    moves the all-reduce of a sum accumulated in a loop out of the loop)."""
    assign = switch_classes(tables, [0] * len(tables.strategies), batch)
    carry = [next((i for i, s in enumerate(st) if s.name == CARRY), None)
             for st in tables.strategies]
    free = [n for n, c in enumerate(carry)
            if c is not None and tables.strategies[n][assign[n]].klass is None]
    # from the better of "sum where made" and "carry every sum as far as it goes" (a
    # gradient reaching a parameter through several ops: LoRA's adapters), one node at
    # a time the other way while that is faster
    best = evaluate(tables, assign).step
    carried = list(assign)
    for n in free:
        carried[n] = carry[n]
    t = evaluate(tables, carried).step
    if t < best * (1 - 1e-9):
        assign, best = carried, t
    for n in free:
        trial = list(assign)
        trial[n] = carry[n] if assign[n] != carry[n] else 0
        t = evaluate(tables, trial).step
        if t < best * (1 - 1e-9):
            assign, best = trial, t
    return assign


def state_classes(graph, uf, num_state_leaves: int, fraction: float = 0.25) -> list[list]:
    """Candidate ways to shard the largest state tensors (those at least `fraction` of the
    largest), one per dim: the factor classes sitting on that dim in their consumers
    (e.g. every layer's expert dim). Sharding them cuts state memory."""
    state = graph.inputs[:num_state_leaves]
    top = max((graph.tensors[t].nbytes for t in state), default=0)
    big = {t for t in state if graph.tensors[t].nbytes >= fraction * top}
    by_dim: dict[int, list] = {}
    for op in graph.ops:
        for fi, f in enumerate(op.rule.factors):
            if not f.shardable:
                continue
            for i, d in f.operands:
                if op.inputs[i] in big:
                    c = uf.find((op.id, fi))
                    if c not in by_dim.setdefault(d, []):
                        by_dim[d].append(c)
    return [by_dim[d] for d in sorted(by_dim)]


class Decisions:
    """The tied decision groups of an assignment, with a cheap local time per group:
    its nodes' compute plus the conversions touching them (no overlap)."""

    def __init__(self, tables: Tables, ties):
        self.tables = tables
        self.ties = ties or list(range(len(tables.strategies)))
        self.groups: dict = {}
        for n, rep in enumerate(self.ties):
            self.groups.setdefault(rep, []).append(n)
        self.touching: dict = {}
        for e in tables.edges:
            for n in {e.src, *(c for c in e.consumers if c >= 0)}:
                self.touching.setdefault(self.ties[n], []).append(e)

    def set(self, assign, rep, s) -> list[int]:
        out = list(assign)
        for n in self.groups[rep]:
            out[n] = s
        return out

    def local_time(self, a, rep) -> float:
        tb = self.tables
        t = sum(tb.main[n][a[n]] + tb.tail[n][a[n]] for n in self.groups[rep])
        return t + sum(e.seconds(e.layouts[a[e.src]]) for e in self.touching.get(rep, ())
                       if e.needed(a))


#: Moves `fit_memory` makes without lowering the peak before it gives up.
STALL = 8


def fit_memory(pr: Priced, assign, ties=None) -> list[int]:
    """Greedy start when an assignment does not fit: repeatedly switch the decision
    (a node with its tied copies) that frees the most memory per second it adds, while
    that lowers the peak within `STALL` moves."""
    dec = Decisions(pr.tables, ties)
    assign = list(assign)
    lowest, stalled = pr.memory.total(assign), 0
    for _ in range(len(assign)):
        total = pr.memory.total(assign)
        if total <= pr.capacity:
            break
        if total < lowest * (1 - 1e-6):
            lowest, stalled = total, 0
        elif stalled >= STALL:  # (the peak is elsewhere than the moves reach: give up)
            break
        else:
            stalled += 1
        saving: dict = {}
        for n, per in pr.memory.constraint_rows(assign):
            for s, b in enumerate(per):
                key = (dec.ties[n], s)
                saving[key] = saving.get(key, 0.0) + per[assign[n]] - b
        best = None
        for (rep, s), gain in saving.items():
            if gain <= 0 or s == assign[rep]:
                continue
            trial = dec.set(assign, rep, s)
            cost = max(dec.local_time(trial, rep) - dec.local_time(assign, rep), 0.0) + 1e-9
            if best is None or (cost / gain, rep, s) < best[0]:
                best = ((cost / gain, rep, s), trial)
        if best is None:
            break
        assign = best[1]
    return assign


def local_search(pr: Priced, assign, ties=None, budget: int = 200, class_moves=()) -> list[int]:
    """Descent from `assign`: coordinated moves first (every node holding a class set
    switches to it: expert parallelism needs forward, backward and optimizer nodes to
    agree), then single decisions screened by local time, then moves that drop an
    expensive conversion, then pair moves at both ends of one. Every move is confirmed by
    the full evaluator and the memory bound; `budget` caps those full evaluations (a
    count, so results are reproducible)."""
    tables = pr.tables
    dec = Decisions(tables, ties)
    assign = list(assign)
    best = pr.time(assign)
    spent = 0

    def exhausted():
        return spent >= budget

    def accept(trial):
        nonlocal assign, best, spent
        spent += 1
        t = pr.time(trial)
        if t < best * (1 - 1e-6) and pr.fits(trial):
            assign, best = trial, t
            return True
        return False

    def paid(e):
        return e.seconds(e.layouts[assign[e.src]]) if e.needed(assign) else 0.0

    def costly_edges(limit=40):
        ranked = sorted(((paid(e), k) for k, e in enumerate(tables.edges)), reverse=True)
        return [tables.edges[k] for c, k in ranked[:limit] if c]

    def costly_pairs(limit=40):
        """(producer group, consumer group) of the most expensive conversions now paid."""
        out = []
        for e in tables.edges:
            c = paid(e)
            for n, ss in e.consumers.items():
                if c and n >= 0 and assign[n] in ss and dec.ties[n] != dec.ties[e.src]:
                    out.append((c, dec.ties[e.src], dec.ties[n]))
        out.sort(reverse=True)
        return list(dict.fromkeys((a, b) for _, a, b in out))[:limit]

    def single_moves():
        moved = False
        for rep in sorted(dec.groups, key=lambda r: -dec.local_time(assign, r)):
            if exhausted():
                break
            here = dec.local_time(assign, rep)
            for s in range(len(tables.strategies[rep])):
                if s == assign[rep]:
                    continue
                trial = dec.set(assign, rep, s)
                if dec.local_time(trial, rep) < here - 1e-12 and accept(trial):
                    moved = True
                    here = dec.local_time(assign, rep)
        return moved

    def drop_conversions():
        """Every consumer group needing an expensive conversion moves at once."""
        moved = False
        for e in costly_edges():
            if exhausted():
                break
            trial = list(assign)
            for n, ss in e.consumers.items():
                if n < 0 or trial[n] not in ss:
                    continue
                rep = dec.ties[n]
                options = [s_ for s_ in range(len(tables.strategies[rep])) if s_ not in ss]
                if options:
                    trial = min((dec.set(trial, rep, s_) for s_ in options),
                                key=lambda t: dec.local_time(t, rep))
            moved |= trial != assign and accept(trial)
        return moved

    def pair_moves():
        moved = False
        for r1, r2 in costly_pairs():
            if exhausted():
                break
            here = dec.local_time(assign, r1) + dec.local_time(assign, r2)
            trials = []
            for s1 in range(len(tables.strategies[r1])):
                for s2 in range(len(tables.strategies[r2])):
                    if (s1, s2) == (assign[r1], assign[r2]):
                        continue
                    trial = dec.set(dec.set(assign, r1, s1), r2, s2)
                    d = dec.local_time(trial, r1) + dec.local_time(trial, r2) - here
                    if d < -1e-12:
                        trials.append((d, trial))
            for _, trial in sorted(trials, key=lambda x: x[0])[:3]:
                if accept(trial):
                    moved = True
                    break
        return moved

    improved = True
    while improved and not exhausted():
        improved = False
        for classes in class_moves:
            improved |= accept(switch_classes(tables, assign, classes))
        improved = single_moves() or improved
        improved = improved or drop_conversions() or pair_moves()
    return assign


def hold_copies(pr: Priced, assign) -> list[int]:
    """Per node copying parameters for the backward pass (checkpointing's copies,
    `ir/checkpoint.py`), one at a time and apart from its repeated layers' ties, the
    largest first: every other strategy of it, kept where it fits and prices faster. Read
    in the layout its readers need, a copy lets the forward pass's gather be held and
    serve the backward instead of gathering again: a few layers' parameters may be held
    where every layer's would not fit (the ties move all layers at once)."""
    st = pr.tables.structure
    size: dict[int, int] = {}
    for copy in stored_copies(st.graph, st.pairs):
        n = st.producer_node[copy]
        size[n] = size.get(n, 0) + st.graph.tensors[copy].nbytes
    nodes = sorted((-b, n) for n, b in size.items())
    assign = list(assign)
    best = pr.time(assign)
    for _, n in nodes:
        for s in range(len(st.strategies[n])):
            if s == assign[n]:
                continue
            trial = assign[:n] + [s] + assign[n + 1:]
            t = pr.time(trial)
            if t < best * (1 - 1e-4) and pr.fits(trial):
                assign, best = trial, t
    return assign
