"""One step laid out in time, per device class: what `timing.evaluate` sums, as spans.

Under the time model of `timing.py` every class runs the same ops in program order,
each op lasting as long as its slowest class takes, so a faster class is idle for the
rest. Consecutive ops are merged into one segment until a collective interrupts: per
class, a `compute` span (its busy time) then an `idle` span (waiting for the slowest).
Inline collectives occupy every class (a group XLA combines pays one latency first); the
gradient sync and the gathers of stored state ahead of their readers (`prefetch`) run on
their own `sync` lane, overlapping the main part; `wait` is what of them is not hidden;
then the tail (optimizer).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from hapsynth.synth.pricing import paid_groups
from hapsynth.synth.timing import evaluate

SYNC = "sync"  # the lane of deferred (overlapped) collectives


@dataclass(frozen=True)
class Span:
    """`lane` (a class name or "sync") is `kind` from `start` to `end` seconds."""

    lane: str
    start: float
    end: float
    kind: str    # compute, idle, collective, wait, sync, prefetch
    label: str = ""

    @property
    def seconds(self) -> float:
        return self.end - self.start


def timeline(tables, assign, names) -> tuple[Span, ...]:
    """Spans of one step of assignment `assign` under `tables`, lanes named by `names`
    (one per class, in class order) and `SYNC`; the last span ends at the step time."""
    st, pricer = tables.structure, tables.pricer
    graph = st.graph
    per_op: dict[int, tuple[float, ...]] = {}
    for n, s in enumerate(assign):
        for op_id, ch in st.strategies[n][s].choices:
            times = pricer.class_times(graph.ops[op_id], ch)
            if max(times):
                per_op[op_id] = times
    rec: dict = {}
    step = evaluate(tables, assign, rec)
    edges = tables.edges
    ahead = set(rec.get("prefetched", ()))
    inline: dict[int, list] = {}
    for k, e in enumerate(edges):
        if (not e.deferred and k not in ahead and e.seconds(e.layouts[assign[e.src]])
                and e.needed(assign)):
            inline.setdefault(e.position, []).append(e)
    for p, g, _ in paid_groups(tables, assign):  # first, the one latency of a combined group
        inline.setdefault(p, []).insert(0, g)
    waits: dict[int, float] = {}
    for k, (_, _, w) in zip(rec.get("prefetched", ()), rec.get("prefetched_spans", ())):
        waits[edges[k].position] = waits.get(edges[k].position, 0.0) + w
    out: list[Span] = []
    lanes = _Lanes(names, out, tables.group_latency)
    for p in range(st.tail_start):
        if waits.get(p):
            lanes.flush()
            lanes.wait(waits.pop(p), "gather not hidden")
        for e in inline.pop(p, ()):
            lanes.collective(e, assign)
        if p in per_op:
            lanes.compute(per_op[p])
    lanes.flush()
    for p in sorted(waits):  # a gather read first in the tail
        lanes.wait(waits[p], "gather not hidden")
    for p in sorted(inline):  # read only by outputs or the tail: paid at the main part's end
        for e in inline[p]:
            lanes.collective(e, assign)
    real = lanes.real_time
    for kind, key in (("sync", "deferred"), ("prefetch", "prefetched")):
        for k, (start, end, *_) in zip(rec.get(key, ()), rec.get(key + "_spans", ())):
            label = ("all-reduce latency (once per group)" if k < 0 else
                     _label(edges[k], assign))
            out.append(Span(SYNC, real(start), real(start) + end - start, kind, label))
    if step.exposed_comm > 0:
        lanes.wait(step.exposed_comm, "gradient sync not hidden")
    for op_id in sorted(per_op):
        if op_id >= st.tail_start:
            lanes.compute(per_op[op_id])
    lanes.flush("tail")
    return tuple(out)


class _Lanes:
    """Builds the class lanes: compute merged per segment, cut by collectives."""

    def __init__(self, names, out, group_latency=0.0):
        self.names, self.out = tuple(names), out
        self.group_latency = group_latency
        self.now = 0.0
        self.pending = 0.0                 # the open segment's length so far
        self.busy = [0.0] * len(self.names)
        self.paused: list[float] = []      # the link's clock at each inline collective
        self.pauses: list[float] = []      # inline time up to and including each

    def compute(self, times) -> None:
        self.pending += max(times)
        self.busy = [b + t for b, t in zip(self.busy, times)]

    def flush(self, label: str = "") -> None:
        if self.pending <= 0:
            return
        end = self.now + self.pending
        for name, b in zip(self.names, self.busy):
            if b > 0:
                self.out.append(Span(name, self.now, self.now + b, "compute", label))
            if self.now + b < end:
                self.out.append(Span(name, self.now + b, end, "idle", label))
        self.now, self.pending = end, 0.0
        self.busy = [0.0] * len(self.names)

    def wait(self, seconds: float, label: str) -> None:
        for name in self.names:
            self.out.append(Span(name, self.now, self.now + seconds, "wait", label))
        self.now += seconds

    def collective(self, e, assign) -> None:
        """Edge `e`'s conversion, or (an int) the latency of combined group `e`."""
        self.flush()
        if isinstance(e, int):
            sec, label = self.group_latency, f"all-reduce latency (combined group {e})"
        else:
            sec, label = e.conversions[e.layouts[assign[e.src]]][2], _label(e, assign)
        for name in self.names:
            self.out.append(Span(name, self.now, self.now + sec, "collective", label))
        done = self.pauses[-1] if self.pauses else 0.0
        self.paused.append(self.now - done)
        self.pauses.append(done + sec)
        self.now += sec

    def real_time(self, t: float) -> float:
        """The lanes' time of `t` on the link's clock (which stops for inline collectives:
        the stream overlaps compute only, `timing.evaluate`)."""
        k = bisect.bisect_right(self.paused, t)
        return t + (self.pauses[k - 1] if k else 0.0)


def _label(e, assign) -> str:
    coll, form, _ = e.conversions[e.layouts[assign[e.src]]]
    return f"{coll} {form or ''} t{e.tensor}".replace("  ", " ")
