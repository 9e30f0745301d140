"""The step time of an assignment (one strategy per node) under priced tables.

Time model (one compute stream, one communication stream per device):
- the *main* part runs ops in program order; each op takes the time of its slowest
  device class; a conversion an op needs is paid inline, before it;
- inline all-reduces that XLA combines into one (`pricing._combine`) pay one latency;
- conversions feeding the *tail* (the optimizer, after the last contraction) are issued
  when their producer finishes and overlap the remaining main compute, one at a time in
  issue order (XLA's latency-hiding scheduler can do no better with one collective
  stream); the group pays one all-reduce latency;
- step = max(main end, last deferred conversion end) + tail compute.
The CP-SAT model (`solver.py`) encodes the same formula.
"""
from __future__ import annotations

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


def evaluate(tables, assign) -> StepTime:
    """Step time of an assignment (strategy index per node), with its breakdown.

    Main compute and inline conversions run in program order; deferred conversions
    queue on one stream from their producer's end (f = max(f, ready) + c, in issue
    order); step = max(main end, stream end) + tail.
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
    inline_mask = ~ar.deferred & (c > 0)
    inline = float(c[inline_mask].sum())
    groups = np.zeros(0, int)
    if len(ar.group_pos):
        pays = needed & ar.pooled[np.arange(len(ar.src)), a[ar.src]] & (ar.group_of >= 0)
        groups = np.unique(ar.group_of[pays])
        inline += ar.group_latency * len(groups)
    main_end = main + inline
    ev = ar.deferred & (c > 0)
    comm_free, deferred_total = 0.0, 0.0
    if ev.any():
        by_pos = np.zeros(ar.n_pos)
        pos = [ar.at[n][s][0] for n, s in enumerate(assign)]
        val = [ar.at[n][s][1] for n, s in enumerate(assign)]
        np.add.at(by_pos, np.concatenate(pos), np.concatenate(val))
        np.add.at(by_pos, ar.position[inline_mask], c[inline_mask])
        np.add.at(by_pos, ar.group_pos[groups], ar.group_latency)
        cum = np.cumsum(by_pos)
        ev_pos = np.concatenate([[-1], ar.position[ev]])
        ev_c = np.concatenate([[ar.group_latency], c[ev]])
        order = np.lexsort((ev_c, ev_pos))
        ev_pos, ev_c = ev_pos[order], ev_c[order]
        ready = np.where(ev_pos >= 0, cum[np.clip(ev_pos, 0, None)], 0.0)
        C = np.cumsum(ev_c)
        comm_free = float(C[-1] + max(0.0, float(np.max(ready - (C - ev_c)))))
        deferred_total = float(C[-1])
    step = max(main_end, comm_free) + tail
    return StepTime(step, main + tail, inline, deferred_total, max(0.0, comm_free - main_end))
