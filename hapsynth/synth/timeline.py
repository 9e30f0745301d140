"""One step laid out in time, per device class: what `timing.evaluate` sums, as spans.

Under the time model of `timing.py` every class runs the same ops in program order,
each op lasting as long as its slowest class takes, so a faster class is idle for the
rest. Consecutive ops are merged into one segment until a collective interrupts: per
class, a `compute` span (its busy time) then an `idle` span (waiting for the slowest).
Inline collectives occupy every class (a group XLA combines pays one latency first); the gradient sync runs on its own `sync` lane,
overlapping the main part; `wait` is the sync not hidden; then the tail (optimizer).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from hapsynth.synth.pricing import paid_groups

SYNC = "sync"  # the lane of deferred (overlapped) collectives


@dataclass(frozen=True)
class Span:
    """`lane` (a class name or "sync") is `kind` from `start` to `end` seconds."""

    lane: str
    start: float
    end: float
    kind: str    # compute, idle, collective, wait, sync
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
    inline: dict[int, list] = {}
    deferred = []
    for e in tables.edges:
        sec = e.seconds(e.layouts[assign[e.src]])
        if not sec or not e.needed(assign):
            continue
        (deferred if e.deferred else inline.setdefault(e.position, [])).append(e)
    for p, g, _ in paid_groups(tables, assign):  # first, the one latency of a combined group
        inline.setdefault(p, []).insert(0, g)
    out: list[Span] = []
    lanes = _Lanes(names, out, tables.group_latency)
    ends: dict[int, float] = {}
    for p in range(st.tail_start):
        for e in inline.pop(p, ()):
            lanes.collective(e, assign)
        if p in per_op:
            lanes.compute(per_op[p])
        ends[p] = lanes.now + lanes.pending
    lanes.flush()
    for p in sorted(inline):  # read only by outputs or the tail: paid at the main part's end
        for e in inline[p]:
            lanes.collective(e, assign)
        ends[p] = lanes.now
    main_end = lanes.now
    free = _sync(out, deferred, assign, _ready(ends), main_end, tables.group_latency)
    if free > main_end:
        for name in names:
            out.append(Span(name, main_end, free, "wait", "gradient sync not hidden"))
        lanes.now = free
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

    def collective(self, e, assign) -> None:
        """Edge `e`'s conversion, or (an int) the latency of combined group `e`."""
        self.flush()
        if isinstance(e, int):
            sec, label = self.group_latency, f"all-reduce latency (combined group {e})"
        else:
            coll, form, sec = e.conversions[e.layouts[assign[e.src]]]
            label = f"{coll} {form or ''} t{e.tensor}".replace("  ", " ")
        for name in self.names:
            self.out.append(Span(name, self.now, self.now + sec, "collective", label))
        self.now += sec


def _ready(ends):
    """When the work up to op position `pos` is done (as `timing.evaluate` sums it: main
    compute and the inline collectives at positions up to `pos`)."""
    known = sorted(ends)

    def at(pos):
        if pos in ends:
            return ends[pos]
        k = bisect.bisect_right(known, pos)
        return ends[known[k - 1]] if k else 0.0
    return at


def _sync(out, deferred, assign, ready_at, main_end, latency) -> float:
    """The sync lane as `timing.evaluate` queues it (one stream, issue order, one group
    latency first); returns when it is free."""
    events = sorted(((ready_at(e.position) if e.position >= 0 else 0.0,
                      e.seconds(e.layouts[assign[e.src]]), e) for e in deferred),
                    key=lambda x: (x[0], x[1]))
    if not events:
        return 0.0
    free = latency
    out.append(Span(SYNC, 0.0, latency, "sync", "all-reduce latency (once per group)"))
    for ready, sec, e in events:
        start = max(free, ready)
        coll, form, _ = e.conversions[e.layouts[assign[e.src]]]
        out.append(Span(SYNC, start, start + sec, "sync", f"{coll} {form or ''} t{e.tensor}"
                        .replace("  ", " ")))
        free = start + sec
    return free
