"""Loop regions written out iteration by iteration: the straight-line program a pipeline
cuts (a scan over layers becomes its layers, so stages may hold unequal numbers of them).

The program is re-traced with each loop region run as a Python loop, and with each state
leaf stacked on the layer axis (a parameter a loop scans over or a Python loop takes
`w[i]` from, and the optimizer state shaped like one) fed as its rows, one input per
layer, so that a stage stores only its layers. Per-layer values stay per layer as far
as the ops allow:
- an iteration's slice of a stack is that iteration's own value (the backward pass reads
  layer i's residuals straight from layer i's forward, and layer i's parameters from
  their own input); so is `w[i]`, and its gradient (row i padded with zero rows) is
  row i alone;
- elementwise ops on stacks run row by row, and reductions over the layer axis sum their
  rows' reductions (the optimizer updates each layer's parameters apart, a global
  gradient norm adds up per-layer sums);
- anything else reads the stack whole, as the step wrote it.
"""
from __future__ import annotations

from collections import ChainMap
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hapsynth import _jax
from hapsynth.ir.rules.registry import facts
from hapsynth.ir.trace import Const, Program, flatten, value_of

__all__ = ["MAX_TRIPS", "state_inputs", "unroll", "unrollable", "written_out"]

#: Longest loop written out: a scan over layers, not one over time steps or tokens.
MAX_TRIPS = 128

_COMBINE = {"reduce_sum": lax.add, "reduce_max": lax.max, "reduce_min": lax.min}


class _Stack(list):
    """Per-layer values of a stacked array, stacked only when something reads it whole;
    a row of None is zeros (the gradient `w[i]` gives the other rows of `w`)."""

    def __init__(self, rows, shape=None, dtype=None):
        super().__init__(rows)
        known = next((r for r in self if r is not None), None)
        self.shape = tuple(np.shape(known)) if known is not None else tuple(shape)
        self.dtype = jnp.result_type(known) if known is not None else dtype


def unrollable(prog: Program, num_state_leaves: int = 0) -> bool:
    """Is there something to write out: loop regions, each short enough, or (without
    loops) a state leaf the step reads row by row (a Python loop over stacked layers)?"""
    if prog.loops:
        return all(lp.length <= MAX_TRIPS for lp in prog.loops)
    return bool(_row_read(prog, num_state_leaves))


def _row_read(prog: Program, num_state_leaves: int) -> set[int]:
    """State leaves read one row at a time, by a loop scanning over them or by a Python
    loop (`w[i]`), and never as a block of rows (`wpe[:T]`)."""
    readers: dict = {}
    for e in prog.eqns:
        for x in e.inputs:
            if isinstance(x, int):
                readers.setdefault(x, []).append(e)
    out = set()
    for k in range(num_state_leaves):
        t = prog.inputs[k]
        if not 1 < (prog.avals[t].shape[:1] or (0,))[0] <= MAX_TRIPS:
            continue
        rows = [e.name == _jax.LOOP_SLICE.name or _rows_of(e) for e in readers.get(t, [])]
        if any(r is True or r and r[1] - r[0] == 1 for r in rows) and \
                not any(r and r is not True and r[1] - r[0] > 1 for r in rows):
            out.add(k)
    return out


def _rows_of(e):
    """(start, stop) of a `slice` that takes whole rows on axis 0, else None."""
    if e.name != "slice":
        return None
    p, shape = e.params, e.in_avals[0].shape
    if any(st not in (None, 1) for st in (p.get("strides") or ())):
        return None
    if tuple(p["start_indices"][1:]) != (0,) * (len(shape) - 1) or \
            tuple(p["limit_indices"][1:]) != tuple(shape[1:]):
        return None
    return int(p["start_indices"][0]), int(p["limit_indices"][0])


def unroll(prog: Program, num_state_leaves: int = 0) -> Program:
    """`prog` with every loop region written out; its leading `num_state_leaves` inputs
    (and the outputs they are handed back as) that are stacked on a loop's axis are fed
    as their rows (`Program.split`)."""
    sliced = _row_read(prog, num_state_leaves)
    if not prog.loops and not sliced:
        return prog
    kinds = {(prog.avals[prog.inputs[k]].shape, prog.avals[prog.inputs[k]].dtype) for k in sliced}
    split = {k for k in range(num_state_leaves)
             if (prog.avals[prog.inputs[k]].shape, prog.avals[prog.inputs[k]].dtype) in kinds}
    while True:  # a leaf shaped like a layer's that comes back whole is fed whole
        closed, per_layer = _retrace(prog, split)
        kept = {k for k in split if k in sliced or per_layer[k]}
        if kept == split:
            break
        split = kept
    eqns, avals, inputs, outputs, consts, loops = flatten(closed.jaxpr, closed.consts)
    counts = tuple(prog.avals[prog.inputs[k]].shape[0] if k in split else 0
                   for k in range(num_state_leaves))
    return replace(prog, eqns=tuple(eqns), avals=tuple(avals), inputs=tuple(inputs),
                   outputs=tuple(outputs), consts=consts, loops=loops,
                   traced_eqns=len(closed.jaxpr.eqns), split=counts if split else ())


def state_inputs(prog: Program, num_state_leaves: int) -> int:
    """How many program inputs the leading `num_state_leaves` leaves are fed as."""
    return num_state_leaves + sum(max(n - 1, 0) for n in prog.split)


def _retrace(prog: Program, split: set[int]):
    """The program traced with loops written out and the `split` leaves fed as rows; and
    per split leaf, whether its output came back per layer."""
    specs, per_layer = [], {}
    for k, t in enumerate(prog.inputs):
        a = prog.avals[t]
        rows = [a.shape[1:]] * a.shape[0] if k in split else [a.shape]
        specs += [jax.ShapeDtypeStruct(s, a.dtype) for s in rows]

    def run(*flat):
        it = iter(flat)
        args = [_Stack(next(it) for _ in range(prog.avals[t].shape[0])) if k in split
                else next(it) for k, t in enumerate(prog.inputs)]
        env = _evaluate(prog, args)
        outs = []
        for k, o in enumerate(prog.outputs):
            if k not in split:
                outs.append(_read(env, o))
                continue
            v = value_of(env, o)
            per_layer[k] = isinstance(v, _Stack)
            outs += [_row(v, i) for i in range(len(v))] if per_layer[k] else [
                lax.index_in_dim(jnp.asarray(v), i, keepdims=False) for i in range(v.shape[0])]
        return outs

    closed, _, _ = _jax.make_jaxpr(run, *specs)
    return closed, per_layer


def _read(env, x):
    """A value, stacked if it is held per layer."""
    if isinstance(x, Const):
        return x.value
    v = env[x]
    if isinstance(v, _Stack):
        v = env[x] = jnp.stack([_row(v, i) for i in range(len(v))])
    return v


def _row(v, i: int):
    if isinstance(v, _Stack):
        return v[i] if v[i] is not None else jnp.zeros(v.shape, v.dtype)
    return v if np.ndim(v) == 0 else lax.index_in_dim(v, i, keepdims=False)


def _is_zero(x) -> bool:
    return isinstance(x, Const) and np.ndim(x.value) == 0 and x.value == 0


def _rows_made(e, vals):
    """Rows made or taken whole: `w[i]` (a slice of rows, then a squeeze or reshape of
    its one row) and its gradient (a row broadcast to a stack of one, padded with zero
    rows on axis 0), or None."""
    if len(e.out_avals) != 1:
        return None
    out, v = e.out_avals[0], vals[0]
    if e.name == "broadcast_in_dim" and not isinstance(v, _Stack) and out.shape[:1] == (1,) \
            and tuple(e.params["broadcast_dimensions"]) == tuple(range(1, out.ndim)) \
            and tuple(np.shape(v)) == out.shape[1:]:
        return _Stack([v])
    if not isinstance(v, _Stack):
        return None
    if e.name == "slice" and _rows_of(e) is not None:
        a, b = _rows_of(e)
        return _Stack(v[a:b], v.shape, v.dtype)
    if e.name in ("squeeze", "reshape") and len(v) == 1 and out.shape == v.shape:
        return _row(v, 0)
    if e.name == "pad" and _is_zero(e.inputs[1]):
        (lo, hi, mid), *rest = e.params["padding_config"]
        if mid == 0 and lo >= 0 and hi >= 0 and all(tuple(r) == (0, 0, 0) for r in rest):
            return _Stack([None] * int(lo) + list(v) + [None] * int(hi), v.shape, v.dtype)
    return None


def _per_layer(e, vals):
    """`e` run layer by layer on operands of which some are held per layer, or None
    when it reads them whole."""
    made = _rows_made(e, vals)
    if made is not None or not any(isinstance(v, _Stack) for v in vals):
        return made
    n = next(len(v) for v in vals if isinstance(v, _Stack))
    if e.primitive.multiple_results or any(isinstance(v, _Stack) and len(v) != n for v in vals):
        return None
    shape = e.out_avals[0].shape
    if facts(e.name).elementwise:
        if shape[:1] != (n,) or any(not isinstance(v, _Stack) and np.ndim(v) not in (0, len(shape))
                                    for v in vals):
            return None
        if e.name in ("add", "add_any") and len(vals) == 2 and all(
                isinstance(v, _Stack) for v in vals):  # a zero row adds nothing
            return _Stack([b if a is None else a if b is None else
                           _jax.bind(e.primitive, [a, b], e.params)
                           for a, b in zip(*vals)], vals[0].shape, vals[0].dtype)
        return _Stack(_jax.bind(e.primitive, [_row(v, i) for v in vals], e.params)
                      for i in range(n))
    if e.name in _COMBINE and len(vals) == 1:
        axes = tuple(e.params["axes"])
        inner = tuple(a - 1 for a in axes if a > 0)
        params = {**e.params, "axes": inner}
        rows = [_jax.bind(e.primitive, [_row(vals[0], i)], params) if inner else
                _row(vals[0], i) for i in range(len(vals[0]))]
        if 0 not in axes:
            return _Stack(rows)
        total = rows[0]
        for r in rows[1:]:
            total = _COMBINE[e.name](total, r)
        return total
    return None


def _run(e, env) -> None:
    vals = [value_of(env, x) for x in e.inputs]
    out = _per_layer(e, vals) if vals else None
    if out is not None:
        env[e.outputs[0]] = out
        return
    if any(isinstance(v, _Stack) for v in vals):
        vals = [_read(env, x) for x in e.inputs]
    outs = _jax.bind(e.primitive, vals, e.params)
    env.update(zip(e.outputs, outs if e.primitive.multiple_results else (outs,)))


def _evaluate(prog: Program, args) -> dict:
    env = dict(prog.consts)
    env.update(zip(prog.inputs, args))
    loops = {lp.start: lp for lp in prog.loops}
    i = 0
    while i < len(prog.eqns):
        if i in loops:
            _loop(prog, loops[i], env)
            i = loops[i].end
        else:
            _run(prog.eqns[i], env)
            i += 1
    return env


def _loop(prog: Program, loop, env: dict) -> None:
    eqns = prog.eqns
    carries = [eqns[c] for c in loop.carries]
    carry = [np.asarray(x.value, x.aval.dtype) if isinstance(x, Const) else _read(env, x)
             for x in (c.inputs[0] for c in carries)]
    xs = [value_of(env, eqns[s].inputs[0]) for s in loop.slices]  # stacks stay per layer
    ys = [[None] * loop.length for _ in loop.stacks]
    order = range(loop.length - 1, -1, -1) if loop.reverse else range(loop.length)
    for i in order:
        local = ChainMap({}, env)  # the body reads what was made before the region
        local.update(zip((c.outputs[0] for c in carries), carry))
        for s, x in zip(loop.slices, xs):
            local[eqns[s].outputs[0]] = _row(x, i)
        for b in loop.body:
            _run(eqns[b], local)
        carry = [_read(local, c.inputs[1]) for c in carries]
        for k, s in enumerate(loop.stacks):
            ys[k][i] = _read(local, eqns[s].inputs[0])
    env.update(zip((c.inputs[1] for c in carries), carry))
    for k, s in enumerate(loop.stacks):
        env[eqns[s].outputs[0]] = _Stack(ys[k])


def written_out(prog: Program, num_state_leaves: int) -> tuple[Program, int] | None:
    """The program as a pipeline cuts it, its loops over layers written out, and its state
    leaves' count there (a stack's rows are leaves of their own); None when it has no
    such loop (`unrollable`)."""
    if not unrollable(prog, num_state_leaves):
        return None
    u = unroll(prog, num_state_leaves)
    return u, state_inputs(u, num_state_leaves)
