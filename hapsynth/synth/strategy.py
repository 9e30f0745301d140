"""Candidate strategies per node, from factor classes (Shardy-style propagation).

Factors of different ops are *linked* when they sit on the same dim of a tensor that
one op produces and another reads. Linked factors form a class; sharding a class
shards every op that holds one of its factors. Sizes may differ where a reshape
merges or splits a dim (the batch of [B, S] -> [B*S]: factors B and B*S on one dim):
both split alike in blocks of the class's *units*, the gcd of its factors' sizes (a
dim holds each of its factors as its major part). Within a node, a strategy is
"shard class c" or "replicate". The classes holding dim 0 of the data arguments are
the *batch*: data parallelism is "every node shards a batch class".

Layouts are `hapsynth.ir.layout.Layout` values: `R`, `P` (partial sum) or
`S(dim, units)`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from hapsynth.ir.graph import REDUCTION, Graph, factor_letter
from hapsynth.ir.layout import P, R, S
from hapsynth.ir.unionfind import UnionFind


class FactorClasses(UnionFind):
    """Disjoint sets of (op, factor), each class sharded in `units(class)` blocks."""

    def __init__(self):
        super().__init__()
        self.size: dict = {}     # (op, factor) -> factor size
        self._units: dict = {}   # class root -> units, filled by `link_factors`

    def units(self, klass) -> int:
        """Blocks every dim holding the class splits in: the gcd of its factors' sizes."""
        return self._units[self.find(klass)]


def link_factors(graph: Graph, ops=None, min_units: int = 1) -> FactorClasses:
    """Link (op, factor) pairs that share a tensor dim between producer and consumer:
    always when their sizes are equal; when one divides the other (a reshape merged or
    split the dim) only if the smaller still has `min_units` units (so a batch never
    degrades into, say, 4 microbatches)."""
    ops = graph.ops if ops is None else ops
    keep = {op.id for op in ops}
    uf = FactorClasses()  # roots are the smallest (op, factor): deterministic class names
    result_pos: dict[tuple[int, int], list] = {}  # (tensor, dim) -> [(op, factor)] producing it
    for op in ops:
        for fi, f in enumerate(op.rule.factors):
            if not f.shardable:
                continue
            uf.find((op.id, fi))
            uf.size[(op.id, fi)] = f.size
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
                    small, big = sorted((psize, f.size))
                    if pop in keep and (small == big or (big % small == 0 and small >= min_units)):
                        a, b = sorted((uf.find((pop, pfi)), uf.find((op.id, fi))))
                        uf.union(a, b)
    for item, size in uf.size.items():
        root = uf.find(item)
        uf._units[root] = math.gcd(uf._units.get(root, 0), size)
    return uf


@dataclass(frozen=True)
class OpChoice:
    """What one op does under a node strategy."""

    factor: int | None          # sharded factor index, or None (replicated / partial carry)
    inputs: tuple               # required layout per operand (None for literals)
    outputs: tuple              # produced layout per result
    units: int = 0              # blocks the sharded factor splits in (divides its size)


def op_choice(op, factor: int | None, in_layouts=None, units: int | None = None,
              growth=lambda i: 1.0) -> OpChoice:
    """Required input and produced output layouts of `op` sharding `factor` in `units`
    blocks (default: the factor's size).

    With `factor=None` the op is replicated, unless `in_layouts` shows a partial-sum
    operand it is linear in: then it carries `P` through (no all-reduce yet) where that
    cannot cost more. `growth(i)` is the result's bytes over operand i's: a unary op that
    grows it (an up-cast of bf16 gradients to f32) does not carry, and a contraction
    carries only what it shrinks (a LoRA weight's gradient times the other adapter).
    """
    nin = len(op.inputs)
    if factor is not None:
        f = op.rule.factors[factor]
        u = units or f.size
        ins, outs = [], []
        for i in range(nin):
            dims = [d for (o, d) in f.operands if o == i]
            if op.inputs[i] is None:
                ins.append(None)
            elif dims:
                ins.append(S(dims[0], u))
            else:
                ins.append(P if f.kind == REDUCTION else R)
        for j in range(len(op.outputs)):
            dims = [d for (r, d) in f.results if r == j]
            outs.append(S(dims[0], u) if dims else (P if f.kind == REDUCTION else R))
        return OpChoice(factor, tuple(ins), tuple(outs), u)
    layouts = in_layouts or [R] * nin
    tensors = [i for i in range(nin) if op.inputs[i] is not None]
    carry = op.carries  # how a partial sum may pass through (the registry's facts)
    partial = [layouts[i] == P for i in tensors]
    if not carries(carry, partial, lambda k: growth(tensors[k])):
        return _replicated(op)
    if carry == "linear":  # the partial operand stays partial, the others arrive whole
        ins = tuple(None if op.inputs[i] is None else P if layouts[i] == P else R
                    for i in range(nin))
    else:
        ins = tuple(P if i in tensors else None for i in range(nin))
    return OpChoice(None, ins, tuple(P for _ in op.outputs))


def carries(carry: str | None, partial, growth) -> bool:
    """Does an op whose registry fact is `carry` pass a partial sum through, its tensor
    operands partial as `partial`, `growth(k)` its result's bytes over operand k's?
    A loop's accumulator stays partial from a whole initial value (itself on one device,
    zeros elsewhere: free), so the all-reduce waits for the loop's end."""
    if carry == "unary":
        return partial == [True] and growth(0) <= 1
    if carry == "sum":
        return bool(partial) and all(partial)
    if carry == "accumulate":
        return any(partial)
    if carry == "linear":
        return sum(partial) == 1 and growth(partial.index(True)) < 1
    return False


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


def class_name(op, fi: int, role: str | None = None, units: int | None = None) -> str:
    """A sharded class named by one op holding it: "shard c=768 of dot_general", with
    its role ("the batch") when known, its units when coarser than the factor ("in 12
    blocks") and ", partial sums" for a sum reduction."""
    f = op.rule.factors[fi]
    what = f"{factor_letter(fi)}={f.size} of {op.primitive}"
    if units and units != f.size:
        what += f" in {units} blocks"
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
        name = class_name(*heaviest[c][1:], roles.get(c), uf.units(c))
        seen[name] = seen.get(name, 0) + 1
        out.append(propagate(graph, ops, c, uf,
                             name=name if seen[name] == 1 else f"{name} #{seen[name]}"))
    return out


def propagate(graph: Graph, ops, klass, uf: UnionFind, carry: bool = False,
              name: str = REPLICATE) -> Strategy:
    """Choices of every op in program order when `klass` is sharded (None: replicate).

    `carry=True`: operands made by other nodes may arrive as partial sums, so sums of
    partial sums (e.g. the two gradient paths of a tied embedding) stay partial.
    """
    layout: dict[int, object] = {}
    choices = []
    units = None if klass is None else uf.units(klass)

    def made_outside(t) -> bool:  # the step's arguments arrive whole, never partial
        return graph.tensors[t].producer is None

    factors = []
    for op in ops:
        factor = None
        if klass is not None:
            for fi, f in enumerate(op.rule.factors):
                if f.shardable and uf.find((op.id, fi)) == klass:
                    factor = fi
                    break
        factors.append(factor)
    # a loop's carry reads its update, made later: the first pass supposes it partial (an
    # accumulator), the second sees the update's layout: a fixed point either way
    ids = {op.id for op in ops}
    later = {t for op in ops for t in op.inputs if t is not None
             and graph.tensors[t].producer in ids and graph.tensors[t].producer > op.id}

    def guess(t):  # a tensor of another node, as made if that node shards `klass` too
        if t in later or (carry and not made_outside(t)):
            return P
        return P if klass is not None and _partial_under(graph, t, klass, uf) else R

    for _ in range(2 if later else 1):
        choices = []
        for op, factor in zip(ops, factors):
            in_layouts = [None if t is None else layout[t] if t in layout else guess(t)
                          for t in op.inputs]
            ch = op_choice(op, factor, in_layouts, units,
                           lambda i, op=op: growth(graph, op, op.inputs[i]))
            for t, lay in zip(op.outputs, ch.outputs):
                layout[t] = lay
            choices.append((op.id, ch))
    return Strategy(klass, tuple(choices), layout, name)


def growth(graph: Graph, op, t: int) -> float:
    """The bytes `op` makes over those of its operand `t`."""
    return sum(graph.tensors[o].nbytes for o in op.outputs) / max(graph.tensors[t].nbytes, 1)


def _join_equal(uf: FactorClasses, classes) -> set:
    """Classes of the batch in equal blocks are one (the same rows, read by several ops:
    e.g. the first microbatch and the loop's next ones); returns the roots left."""
    by_units: dict = {}
    for c in sorted(classes):
        root = by_units.setdefault(uf.units(c), c)
        if uf.find(root) != uf.find(c):
            units = uf.units(root)
            uf.union(uf.find(root), uf.find(c))
            uf._units[uf.find(root)] = units
    return {uf.find(c) for c in classes}


def _partial_under(graph: Graph, t: int, klass, uf: UnionFind, depth: int = 6) -> bool:
    """Is `t` a partial sum when its producer shards `klass`: made by an op reducing over
    `klass`, or carried as a partial sum (the registry's facts) from such ops?"""
    p = graph.tensors[t].producer
    if p is None or depth == 0:
        return False
    op = graph.ops[p]
    if any(f.shardable and f.kind == REDUCTION and uf.find((op.id, fi)) == klass
           for fi, f in enumerate(op.rule.factors)):
        return True
    ins = [x for x in op.inputs if x is not None]
    below = [_partial_under(graph, x, klass, uf, depth - 1) for x in ins]
    return carries(op.carries, below, lambda k: growth(graph, op, ins[k]))


def batch_classes(graph: Graph, uf: FactorClasses, data_inputs) -> tuple:
    """The factor classes holding the batch dim of the data arguments (dim 0, or the
    microbatch dim of one fed split), most ops first: what data parallelism shards
    (several when no op joins two data inputs' batches).

    An argument that is not state may still be weights (a frozen base model beside its
    LoRA adapters, a teacher, a target network): its dim 0 is then a class that also
    holds another dim of some argument (x's features, contracted with it), which a
    batch never does; such classes are dropped while a class of the batch remains."""
    data = {t: graph.batch_dims.get(t, 0) for t in data_inputs}
    found = {uf.find((op.id, fi)) for op in graph.ops for fi, f in enumerate(op.rule.factors)
             if f.shardable and any(data.get(op.inputs[i]) == d for (i, d) in f.operands)}
    inputs = set(graph.inputs)
    other = {uf.find((op.id, fi)) for op in graph.ops for fi, f in enumerate(op.rule.factors)
             if f.shardable and any(op.inputs[i] in inputs and d != data.get(op.inputs[i], 0)
                                    for (i, d) in f.operands)}
    found = found - other if found - other else found
    found = _join_equal(uf, found)
    reach: dict = {}
    for item in uf.size:
        root = uf.find(item)
        if root in found:
            reach[root] = reach.get(root, 0) + 1
    return tuple(sorted(found, key=lambda c: (-reach[c], c)))


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
