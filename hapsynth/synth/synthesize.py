"""Synthesis: alternate CP-SAT strategy choice and per-class shares (HAP's scheme).

1. Structure (strategies, needed layouts) once; baselines DP-EV, DP-CP and ideal.
2. Shares start proportional to FLOP/s; CP-SAT picks strategies from the best known
   assignment (a data-parallel hint, so a feasible plan always exists).
3. With strategies fixed, shares are searched on a small grid between FLOP/s,
   memory bandwidth and even; repeat 2-3 until no improvement.
The returned plan is never slower than DP-EV or DP-CP under the same cost model:
when a baseline prices best, it is the plan (and `Plan.chosen` says so).
"""
from __future__ import annotations

import hashlib
import time

from hapsynth.ir.graph import Graph
from hapsynth.synth.cluster import Cluster
from hapsynth.synth.memory import memory_per_device, memory_rows
from hapsynth.synth.plan import Conversion, Plan, layout_str
from hapsynth.synth.pricing import build_structure, data_parallel, edge_needed, evaluate, price
from hapsynth.synth.solver import solve
from hapsynth.synth.strategy import batch_class, layer_ties, link_factors


class InfeasibleMemory(ValueError):
    """No plan found fits a device class's memory."""


def graph_signature(graph: Graph) -> str:
    h = hashlib.sha256()
    for op in graph.ops:
        h.update(repr((op.primitive, op.inputs, op.outputs)).encode())
    for t in graph.tensors:
        h.update(repr((t.shape, t.dtype)).encode())
    return h.hexdigest()[:16]


def _shares(cluster: Cluster, speed) -> tuple[float, ...]:
    w = [c.count * speed(c) for c in cluster.classes]
    return tuple(x / sum(w) for x in w)


def share_candidates(cluster: Cluster) -> list[tuple[float, ...]]:
    """Per-class shares between FLOP/s-proportional, bandwidth-proportional and even."""
    flops = _shares(cluster, lambda c: c.flops)
    bw = _shares(cluster, lambda c: c.mem_bandwidth)
    even = _shares(cluster, lambda c: 1.0)
    out = []
    for g in (0.0, 0.5, 1.0):                    # flops -> bandwidth
        mix = tuple((1 - g) * a + g * b for a, b in zip(flops, bw))
        for lam in (0.0, 0.25, 0.5):             # -> even
            out.append(tuple((1 - lam) * a + lam * e for a, e in zip(mix, even)))
    return list(dict.fromkeys(out))


def preferred(tables, classes) -> list[int]:
    """Each node shards the first class of `classes` it holds, else replicates."""
    return switch_classes(tables, [0] * len(tables.strategies), classes)


def state_classes(graph, uf, num_state_leaves: int, fraction: float = 0.25) -> list[list]:
    """Candidate ways to shard the largest state tensors (those at least `fraction` of the
    largest), one per dim: the factor classes sitting on that dim in their consumers
    (e.g. every layer's expert dim). Sharding them cuts state memory."""
    from hapsynth.synth.strategy import _shardable

    state = graph.inputs[:num_state_leaves]
    top = max((graph.tensors[t].nbytes for t in state), default=0)
    big = {t for t in state if graph.tensors[t].nbytes >= fraction * top}
    by_dim: dict[int, list] = {}
    for op in graph.ops:
        for fi, f in enumerate(op.rule.factors):
            if not _shardable(f):
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

    def __init__(self, tables, ties):
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
        return t + sum(e.cost[e.layouts[a[e.src]]] for e in self.touching.get(rep, ())
                       if edge_needed(e, a))


def fit_memory(st, tables, assign, capacity, ties=None) -> list[int]:
    """Greedy start when data parallelism does not fit: repeatedly switch the decision
    (a node with its tied copies) that frees the most memory per second it adds."""
    dec = Decisions(tables, ties)
    assign = list(assign)
    for _ in range(len(assign)):
        if memory_per_device(st, tables, assign)["total"] <= capacity:
            break
        saving: dict = {}
        for n, per in memory_rows(st, tables, assign):
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


def switch_classes(tables, assign, classes) -> list[int]:
    """Every node holding one of `classes` shards the first it holds; others keep theirs."""
    out = list(assign)
    for n, strats in enumerate(tables.strategies):
        ks = [s.klass for s in strats]
        for c in classes:
            if c in ks:
                out[n] = ks.index(c)
                break
    return out


def local_search(st, tables, assign, capacity, ties=None, budget: int = 200,
                 class_moves=()) -> list[int]:
    """Descent from `assign`: coordinated moves first (every node holding a class set
    switches to it: expert parallelism needs forward, backward and optimizer nodes to
    agree), then single decisions screened by local time, then moves that drop an
    expensive conversion. Every move is confirmed by the full evaluator and the memory
    bound; `budget` caps those full evaluations (a count, so results are reproducible)."""
    dec = Decisions(tables, ties)
    assign = list(assign)
    best = evaluate(tables, assign)["step"]
    spent = 0

    def exhausted():
        return spent >= budget

    def accept(trial):
        nonlocal assign, best, spent
        spent += 1
        t = evaluate(tables, trial)["step"]
        if t < best * (1 - 1e-6) and memory_per_device(st, tables, trial)["total"] <= capacity:
            assign, best = trial, t
            return True
        return False

    def costly_edges(limit=40):
        paid = [(e.cost.get(e.layouts[assign[e.src]], 0.0), k) for k, e in enumerate(tables.edges)]
        paid = [(c, k) for c, k in paid if c and edge_needed(tables.edges[k], assign)]
        return [tables.edges[k] for _, k in sorted(paid, reverse=True)[:limit]]

    def costly_pairs(limit=40):
        """(producer group, consumer group) of the most expensive conversions now paid."""
        out = []
        for e in tables.edges:
            c = e.cost.get(e.layouts[assign[e.src]], 0.0)
            if not c or not edge_needed(e, assign):
                continue
            for n, ss in e.consumers.items():
                if n >= 0 and assign[n] in ss and dec.ties[n] != dec.ties[e.src]:
                    out.append((c, dec.ties[e.src], dec.ties[n]))
        out.sort(reverse=True)
        return list(dict.fromkeys((a, b) for _, a, b in out))[:limit]

    improved = True
    while improved and not exhausted():
        improved = False
        for classes in class_moves:
            improved |= accept(switch_classes(tables, assign, classes))
        for rep in sorted(dec.groups, key=lambda r: -dec.local_time(assign, r)):
            if exhausted():
                break
            here = dec.local_time(assign, rep)
            for s in range(len(tables.strategies[rep])):
                if s == assign[rep]:
                    continue
                trial = dec.set(assign, rep, s)
                if dec.local_time(trial, rep) >= here - 1e-12:
                    continue
                if accept(trial):
                    improved = True
                    here = dec.local_time(assign, rep)
        if improved:
            continue
        # drop an expensive conversion: every consumer group needing it moves at once
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
            if trial != assign and accept(trial):
                improved = True
        if improved:
            continue
        # pair moves: change both ends of an expensive conversion together
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
                    improved = True
                    break
    return assign


def synthesize(graph: Graph, cluster: Cluster, *, num_state_leaves: int, data_inputs,
               time_limit: float = 10.0, workers: int = 2, seed: int = 0, max_rounds: int = 2,
               share_layers: bool = True, max_classes: int = 3,
               strategy: str = "auto", shares=None, min_gain: float = 0.05) -> Plan:
    """Synthesise a plan; `strategy="data-parallel"` returns data parallelism as the plan
    (for comparisons and benchmarks): at FLOP/s-proportional shares (DP-CP), or at
    `shares`, one fraction of the batch per device class.

    A data-parallel baseline that fits memory is kept unless the synthesized plan is
    predicted at least `min_gain` faster: the cost model's measured error on real runs
    is of that order (benchmarks/RESULTS.md), and data parallelism is the simplest
    program, with the fewest collectives."""
    if strategy not in ("auto", "data-parallel"):
        raise ValueError(f"strategy must be 'auto' or 'data-parallel', got {strategy!r}")
    if shares is not None:
        if strategy != "data-parallel":
            raise ValueError("shares= applies to strategy='data-parallel' only")
        shares = tuple(float(x) for x in shares)
        if len(shares) != cluster.num_classes or min(shares) < 0 or abs(sum(shares) - 1) > 1e-6:
            raise ValueError(f"shares must be {cluster.num_classes} non-negative fractions "
                             f"summing to 1 (one per class), got {shares!r}")
    t0 = time.perf_counter()
    uf = link_factors(graph)
    batch = batch_class(graph, uf, data_inputs)
    big = state_classes(graph, uf, num_state_leaves)
    keep = tuple(dict.fromkeys(c for c in (batch, *(c for cs in big for c in cs)) if c is not None))
    st = build_structure(graph, num_state_leaves=num_state_leaves, max_classes=max_classes,
                         uf=uf, keep=keep)
    phases = {"structure": time.perf_counter() - t0}
    mark = time.perf_counter()
    dp = data_parallel(st_tables := price(st, cluster, _shares(cluster, lambda c: c.flops)), batch)
    ev_shares = _shares(cluster, lambda c: 1.0)
    ev_tables = price(st, cluster, ev_shares)
    baselines = {"DP-EV": evaluate(ev_tables, dp)["step"], "DP-CP": evaluate(st_tables, dp)["step"],
                 "ideal": graph.flops / cluster.total_flops}
    capacity = min(c.memory for c in cluster.classes)
    baseline_memory = {"DP-EV": memory_per_device(st, ev_tables, dp)["total"],
                       "DP-CP": memory_per_device(st, st_tables, dp)["total"]}
    ties = layer_ties(graph, st.strategies) if share_layers else None
    phases["baselines"] = time.perf_counter() - mark
    if strategy == "data-parallel":
        tb = st_tables if shares is None else price(st, cluster, shares)
        need = memory_per_device(st, tb, dp)["total"]
        return _make_plan(graph, cluster, st, tb, dp, tb.pricer.shares, baselines,
                          baseline_memory, "DP-CP" if shares is None else "DP", need,
                          {"status": "NONE", "gap": None, "objective": None, "bound": None,
                           "solve_seconds": 0.0, "wall": time.perf_counter() - t0, "rounds": 0,
                           "phases": phases, "variables": 0, "decisions": len(graph.nodes)})
    mark = time.perf_counter()

    # Starts: data parallel, and "shard the big state tensors on dim d, else the batch"
    # (expert parallelism for an MoE), each made to fit memory, at FLOP/s-proportional
    # and at even shares (even shares pad less, which can be what makes a plan fit).
    starts = []
    for tb in (st_tables, ev_tables):
        for a in [dp] + [preferred(tb, [*cs, batch]) for cs in big]:
            if memory_per_device(st, tb, a)["total"] > capacity:
                a = fit_memory(st, tb, a, capacity, ties)
            fits = memory_per_device(st, tb, a)["total"] <= capacity
            starts.append(((not fits, evaluate(tb, a)["step"]), tb, a))
    _, tables, assign = min(starts, key=lambda x: x[0])
    shares = tables.pricer.shares
    moves = [cs for cs in big] + [[c] for c in keep]
    assign = local_search(st, tables, assign, capacity, ties, budget=int(40 * time_limit),
                          class_moves=moves)
    best = evaluate(tables, assign)["step"]
    phases["starts+search"] = time.perf_counter() - mark
    mark = time.perf_counter()
    stats, rounds, solve_wall = None, 0, 0.0
    candidates = share_candidates(cluster)
    for rounds in range(1, max_rounds + 1):
        if rounds > 1 and time.perf_counter() - t0 > 0.5 * time_limit:
            rounds -= 1
            break  # the wall-clock budget is what users asked for
        a, stats = solve(tables, assign, time_limit=0.3 * time_limit / rounds, workers=workers,
                         wall_limit=0.35 * time_limit / rounds,
                         seed=seed, ties=ties, memory=(capacity, memory_rows(st, tables, assign)))
        solve_wall += stats.wall
        a = local_search(st, tables, a, capacity, ties, budget=int(15 * time_limit),
                         class_moves=moves)
        if evaluate(tables, a)["step"] < best:
            assign, best = a, evaluate(tables, a)["step"]
        improved = False
        for cand in candidates:
            tb = price(st, cluster, cand, only=assign)
            t = evaluate(tb, assign)["step"]
            if t < best * (1 - 1e-3) and memory_per_device(st, tb, assign)["total"] <= capacity:
                shares, best, improved = cand, t, True
        if not improved:
            break
        tables = price(st, cluster, shares)

    chosen = "synthesized"
    fitting = [(baselines[name], name, tb) for name, tb in (("DP-CP", st_tables),
                                                            ("DP-EV", ev_tables))
               if memory_per_device(st, tb, dp)["total"] <= capacity]
    if fitting and best > min(fitting)[0] * (1 - min_gain):
        best, chosen, tables = min(fitting)
        assign, shares = dp, tables.pricer.shares
    need = memory_per_device(st, tables, assign)["total"]
    for c in cluster.classes:
        if need > c.memory:
            raise InfeasibleMemory(
                f"no plan found fits device class {c.name!r}: it needs {need / 2**30:.2f} GiB per "
                f"device ({need:.0f} bytes) but has {c.memory / 2**30:.2f} GiB ({c.memory} bytes), "
                f"short by {(need - c.memory) / 2**30:.2f} GiB")
    return _make_plan(graph, cluster, st, tables, assign, shares, baselines, baseline_memory,
                      chosen, need, {
        "status": stats.status if stats else "NONE",
        "gap": stats.gap if stats and stats.gap == stats.gap else None,
        "objective": stats.objective if stats and stats.objective == stats.objective else None,
        "bound": stats.bound if stats and stats.bound == stats.bound else None,
        "solve_seconds": solve_wall, "wall": time.perf_counter() - t0, "rounds": rounds,
        "phases": {**phases, "rounds": time.perf_counter() - mark},
        "variables": stats.variables if stats else 0,
        "decisions": len(set(ties)) if ties else len(graph.nodes)})


def _make_plan(graph, cluster, st, tables, assign, shares, baselines, baseline_memory, chosen, need,
               solver) -> Plan:
    ev = evaluate(tables, assign)
    op_factors = [-1] * len(graph.ops)
    busy = [0.0] * len(cluster.classes)
    layouts = ["R"] * len(graph.tensors)
    op_inputs = [()] * len(graph.ops)
    for n, s in enumerate(assign):
        for t, lay in st.strategies[n][s].layouts.items():
            layouts[t] = layout_str(lay)
        for op_id, ch in st.strategies[n][s].choices:
            op_factors[op_id] = -1 if ch.factor is None else ch.factor
            op_inputs[op_id] = tuple(None if x is None else layout_str(x) for x in ch.inputs)
            for c, t in enumerate(tables.pricer.class_times(graph.ops[op_id], ch)):
                busy[c] += t
    convs = []
    for e in tables.edges:
        lay = e.layouts[assign[e.src]]
        if not e.cost[lay] or not edge_needed(e, assign):
            continue
        nbytes = graph.tensors[e.tensor].nbytes
        coll, form, _ = tables.pricer.conversion(lay, e.need, nbytes, e.deferred)
        convs.append(Conversion(e.tensor, layout_str(lay), layout_str(e.need), coll, form,
                                e.cost[lay], e.deferred, int(nbytes)))
    return Plan(
        cluster=cluster.name, classes=tuple(c.name for c in cluster.classes),
        ratios={c.name: float(s) for c, s in zip(cluster.classes, shares)},
        predicted_step_time=ev["step"],
        breakdown={**{k: ev[k] for k in ("compute", "inline_comm", "deferred_comm", "exposed_comm")},
                   "compute_per_class": {c.name: b for c, b in zip(cluster.classes, busy)},
                   "idle_per_class": {c.name: ev["step"] - b for c, b in zip(cluster.classes, busy)}},
        baselines=baselines,
        baseline_memory={k: int(v) for k, v in baseline_memory.items()},
        memory={c.name: {"need": int(need), "capacity": int(c.memory)} for c in cluster.classes},
        solver=solver, strategies=tuple(assign), op_factors=tuple(op_factors),
        tensor_layouts=tuple(layouts), op_inputs=tuple(op_inputs),
        conversions=tuple(convs), shard_units={int(k): tuple(v) for k, v in tables.units.items()},
        signature=graph_signature(graph), unsupported=dict(graph.unsupported), chosen=chosen,
        state_leaves=st.num_state_leaves)
