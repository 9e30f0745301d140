"""Segment scheduling: which ops share one branch, and which values cross between branches.

Pure functions of the program's wiring and the plan's layouts, with no JAX: an op is
anything with `.inputs` (tensor ids, or constants, which are not ints) and `.outputs`
(tensor ids); `op_inputs[op][i]` is the `Layout` the plan wants operand i in (None for a
constant) and `tensor_layouts[t]` the layout tensor t is made in.
"""
from __future__ import annotations

from typing import Sequence

from hapsynth.ir.layout import Layout

__all__ = ["segments", "exports", "operands"]


def segments(ops: Sequence, op_inputs: Sequence, tensor_layouts: Sequence) -> list[list[int]]:
    """Group the ops into as few segments as the conversions allow.

    An op that needs a value made in the current segment converted must wait for a
    later segment, and so must every op reading its results; all other ops stay
    (the program is pure, so any topological order computes the same values).
    Conversions of values made earlier are hoisted before a segment, so each segment
    is one switch with every collective outside it. Few segments matter: a value
    leaving a segment is materialised (and padded), where inside one XLA fuses it
    (the loss's all-reduce no longer splits a step's forward from its backward)."""
    out, remaining = [], list(range(len(ops)))
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
    return out


def exports(ops: Sequence, outputs: Sequence, segs: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per segment, the tensors it makes that a later segment or the program's `outputs`
    read (only these leave its branch)."""
    later = {o for o in outputs if isinstance(o, int)}
    out = []
    for seg in reversed(segs):
        made = [t for op_id in seg for t in ops[op_id].outputs]
        out.append([t for t in made if t in later])
        later.update(x for op_id in seg for x in ops[op_id].inputs if isinstance(x, int))
    return out[::-1]


def operands(ops: Sequence, op_inputs: Sequence, seg: Sequence[int]) -> list[tuple[int, Layout]]:
    """The (tensor, layout) pairs a segment reads from before it, in first-use order:
    the values converted outside its branch and passed in."""
    made = {t for op_id in seg for t in ops[op_id].outputs}
    keys = []
    for op_id in seg:
        for x, need in zip(ops[op_id].inputs, op_inputs[op_id]):
            if isinstance(x, int) and x not in made:
                keys.append((x, need))
    return list(dict.fromkeys(keys))
