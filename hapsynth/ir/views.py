"""Data arguments fed in the shape the step first gives them.

A step that accumulates gradients over microbatches reshapes its batch `[B, ...]` into
`[n, B/n, ...]` and loops over the `n`: data parallelism must split each microbatch
(the minor part of the batch dim), which no contiguous block of rows is. Fed already
split, the batch's rows are spread as the loop reads them, and the reshape is gone from
the program. `Program.input_views` records it: the lowering reshapes such an argument
when it stores it.

The same holds for a batch read in blocks of `m` rows (big_vision's accumulation: the
first microbatch by a static slice, the next ones by a `dynamic_slice` at `i * m` in a
`fori_loop`): fed as `[B/m, m, ...]`, a static block is a slice of the view and the
loop's blocks are the loop's slices of it, as if the step had scanned over them.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from hapsynth import _jax
from hapsynth.ir.trace import Aval, Const, Eqn, Program, loops_of


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
        return fold_block_reads(prog, data)
    eqns = [replace(e, inputs=tuple(alias.get(x, x) if isinstance(x, int) else x
                                    for x in e.inputs))
            for i, e in enumerate(prog.eqns) if i not in dropped]
    params = {lp.id: (lp.length, lp.reverse) for lp in prog.loops}
    return fold_block_reads(replace(
        prog, eqns=tuple(eqns), inputs=tuple(inputs), input_views=tuple(views),
        outputs=tuple(alias.get(o, o) if isinstance(o, int) else o for o in prog.outputs),
        loops=loops_of(eqns, params)), data)


def _splits_leading(old, new) -> bool:
    return (len(new) == len(old) + 1 and len(old) >= 1 and tuple(new[2:]) == tuple(old[1:])
            and new[0] * new[1] == old[0] and new[0] > 1 and new[1] > 1)


def fold_block_reads(prog: Program, data: Sequence[int]) -> Program:
    """`prog` with every data argument whose readers all take whole blocks of `m` rows of
    its leading dim (a static slice, or a loop's `dynamic_slice` at consecutive blocks)
    fed as `[B/m, m, ...]`, each read rewritten as a read of that view."""
    views = list(prog.input_views or [None] * len(prog.inputs))
    for pos in data:
        if views[pos] is not None:
            continue
        folded = _fold_blocks(prog, pos)
        if folded is not None:
            prog = folded
            views = list(prog.input_views)
    return prog


def _fold_blocks(prog: Program, pos: int) -> Program | None:
    t = prog.inputs[pos]
    shape = prog.avals[t].shape
    if not shape or t in prog.outputs:
        return None
    loops = {lp.id: lp for lp in prog.loops}
    readers = [i for i, e in enumerate(prog.eqns) if t in e.inputs]
    reads = {i: _block_read(prog, prog.eqns[i], t, loops) for i in readers}
    if not reads or None in reads.values() or len({m for m, _ in reads.values()}) != 1:
        return None
    m = next(iter(reads.values()))[0]
    if m < 2 or shape[0] % m or shape[0] // m < 2:
        return None
    avals = list(prog.avals)
    view = len(avals)
    avals.append(Aval((shape[0] // m, m, *shape[1:]), prog.avals[t].dtype))
    # a loop's first eqn -> (slices of the view made before the loop, the loop's slices)
    at_start: dict[int, tuple[list[Eqn], list[Eqn]]] = {}
    replaced: dict[int, list[Eqn]] = {}
    for i, (_, block) in reads.items():
        e = prog.eqns[i]
        if e.loop is not None and e.name == "dynamic_slice":
            before, inside = at_start.setdefault(loops[e.loop].start, ([], []))
            take, each = _loop_blocks(e, block, view, avals, loops[e.loop])
            before.append(take)
            inside.append(each)
            replaced[i] = []
        else:
            replaced[i] = _static_block(e, block, view, avals)
    eqns: list[Eqn] = []
    for i, e in enumerate(prog.eqns):
        for part in at_start.get(i, ()):
            eqns.extend(part)
        eqns.extend(replaced.get(i, [e]))
    inputs, views = list(prog.inputs), list(prog.input_views or [None] * len(prog.inputs))
    inputs[pos], views[pos] = view, (avals[view].shape, 1)
    params = {lp.id: (lp.length, lp.reverse) for lp in prog.loops}
    return replace(prog, eqns=tuple(eqns), avals=tuple(avals), inputs=tuple(inputs),
                   input_views=tuple(views), loops=loops_of(eqns, params))


def _block_read(prog: Program, e: Eqn, t: int, loops) -> tuple[int, int] | None:
    """(m, first block) if `e` reads whole blocks of m rows of `t` (all of every other dim):
    a static slice of one block, or a non-reversed loop's `dynamic_slice` taking blocks
    first, first + 1, ... in its iterations; else None."""
    shape = prog.avals[t].shape
    if e.inputs[0] != t or t in e.inputs[1:]:
        return None
    if e.name == "slice" and not any(s not in (None, 1) for s in (e.params.get("strides") or ())):
        start, limit = e.params["start_indices"], e.params["limit_indices"]
        m = limit[0] - start[0]
        if (tuple(start[1:]) == (0,) * (len(shape) - 1) and tuple(limit[1:]) == shape[1:]
                and m > 0 and start[0] % m == 0):
            return m, start[0] // m
        return None
    if e.name != "dynamic_slice" or e.loop is None:
        return None
    loop = loops[e.loop]
    sizes = tuple(e.params["slice_sizes"])
    if loop.reverse or sizes[1:] != shape[1:] or not all(
            isinstance(x, Const) and int(np.asarray(x.value)) == 0 for x in e.inputs[2:]):
        return None
    m = sizes[0]
    starts = _per_iteration(prog, e.inputs[1], loop)
    if not starts or any(s % m for s in starts):
        return None
    blocks = [s // m for s in starts]
    if blocks != list(range(blocks[0], blocks[0] + loop.length)) or blocks[0] < 0 or (
            blocks[-1] >= shape[0] // m):
        return None
    return m, blocks[0]


def _per_iteration(prog: Program, x, loop) -> list[int] | None:
    """The scalar `x` in each iteration of `loop`, where it depends only on constants and
    a counter (a carry starting at a constant and adding 1 each iteration); else None."""
    made = {o: i for i in range(loop.start, loop.end) for o in prog.eqns[i].outputs}
    counter = None
    for i in loop.carries:
        c = prog.eqns[i]
        init, out = c.inputs
        step = prog.eqns[made[out]] if out in made else None
        dtype = np.dtype(prog.avals[c.outputs[0]].dtype)
        if (isinstance(init, Const) and not init.aval.shape and dtype.kind in "iu"
                and step is not None and step.name == "add" and c.outputs[0] in step.inputs
                and any(isinstance(y, Const) and int(np.asarray(y.value)) == 1
                        for y in step.inputs)):
            counter = (c.outputs[0], int(np.asarray(init.value)), dtype)
            break
    if counter is None:
        return None
    values = []
    for k in range(loop.length):
        i = np.asarray(counter[1] + k, counter[2])
        v = _scalar(prog, x, made, {counter[0]: i}, depth=12)
        if v is None:
            return None
        values.append(int(v))
    return values


def _scalar(prog: Program, x, made, env, depth: int):
    """Evaluate scalar `x` from `env` and constants, binding each eqn on the host."""
    if isinstance(x, Const):
        return np.asarray(x.value)
    if x in env:
        return env[x]
    if depth == 0 or x not in made or prog.avals[x].shape:
        return None
    e = prog.eqns[made[x]]
    if e.name in _jax.LOOP_MARKERS or len(e.outputs) != 1:
        return None
    args = [_scalar(prog, y, made, env, depth - 1) for y in e.inputs]
    if any(a is None for a in args):
        return None
    env[x] = np.asarray(_jax.bind(e.primitive, args, e.params))
    return env[x]


def _static_block(e: Eqn, block: int, view: int, avals) -> list[Eqn]:
    """A static slice of one block: the view's block, its leading dim of 1 dropped."""
    v = avals[view]
    one = Aval((1, *v.shape[1:]), v.dtype)
    sliced = len(avals)
    avals.append(one)
    start = (block,) + (0,) * (len(v.shape) - 1)
    limit = (block + 1,) + tuple(v.shape[1:])
    return [_eqn("slice", lambda a: _slice(a, start, limit), [view], [sliced], [v], [one], e),
            _eqn("reshape", lambda a: a.reshape(v.shape[1:]), [sliced], list(e.outputs),
                 [one], list(e.out_avals), e)]


def _loop_blocks(e: Eqn, first: int, view: int, avals, loop) -> list[Eqn]:
    """The loop's blocks as a slice of the view (made before the loop), then the loop's
    per-iteration slice of it in place of the `dynamic_slice`."""
    v = avals[view]
    blocks = Aval((loop.length, *v.shape[1:]), v.dtype)
    sliced = len(avals)
    avals.append(blocks)
    start = (first,) + (0,) * (len(v.shape) - 1)
    limit = (first + loop.length,) + tuple(v.shape[1:])
    take = _eqn("slice", lambda a: _slice(a, start, limit), [view], [sliced], [v], [blocks],
                e, loop=None)
    each = Eqn(_jax.LOOP_SLICE, {"loop": loop.id}, (sliced,), e.outputs, (blocks,), e.out_avals,
               e.source, loop.id)
    return [take, each]


def _slice(a, start, limit):
    from jax import lax
    return lax.slice(a, start, limit)


def _eqn(name, fn, ins, outs, in_avals, out_avals, like: Eqn, loop="same") -> Eqn:
    primitive, params = _jax.eqn_like(fn, *in_avals)
    assert primitive.name == name, (primitive.name, name)
    return Eqn(primitive, params, tuple(ins), tuple(outs), tuple(in_avals), tuple(out_avals),
               like.source, like.loop if loop == "same" else loop)
