"""What a plan was made for: the program's inputs, outputs and ops, so a saved plan is
never applied to a different program (a mismatch names what differs)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import jax

from hapsynth.ir.graph import Graph, short_dtype
from hapsynth.ir.trace import Program


@dataclass(frozen=True)
class Signature:
    inputs: tuple[str, ...]    # per input leaf: its path and type, e.g. "[2]['x'] f32[8,16]"
    outputs: tuple[str, ...]   # per output leaf: its type
    ops: tuple[str, ...]       # primitive of each op, in program order
    digest: str                # hash of how the ops are wired and every tensor's type


def _type(shape, dtype) -> str:
    return f"{short_dtype(dtype)}[{','.join(map(str, shape))}]"


def _make(paths, types, ops, inputs, outputs) -> Signature:
    h = hashlib.sha256()
    for prim, ins, outs in ops:
        h.update(repr((prim, ins, outs)).encode())
    for t in types:
        h.update(t.encode())
    return Signature(tuple(f"{p} {types[t]}" for p, t in zip(paths, inputs)),
                     tuple("const" if t is None else types[t] for t in outputs),
                     tuple(prim for prim, _, _ in ops), h.hexdigest()[:16])


def leaf_paths(tree) -> list[str]:
    """The pytree path of every leaf of `tree` (a treedef), e.g. "[0]['dense']['kernel']"."""
    dummy = jax.tree.unflatten(tree, range(tree.num_leaves))
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]


def input_paths(prog: Program) -> list[str]:
    """The path of every program input; a leaf fed as rows has one per row."""
    out = []
    for k, p in enumerate(leaf_paths(prog.in_tree)):
        n = prog.split[k] if k < len(prog.split) else 0
        out += [f"{p}[row {i}]" for i in range(n)] if n else [p]
    return out


def of_program(prog: Program) -> Signature:
    types = [_type(a.shape, getattr(a.dtype, "name", str(a.dtype))) for a in prog.avals]
    ops = [(e.name, tuple(x if isinstance(x, int) else None for x in e.inputs), e.outputs)
           for e in prog.eqns]
    outs = [o if isinstance(o, int) else None for o in prog.outputs]
    return _make(input_paths(prog), types, ops, prog.inputs, outs)


def of_graph(graph: Graph) -> Signature:
    types = [_type(t.shape, t.dtype) for t in graph.tensors]
    ops = [(op.primitive, op.inputs, op.outputs) for op in graph.ops]
    paths = graph.input_paths or [f"[{i}]" for i in range(len(graph.inputs))]
    return _make(paths, types, ops, graph.inputs, graph.outputs)


def difference(planned: Signature, actual: Signature) -> str | None:
    """None if equal, else what differs first, in words."""
    if planned == actual:
        return None
    for what, a, b in (("inputs", planned.inputs, actual.inputs),
                       ("outputs", planned.outputs, actual.outputs)):
        if len(a) != len(b):
            return f"the plan is for {len(a)} {what} leaves, the program has {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"{what[:-1]} {i}: the plan is for {x}, the program has {y}"
    if len(planned.ops) != len(actual.ops):
        return f"the plan is for a program of {len(planned.ops)} ops, this one has {len(actual.ops)}"
    for i, (x, y) in enumerate(zip(planned.ops, actual.ops)):
        if x != y:
            return f"op {i}: the plan has {x}, the program has {y}"
    return "the ops are the same primitives on the same inputs but wired or typed differently"
