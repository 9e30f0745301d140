"""Bytes per device of a pipelined program, as the lowering allocates them.

One SPMD program gives every device the same buffers, each sized for the stage needing
most: the state, the parameters copied in, the gradient sums and the step's data
(`fixed_bytes`); the keep pool's slots, the mailboxes and the wires of the tick table
(`slots.py`; `buffer_bytes`). So every device must hold the largest stage's.
"""
from __future__ import annotations

from dataclasses import dataclass

from hapsynth.synth.lockstep import ticks
from hapsynth.synth.pipeschedule import PipeSchedule
from hapsynth.synth.slots import tick_tables

__all__ = ["Messages", "messages", "fixed_bytes", "keep_caps", "buffer_bytes"]


@dataclass(frozen=True)
class Messages:
    """Per channel `(shift, phase)` of the tick table: the bytes per device of its widest
    message, and per stage sending on it the phases of its receiver reading it (a
    message waits in the mailbox until its last reader)."""

    size: dict
    readers: dict


def messages(send, share, rows, devices, readers) -> Messages:
    """The channels of a candidate's tick table. `send[a, b, way]`: bytes of one
    microbatch stage a sends b; `share[a]`: the largest share of a microbatch's rows one
    of a's devices holds; `rows`, `devices`: per stage; `readers` as `CutScan.readers`.
    A message to a stage splitting its rows otherwise is gathered over the sender's
    devices first."""
    S = len(rows)
    size, channels = {}, {}
    for a in range(S):
        for b in range(S):
            for way, ph in enumerate("FB"):
                if a == b or send[a, b, way] <= 0:
                    continue
                n = send[a, b, way] * share[a] * (len(devices[a]) if rows[a] != rows[b] else 1)
                c = (b - a, ph)
                size[c] = max(size.get(c, 0.0), n)
                channels.setdefault(c, {})[a] = readers[(a, b, way)]
    return Messages(size, channels)


def fixed_bytes(graph, scan, order, members, state: int, sums: int, data: float) -> float:
    """Bytes per device whatever the schedule: `state` and `sums` (as each device holds
    them), the most parameters a group of devices (`members`: its stages) copies in from
    stages on other groups, and the step's `data`."""
    copied = [sum(graph.tensors[graph.inputs[p]].nbytes for p in set().union(
        *(scan.needs[t] for t in m)) if order[scan.owner[p]] != order[m[0]]) for m in members]
    return state + max(copied) + sums + data


def keep_caps(capacity: float, fixed: float, per_micro, micros: int) -> list[int]:
    """Per stage, the most microbatches in flight its keep pool's memory allows (a stage
    keeping nothing takes no slot of the pool, however deep its warm-up)."""
    keep = max(per_micro)
    return [max(1, int((capacity - fixed) // keep)) - 1 if keep and per_micro[s] > 0
            else micros for s in range(len(per_micro))]


def buffer_bytes(sch: PipeSchedule, delay: int, msgs: Messages, per_micro, members) -> float:
    """Per device, the bytes of the keep pool (its slots and the microbatch being worked
    on), the mailboxes and the wires the lowering allocates for `sch`'s table, each slot
    sized for the stage needing most (`per_micro`: per stage, one microbatch's kept bytes).
    A group of devices running several stages (a V's what-if) keeps each stage's values in
    a pool of its own, as many slots as it has microbatches in flight at once, plus the
    one worked on."""
    S = sch.stages
    rows = ticks(sch)
    tables = tick_tables(rows, S, [x > 0 for x in per_micro], msgs.readers, delay)
    mail = sum((tables.mail_slots[c] + 1) * n for c, n in msgs.size.items())  # + a spare row
    wires: dict = {}
    for (d, _), n in msgs.size.items():
        wires[d] = max(wires.get(d, 0.0), n)
    pool = (tables.keep_slots + 1) * max(per_micro)
    if len(members) < S:
        pool = _group_pools(rows, per_micro, members, S)
    return pool + mail + (1 + delay) * sum(wires.values())


def _group_pools(rows, per_micro, members, S: int) -> float:
    """The largest group's pools: per stage on it, the most microbatches it holds
    between their forward and backward at any tick, plus the one worked on."""
    fwd = {(s, m): t for t, s, m, ph in rows if ph == "F"}
    bwd = {(s, m): t for t, s, m, ph in rows if ph == "B"}
    live = [max([0] + [sum(1 for (x, m), f in fwd.items() if x == s and f <= t <= bwd[x, m])
                       for t in {r[0] for r in rows}]) for s in range(S)]
    return max(sum((live[s] + 1) * per_micro[s] for s in m) for m in members)
