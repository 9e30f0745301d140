"""Candidate strategies per node, from factor classes (Shardy-style propagation).

Factors of different ops are *linked* when they sit on the same dim of a tensor
that one op produces and another reads, and have the same size. Linked factors
form a class; sharding a class shards every op that holds one of its factors.
Within a node, a strategy is "shard class c" or "replicate". The same linking done
across the whole graph names the *batch class* (the one holding dim 0 of the data
arguments): data parallelism is "every node shards the batch class".

Layouts are `hapsynth.ir.layout.Layout` values: `R`, `P` (partial sum) or
`S(dim, units)`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hapsynth.ir.graph import REDUCTION, Graph, factor_letter
from hapsynth.ir.layout import P, R, S
from hapsynth.ir.rules import facts
from hapsynth.ir.unionfind import UnionFind


def link_factors(graph: Graph, ops=None) -> UnionFind:
    """Union (op, factor) pairs that share a tensor dim between producer and consumer."""
    ops = graph.ops if ops is None else ops
    keep = {op.id for op in ops}
    uf = UnionFind()  # roots are the smallest (op, factor): deterministic class names
    result_pos: dict[tuple[int, int], list] = {}  # (tensor, dim) -> [(op, factor)] producing it
    for op in ops:
        for fi, f in enumerate(op.rule.factors):
            if not f.shardable:
                continue
            uf.find((op.id, fi))
            for (j, d) in f.results:
                result_pos.setdefault((op.outputs[j], d), []).append((op.id, fi, f.size))
    for op in ops:
        for fi, f in enumerate(op.rule.factors):
            if not f.shardable:
                continue
            for (i, d) in f.operands:
                t = op.inputs[i]
                if t is None:
                    continue
                for (pop, pfi, psize) in result_pos.get((t, d), ()):
                    if pop in keep and psize == f.size:
                        a, b = sorted((uf.find((pop, pfi)), uf.find((op.id, fi))))
                        uf.union(a, b)
    return uf


@dataclass(frozen=True)
class OpChoice:
    """What one op does under a node strategy."""

    factor: int | None          # sharded factor index, or None (replicated / partial carry)
    inputs: tuple               # required layout per operand (None for literals)
    outputs: tuple              # produced layout per result


def op_choice(op, factor: int | None, in_layouts=None) -> OpChoice:
    """Required input and produced output layouts of `op` sharding `factor`.

    With `factor=None` the op is replicated, unless `in_layouts` shows a partial-sum
    operand it is linear in: then it carries `P` through (no all-reduce yet).
    """
    nin = len(op.inputs)
    if factor is not None:
        f = op.rule.factors[factor]
        ins, outs = [], []
        for i in range(nin):
            dims = [d for (o, d) in f.operands if o == i]
            if op.inputs[i] is None:
                ins.append(None)
            elif dims:
                ins.append(S(dims[0], f.size))
            else:
                ins.append(P if f.kind == REDUCTION else R)
        for j in range(len(op.outputs)):
            dims = [d for (r, d) in f.results if r == j]
            outs.append(S(dims[0], f.size) if dims else (P if f.kind == REDUCTION else R))
        return OpChoice(factor, tuple(ins), tuple(outs))
    layouts = in_layouts or [R] * nin
    tensors = [i for i in range(nin) if op.inputs[i] is not None]
    carry = facts(op.primitive).partial  # ops a partial sum may pass through (registry facts)
    if tensors and all(layouts[i] == P for i in tensors) and (
            (carry == "unary" and len(tensors) == 1) or carry == "sum"):
        return OpChoice(None, tuple(P if i in tensors else None for i in range(nin)),
                        tuple(P for _ in op.outputs))
    return _replicated(op)


def _replicated(op) -> OpChoice:
    return OpChoice(None, tuple(None if t is None else R for t in op.inputs),
                    tuple(R for _ in op.outputs))


@dataclass(frozen=True)
class Strategy:
    """One way to run a node: `klass` is the sharded factor class (None = replicate);
    `name` says it in words, from the node's own ops (e.g. "shard c=768 of dot_general")."""

    klass: tuple | None
    choices: tuple[tuple[int, OpChoice], ...]  # (op id, choice) in program order
    layouts: dict = field(default_factory=dict, compare=False)  # produced tensor -> layout
    name: str = "replicate"

    def __str__(self) -> str:
        return self.name


REPLICATE = "replicate"
CARRY = "replicate, carry partial sums"


def class_name(op, fi: int, role: str | None = None) -> str:
    """A sharded class named by one op holding it: "shard c=768 of dot_general", with
    its role ("the batch") when known and ", partial sums" for a sum reduction."""
    f = op.rule.factors[fi]
    what = f"{factor_letter(fi)}={f.size} of {op.primitive}"
    text = f"shard {role} ({what})" if role else f"shard {what}"
    return text + (", partial sums" if f.kind == REDUCTION else "")


def node_strategies(graph: Graph, node, uf: UnionFind, max_classes: int = 6,
                    keep=(), roles=None) -> list[Strategy]:
    """Replicate, plus sharding each of the node's heaviest factor classes (and `keep`).

    `roles` names some classes ({class: "the batch"}) in the strategies' names."""
    ops = [graph.ops[i] for i in node.ops]
    roles = roles or {}
    weight: dict = {}
    anchor: dict = {}  # first (local op index, factor) holding the class: a node-relative name
    heaviest: dict = {}  # class -> (op weight, op, factor): the op that names the class
    for k, op in enumerate(ops):
        w_op = op.cost.flops + 1e-3 * op.cost.bytes
        for fi, f in enumerate(op.rule.factors):
            if f.shardable:
                c = uf.find((op.id, fi))
                weight[c] = weight.get(c, 0.0) + w_op
                anchor.setdefault(c, (k, fi))
                if c not in heaviest or w_op > heaviest[c][0]:
                    heaviest[c] = (w_op, op, fi)
    ranked = sorted(weight, key=lambda c: (-weight[c], anchor[c]))
    classes = [c for c in ranked if c in keep] + [c for c in ranked if c not in keep]
    classes = classes[:max(max_classes, sum(1 for c in ranked if c in keep))]
    out = [propagate(graph, ops, None, uf, name=REPLICATE)]
    carry = propagate(graph, ops, None, uf, carry=True, name=CARRY)
    if carry.choices != out[0].choices:
        out.append(carry)
    seen: dict[str, int] = {}
    for c in classes:
        name = class_name(*heaviest[c][1:], roles.get(c))
        seen[name] = seen.get(name, 0) + 1
        out.append(propagate(graph, ops, c, uf,
                             name=name if seen[name] == 1 else f"{name} #{seen[name]}"))
    return out


def propagate(graph: Graph, ops, klass, uf: UnionFind, carry: bool = False,
              name: str = REPLICATE) -> Strategy:
    """Choices of every op in program order when `klass` is sharded (None: replicate).

    `carry=True`: operands from other nodes may arrive as partial sums, so sums of
    partial sums (e.g. the two gradient paths of a tied embedding) stay partial.
    """
    layout: dict[int, object] = {}
    choices = []
    for op in ops:
        factor = None
        if klass is not None:
            for fi, f in enumerate(op.rule.factors):
                if f.shardable and uf.find((op.id, fi)) == klass:
                    factor = fi
                    break
        outside = P if carry else R
        in_layouts = [layout.get(t, outside) if t is not None else None for t in op.inputs]
        ch = op_choice(op, factor, in_layouts)
        for t, lay in zip(op.outputs, ch.outputs):
            layout[t] = lay
        choices.append((op.id, ch))
    return Strategy(klass, tuple(choices), layout, name)


def batch_class(graph: Graph, uf: UnionFind, data_inputs) -> tuple | None:
    """The factor class holding dim 0 of the data arguments (what data parallelism shards)."""
    data = set(data_inputs)
    for op in graph.ops:
        for fi, f in enumerate(op.rule.factors):
            if f.shardable and any(op.inputs[i] in data and d == 0 for (i, d) in f.operands):
                return uf.find((op.id, fi))
    return None


def layer_ties(graph: Graph, strategies) -> list[int]:
    """Representative node per node: nodes repeated across layers share one decision.

    Two nodes tie when their ops match (primitive, shapes, in order) and their
    strategy lists line up (same count, ranked by node-relative anchors), so index s
    means the same strategy in both. Any tie is a valid plan; it only shrinks search.
    """
    first: dict = {}
    reps = []
    for node, strats in zip(graph.nodes, strategies):
        sig = (tuple(s.name for s in strats), tuple(
            (graph.ops[i].primitive, tuple(graph.tensors[t].shape if t is not None else None
                                           for t in graph.ops[i].inputs),
             tuple(graph.tensors[t].shape for t in graph.ops[i].outputs)) for i in node.ops))
        reps.append(first.setdefault(sig, node.id))
    return reps
