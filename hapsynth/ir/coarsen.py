"""Coarsening: group ops into nodes that share one sharding decision.

*Leaders* (contractions, reductions, gathers, control flow, ...) each anchor a
node. *Followers* (elementwise and layout-only ops) join the node of the
operands they read, so an elementwise chain, or a parameter's optimizer update
chain, follows its producer's layout. Two leaders are never merged through a
follower (a residual `add` of two matmuls stays a boundary). Past the last
contraction (the optimizer's tail), a follower does not join a leader from before it:
a parameter's update (its gradient clipped, its optimizer state) decides its own
layout, apart from the matmul that made the gradient (ZeRO and FSDP shard the update
and the state, while the gradient's matmul shards the batch). Ops that read no
tensor (iota, broadcast of a literal) join their first consumer.
"""
from __future__ import annotations

from hapsynth._jax import CONTROL_FLOW
from hapsynth.ir.rules import facts
from hapsynth.ir.unionfind import UnionFind


def is_follower(primitive: str) -> bool:
    """Elementwise and layout-only ops follow; every other op leads (registry facts)."""
    return facts(primitive).follower


class _Groups(UnionFind):
    """Union-find over op indices that never merges two groups holding a leader."""

    def __init__(self, leader: list[bool]):
        super().__init__()
        self.leader = dict(enumerate(leader))

    def union(self, a: int, b: int) -> bool:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return True
        if self.leader[ra] and self.leader[rb]:
            return False
        if self.leader[rb]:
            ra, rb = rb, ra
        super().union(ra, rb)
        self.leader[ra] = self.leader[ra] or self.leader[rb]
        return True


def coarsen(ops, producer: dict[int, int], is_input: set[int], shape_of=None):
    """Assign each op a node: returns (node index per op, kind per node).

    `ops` are (primitive, input tensor ids or None, output ids); `producer` maps a
    tensor to the op making it; `is_input` holds the step's input tensors;
    `shape_of(t)` gives a tensor's shape. An elementwise follower anchors only
    through operands shaped like its result: a scalar (a clipping factor, a
    predicate) or a broadcast operand does not pull it into another node.
    """
    n = len(ops)
    follower = [is_follower(p) for p, _, _ in ops]
    tail = 1 + max((i for i, (p, _, _) in enumerate(ops) if facts(p).contraction), default=n)
    g = _Groups([not f for f in follower])
    by_input: dict[int, int] = {}
    touches_input = [False] * n
    reads_tensor = [any(t is not None for t in ins) for _, ins, _ in ops]
    for i, (prim, ins, outs) in enumerate(ops):
        if not follower[i]:
            continue
        anchors = []
        same_shape = not facts(prim).layout_only and shape_of is not None and outs
        for t in ins:
            if t is None or (same_shape and shape_of(t) != shape_of(outs[0])):
                continue
            if t in producer:
                if i >= tail and g.leader[g.find(producer[t])] and g.find(producer[t]) < tail:
                    continue  # (an update does not follow the backward pass's layout)
                anchors.append(producer[t])
            elif t in is_input:
                touches_input[i] = True
                anchors.append(by_input.setdefault(t, i))
        anchors.sort(key=lambda a: not g.leader[g.find(a)])  # producer with a leader first
        for a in anchors:
            g.union(a, i)
    consumers: dict[int, int] = {}
    for i, (_, ins, _) in enumerate(ops):
        for t in ins:
            if t is not None and t in producer:
                consumers.setdefault(producer[t], i)
    for i in range(n):
        if follower[i] and not reads_tensor[i] and i in consumers:
            g.union(consumers[i], i)

    roots: dict[int, int] = {}
    node_of = [roots.setdefault(g.find(i), len(roots)) for i in range(n)]
    kinds = ["elementwise"] * len(roots)
    for i in range(n):
        k = node_of[i]
        if not follower[i]:
            kinds[k] = "opaque" if ops[i][0] in CONTROL_FLOW else "compute"
        elif touches_input[i] and kinds[k] == "elementwise":
            kinds[k] = "optimizer"
    return node_of, kinds
