"""Segment scheduling: which ops share one branch, which values cross between branches,
and loop regions (each run as one scan, its body cut into segments of its own).

Pure functions of the program's wiring and the plan's layouts, with no JAX: an op is
anything with `.inputs` (tensor ids, or constants, which are not ints) and `.outputs`
(tensor ids); `op_inputs[op][i]` is the `Layout` the plan wants operand i in (None for a
constant) and `tensor_layouts[t]` the layout tensor t is made in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hapsynth.ir.layout import Layout

__all__ = ["LoopSchedule", "schedule", "segments", "exports", "operands"]


@dataclass(frozen=True)
class LoopSchedule:
    """A loop region run as one scan: `loop` (a `trace.Loop`), its body's segments and
    what each exports (to later segments of the body, to the carries, to the stacks)."""

    loop: object
    segments: list
    exports: list


def schedule(ops: Sequence, op_inputs: Sequence, tensor_layouts: Sequence, loops: Sequence,
             outputs: Sequence) -> tuple[list, list]:
    """The program as items in order — segments (lists of op ids) and `LoopSchedule`s —
    and per item the tensors it exports to later items or the `outputs`."""
    items, at = [], 0
    for lp in sorted(loops, key=lambda lp: lp.start):
        items += segments(ops, op_inputs, tensor_layouts, range(at, lp.start))
        body = segments(ops, op_inputs, tensor_layouts, lp.body)
        ends = [ops[c].inputs[1] for c in lp.carries] + [ops[s].inputs[0] for s in lp.stacks]
        items.append(LoopSchedule(lp, body, exports(ops, ends, body)))
        at = lp.end
    items += segments(ops, op_inputs, tensor_layouts, range(at, len(ops)))
    return items, exports(ops, outputs, items)


def region_ops(item) -> list[int]:
    """Every op of an item (a loop's markers and body)."""
    if isinstance(item, LoopSchedule):
        return list(range(item.loop.start, item.loop.end))
    return list(item)


def made_by(ops: Sequence, item) -> list[int]:
    """The tensors an item makes that outlive it: a segment's results; a loop's final
    carries and stacked results."""
    if isinstance(item, LoopSchedule):
        lp = item.loop
        return [ops[c].inputs[1] for c in lp.carries] + [ops[s].outputs[0] for s in lp.stacks]
    return [t for op_id in item for t in ops[op_id].outputs]


def segments(ops: Sequence, op_inputs: Sequence, tensor_layouts: Sequence,
             ids: Sequence[int] | None = None) -> list[list[int]]:
    """Group the ops into as few segments as the conversions allow.

    An op that needs a value made in the current segment converted must wait for a
    later segment, and so must every op reading its results; all other ops stay
    (the program is pure, so any topological order computes the same values).
    Conversions of values made earlier are hoisted before a segment, so each segment
    is one switch with every collective outside it. Few segments matter: a value
    leaving a segment is materialised (and padded), where inside one XLA fuses it
    (the loss's all-reduce no longer splits a step's forward from its backward)."""
    out, remaining = [], list(range(len(ops)) if ids is None else ids)
    while remaining:
        current, made, waiting, later = [], set(), set(), []
        for op_id in remaining:
            op = ops[op_id]
            blocked = any(
                isinstance(x, int) and (x in waiting or x in made and need is not None and
                                        tensor_layouts[x] != need)
                for x, need in zip(op.inputs, op_inputs[op_id]))
            if blocked:
                later.append(op_id)
                waiting.update(op.outputs)
            else:
                current.append(op_id)
                made.update(op.outputs)
        out.append(current)
        remaining = later
    return _sink(ops, op_inputs, tensor_layouts, out)


def _sink(ops, op_inputs, tensor_layouts, segs: list[list[int]]) -> list[list[int]]:
    """Each op that reads only values made before its segment moved to the last segment
    its readers allow. Segments take ops as early as they can, so an optimizer's
    `b * m` (state only) ran in the forward's segment, a pass of its own over the moment
    kept alive through the step, where beside its reader XLA fuses it into the update."""
    at = {o: k for k, seg in enumerate(segs) for o in seg}
    readers: dict = {}
    for o in at:
        for x, need in zip(ops[o].inputs, op_inputs[o]):
            if isinstance(x, int):
                readers.setdefault(x, []).append((o, need))
    made_at = {t: at[o] for o in at for t in ops[o].outputs}
    for o in sorted(at, reverse=True):  # readers before the ops they read
        k = at[o]
        if any(isinstance(x, int) and made_at.get(x, -1) == k for x in ops[o].inputs):
            continue
        last = len(segs) - 1
        for t in ops[o].outputs:
            for r, need in readers.get(t, ()):
                converted = need is not None and tensor_layouts[t] != need
                last = min(last, at[r] - converted)
        if last > k:
            at[o] = last
            for t in ops[o].outputs:
                made_at[t] = last
    out = [[] for _ in segs]
    for o in sorted(at):
        out[at[o]].append(o)
    return [seg for seg in out if seg]


def exports(ops: Sequence, outputs: Sequence, items: Sequence) -> list[list[int]]:
    """Per item (segment or loop), the tensors it makes that a later item or `outputs`
    read (only these leave its branch or its scan)."""
    later = {o for o in outputs if isinstance(o, int)}
    out = []
    for item in reversed(items):
        out.append([t for t in made_by(ops, item) if t in later])
        later.update(x for op_id in region_ops(item) for x in ops[op_id].inputs
                     if isinstance(x, int))
    return out[::-1]


def operands(ops: Sequence, op_inputs: Sequence, seg: Sequence[int]) -> list[tuple[int, Layout]]:
    """The (tensor, layout) pairs a segment (or a loop region's ops) reads from before
    it, in first-use order: the values converted outside its branch (or scan)."""
    made = {t for op_id in seg for t in ops[op_id].outputs}
    keys = []
    for op_id in seg:
        for x, need in zip(ops[op_id].inputs, op_inputs[op_id]):
            if isinstance(x, int) and x not in made:
                keys.append((x, need))
    return list(dict.fromkeys(keys))
