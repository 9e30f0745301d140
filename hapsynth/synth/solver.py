"""CP-SAT model: one strategy per node, minimising the priced step time.

Mirrors `pricing.evaluate` exactly (times in integer nanoseconds):
- x[n, s] one-hot per node; `main`/`tail` compute are linear in x;
- each conversion edge is paid if its producer's layout needs converting and some
  consumer strategy needs it (w >= [layout] + [needed] - 1);
- deferred conversions form one FIFO communication stream that overlaps the main
  part: F >= prefix_main(p_k) + sum of deferred costs issued at or after p_k;
- step T >= main + inline + tail and T >= F + tail.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from hapsynth.synth.pricing import Tables

NS = 1e9


def _ns(sec: float) -> int:
    return int(round(sec * NS))


@dataclass(frozen=True)
class SolveStats:
    status: str
    objective: float   # seconds
    bound: float       # seconds
    gap: float         # (objective - bound) / objective
    wall: float
    variables: int
    constraints: int


def solve(tables: Tables, hint: list[int], *, time_limit: float = 10.0, workers: int = 2,
          seed: int = 0) -> tuple[list[int], SolveStats]:
    m = cp_model.CpModel()
    x = [[m.new_bool_var(f"x{n}_{s}") for s in range(len(st))] for n, st in enumerate(tables.strategies)]
    for row in x:
        m.add_exactly_one(row)
    main_terms, tail_terms = [], []
    for n, row in enumerate(x):
        for s, v in enumerate(row):
            if tables.main[n][s]:
                main_terms.append(_ns(tables.main[n][s]) * v)
            if tables.tail[n][s]:
                tail_terms.append(_ns(tables.tail[n][s]) * v)

    deferred_positions = sorted({e.position for e in tables.edges if e.deferred})
    n_seg = len(deferred_positions)
    seg_terms = [[] for _ in range(n_seg)]

    def seg_of(pos):
        k = bisect.bisect_left(deferred_positions, pos)
        return k if k < n_seg else None

    for n, row in enumerate(x):
        for s, v in enumerate(row):
            acc: dict[int, float] = {}
            for pos, t in tables.main_at[n][s].items():
                k = seg_of(pos)
                if k is not None:
                    acc[k] = acc.get(k, 0.0) + t
            for k, t in acc.items():
                if _ns(t):
                    seg_terms[k].append(_ns(t) * v)

    # A complete hint (every auxiliary variable too) hands CP-SAT a feasible start.
    aux_hint = []
    chosen = lambda node, ss: node < 0 or hint[node] in ss  # noqa: E731
    inline_terms, deferred_by_pos = [], {}
    for ei, e in enumerate(tables.edges):
        is_needed = any(chosen(n, ss) for n, ss in e.consumers.items())
        if -1 in e.consumers:
            needed = 1
        else:
            needed = m.new_bool_var(f"need{ei}")
            aux_hint.append((needed, int(is_needed)))
            for node, ss in e.consumers.items():
                for s in ss:
                    m.add_implication(x[node][s], needed)
        by_layout: dict = {}
        for s, lay in enumerate(e.layouts):
            by_layout.setdefault(lay, []).append(x[e.src][s])
        for lay, vs in by_layout.items():
            c = _ns(e.cost[lay])
            if not c:
                continue
            w = m.new_bool_var(f"w{ei}")
            m.add(w >= sum(vs) + needed - 1)
            aux_hint.append((w, int(is_needed and e.layouts[hint[e.src]] == lay)))
            term = c * w
            if e.deferred:
                deferred_by_pos.setdefault(e.position, []).append(term)
            else:
                inline_terms.append(term)
                k = seg_of(e.position)
                if k is not None:
                    seg_terms[k].append(term)

    horizon = _ns(sum(max(r) for r in tables.main) + sum(max(r) for r in tables.tail)
                  + sum(max(e.cost.values()) for e in tables.edges)) + 1
    T = m.new_int_var(0, horizon, "T")
    tail = sum(tail_terms)
    m.add(T >= sum(main_terms) + sum(inline_terms) + tail)
    if n_seg:
        F = m.new_int_var(0, horizon, "F")
        suffix = 0
        suffixes = [None] * n_seg
        for k in range(n_seg - 1, -1, -1):
            suffix = suffix + sum(deferred_by_pos.get(deferred_positions[k], []))
            suffixes[k] = suffix
        m.add(F >= _ns(tables.group_latency) + suffixes[0])
        prefix = 0
        for k in range(n_seg):
            pk = m.new_int_var(0, horizon, f"prefix{k}")
            m.add(pk == prefix + sum(seg_terms[k]))
            prefix = pk
            m.add(F >= pk + suffixes[k])
        m.add(T >= F + tail)
    m.minimize(T)
    for n, s in enumerate(hint):
        for si, v in enumerate(x[n]):
            m.add_hint(v, si == s)
    for v, val in aux_hint:
        m.add_hint(v, val)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = int(seed)
    solver.parameters.repair_hint = True
    t0 = time.perf_counter()
    status = solver.solve(m)
    wall = time.perf_counter() - t0
    name = solver.status_name(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return list(hint), SolveStats(name, float("nan"), float("nan"), float("nan"), wall,
                                      len(m.proto.variables), len(m.proto.constraints))
    assign = [next(s for s, v in enumerate(row) if solver.value(v)) for row in x]
    obj, bound = solver.objective_value / NS, solver.best_objective_bound / NS
    gap = 0.0 if obj <= 0 else max(0.0, (obj - bound) / obj)
    return assign, SolveStats(name, obj, bound, gap, wall, len(m.proto.variables),
                              len(m.proto.constraints))
