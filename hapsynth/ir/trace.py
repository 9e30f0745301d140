"""Trace a train step to a flat `Program`: one list of primitive applications.

Nested `jit`, custom-derivative calls and `remat` are inlined; control flow stays
one eqn (its bodies are kept for costing). Dead eqns are removed, as XLA would.
Tensors are numbered; the same inner jaxpr inlined twice gets fresh numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from hapsynth import _jax


@dataclass(frozen=True)
class Aval:
    """Shape and dtype of a tensor (a JAX-independent copy of a ShapedArray)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True, eq=False)
class Const:
    """An inline constant operand (a jaxpr literal or a closed-over value)."""

    value: Any
    aval: Aval


@dataclass(frozen=True, eq=False)
class Eqn:
    """One primitive application: operands are tensor ids or `Const`s."""

    primitive: Any
    params: Mapping[str, Any]
    inputs: tuple[int | Const, ...]
    outputs: tuple[int, ...]
    in_avals: tuple[Aval, ...]
    out_avals: tuple[Aval, ...]
    source: str = ""

    @property
    def name(self) -> str:
        return self.primitive.name


@dataclass(frozen=True, eq=False)
class Program:
    """A whole train step, flattened. `avals[t]` is tensor t's type."""

    eqns: tuple[Eqn, ...]
    avals: tuple[Aval, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int | Const, ...]
    in_tree: Any
    out_tree: Any
    consts: Mapping[int, Any] = field(default_factory=dict)
    traced_eqns: int = 0  # top-level eqns of the jaxpr before inlining


def to_aval(jax_aval) -> Aval:
    dtype = jax_aval.dtype
    try:
        dtype = np.dtype(dtype)
    except TypeError:  # extended dtypes (PRNG keys): keep the object, size by key data
        pass
    return Aval(tuple(int(d) for d in jax_aval.shape), dtype)


class _Builder:
    def __init__(self):
        self.avals: list[Aval] = []
        self.eqns: list[Eqn] = []
        self.consts: dict[int, Any] = {}
        self.effectful: set[int] = set()

    def new_tensor(self, aval: Aval) -> int:
        self.avals.append(aval)
        return len(self.avals) - 1

    def read(self, env, atom):
        if _jax.is_literal(atom):
            return Const(atom.val, to_aval(atom.aval))
        return env[atom]

    def inline(self, jaxpr, consts, args) -> list:
        """Append jaxpr's eqns with invars bound to `args`; returns its outputs."""
        env: dict = {}
        for var, val in zip(jaxpr.constvars, consts):
            t = self.new_tensor(to_aval(var.aval))
            self.consts[t] = val
            env[var] = t
        for var, arg in zip(jaxpr.invars, args):
            env[var] = arg
        for eqn in jaxpr.eqns:
            ins = [self.read(env, a) for a in eqn.invars]
            body = _jax.inline_body(eqn)
            if body is not None:
                outs = self.inline(body[0], body[1], ins)
                for var, val in zip(eqn.outvars, outs):
                    env[var] = val
                continue
            outs = tuple(self.new_tensor(to_aval(v.aval)) for v in eqn.outvars)
            for var, t in zip(eqn.outvars, outs):
                env[var] = t
            self.eqns.append(Eqn(
                primitive=eqn.primitive, params=dict(eqn.params), inputs=tuple(ins), outputs=outs,
                in_avals=tuple(to_aval(a.aval) for a in eqn.invars),
                out_avals=tuple(to_aval(v.aval) for v in eqn.outvars),
                source=_jax.source_of(eqn),
            ))
            if _jax.has_effects(eqn):
                self.effectful.add(len(self.eqns) - 1)
        return [self.read(env, a) for a in jaxpr.outvars]


def flatten(jaxpr, consts=()) -> tuple[list[Eqn], list[Aval], list[int], list, dict]:
    """Flatten an open jaxpr with its consts: (eqns, avals, input ids, outputs, consts)."""
    b = _Builder()
    inputs = [b.new_tensor(to_aval(v.aval)) for v in jaxpr.invars]
    outputs = b.inline(jaxpr, consts, inputs)
    eqns = _dce(b.eqns, outputs, b.effectful)
    return eqns, b.avals, inputs, outputs, b.consts


def _dce(eqns: list[Eqn], outputs, effectful: set[int]) -> list[Eqn]:
    live = {o for o in outputs if isinstance(o, int)}
    kept = []
    for i in range(len(eqns) - 1, -1, -1):
        e = eqns[i]
        if i in effectful or any(o in live for o in e.outputs):
            kept.append(e)
            live.update(x for x in e.inputs if isinstance(x, int))
    kept.reverse()
    return kept


def trace(fn, *args) -> Program:
    """Trace `fn(*args)` (arrays or ShapeDtypeStructs) into a flat Program."""
    closed, in_tree, out_tree = _jax.make_jaxpr(fn, *args)
    eqns, avals, inputs, outputs, consts = flatten(closed.jaxpr, closed.consts)
    return Program(
        eqns=tuple(eqns), avals=tuple(avals), inputs=tuple(inputs), outputs=tuple(outputs),
        in_tree=in_tree, out_tree=out_tree, consts=consts, traced_eqns=len(closed.jaxpr.eqns),
    )


def value_of(env, x):
    """An operand's value: a constant's own, or the tensor's from `env`."""
    return x.value if isinstance(x, Const) else env[x]


def evaluate(prog: Program, flat_args, place=None) -> dict:
    """Run the flat program eqn by eqn (eager, or traced under jit); returns {tensor id:
    value}. `place(tensor id, value)`, if given, replaces each result as it is made
    (the lowering uses it to pin results to their planned layouts)."""
    env = dict(prog.consts)
    env.update(zip(prog.inputs, flat_args))
    for e in prog.eqns:
        vals = [value_of(env, x) for x in e.inputs]
        outs = _jax.bind(e.primitive, vals, e.params)
        if not e.primitive.multiple_results:
            outs = (outs,)
        if place is not None:
            outs = [place(t, v) for t, v in zip(e.outputs, outs)]
        env.update(zip(e.outputs, outs))
    return env
