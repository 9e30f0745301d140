"""A pipeline's schedule as the lowering runs it: a static table of ticks, and its price.

The tick loop of `lower.pipeline.Pipelined` runs one work per stage a tick, every stage
meeting the others at each tick's crossing (`ticks`); where collectives run beside
independent work, what a tick made crosses during the next one instead, its readers a
tick later (`late_ticks`). `lockstep` prices a simulated schedule so.
"""
from __future__ import annotations

from hapsynth.synth.pipeschedule import PipeSchedule, Slot

__all__ = ["lockstep", "ticks", "late_ticks"]


def lockstep(sch: PipeSchedule, fwd, bwd, send, send_back, wire=None) -> PipeSchedule:
    """`sch` as the lowering runs it: a table of ticks (`ticks`), each tick's work in one
    switch on every device (a group of devices running several stages, a V shape's
    what-if: one work per stage, the group's one after another). Without `wire`, what a
    tick made crosses to its readers by `ppermute` after the work, in the same iteration
    of the tick loop: a tick lasts its longest work plus its forwards' longest transfer
    and then its backwards' (a link direction carrying one message at a time). With
    `wire` (seconds), what a tick made crosses during the next tick, on every pair its
    shift may use (device runtimes whose collectives run beside independent work: XLA's
    GPU async collectives): a tick lasts its longest work or `wire`, whichever is longer,
    and readers across a boundary sit a tick later."""
    S = sch.stages
    rows = ticks(sch) if wire is None else late_ticks(sch)
    by_tick: dict = {}
    for t, s, m, ph in rows:
        by_tick.setdefault(t, []).append((s, m, ph))
    slots, end = [], 0.0
    for t in sorted(by_tick) if wire is None else range(max(by_tick) + 1):
        work = by_tick.get(t, [])
        busy: dict = {}  # per group: its stages' work this tick, one after another
        for s, m, ph in work:
            d = fwd[s] if ph == "F" else bwd[s]
            at = end + busy.get(sch.group(s), 0.0)
            slots.append(Slot(s, m, ph, at, at + d))
            busy[sch.group(s)] = busy.get(sch.group(s), 0.0) + d
        length = list(busy.values())
        if wire is not None:  # a tick without work still carries the last one's messages
            end += max([wire, *length])
            continue
        end += max(length) + _shifts(work, S, send, send_back)
    return PipeSchedule(sch.kind, S, sch.micros, tuple(slots), end, sch.in_flight, sch.depths,
                        tuple(rows), sch.place)


def _shifts(work, S: int, send, send_back) -> float:
    """Seconds of a tick's crossing after its `work`: the forwards' shift, then the
    backwards' (the lowering orders them), each as long as its slowest link, a link
    direction carrying its messages one after another."""
    moved: dict = {}
    for s, _, ph in work:
        if ph == "F" and s < S - 1:
            moved[("F", s)] = moved.get(("F", s), 0.0) + send[s]
        elif ph == "B" and s > 0:
            moved[("B", s - 1)] = moved.get(("B", s - 1), 0.0) + send_back[s - 1]
    return sum(max([0.0] + [t for (ph, _), t in moved.items() if ph == way]) for way in "FB")


def ticks(sch: PipeSchedule, lag=None) -> list[tuple[int, int, int, str]]:
    """The schedule as a static table of (tick, stage, microbatch, "F"/"B"): each stage's
    work in its simulated order, a tick after what it waits for (its previous work, the
    forward before it, the backward after it), as early as that allows and, across
    boundary s, `lag[("F" or "B", s)]` ticks later still. A tick runs one work per stage
    (a group of devices running several stages runs theirs one after another in it). A
    schedule run in lock step keeps the table it ran (`PipeSchedule.ticks`)."""
    if sch.ticks and lag is None:
        return [tuple(r) for r in sch.ticks]
    lag = lag or {}
    S = sch.stages
    before: dict = {}
    last: dict = {}
    for x in sch.slots:  # the simulation lists each stage's work in the order it ran it
        key = (x.phase, x.stage, x.micro)
        before[key] = last.get(x.stage)
        last[x.stage] = key
    when: dict = {}

    def tick(key) -> int:
        if key not in when:
            ph, s, m = key
            deps = [(before[key], 0)]
            if ph == "F" and s > 0:
                deps.append((("F", s - 1, m), lag.get(("F", s - 1), 0)))
            if ph == "B":
                deps.append((("F", s, m), 0))
                if s < S - 1:
                    deps.append((("B", s + 1, m), lag.get(("B", s), 0)))
            when[key] = 1 + max([-1] + [tick(d) + e for d, e in deps if d is not None])
        return when[key]

    return sorted((tick(k), k[1], k[2], k[0]) for k in before)


def late_ticks(sch: PipeSchedule) -> list[tuple[int, int, int, str]]:
    """The tick table of `sch` sending a tick late: every reader across a boundary a tick
    after the message crossed (what a plan with `delay` 1 runs; nothing crosses between
    stages on one group)."""
    return ticks(sch, {(ph, s): 1 for ph in "FB" for s in range(sch.stages - 1)
                       if sch.group(s) != sch.group(s + 1)})

