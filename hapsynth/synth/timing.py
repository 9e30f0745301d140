"""The step time of an assignment (one strategy per node) under priced tables.

Time model (one compute stream, one communication stream per device):
- the *main* part runs ops in program order; each op takes the time of its slowest
  device class; a conversion an op needs is paid inline, before it;
- inline all-reduces that XLA combines into one (`pricing._combine`) pay one latency;
- conversions feeding the *tail* (the optimizer, after the last contraction) are
  *deferred*: issued when their producer finishes, they overlap the remaining main
  compute on the communication stream (XLA's latency-hiding scheduler can do no better
  with one collective stream); the group pays one all-reduce latency;
- a conversion of stored state (a parameter all-gathered for its readers: its source is
  a step input, there from the start, or checkpointing's copy of one) is *prefetched*:
  issued once the previous prefetched conversion's reader starts (one ahead, as FSDP
  prefetches the next layer's gather), it overlaps the compute in between and goes
  before the deferred conversions waiting then; its reader waits for what is not hidden;
- the stream overlaps compute only: an inline collective has the link to itself, so the
  stream's clock (`stream`'s `before`) is the main compute's, and the inline
  collectives' time is added to its end;
- step = max(main compute + prefetch waits, stream end) + inline conversions + tail.
The CP-SAT model (`solver.py`) encodes the same formula, except that it pays prefetched
conversions inline (an upper bound; every plan is confirmed by `evaluate`).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepTime:
    """Seconds: the step, and where it goes."""

    step: float
    compute: float        # main + tail compute (slowest class per op)
    inline_comm: float    # conversions paid before their consumers
    deferred_comm: float  # gradient-style conversions overlapping the backward pass
    exposed_comm: float   # the part of the deferred ones not hidden by compute
    prefetched_comm: float = 0.0  # stored state gathered ahead of its readers
    prefetch_wait: float = 0.0    # the part of those not hidden by compute


class EvalArrays:
    """Tables as numpy arrays, so one assignment evaluates in about a millisecond."""

    def __init__(self, tables):
        strategies = tables.strategies
        N = len(strategies)
        S = max(len(st) for st in strategies)
        self.rows = np.arange(N)
        self.main = np.zeros((N, S))
        self.tail = np.zeros((N, S))
        self.at = []
        for n, per in enumerate(tables.main_at):
            self.main[n, :len(per)] = tables.main[n]
            self.tail[n, :len(per)] = tables.tail[n]
            self.at.append([(np.fromiter(d.keys(), int, len(d)), np.fromiter(d.values(), float, len(d)))
                            for d in per])
        edges = tables.edges
        E = len(edges)
        self.src = np.array([e.src for e in edges], int)
        self.cost = np.zeros((E, S))
        for k, e in enumerate(edges):
            self.cost[k, :len(e.layouts)] = [e.seconds(lay) for lay in e.layouts]
        self.deferred = np.array([e.deferred for e in edges], bool)
        self.prefetch = np.array([e.prefetch for e in edges], bool)
        self.avail = np.array([e.avail for e in edges], int)
        self.position = np.array([e.position for e in edges], int)
        self.always = np.array([k for k, e in enumerate(edges) if -1 in e.consumers], int)
        trig = [[[] for _ in st] for st in strategies]
        for k, e in enumerate(edges):
            for n, ss in e.consumers.items():
                if n >= 0:
                    for s_ in ss:
                        trig[n][s_].append(k)
        self.triggers = [[np.array(t, int) for t in row] for row in trig]
        top = max([int(p.max()) for row in self.at for p, _ in row if len(p)] +
                  [int(self.position.max()) if E else 0])
        self.n_pos = top + 1
        self.group_latency = tables.group_latency
        # combined inline all-reduces: per edge its group (-1: none) and which producer
        # layouts it pools; per group the position its one latency is paid at
        self.group_of = np.full(E, -1, int)
        self.pooled = np.zeros((E, S), bool)
        self.group_pos = np.array([edges[g[0]].position for g in tables.combined], int)
        for gi, members in enumerate(tables.combined):
            for k in members:
                self.group_of[k] = gi
                self.pooled[k, :len(edges[k].layouts)] = [lay in edges[k].pooled
                                                          for lay in edges[k].layouts]


def evaluate(tables, assign, record: dict | None = None) -> StepTime:
    """Step time of an assignment (strategy index per node), with its breakdown.

    Main compute and inline conversions run in program order; deferred and prefetched
    conversions queue on one stream (`stream`), overlapping compute; step = max(main
    compute + waits for prefetched state, stream end) + inline conversions + tail. `record`, when given, receives the stream's
    events (`stream`) for drawing.
    """
    ar = tables.arrays
    a = np.asarray(assign, int)
    main = float(ar.main[ar.rows, a].sum())
    tail = float(ar.tail[ar.rows, a].sum())
    needed = np.zeros(len(ar.src), bool)
    needed[ar.always] = True
    trig = [ar.triggers[n][s] for n, s in enumerate(assign)]
    if trig:
        needed[np.concatenate(trig)] = True
    c = ar.cost[np.arange(len(ar.src)), a[ar.src]] * needed if len(ar.src) else np.zeros(0)
    ev = ar.deferred & (c > 0)
    pf = ar.prefetch & (c > 0)
    inline_mask = ~ar.deferred & (c > 0) & ~pf
    inline = float(c[inline_mask].sum())
    groups = np.zeros(0, int)
    if len(ar.group_pos):
        pays = needed & ar.pooled[np.arange(len(ar.src)), a[ar.src]] & (ar.group_of >= 0)
        groups = np.unique(ar.group_of[pays])
        inline += ar.group_latency * len(groups)
    wait, comm_free = 0.0, 0.0
    if ev.any() or pf.any():
        by_pos = np.zeros(ar.n_pos)
        pos = [ar.at[n][s][0] for n, s in enumerate(assign)]
        val = [ar.at[n][s][1] for n, s in enumerate(assign)]
        np.add.at(by_pos, np.concatenate(pos), np.concatenate(val))
        before = np.concatenate([[0.0], np.cumsum(by_pos)])  # compute alone: the link's clock
        d = np.flatnonzero(ev)
        d = d[np.lexsort((c[d], ar.position[d]))]
        d_pos = np.concatenate([[-1], ar.position[d]]) if len(d) else np.zeros(0, int)
        d_c = np.concatenate([[ar.group_latency], c[d]]) if len(d) else np.zeros(0)
        p = np.flatnonzero(pf)
        p = p[np.lexsort((c[p], ar.position[p]))]
        if record is not None:
            record.update(deferred=[-1, *d.tolist()] if len(d) else [], prefetched=p.tolist())
        wait, comm_free = stream(before, ar.position[p].tolist(), c[p].tolist(), d_pos, d_c,
                                 record, ar.avail[p].tolist())
    step = max(main + wait, comm_free) + inline + tail
    return StepTime(step, main + tail, inline, float(c[ev].sum()) + ar.group_latency * ev.any(),
                    max(0.0, comm_free - main - wait), float(c[pf].sum()), wait)


def stream(before, p_pos, p_c, d_pos, d_c, record: dict | None = None,
           p_avail=None) -> tuple[float, float]:
    """The communication stream: (the readers' waits in all, when the stream is free).

    `before[q]`: when op q starts, waits aside. Deferred conversions (`d_pos`, `d_c`,
    in issue order; position -1: ready at once) are ready when their producer ends.
    Prefetched ones (`p_pos`: their first reader, `p_c`, in order) are issued when the
    previous one's reader starts (the first at once), and not before op `p_avail` (a
    copy of a step input: the copy; -1: none) is done; a reader waits for the part of its
    gather not done, and every later op with it. A transfer runs to its end; then a
    prefetched gather issued by then goes first (its reader waits on it; a gradient
    waits only for the optimizer, as FSDP issues the next all-gather before the
    reduce-scatters), else the deferred conversions in order. `record` gets per deferred
    conversion `(start, end)` under "deferred_spans", per prefetched `(start, end,
    wait)` under "prefetched_spans"."""
    waited, free, i, D = 0.0, 0.0, 0, len(d_pos)
    d_spans, p_spans = [], []
    stall_pos, stall_sum = [], []  # readers' positions, the waits up to each

    def ready(j) -> float:
        q = d_pos[j]
        k = bisect.bisect_right(stall_pos, q)
        return (before[q + 1] if q >= 0 else 0.0) + (stall_sum[k - 1] if k else 0.0)

    def deferred_before(t) -> None:
        nonlocal free, i
        while i < D:
            start = max(free, ready(i))
            if start >= t:
                return
            free = start + d_c[i]
            d_spans.append((start, free))
            i += 1

    def reader(k) -> float:
        nonlocal waited
        q = p_pos[k]
        w = max(0.0, p_spans[k][1] - (before[q] + waited))
        waited += w
        stall_pos.append(q)
        stall_sum.append(waited)
        p_spans[k] = (*p_spans[k][:2], w)
        return before[q] + waited

    for k, sec in enumerate(p_c):
        issue = reader(k - 1) if k else 0.0
        made = p_avail[k] if p_avail else -1
        earliest = max(issue, before[made + 1] + waited if made >= 0 else 0.0)
        deferred_before(earliest)
        start = max(free, earliest)
        free = start + sec
        p_spans.append((start, free, 0.0))
    if p_c:
        reader(len(p_c) - 1)
    if i < D:  # the rest in one go: f_j = max(f_j-1, r_j) + c_j
        q = np.asarray(d_pos[i:])
        k = np.searchsorted(np.asarray(stall_pos, int), q, side="right")
        r = np.where(q >= 0, np.asarray(before)[np.clip(q + 1, 0, None)], 0.0)
        r = r + np.concatenate([[0.0], stall_sum])[k]
        C = np.cumsum(d_c[i:])
        ends = C + np.maximum(free, np.maximum.accumulate(r - (C - d_c[i:])))
        if record is not None:
            d_spans += list(zip((ends - d_c[i:]).tolist(), ends.tolist()))
        free = float(ends[-1])
    if record is not None:
        record.update(deferred_spans=d_spans, prefetched_spans=p_spans)
    return waited, free
