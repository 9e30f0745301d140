"""Where a tick-loop program's values lie, fixed before it is traced: per stage the
packings of its state, of what its forwards keep, of what it sends on each channel and
of its sums; the buffers they fill (each sized for the stage needing most); the groups
of devices; and the tables the loop indexes per tick (`synth.slots.tick_tables`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hapsynth.lower.packing import Packing, bundle
from hapsynth.lower.wiring import StageWiring
from hapsynth.synth.slots import B, F, TickTables, sum_dtype, tick_tables, wire_rounds

__all__ = ["TickLayout", "tick_layout"]


@dataclass(frozen=True, eq=False)
class TickLayout:
    """The static layout of a pipelined program (`Pipelined`). A channel is (shift to the
    reader, phase); buffers are named by dtype (`packing.dtype_of`)."""

    stage_devices: int      # devices per stage (the mesh's "data" axis)
    groups: list            # (stage, rows) of each group of devices, sorted
    group_of: np.ndarray    # [stage, device]: its group
    state_packing: list     # per stage: its state leaves, by leaf number
    state_sizes: dict       # per state buffer: its size
    keep_packing: dict      # per stage: what its forward keeps for its backward
    keep_sizes: dict        # per keep buffer: its size (a pool slot)
    chan_pack: dict         # per channel, per sending stage: what it sends
    chan_sizes: dict        # per channel: its mailbox buffers' sizes
    wire_sizes: dict        # per shift: the buffers every channel on it fits
    chunked: dict           # per shift: a receiver gathers every sender's chunk
    acc_packing: dict       # per phase, per stage: the sums that phase adds to
    acc_sizes: dict         # per phase: its sums' buffers' sizes
    delay: int              # 0: a message crosses in the tick making it; 1: in the next
    tables: TickTables
    kind: np.ndarray        # [tick, stage]: its kind of work (`_work_kinds`)
    kinds: list             # per kind of work but idle: (group, phase) of its branches
    within: np.ndarray      # [kind - 1, group]: the group's branch in its kind's switch
    senders: dict           # per shift: `senders`
    rounds: list            # the shifts crossing together (`synth.slots.wire_rounds`)
    spans: dict             # per shift: (start, end) of its buffers in a tick's results

    @property
    def stages(self) -> int:
        return len(self.state_packing)

    @property
    def state_order(self) -> tuple:
        return tuple(self.state_sizes)

    @property
    def keep_buffers(self) -> int:
        """Slots in each device's pool of keep buffers."""
        return self.tables.keep_slots

    @property
    def shifts(self) -> list:
        return sorted(self.wire_sizes)

    @property
    def chans(self) -> list:
        return sorted(self.chan_pack)


def tick_layout(w: StageWiring, stage_devices: int, apart: int) -> TickLayout:
    """The layout of `w`'s stages on a (stage, data) mesh of `stage_devices` per stage;
    state leaves of at least `apart` bytes in buffers of their own."""
    prog, S = w.prog, w.S
    groups = sorted({(s, r) for s in range(S) for r in w.rows[s]})
    group_of = np.array([[groups.index((s, r)) for r in w.rows[s]] for s in range(S)],
                        np.int32)
    # what a stage's forward keeps, in buffers of one size for every stage: a tick writes
    # into a pool slot whose last reader has run, so a device whose stage keeps nothing
    # that tick passes the pool through untouched
    keep_packing = {s: Packing([(t, w._padded(t, s), prog.avals[t].dtype) for t in w.keeps[s]])
                    for s in range(S)}
    chan_pack = _channels(w)
    chan_sizes = {c: bundle(ps.values()) for c, ps in chan_pack.items()}
    shifts = sorted({d for d, _ in chan_pack})
    wire_sizes = {d: bundle(p for (e, _), ps in chan_pack.items() if e == d
                            for p in ps.values()) for d in shifts}
    # a receiver holding other rows than its sender gathers every sender's chunk
    chunked = {d: any(w.rows[a] != w.rows[a + d] for (e, _), ps in chan_pack.items()
                      if e == d for a in ps) for d in shifts}
    delay = int(w.plan.pipeline.get("delay", 0))
    if delay not in (0, 1):
        raise ValueError(f"a pipeline plan's messages cross in the tick that made them "
                         f"(delay 0) or during the next one (delay 1), not {delay} "
                         f"ticks later")
    tables = tick_tables(
        w.plan.pipeline["table"], S, [bool(w.keeps[s]) for s in range(S)],
        {c: {a: sorted({key[1] for key in p.slots}) for a, p in ps.items()}
         for c, ps in chan_pack.items()}, delay)
    # accumulated per phase: a forward adds to its sums only (a loss), a backward to its
    # own (gradients), so neither moves the other's buffer (in float32 where the sums are
    # narrower: `sum_dtype`; cast back once summed)
    acc_packing = {ph: [Packing([(t, prog.avals[t].shape, sum_dtype(prog.avals[t].dtype))
                                 for t in w.sums_of(s, ph)], apart=True) for s in range(S)]
                   for ph in "FB"}
    state_packing = [Packing([(p, prog.avals[prog.inputs[p]].shape,
                               prog.avals[prog.inputs[p]].dtype)
                              for p in range(w.nstate) if w.owner[p] == s], apart=apart)
                     for s in range(S)]
    kind, kinds, within = _work_kinds(w, groups, tables)
    senders = {d: _senders(tables, chan_pack, S, d) for d in shifts}
    rounds = wire_rounds({d: senders[d][2] for d in shifts}, {d for d in shifts if chunked[d]})
    ends = np.cumsum([len(wire_sizes[d]) for d in shifts]).tolist()
    spans = {d: (e - len(wire_sizes[d]), e) for d, e in zip(shifts, ends)}
    return TickLayout(stage_devices, groups, group_of, state_packing, bundle(state_packing),
                      keep_packing, bundle(keep_packing.values()), chan_pack, chan_sizes,
                      wire_sizes, chunked, acc_packing,
                      {ph: bundle(ps) for ph, ps in acc_packing.items()}, delay, tables,
                      kind, kinds, within, senders, rounds, spans)


def _channels(w: StageWiring) -> dict:
    """Per channel (shift to the reader, phase) and sending stage, the packing of what it
    sends; a channel's messages wait in the reader's mailbox until read."""
    items: dict = {}
    for (a, pha), dests in sorted(w.sends.items()):
        for (b, phb), xs in sorted(dests.items()):
            items.setdefault((b - a, pha), {}).setdefault(a, []).extend(
                ((b, phb, x), w._padded(x, a), w.prog.avals[x].dtype) for x in sorted(xs))
    return {c: {a: Packing(v) for a, v in per.items()} for c, per in items.items()}


def _work_kinds(w: StageWiring, groups, tables) -> tuple:
    """Per tick and stage its kind of work (0 idle, 1 a forward keeping values, 2 a
    forward keeping nothing, 3 a backward); each kind but idle is a switch of its own
    over the groups, so no device makes or moves a buffer it does not fill. Returns the
    kind table, per kind its branches, each group's branch in each kind."""
    fkeep = np.asarray([bool(w.keeps[s]) for s in range(w.S)])
    kind = np.where(tables.phase == F, np.where(fkeep, 1, 2),
                    np.where(tables.phase == B, 3, 0)).astype(np.int32)
    kinds = [[(g, "F") for g, (s, _) in enumerate(groups) if fkeep[s]],
             [(g, "F") for g, (s, _) in enumerate(groups) if not fkeep[s]],
             [(g, "B") for g in range(len(groups))]]
    within = np.zeros((3, len(groups)), np.int32)
    for k, pairs in enumerate(kinds):
        for j, (g, _) in enumerate(pairs):
            within[k, g] = j
    return kind, kinds, within


def _senders(tables: TickTables, chan_pack: dict, S: int, d: int) -> tuple:
    """Per tick, which pattern of stages sends on shift `d` (an index into the patterns),
    the patterns as (sender, receiver) pairs, and every pair sending on it at some tick."""
    pats: dict = {}
    index = np.zeros(tables.ticks, np.int32)
    for i in range(tables.ticks):
        pairs = tuple((a, a + d) for a in range(S) if tables.phase[i, a]
                      and a in chan_pack.get((d, "FB"[tables.phase[i, a] - 1]), {}))
        index[i] = pats.setdefault(pairs, len(pats))
    every = tuple(sorted({p for pairs in pats for p in pairs}))
    return index, list(pats), every
