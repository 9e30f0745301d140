"""CP-SAT model: one strategy per node, minimising the priced step time.

Mirrors `timing.evaluate` (times in integer nanoseconds), except that a prefetched
conversion of stored state is paid inline here (an upper bound):
- x[n, s] one-hot per node; `main`/`tail` compute are linear in x;
- each conversion edge is paid if its producer's layout needs converting and some
  consumer strategy needs it (w >= [layout] + [needed] - 1);
- deferred conversions form one FIFO communication stream that overlaps the main
  compute: F >= prefix_compute(p_k) + sum of deferred costs issued at or after p_k;
- a group of combined inline all-reduces pays one latency: y_g >= each member's w;
- step T >= main + inline + tail and T >= F + inline + tail.
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


class _Model:
    """A CP-SAT model that also evaluates every variable at the hint (a full start)."""

    def __init__(self):
        self.m = cp_model.CpModel()
        self.hint: dict = {}

    def bool(self, name, hint_value):
        v = self.m.new_bool_var(name)
        self.hint[v] = int(hint_value)
        return v

    def value(self, terms) -> int:
        return sum(c * (self.hint[v] if not isinstance(v, int) else v) for c, v in terms)

    def any_of(self, name, literals):
        """A bool at least each of `literals` (minimised, it is their or)."""
        y = self.bool(name, max([self.value([(1, v)]) for v in literals], default=0))
        for v in literals:
            self.m.add(y >= v)
        return y

    def define(self, name, terms, horizon):
        """An int var equal to sum(c * v for c, v in terms)."""
        v = self.m.new_int_var(0, horizon, name)
        self.m.add(v == sum(c * x for c, x in terms))
        self.hint[v] = self.value(terms)
        return v


def solve(tables: Tables, hint: list[int], *, time_limit: float = 10.0, workers: int = 2,
          seed: int = 0, ties: list[int] | None = None, wall_limit: float | None = None,
          memory: tuple[float, list] | None = None) -> tuple[list[int], SolveStats]:
    """Best assignment found from `hint`; `ties[n]` = node whose decision n shares.

    `memory = (capacity bytes, [(node, bytes per strategy), ...])` bounds per-device
    memory (see `MemoryModel.constraint_rows`). `time_limit` is CP-SAT deterministic time (the
    result depends only on the seed); `wall_limit` is a wall-clock backstop.
    """
    ties = ties or list(range(len(tables.strategies)))
    hint = [hint[ties[n]] for n in range(len(hint))]  # a tied hint
    M = _Model()
    m = M.m
    x = []
    for n, st in enumerate(tables.strategies):
        if ties[n] != n:
            x.append(x[ties[n]])
            continue
        x.append([M.bool(f"x{n}_{s}", hint[n] == s) for s in range(len(st))])
        m.add_exactly_one(x[n])
    main_terms, tail_terms = [], []
    for n, row in enumerate(x):
        for s, v in enumerate(row):
            if _ns(tables.main[n][s]):
                main_terms.append((_ns(tables.main[n][s]), v))
            if _ns(tables.tail[n][s]):
                tail_terms.append((_ns(tables.tail[n][s]), v))

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
                    seg_terms[k].append((_ns(t), v))

    inline_terms, deferred_at, group_paid = [], {}, {}
    group_of = {k: g for g, members in enumerate(tables.combined) for k in members}
    for ei, e in enumerate(tables.edges):
        if -1 in e.consumers or any(len(ss) == len(x[n]) for n, ss in e.consumers.items()):
            needed = 1  # some consumer needs this layout whatever it chooses
        else:
            needed = M.bool(f"need{ei}", any(hint[n] in ss for n, ss in e.consumers.items()))
            for node, ss in e.consumers.items():
                for s in ss:
                    m.add_implication(x[node][s], needed)
        by_layout: dict = {}
        for s, lay in enumerate(e.layouts):
            by_layout.setdefault(lay, []).append(x[e.src][s])
        for lay, vs in by_layout.items():
            c = _ns(e.seconds(lay))
            if not c:
                continue
            if len(vs) == len(e.layouts):      # the producer always has this layout
                terms = [(c, needed)]
            elif isinstance(needed, int):      # always needed: pay when the layout is chosen
                terms = [(c, v) for v in vs]
            else:
                hv = M.hint[needed] and e.layouts[hint[e.src]] == lay
                w = M.bool(f"w{ei}", hv)
                m.add(w >= sum(vs) + needed - 1)
                terms = [(c, w)]
            if lay in e.pooled:
                group_paid.setdefault(group_of[ei], []).extend(v for _, v in terms)
            if e.deferred:
                deferred_at.setdefault(seg_of(e.position), []).extend(terms)
            else:
                inline_terms += terms
    lat = _ns(tables.group_latency)
    for g, paid in group_paid.items():  # a combined group pays one latency if any member does
        inline_terms.append((lat, M.any_of(f"group{g}", paid)))

    horizon = _ns(sum(max(r) for r in tables.main) + sum(max(r) for r in tables.tail)
                  + sum(max(c[2] for c in e.conversions.values()) for e in tables.edges)
                  + tables.group_latency * (1 + len(tables.combined))) + 1
    T = m.new_int_var(0, horizon, "T")
    tail_terms = [(c, v) for c, v in tail_terms]
    bound_main = main_terms + inline_terms + tail_terms
    m.add(T >= sum(c * v for c, v in bound_main))
    t_hint = M.value(bound_main)
    if n_seg:
        tail = M.define("tail", tail_terms, horizon)
        suffix = [None] * n_seg
        nxt = []
        for k in range(n_seg - 1, -1, -1):   # D_k = deferred comm issued at or after p_k
            suffix[k] = M.define(f"suffix{k}", deferred_at.get(k, []) + nxt, horizon)
            nxt = [(1, suffix[k])]
        F = m.new_int_var(0, horizon, "F")
        # the group latency, paid once if any deferred conversion is
        z = M.any_of("deferred_paid", [v for terms in deferred_at.values() for _, v in terms])
        f_hint = _ns(tables.group_latency) * M.hint[z] + M.hint[suffix[0]]
        m.add(F >= _ns(tables.group_latency) * z + suffix[0])
        prev = []
        for k in range(n_seg):               # P_k = main time up to p_k
            pk = M.define(f"prefix{k}", seg_terms[k] + prev, horizon)
            prev = [(1, pk)]
            m.add(F >= pk + suffix[k])
            f_hint = max(f_hint, M.hint[pk] + M.hint[suffix[k]])
        inline = M.define("inline", inline_terms, horizon)
        m.add(T >= F + inline + tail)
        m.add_hint(F, f_hint)
        t_hint = max(t_hint, f_hint + M.hint[inline] + M.hint[tail])
    if memory is not None:
        cap, rows = memory
        kib = [(int(round(b / 1024)), x[n][s]) for n, per in rows for s, b in enumerate(per) if b]
        m.add(sum(c * v for c, v in kib) <= int(cap // 1024))
    m.minimize(T)
    m.add_hint(T, t_hint)
    for v, val in M.hint.items():
        m.add_hint(v, val)

    solver = cp_model.CpSolver()
    # A deterministic-time limit and interleaved workers make the result a function of
    # the seed; the wall-clock limit is only a backstop on slow machines.
    solver.parameters.max_deterministic_time = float(time_limit)
    solver.parameters.max_time_in_seconds = float(wall_limit or 3.0 * time_limit)
    solver.parameters.num_workers = int(workers)
    solver.parameters.interleave_search = True
    solver.parameters.random_seed = int(seed)
    # Full presolve costs more than the search on large models (measured: 15 s of 30 s on
    # BERT-base); a light one leaves the time to the search, which starts from the hint.
    solver.parameters.max_presolve_iterations = 1
    solver.parameters.cp_model_probing_level = 0
    solver.parameters.symmetry_level = 0
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
