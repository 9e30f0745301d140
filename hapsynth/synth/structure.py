"""What a plan chooses from, independent of shard sizes: strategies per node, and which
layout of which tensor each strategy needs (the conversions that may be paid)."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from hapsynth.ir.graph import Graph
from hapsynth.ir.layout import R, Layout
from hapsynth.ir.rules import facts
from hapsynth.synth.strategy import Strategy, link_factors, node_strategies


@dataclass(frozen=True)
class Need:
    """Tensor `tensor` is needed in layout `layout` by the node strategies in `consumers`
    ({node: strategy indices}; node -1: the step's output) through the ops `ops`."""

    tensor: int
    layout: Layout
    consumers: Mapping[int, frozenset]
    ops: frozenset
    repeat: int = 1   # times it is converted: a loop's iterations, when made and read in it
    deferred: bool = False  # read only on the way to the optimizer: may overlap compute


@dataclass(frozen=True)
class Structure:
    graph: Graph
    strategies: tuple[tuple[Strategy, ...], ...]  # per node
    needs: tuple[Need, ...]
    producer_node: Mapping[int, int]               # tensor -> node making it
    tail_start: int                                # first op after the last contraction
    pairs: Mapping[int, int]                       # state input tensor -> its update
    num_state_leaves: int = 0
    loop_start: Mapping[int, int] = field(default_factory=dict)  # loop id -> its first op


def state_pairs(graph: Graph, num_state_leaves: int) -> dict[int, int]:
    """input tensor -> output tensor for state leaves (the step's fixed point)."""
    return {graph.inputs[i]: graph.outputs[i] for i in range(num_state_leaves)
            if graph.outputs[i] is not None}


def stored_copies(graph: Graph, pairs) -> dict[int, int]:
    """{copy: state input} for every `optimization_barrier` copy of a state input
    (checkpointing copies a segment's weights so they are gathered again for its
    backward pass, `ir/checkpoint.py`)."""
    return {y: x for op in graph.ops if op.primitive == "optimization_barrier"
            for x, y in zip(op.inputs, op.outputs) if x in pairs and y is not None}


def build_structure(graph: Graph, *, num_state_leaves: int = 0, max_classes: int = 3,
                    uf=None, keep=(), roles=None) -> Structure:
    """Strategies of every node (replicate, carry partial sums, the heaviest factor classes
    and `keep`), and every (tensor, layout) a strategy reads from another node.

    A state input is read in its update's layout (the step's fixed point); data inputs
    are fed in whatever layout is needed, so they need nothing; outputs the user reads
    (not state) must end replicated."""
    uf = uf or link_factors(graph)
    contraction_at = [op.id for op in graph.ops if facts(op.primitive).contraction]
    tail_start = (max(contraction_at) + 1) if contraction_at else len(graph.ops)
    producer_node = {t.id: graph.ops[t.producer].node for t in graph.tensors
                     if t.producer is not None}
    pairs = state_pairs(graph, num_state_leaves)
    strategies, needs = [], {}
    for node in graph.nodes:
        strats = node_strategies(graph, node, uf, max_classes, keep, roles)
        strategies.append(tuple(strats))
        for si, st in enumerate(strats):
            for op_id, ch in st.choices:
                for i, t in enumerate(graph.ops[op_id].inputs):
                    if t is None or ch.inputs[i] is None:
                        continue
                    src = pairs.get(t, t)
                    if src not in producer_node:
                        continue
                    key = (src, ch.inputs[i], _repeat(graph, src, op_id))
                    consumers, ops = needs.setdefault(key, ({}, set()))
                    consumers.setdefault(node.id, set()).add(si)
                    ops.add(op_id)
    state_outs = set(pairs.values())
    for t in graph.outputs:
        if t is not None and t not in state_outs and t in producer_node:
            needs.setdefault((t, R, 1), ({}, set()))[0][-1] = {0}
    late = feeds_tail(graph, tail_start)
    frozen = tuple(Need(t, lay, MappingProxyType({n: frozenset(s) for n, s in cons.items()}),
                        frozenset(ops), rep, bool(ops) and all(late[o] for o in ops))
                   for (t, lay, rep), (cons, ops) in needs.items())
    loop_start: dict[int, int] = {}
    for op in graph.ops:
        if op.loop is not None:
            loop_start.setdefault(op.loop, op.id)
    return Structure(graph, tuple(strategies), frozen, MappingProxyType(producer_node),
                     tail_start, MappingProxyType(pairs), num_state_leaves,
                     MappingProxyType(loop_start))


def _repeat(graph: Graph, t: int, op_id: int) -> int:
    """A value made in a loop and read in it is converted every iteration; one made
    before the loop, or read after it, is converted once, outside it."""
    made_in, reader = graph.ops[graph.tensors[t].producer].loop, graph.ops[op_id]
    return reader.repeat if made_in is not None and reader.loop == made_in else 1
def feeds_tail(graph: Graph, tail_start: int) -> list[bool]:
    """Per op: is it in the tail (the optimizer, after the last contraction), or a light op
    (moves layout, elementwise, or linear in a partial sum) whose results are read only by
    such ops? A value read only by those is not needed before the tail: its conversion
    can overlap the rest of the backward pass (the accumulation of a layer's gradient
    into a stacked one is on that way)."""
    readers: dict[int, list[int]] = {}
    for op in graph.ops:
        for t in op.inputs:
            if t is not None:
                readers.setdefault(t, []).append(op.id)
    outputs = {t for t in graph.outputs if t is not None}
    late = [False] * len(graph.ops)
    for op in reversed(graph.ops):
        if op.id >= tail_start:
            late[op.id] = True
        elif facts(op.primitive).follower or op.carries in ("unary", "sum", "accumulate"):
            rs = [r for t in op.outputs for r in readers.get(t, ())]
            late[op.id] = bool(rs) and not outputs & set(op.outputs) and all(
                r > op.id and late[r] for r in rs)
    return late
