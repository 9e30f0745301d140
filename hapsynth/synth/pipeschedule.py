"""Microbatch schedules of a pipeline, simulated: GPipe, 1F1B, and a heterogeneity-aware 1F1B.

A pipeline of `S` stages runs `M` microbatches forward (F) then backward (B). Stage `s`
takes `forward[s]` / `backward[s]` seconds per microbatch; an activation crosses from
stage s to s+1 in `send[s]` seconds and its cotangent back in `send_back[s]` (each
direction of a link carries one transfer at a time, overlapping compute). A schedule
is the order of F and B work per stage; `simulate` runs it as early as dependencies,
stages and links allow. The result is data: one `Slot` per (stage, microbatch, F/B).
A `place` puts several stages on one group of devices (a V-shaped pipeline: the first
and last stages on one island, the middle on another), which runs one work at a time;
a stage's boundary to a stage on its own group carries nothing (`send` 0 there), and
the two boundaries of a V that use one direction of a link take turns on it.

- GPipe: every forward, then every backward;
- 1F1B: `S - 1 - s` forwards to warm up, then one forward and one backward in turn;
  at most `S - s` activations in flight on stage s;
- hetero-1F1B: a stage never idles while work is ready. It runs a ready backward
  first (frees memory), else a ready forward while fewer than its warm-up depth are in
  flight. The depths are searched per stage (within a memory cap) for the shortest
  step, so a fast stage next to a slow one, or a slow link, gets the extra microbatches
  in flight that hide them.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product

KINDS = ("gpipe", "1f1b", "hetero-1f1b")


@dataclass(frozen=True)
class Slot:
    """Stage `stage` runs `phase` ("F" or "B") of microbatch `micro` from `start` to `end`."""

    stage: int
    micro: int
    phase: str
    start: float
    end: float


@dataclass(frozen=True)
class PipeSchedule:
    """A simulated schedule: its slots, the step's length, peak activations in flight."""

    kind: str
    stages: int
    micros: int
    slots: tuple[Slot, ...]
    makespan: float
    in_flight: tuple[int, ...]   # per stage: the most microbatches forwarded, not yet back
    depths: tuple[int, ...] = ()  # hetero-1f1b: the warm-up depth chosen per stage
    ticks: tuple = ()             # as run in lock step: its (tick, stage, micro, phase) rows
    place: tuple[int, ...] = ()   # per stage: the group of devices running it (empty: its own)

    def group(self, stage: int) -> int:
        return self.place[stage] if self.place else stage

    @property
    def groups(self) -> int:
        return len(set(self.place)) if self.place else self.stages

    def order(self, stage: int) -> list[str]:
        """"F0 F1 B0 F2 ..." on one stage, in time order."""
        return [f"{s.phase}{s.micro}" for s in sorted(self.slots, key=lambda s: s.start)
                if s.stage == stage]

    def bubble(self) -> float:
        """The fraction of device-group time idle within the step."""
        busy = sum(s.end - s.start for s in self.slots)
        return 1.0 - busy / (self.groups * self.makespan) if self.makespan else 0.0

    def table(self) -> str:
        """One line per slot: start, end, stage, microbatch, phase."""
        rows = [f"{'start':>10} {'end':>10} stage micro phase"]
        rows += [f"{s.start:10.4g} {s.end:10.4g} {s.stage:5d} {s.micro:5d} {s.phase:>5}"
                 for s in sorted(self.slots, key=lambda s: (s.start, s.stage))]
        return "\n".join(rows)

    def plot(self, ax=None):
        """A Gantt chart: a row per stage, forward and backward per microbatch (needs
        `hapsynth[plot]`); returns the Figure."""
        from hapsynth.view.plots import plot_schedule
        return plot_schedule(self, ax=ax)


def schedule(kind: str, forward, backward, micros: int, send=None, send_back=None,
             memory_cap=None, cost=None, ready=None, place=None) -> PipeSchedule:
    """The `kind` schedule (one of `KINDS`) of `micros` microbatches over the stages
    given by per-stage `forward` and `backward` seconds and per-boundary transfer
    seconds; `memory_cap[s]` bounds hetero-1f1b's activations in flight on stage s;
    `cost(schedule)` is what hetero-1f1b's search minimises (default: the makespan; a
    lowering that runs the schedule another way prices it its own way); `ready`: per link
    direction (("F", s): stage s to s + 1, ("B", s): back), when what crossed it before
    the first microbatch has arrived; the stage it went to starts no work before.
    `place[s]`: the group of devices running stage s (groups 0, 1, ...; default: each
    stage its own); a group runs one work at a time, a ready backward before a forward
    and a later stage's forward before an earlier one's."""
    S = len(forward)
    if len(backward) != S or S < 1 or micros < 1:
        raise ValueError(f"need as many backward as forward times (got {len(forward)} and "
                         f"{len(backward)}) and at least one microbatch (got {micros})")
    send = tuple(send or (0.0,) * (S - 1))
    send_back = tuple(send_back or send)
    if len(send) != S - 1 or len(send_back) != S - 1:
        raise ValueError(f"{S} stages have {S - 1} boundaries; got {len(send)} transfer times")
    place = tuple(int(g) for g in place) if place is not None else ()
    if place and (len(place) != S or set(place) != set(range(max(place) + 1))):
        raise ValueError(f"place needs a group 0, 1, ... per stage ({S}), got {place}")
    if place == tuple(range(S)):
        place = ()
    times = (tuple(map(float, forward)), tuple(map(float, backward)), send, send_back,
             dict(ready or {}), place)
    if kind == "gpipe":
        orders = [[("F", m) for m in range(micros)] + [("B", m) for m in range(micros)]
                  for _ in range(S)]
        return _run(kind, times, micros, orders=orders)
    if kind == "1f1b":
        return _run(kind, times, micros, orders=[_one_f_one_b(S, s, micros) for s in range(S)])
    if kind == "hetero-1f1b":
        return _adaptive(times, micros, memory_cap, cost)
    raise ValueError(f"unknown schedule {kind!r}; one of {', '.join(KINDS)}")


def _one_f_one_b(S: int, s: int, M: int) -> list[tuple[str, int]]:
    warm = min(S - 1 - s, M)
    out = [("F", m) for m in range(warm)]
    f, b = warm, 0
    while b < M:
        if f < M:
            out.append(("F", f))
            f += 1
        out.append(("B", b))
        b += 1
    return out


def _adaptive(times, micros: int, memory_cap, cost) -> PipeSchedule:
    """hetero-1f1b: the best warm-up depths per stage, from 1F1B's upward (a small
    search: each stage may keep 1, 2 or 4 more microbatches in flight, within its cap).
    `cost` None: the makespan (a run is then given up once it runs past the best)."""
    S = len(times[0])
    base = [min(S - s, micros) for s in range(S)]
    cap = [micros if memory_cap is None else max(1, min(micros, int(memory_cap[s])))
           for s in range(S)]
    choices = [sorted({min(c, b + k) for k in (0, 1, 2, 4)}) for b, c in zip(base, cap)]
    best = None
    if all(b <= c for b, c in zip(base, cap)):  # plain 1F1B fits: never do worse than it
        plain = _run("hetero-1f1b", times, micros,
                     orders=[_one_f_one_b(S, s, micros) for s in range(S)])
        best = PipeSchedule(plain.kind, S, micros, plain.slots, plain.makespan, plain.in_flight,
                            tuple(base), place=plain.place)
    makespan = cost is None
    cost = cost or (lambda x: x.makespan)
    best_cost = None if best is None else cost(best)
    boxes: list = []  # per run so far, the depths that would have run it alike
    for depths in product(*choices) if _count(choices) <= 729 else [tuple(
            min(c, b + 2) for b, c in zip(base, cap))]:
        if any(all(lo <= d <= hi for d, (lo, hi) in zip(depths, box)) for box in boxes):
            continue  # (the same run again: no better)
        box = [[1, micros] for _ in range(S)]
        boxes.append(box)
        run = _run("hetero-1f1b", times, micros, depths=depths, box=box,
                   stop=best_cost * (1 - 1e-12) if makespan and best is not None else None)
        if run is None:
            continue
        c = cost(run)
        if best is None or c < best_cost * (1 - 1e-12):
            best, best_cost = run, c
    return best


def _count(choices) -> int:
    n = 1
    for c in choices:
        n *= len(c)
    return n


def arrived(ready, S: int) -> list[float]:
    """Per stage: when everything sent to it before the first microbatch is there
    (`ready` keyed as in `schedule`: ("F", s) reaches stage s + 1, ("B", s) stage s)."""
    return [max([0.0] + [t for (ph, b), t in ready.items() if (b + 1 if ph == "F" else b) == s])
            for s in range(S)]


def _run(kind, times, M: int, orders=None, depths=None, stop=None,
         box=None) -> PipeSchedule | None:
    """Simulate: fixed per-stage `orders`, or (with `depths`) the ready-first rule; None
    once a work would end at `stop` or later. `box[s]`, narrowed to the depths of stage s
    under which every test of its depth goes as it went (so the same run). Each step runs
    the earliest work any stage may start next, a backward before a forward (on a group
    running several stages too) and a later stage's forward before an earlier one's."""
    fwd, bwd, send, send_back, ready_at, place = times
    S = len(fwd)
    group = place or tuple(range(S))
    # per boundary, each direction of its link (one transfer at a time on it)
    way = {"F": [(group[s], group[s + 1]) for s in range(S - 1)],
           "B": [(group[s + 1], group[s]) for s in range(S - 1)]}
    link_free: dict = {}
    for (phase, s), t in ready_at.items():
        w = way[phase][s]
        link_free[w] = max(link_free.get(w, 0.0), t)
    first = arrived(ready_at, S)
    free = [0.0] * (max(group) + 1)     # per group of devices: when its last work ends
    nxt = [0] * S                        # position in orders / next forward micro
    back = [0] * S                       # next backward micro (with depths)
    live = [0] * S
    peak = [0] * S
    into = {"F": [[None] * M for _ in range(S)],  # when a work's input is there
            "B": [[None] * M for _ in range(S)]}
    into["F"][0] = [0.0] * M
    slots: list = []
    total = 2 * M * S

    while len(slots) < total:
        best = None
        for s in range(S):
            if orders is not None:
                works = (orders[s][nxt[s]],) if nxt[s] < len(orders[s]) else ()
            else:
                works = [("B", back[s])] if back[s] < nxt[s] else []
                if nxt[s] < M:
                    if live[s] < depths[s]:
                        works.append(("F", nxt[s]))
                        if box is not None:
                            box[s][0] = max(box[s][0], live[s] + 1)
                    elif box is not None:
                        box[s][1] = min(box[s][1], live[s])
            at = max(free[group[s]], first[s])
            for pref, (phase, m) in enumerate(works):
                r = into[phase][s][m]
                if r is None:
                    continue
                key = (max(at, r), phase == "F", -s if phase == "F" else s, pref)
                if best is None or key < best[0]:
                    best = (key, s, phase, m)
        if best is None:
            raise RuntimeError("pipeline schedule deadlocked")  # a bad fixed order
        (start, *_), s, phase, m = best
        end = start + (fwd[s] if phase == "F" else bwd[s])
        if stop is not None and end >= stop:
            return None
        slots.append((s, m, phase, start, end))
        free[group[s]] = end
        if orders is not None or phase == "F":
            nxt[s] += 1
        else:
            back[s] += 1
        live[s] += 1 if phase == "F" else -1
        peak[s] = max(peak[s], live[s])
        if phase == "F" and s == S - 1:
            into["B"][s][m] = end
        elif phase == "F":
            t0 = max(end, link_free.get(way["F"][s], 0.0))
            link_free[way["F"][s]] = into["F"][s + 1][m] = t0 + send[s]
        elif s > 0:
            t0 = max(end, link_free.get(way["B"][s - 1], 0.0))
            link_free[way["B"][s - 1]] = into["B"][s - 1][m] = t0 + send_back[s - 1]
    return PipeSchedule(kind, S, M, tuple(Slot(*x) for x in slots), max(x[4] for x in slots),
                        tuple(peak), tuple(depths) if depths is not None else (), place=place)
