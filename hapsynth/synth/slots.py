"""The tables a pipelined program's tick loop indexes, from a plan's static schedule:
which slot of the keep pool and of each mailbox every tick uses. The lowering
(`lower/pipeline.py`) allocates and indexes them; the pricing (`synth/pipememory.py`)
counts the same slots for memory.

The loop body is the same at every tick (so the program's size does not grow with the
microbatches); what differs is data: per tick and stage the work (idle, a forward or a
backward, of which microbatch), the slot of the keep pool its branch reads or writes,
and per channel the mailbox slot a received message is stored in or read from. Pure
Python and numpy, no JAX.

A channel `(d, phase)` carries what a stage's `phase` sends to the stage `d` after it
(before it when `d < 0`). A message waits in its receiver's mailbox until the last work
reading it has run; keep buffers wait for their stage's backward. Both reuse slots; a
table entry equal to the number of slots means none (nothing to read or store).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

__all__ = ["IDLE", "F", "B", "TickTables", "tick_tables", "keep_pool", "packed_bytes",
           "touched_bytes", "APART_BYTES", "wire_rounds", "sum_dtype",
           "sum_bytes"]

IDLE, F, B = 0, 1, 2
PHASE = {"F": F, "B": B}


@functools.lru_cache(maxsize=None)
def _narrow_float(name: str) -> int:
    """Bytes per element of a floating dtype narrower than float32 (bf16, f16, the float8s
    and the like, as `ml_dtypes` registers them with numpy), else 0."""
    if not (name in ("bfloat16", "float16") or name.startswith(("float8_", "float6_", "float4_"))):
        return 0
    import ml_dtypes  # noqa: F401  (registers the names with numpy)
    return np.dtype(name).itemsize


def sum_dtype(dtype) -> str:
    """The dtype a partial sum (a gradient, a loss) is added up in over microbatches:
    float32 for narrower floats, as mixed-precision training accumulates gradients (a
    bf16 running sum rounds at every microbatch; one step on one device rounds once)."""
    return "float32" if _narrow_float(str(dtype)) else str(dtype)


def sum_bytes(dtype, nbytes: float) -> float:
    """The bytes of a partial sum of `nbytes` in `dtype` once in its `sum_dtype`."""
    size = _narrow_float(str(dtype))
    return nbytes * 4 / size if size else nbytes


@dataclass(frozen=True)
class TickTables:
    """Per tick (rows, in tick order) and stage (columns), int32 tables."""

    phase: np.ndarray        # IDLE, F or B
    micro: np.ndarray        # the microbatch worked on (0 when idle)
    keep_in: np.ndarray      # the keep slot a backward reads
    keep_out: np.ndarray     # the keep slot a forward writes
    keep_slots: int
    mail_in: dict            # channel -> the mailbox slot the work reads
    mail_out: dict           # channel -> the slot a message received this tick is stored in
    mail_slots: dict         # channel -> slots in use at most

    @property
    def ticks(self) -> int:
        return self.phase.shape[0]


def keep_pool(table, keeps) -> dict:
    """Per tick whose forwards keep something (`keeps[s]` true), the pool slot they write:
    one whose every reading backward has run, else a new one."""
    free, slot, readers = [], {}, {}
    for tick in sorted({row[0] for row in table}):
        acts = {row[1]: (row[2], row[3]) for row in table if row[0] == tick}
        keeping = {(s, m) for s, (m, ph) in acts.items() if ph == "F" and keeps[s]}
        if keeping:
            slot[tick] = free.pop() if free else len(readers)
            readers[slot[tick]] = keeping
        for s, (m, ph) in acts.items():
            for k, left in readers.items():
                if ph == "B" and (s, m) in left:
                    left.discard((s, m))
                    if not left:
                        free.append(k)
    return slot


def tick_tables(table, stages: int, keeps, channels, delay: int = 0) -> TickTables:
    """`table`: (tick, stage, microbatch, "F"/"B") rows; `keeps[s]`: whether stage s's
    forward keeps values for its backward; `channels[(d, phase)]`: per sending stage, the
    phases of stage `sender + d` that read what it sends; `delay`: ticks between making a
    message and its crossing (it is stored at the end of tick `made + delay`)."""
    # ticks where no stage works are dropped, unless a message crosses in them (delay)
    order = sorted({row[0] for row in table}) if not delay else list(
        range(max(row[0] for row in table) + 1))
    at = {t: i for i, t in enumerate(order)}
    T, S = len(order), stages
    phase = np.zeros((T, S), np.int32)
    micro = np.zeros((T, S), np.int32)
    when = {}
    for t, s, m, ph in table:
        phase[at[t], s], micro[at[t], s] = PHASE[ph], m
        when[(s, m, ph)] = at[t]

    pool = keep_pool(table, keeps)
    K = len(set(pool.values()))
    keep_in = np.full((T, S), K, np.int32)
    keep_out = np.full((T, S), K, np.int32)
    for t, s, m, ph in table:
        if not keeps[s]:
            continue
        written = pool[order[when[(s, m, "F")]]]
        if ph == "F":
            keep_out[at[t], s] = written
        else:
            keep_in[at[t], s] = written

    mail_in, mail_out, mail_slots = {}, {}, {}
    for (d, pha), senders in sorted(channels.items()):
        events = []  # (arrival tick, last reader's tick, receiver, readers)
        for (s, m, ph), i in when.items():
            if ph != pha or s not in senders:
                continue
            b = s + d
            reads = [(b, m, phb) for phb in senders[s]]
            ticks = [when[r] for r in reads]
            if min(ticks) <= i + delay:
                raise ValueError(f"stage {b} reads microbatch {m}'s {pha} message from stage "
                                 f"{s} at tick {min(ticks)}, not after it arrived ({i + delay})")
            events.append((i + delay, max(ticks), b, reads))
        win = np.full((T, S), -1, np.int32)
        wout = np.full((T, S), -1, np.int32)
        used = 0
        for b in range(S):
            free, busy = [], []  # busy: (last reader's tick, slot)
            for i, last, _, reads in sorted(e for e in events if e[2] == b):
                # slots whose last reader ran by this tick (reads come before stores)
                free += [k for lt, k in busy if lt <= i]
                busy = [(lt, k) for lt, k in busy if lt > i]
                k = free.pop() if free else len(busy) + len(free)
                busy.append((last, k))
                used = max(used, k + 1)
                wout[i, b] = k
                for r in reads:
                    win[when[r], b] = k
        win[win < 0], wout[wout < 0] = used, used
        mail_in[(d, pha)], mail_out[(d, pha)], mail_slots[(d, pha)] = win, wout, used
    return TickTables(phase, micro, keep_in, keep_out, K, mail_in, mail_out, mail_slots)


def wire_rounds(senders: dict, alone=()) -> list[tuple[int, ...]]:
    """The shifts whose messages cross together, one `ppermute` per round, given per shift
    the (sender, receiver) stage pairs that ever send on it: a shift and its opposite
    share a round where no stage sends on both and none receives on both (two stages: the
    forwards one way, the backwards the other, both directions of the link at once); the
    other shifts cross alone, as do those in `alone` (gathered over the stage's devices
    first). Rounds run one after the other."""
    rounds, done = [], set()
    for d in sorted(senders, key=lambda d: (abs(d), -d)):
        if d in done:
            continue
        done.add(d)
        both = [*senders[d], *senders.get(-d, ())]
        if -d in senders and -d not in done and not {d, -d} & set(alone) and \
                len({a for a, _ in both}) == len({b for _, b in both}) == len(both):
            done.add(-d)
            rounds.append((d, -d))
        else:
            rounds.append((d,))
    return rounds


#: A state leaf of at least this many bytes has a buffer of its own in a pipelined
#: program (`lower.packing.Packing`): read and written whole, never copied out of or
#: into a buffer shared with the rest of its stage's state.
APART_BYTES = 1 << 20


def packed_bytes(per_stage, least: int = 0) -> int:
    """Bytes of the buffers per-stage values are packed in, as the lowering allocates
    them (`lower.packing.Packing(apart=least)`): per stage, its values as (group, dtype,
    bytes). A value of at least `least` bytes has a buffer of its own: each group's
    largest of each dtype shares the first buffer of that dtype with every other stage's
    largest, and so on down; the smaller ones lie end to end in one buffer per group and
    dtype. Every buffer is sized for the stage needing most."""
    ranked, _ = _buffers(per_stage, least)
    return int(sum(ranked.values()))


def touched_bytes(per_stage, least: int = 0) -> list[int]:
    """Per stage, the bytes of the buffers (laid out as `packed_bytes`) it writes a value
    into: a stage adding its sums pads each of those whole, and adds nothing to the rest."""
    ranked, used = _buffers(per_stage, least)
    return [int(sum(ranked[k] for k in mine)) for mine in used]


def _buffers(per_stage, least: int):
    """(bytes of each buffer, the buffers each stage writes into)."""
    ranked: dict = {}
    used: list[set] = []
    for values in per_stage:
        mine: dict = {}
        for group, dtype, n in values:
            mine.setdefault((group, dtype, n >= least), []).append(n)
        used.append(set())
        for (group, dtype, apart), sizes in mine.items():
            if apart:
                for j, n in enumerate(sorted(sizes, reverse=True)):
                    ranked[(group, dtype, j)] = max(ranked.get((group, dtype, j), 0), n)
                    used[-1].add((group, dtype, j))
            else:
                ranked[(group, dtype)] = max(ranked.get((group, dtype), 0), sum(sizes))
                used[-1].add((group, dtype))
    return ranked, used
