"""Data arguments fed in the shape the step first gives them.

A step that accumulates gradients over microbatches reshapes its batch `[B, ...]` into
`[n, B/n, ...]` and loops over the `n`: data parallelism must split each microbatch
(the minor part of the batch dim), which no contiguous block of rows is. Fed already
split, the batch's rows are spread as the loop reads them, and the reshape is gone from
the program. `Program.input_views` records it: the lowering reshapes such an argument
when it stores it.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from hapsynth.ir.trace import Program, loops_of


def fold_batch_splits(prog: Program, data: Sequence[int]) -> Program:
    """`prog` with every data argument (positions `data` among the inputs) whose readers
    all split its leading dim alike (`[B, ...] -> [n, B/n, ...]`) fed split instead:
    its view is `(split shape, 1)`, the second dim being the one a batch shards."""
    readers: dict[int, list[int]] = {}
    for i, e in enumerate(prog.eqns):
        for x in e.inputs:
            if isinstance(x, int):
                readers.setdefault(x, []).append(i)
    inputs, views = list(prog.inputs), list(prog.input_views or [None] * len(prog.inputs))
    alias: dict[int, int] = {}
    dropped: set[int] = set()
    for pos in data:
        t = inputs[pos]
        ids = readers.get(t, [])
        eqns = [prog.eqns[i] for i in ids]
        if not eqns or any(e.name != "reshape" or e.params.get("dimensions") is not None
                           for e in eqns):
            continue
        new, old = eqns[0].out_avals[0].shape, prog.avals[t].shape
        if any(e.out_avals[0].shape != new for e in eqns) or not _splits_leading(old, new):
            continue
        keep = eqns[0].outputs[0]
        inputs[pos], views[pos] = keep, (tuple(new), 1)
        dropped.update(ids)
        alias.update((e.outputs[0], keep) for e in eqns)
    if not dropped:
        return prog
    eqns = [replace(e, inputs=tuple(alias.get(x, x) if isinstance(x, int) else x
                                    for x in e.inputs))
            for i, e in enumerate(prog.eqns) if i not in dropped]
    params = {lp.id: (lp.length, lp.reverse) for lp in prog.loops}
    return replace(prog, eqns=tuple(eqns), inputs=tuple(inputs), input_views=tuple(views),
                   outputs=tuple(alias.get(o, o) if isinstance(o, int) else o
                                 for o in prog.outputs),
                   loops=loops_of(eqns, params))


def _splits_leading(old, new) -> bool:
    return (len(new) == len(old) + 1 and len(old) >= 1 and tuple(new[2:]) == tuple(old[1:])
            and new[0] * new[1] == old[0] and new[0] > 1 and new[1] > 1)
