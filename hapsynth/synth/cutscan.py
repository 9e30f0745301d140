"""What cutting a step into stages costs, whatever the microbatches: per stage its ops,
the bytes crossing to other stages, summed, kept and stored.

`op_table` lists once, as arrays, what each op run per microbatch or after the
microbatches reads and makes; `scan_cut` reads it for every cut a search prices. A
value crosses a boundary once per pair of stages (the lowering sends it once and, read
by both phases of the later stage, its forward keeps it for its backward); a value
made after the microbatches is sent once a step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hapsynth.ir.graph import Graph
from hapsynth.synth.slots import APART_BYTES, packed_bytes, sum_bytes, sum_dtype, touched_bytes
from hapsynth.synth.stages import Regions, stage_of

__all__ = ["OpTable", "Reads", "CutScan", "op_table", "summed_partials", "scan_cut",
           "grouped_bytes"]


@dataclass(frozen=True, eq=False)
class Reads:
    """One row per (op, value) where a listed op reads a value another op made that is
    not a pre op."""

    op: np.ndarray        # the reader: its index in `OpTable.ops`
    value: np.ndarray     # the tensor read
    source: np.ndarray    # the op that made it
    micro: np.ndarray     # made and read by ops run per microbatch
    made_fwd: np.ndarray  # made by a forward op
    nbytes: np.ndarray    # its bytes (float)
    fwd: np.ndarray       # read by a forward op
    back: np.ndarray      # read by a backward op run per microbatch


@dataclass(frozen=True, eq=False)
class OpTable:
    """The ops run per microbatch (micro) or once after them (post), as arrays."""

    rank: np.ndarray         # per op of the graph: its rank (-1: none)
    ops: np.ndarray          # the micro and post ops, by id
    forward: np.ndarray      # per listed op: a forward micro op
    counted_at: np.ndarray   # where in `ops` the micro ops counted as ops of their own are
    counted: np.ndarray      # those ops, by id
    post_at: np.ndarray      # where in `ops` the post ops are
    post: np.ndarray         # those ops, by id
    partials: tuple          # (where in `ops`, its partial sums: (forward?, dtype, bytes)...)
    leaves: tuple            # (where in `ops`, the state leaves it needs)
    reads: Reads
    summed: frozenset        # the partial sums the microbatches add to (`summed_partials`)


@dataclass(frozen=True, eq=False)
class CutScan:
    """What a cut costs whatever the microbatches, per stage (lists) or per pair of
    stages `a`, `b` (arrays)."""

    owner: list      # per state leaf: the stage storing it
    fwd: list        # per stage: its forward ops run per microbatch (counted ones)
    bwd: list        # per stage: its backward ops run per microbatch
    nops: list       # per stage: [forward ops, backward ops]
    whole: list      # per stage: seconds of its ops after the microbatches
    send: np.ndarray   # [a, b, way]: bytes of the whole batch a sends b, forward/backward
    once: np.ndarray   # [a, b]: bytes a sends b once a step, after the microbatches (sums)
    readers: dict      # (a, b, way): the phases of b reading what a sends ("F", "B")
    resid: list      # per stage: bytes of the whole batch its forward keeps for its backward
    needs: list      # per stage: the state leaves its ops read
    held: list       # per stage: its state leaves, ("state", dtype, bytes)
    sum_items: list  # per stage: its partial sums, (forward?, dtype, bytes)
    acc: list        # per stage: bytes of its partial sums
    sums: int        # bytes of the sums' buffers each device holds (`packed_bytes`)
    state: int       # bytes of the state's buffers each device holds
    added: list      # per stage: bytes of the sums' buffers its backward adds into


def summed_partials(graph: Graph, regions: Regions, layouts) -> set:
    """The partial sums each microbatch adds to, summed after the last one: those read
    once a step, by the ops after the microbatches or as outputs, as the lowering
    accumulates them (not a gradient a microbatch's own ops rearrange first)."""
    later = {x for op in graph.ops if regions.region[op.id] == "post"
             for x in op.inputs if x is not None} | set(graph.outputs)
    return {t for op in graph.ops if regions.region[op.id] == "micro"
            for t in op.outputs if layouts[t].kind == "P" and t in later}


@dataclass(frozen=True)
class _OpUse:
    """What `scan_cut` reads of one micro or post op, whatever the cut."""

    op: int
    micro: bool
    forward: bool
    counted: bool       # an op of its own (not one XLA folds into the contraction making it)
    partials: tuple     # its partial sums: (forward?, dtype, bytes)
    leaves: frozenset   # the state leaves it needs
    reads: tuple        # per value it reads from an op not pre: (value, source, made by a
    #                     micro op?, made forward?, bytes)


def _op_use(graph: Graph, regions: Regions, op, summed, leaf: dict, producer: dict) -> _OpUse:
    r, i = regions, op.id
    micro = r.region[i] == "micro"
    partials = tuple((r.forward[i], sum_dtype(graph.tensors[o].dtype),
                      sum_bytes(graph.tensors[o].dtype, graph.tensors[o].nbytes))
                     for o in op.outputs if o in summed) if micro else ()
    leaves, reads = set(), []
    for x in op.inputs:
        if x is None:
            continue
        if x in leaf:
            leaves.add(leaf[x])
            continue
        j = producer.get(x)
        if j is None:
            continue
        if r.region[j] == "pre":
            leaves |= r.reads[j]
            continue
        reads.append((x, j, r.region[j] == "micro", bool(r.forward[j]), graph.tensors[x].nbytes))
    return _OpUse(i, micro, bool(r.forward[i]) if micro else False, i not in r.folded,
                  partials, frozenset(leaves), tuple(reads))


def op_table(graph: Graph, regions: Regions, layouts, num_state_leaves: int) -> OpTable:
    """The micro and post ops of the step as `scan_cut` reads them."""
    summed = summed_partials(graph, regions, layouts)
    producer = {t: op.id for op in graph.ops for t in op.outputs}
    leaf = {t: i for i, t in enumerate(graph.inputs[:num_state_leaves])}
    uses = [_op_use(graph, regions, op, summed, leaf, producer) for op in graph.ops
            if regions.region[op.id] in ("micro", "post")]
    ids = np.array([u.op for u in uses], np.int64)
    micro = np.array([u.micro for u in uses], bool)
    counted_at = np.flatnonzero(micro & np.array([u.counted for u in uses], bool))
    return OpTable(
        rank=np.array(regions.rank, np.int64), ops=ids,
        forward=np.array([u.forward for u in uses], bool), counted_at=counted_at,
        counted=ids[counted_at], post_at=np.flatnonzero(~micro), post=ids[~micro],
        partials=tuple((k, u.partials) for k, u in enumerate(uses) if u.partials),
        leaves=tuple((k, u.leaves) for k, u in enumerate(uses) if u.leaves),
        reads=_reads(uses, micro), summed=frozenset(summed))


def _reads(uses: list, micro: np.ndarray) -> Reads:
    rows = [(k, *x) for k, u in enumerate(uses) for x in u.reads]

    def col(c, dtype):
        return np.array([x[c] for x in rows], dtype) if rows else np.zeros(0, dtype)

    op = col(0, np.int64)
    return Reads(op=op, value=col(1, np.int64), source=col(2, np.int64),
                 micro=col(3, bool) & micro[op], made_fwd=col(4, bool),
                 nbytes=col(5, np.float64),
                 fwd=np.array([uses[k].forward for k in op], bool),
                 back=np.array([uses[k].micro and not uses[k].forward for k in op], bool))


def scan_cut(table: OpTable, graph: Graph, regions: Regions, cuts, post_seconds) -> CutScan:
    """What `cuts` (the ranks where stages 2.. start) cost whatever the microbatches;
    `post_seconds[s]`: per post op (`table.post`), its seconds on stage s's devices."""
    S = len(cuts) + 1
    stage = np.where(table.rank >= 0,
                     np.searchsorted(np.asarray(cuts, np.int64), table.rank, "right"), -1)
    owner = [stage_of(x, cuts) for x in regions.owner_rank]
    listed = stage[table.ops]  # the micro and post ops' stages
    fwd, bwd, post = _stage_ops(table, listed, S)
    sums, needs = _sums_and_needs(table, listed, S)
    send, once, resid, readers = _crossings(table, stage, listed, S)
    held = _held(graph, owner, S)
    return CutScan(
        owner=owner, fwd=fwd, bwd=bwd, nops=[[len(f), len(b)] for f, b in zip(fwd, bwd)],
        whole=[float(post_seconds[s][post == s].sum()) for s in range(S)],
        send=send, once=once, readers={k: sorted(v) for k, v in readers.items()},
        resid=[float(x) for x in resid], needs=needs, held=held, sum_items=sums,
        acc=[float(sum(x[2] for x in mine)) for mine in sums],
        sums=packed_bytes(sums), state=packed_bytes(held, APART_BYTES),
        added=touched_bytes([[x for x in mine if not x[0]] for mine in sums]))


def _stage_ops(table: OpTable, listed, S: int) -> tuple[list, list, np.ndarray]:
    """Per stage its forward and backward ops run per microbatch; per post op its stage
    (one reading only the step's data, stage -1: the last)."""
    at, forward = listed[table.counted_at], table.forward[table.counted_at]
    fwd = [table.counted[(at == s) & forward].tolist() for s in range(S)]
    bwd = [table.counted[(at == s) & ~forward].tolist() for s in range(S)]
    post = np.where(listed[table.post_at] < 0, S - 1, listed[table.post_at])
    return fwd, bwd, post


def _sums_and_needs(table: OpTable, listed, S: int) -> tuple[list, list]:
    """Per stage the partial sums its ops add to, and the state leaves they read."""
    sums: list[list] = [[] for _ in range(S)]
    for k, items in table.partials:
        if listed[k] >= 0:
            sums[listed[k]] += items
    needs: list[set] = [set() for _ in range(S)]
    for k, leaves in table.leaves:
        if listed[k] >= 0:
            needs[listed[k]] |= leaves
    return sums, needs


def _crossings(table: OpTable, stage, listed, S: int):
    """Bytes sent per microbatch (`CutScan.send`) and once a step (`once`), kept for the
    backward (`resid`), and the phases reading what crosses (`readers`)."""
    t = table.reads
    send, once, resid = np.zeros((S, S, 2)), np.zeros((S, S)), np.zeros(S)
    rs, ra = listed[t.op], stage[t.source]
    # a value is kept, sent or summed once per stage and phase, however many read it
    use = np.flatnonzero(rs >= 0)
    _, first = np.unique((t.value[use] * (S + 1) + rs[use]) * 2 + t.back[use],
                         return_index=True)
    use = use[np.sort(first)]
    rs, ra, nbytes = rs[use], ra[use], t.nbytes[use]
    here = ra == rs
    kept = here & t.made_fwd[use] & t.back[use]
    np.add.at(resid, rs[kept], nbytes[kept])
    away = (ra >= 0) & ~here
    cross = away & t.micro[use]  # (both ends in the microbatches)
    np.add.at(once, (ra[away & ~cross], rs[away & ~cross]), nbytes[away & ~cross])
    readers: dict = {}
    if cross.any():
        readers = _sent_per_microbatch(t, use[cross], ra[cross], rs[cross], nbytes[cross],
                                       send, resid, S)
    return send, once, resid, readers


def _sent_per_microbatch(t: Reads, rows, a, b, nbytes, send, resid, S: int) -> dict:
    """Adds into `send` the values that stage `a` sends `b` (rows of `t`), and into
    `resid` those both phases of `b` read: one crosses once and the forward keeps it for
    the backward, as the lowering sends it. Returns per (a, b, way) the phases reading."""
    x = t.value[rows]
    way = np.where(t.made_fwd[rows], 0, 1)
    phase = t.fwd[rows]
    _, group, inv = np.unique((x * (S + 1) + a) * (S + 1) + b, return_index=True,
                              return_inverse=True)
    has_f = np.zeros(len(group), bool)
    has_b = np.zeros(len(group), bool)
    np.logical_or.at(has_f, inv, phase)
    np.logical_or.at(has_b, inv, ~phase)
    nb = nbytes[group]
    np.add.at(send, (a[group], b[group], way[group]), nb)
    np.add.at(resid, b[group][has_f & has_b], nb[has_f & has_b])
    readers: dict = {}
    for k, (aa, bb, w) in enumerate(zip(a[group], b[group], way[group])):
        readers.setdefault((int(aa), int(bb), int(w)), set()).add("F" if has_f[k] else "B")
    return readers


def _held(graph: Graph, owner: list, S: int) -> list:
    """Per stage its state leaves: ("state", dtype, bytes)."""
    held: list[list] = [[] for _ in range(S)]
    for p, o in enumerate(owner):
        tensor = graph.tensors[graph.inputs[p]]
        held[o].append(("state", str(tensor.dtype), tensor.nbytes))
    return held


def grouped_bytes(scan: CutScan, members) -> tuple[int, int]:
    """The bytes of the state and of the sums each device holds where groups of devices
    run `members` (their stages), each group holding its stages'."""
    return (packed_bytes([[x for s in m for x in scan.held[s]] for m in members], APART_BYTES),
            packed_bytes([[x for s in m for x in scan.sum_items[s]] for m in members]))
