"""The step's own recomputation undone: equal ops on equal operands merged into one.

A step written with `jax.checkpoint` recomputes its blocks' activations in the backward
pass: the same ops on the same operands as the forward ran (read through an
`optimization_barrier`, as `jax.checkpoint` places one where it could be merged). That
is right on one device short of memory. A pipeline holds a few layers a stage, so the
planner may rather keep the activations: `merge_recomputed` gives the program that
does, and the planner prices both, keeping the faster that fits. Ops inside loop
regions, and ops with effects, stay as they are.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from hapsynth import _jax
from hapsynth.ir.trace import Const, Program

__all__ = ["merge_recomputed"]

# primitives whose results are not a function of their operands alone
_NEVER = ("rng_uniform",)
# what a recomputation worth undoing repeats (a repeated broadcast alone is not)
_WORK = ("dot_general", "conv_general_dilated")


def _mergeable(e) -> bool:
    name = e.name
    return (e.loop is None and bool(e.outputs) and name not in _NEVER
            and "callback" not in name and "debug" not in name
            and name not in _jax.LOOP_MARKERS)


def _const_key(c: Const):
    value = np.asarray(c.value)
    if value.size > 4096:
        return ("const", id(c))
    return ("const", value.dtype.str, value.shape, value.tobytes())


def _params_key(params):
    try:
        key = tuple(sorted(params.items()))
        hash(key)
    except TypeError:
        return None
    return key


def merge_recomputed(prog: Program) -> Program | None:
    """`prog` with every op equal to an earlier one (primitive, parameters and operands,
    an `optimization_barrier` seen through) dropped and its results read from the
    earlier; None where no matmul or convolution repeats."""
    if prog.loops:  # (loop regions are eqn ranges: they would move)
        return None
    alias: dict[int, int] = {}
    seen: dict = {}
    kept, merged = [], 0

    def read(x):
        return _const_key(x) if isinstance(x, Const) else alias.get(x, x)

    for e in prog.eqns:
        if e.primitive is _jax.BARRIER and all(isinstance(x, int) for x in e.inputs):
            alias.update((o, alias.get(x, x)) for x, o in zip(e.inputs, e.outputs))
            continue
        params = _params_key(e.params) if _mergeable(e) else None
        key = None if params is None else (e.primitive, params, tuple(map(read, e.inputs)))
        if key is not None and key in seen:
            alias.update(zip(e.outputs, seen[key].outputs))
            merged += e.name in _WORK
            continue
        if key is not None:
            seen[key] = e
        ins = tuple(x if isinstance(x, Const) else alias.get(x, x) for x in e.inputs)
        kept.append(e if ins == e.inputs else replace(e, inputs=ins))
    if not merged:
        return None
    outputs = tuple(o if isinstance(o, Const) else alias.get(o, o) for o in prog.outputs)
    return replace(prog, eqns=tuple(kept), outputs=outputs)
