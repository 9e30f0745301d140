"""Where each op of a step runs in a pipeline: regions, forward/backward, and a rank
that stage cuts split (pure functions of the IR's wiring and a data-parallel plan's
layouts; no JAX).

Microbatching is sharding the batch over time. Under data parallelism every tensor is
sharded on the batch (S), a partial sum over it (P), or whole (R), so ops fall in:
- `pre`: reads no data (state-only: casts, transposes of parameters); run where needed;
- `micro`: makes an S tensor, or sums an S tensor into a P one: run per microbatch;
- `post`: the rest (the optimizer, loss scaling): run once, on the accumulated sums;
- `data`: made from data alone and read whole (a count of real tokens that every
  example's loss is divided by): made once from the whole batch, before the microbatches.
A micro op is *forward* if the step's non-state outputs (the loss) depend on it, else
*backward*. Its *rank* is an op index: a stage boundary is a rank, and an op runs on the
stage holding its rank. Parameters rank at their first forward use; a forward op ranks
with the latest parameter it depends on (pulled to its readers when it reads none);
a backward op with the latest of: what it reads directly and the parameters whose
update it reaches (not through a reduction after the batch's work, such as a
global gradient norm). Then, at each cut point, ops that may run on either side move to
the one where the fewest bytes cross (a minimum cut: `_fewest_crossing`). Ops reading
only data inputs and constants rank -1: every stage that needs them computes them.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import numpy as np
from ortools.graph.python import max_flow

from hapsynth.ir.graph import Graph

__all__ = ["NotPipelineable", "Regions", "analyse", "stage_of"]


class NotPipelineable(ValueError):
    """The step cannot run as microbatches (why, in words)."""


@dataclass(frozen=True)
class Regions:
    """Per op: `region` ("pre", "micro", "post", "data"), `forward` (micro ops), `rank`; per state
    leaf `owner_rank` (the rank of the stage that stores it); `batch`: global batch rows."""

    region: tuple[str, ...]
    forward: tuple[bool, ...]
    rank: tuple[int, ...]
    owner_rank: tuple[int, ...]
    batch: int
    reads: tuple[frozenset, ...] = ()  # per op: the state leaves it reads, itself or by pre ops
    folded: frozenset = frozenset()  # micro ops only rearranging a partial sum (`_moves_sum`)

    def cut_points(self) -> list[int]:
        """Ranks where a stage may start: the first forward use of each parameter."""
        return sorted({r for r in self.owner_rank if r > 0})


def stage_of(rank: int, cuts) -> int:
    """The stage of `rank` under boundaries `cuts` (sorted ranks; stage s starts at cuts[s-1])."""
    return bisect_right(cuts, rank)


def analyse(graph: Graph, layouts, op_inputs, num_state_leaves: int) -> Regions:
    """Regions and ranks of `graph`'s ops under a data-parallel plan's `layouts` (per
    tensor) and `op_inputs` (per op, per operand); `NotPipelineable` says why not."""
    ops, n = graph.ops, len(graph.ops)
    if any(op.loop is not None for op in ops):
        raise NotPipelineable("the step holds a loop region (scan/fori) too long to write "
                              "out layer by layer (`ir.unroll.MAX_TRIPS`): stages cut only "
                              "between ops outside loops")
    state = list(graph.inputs[:num_state_leaves])
    data = set(graph.inputs[num_state_leaves:])
    producer = {t: op.id for op in ops for t in op.outputs}
    readers: dict[int, list[int]] = {}
    for op in ops:
        for x in op.inputs:
            if x is not None:
                readers.setdefault(x, []).append(op.id)

    batch = _batch_rows(graph, layouts, data)
    on_data, on_state = [False] * n, [False] * n
    region = [""] * n
    moved: list[int] = []  # layout ops on a partial sum, run where it is made (`_moves_sum`)
    leaves = set(state)
    for op in ops:
        outs = [layouts[t] for t in op.outputs]
        ins = [(x, need) for x, need in zip(op.inputs, op_inputs[op.id]) if x is not None]
        on_data[op.id] = any(x in data or (x in producer and on_data[producer[x]]) for x, _ in ins)
        on_state[op.id] = any(x in leaves or (x in producer and on_state[producer[x]])
                              for x, _ in ins)
        if any(l.kind == "S" for l in outs) or (any(l.kind == "P" for l in outs) and any(
                layouts[x].kind == "S" and need is not None and need.kind == "S" for x, need in ins)):
            region[op.id] = "micro"
        elif _moves_sum(graph, op, ins, outs, layouts, producer, region):
            region[op.id] = "micro"
            moved.append(op.id)
        elif not on_data[op.id]:
            region[op.id] = "pre"
        else:
            region[op.id] = "post"
    # what data alone makes and is read whole (a count of real tokens, read per example;
    # a mask read after the microbatches) is made once from the whole batch: "data"
    for op in reversed(ops):
        if on_state[op.id]:
            continue
        read_whole = any(region[j] in ("data", "post") for t in op.outputs
                         for j in readers.get(t, ()))
        if on_data[op.id] and (read_whole or any(layouts[t].kind != "S" for t in op.outputs)) \
                or not on_data[op.id] and any(region[j] == "data" for t in op.outputs
                                              for j in readers.get(t, ())):
            region[op.id] = "data"
    for op in ops:
        for x, need in zip(op.inputs, op_inputs[op.id]):
            if x is None or x not in producer and x not in data:
                continue
            made = "data" if x in data else region[producer[x]]
            whole = x in data or made == "data"
            if region[op.id] != "micro":
                if made == "micro" and layouts[x].kind == "S":
                    raise NotPipelineable(f"op {op.id} ({op.primitive}) reads the whole batch of "
                                          f"t{x} after the per-example work")
                continue
            if made == "post":
                raise NotPipelineable(
                    f"op {op.id} ({op.primitive}) reads a value summed over the whole batch "
                    f"(t{x}) per example (e.g. batch statistics): microbatches would change it")
            if whole and need is not None and need.kind == "P":
                raise NotPipelineable(f"op {op.id} ({op.primitive}) reads t{x}, made from the "
                                      "whole batch, as a partial sum")
            if whole and (need is None or need.kind != "S") and graph.tensors[x].shape \
                    and (x in data or layouts[x].kind == "S"):
                raise NotPipelineable(f"op {op.id} ({op.primitive}) reads the whole batch of "
                                      f"t{x}, not its own rows")
            if made == "micro" and need is not None and need != layouts[x]:
                raise NotPipelineable(f"op {op.id} ({op.primitive}) reads t{x} of the batch "
                                      f"in layout {need}, not as made ({layouts[x]})")
    outputs = list(graph.outputs)
    for i, o in enumerate(outputs):
        if o is not None and o in producer and region[producer[o]] == "micro" \
                and layouts[o].kind == "S":
            raise NotPipelineable(f"output {i} keeps the batch dim (t{o}): only sums over "
                                  "the batch leave a pipeline")

    # forward: what the loss (and other outputs made before any gradient) depends on; an
    # output made from the gradients (their norm) or the new state says nothing of it
    def ancestors(ts) -> set:
        seen, stack = set(), [producer[t] for t in ts if t is not None and t in producer]
        while stack:
            i = stack.pop()
            if i not in seen:
                seen.add(i)
                stack += [producer[x] for x in ops[i].inputs if x is not None and x in producer]
        return seen

    to_state = ancestors(outputs[:num_state_leaves])
    grads = {i for i in to_state if region[i] == "micro"
             and any(layouts[t].kind == "P" for t in ops[i].outputs)}
    forward = [False] * n
    for o in outputs[num_state_leaves:]:
        up = ancestors([o])
        if up and not up & grads:
            for i in up:
                forward[i] = region[i] == "micro"
    if not any(forward):
        raise NotPipelineable("the step returns no loss made before its gradients: "
                              "there is no forward pass to cut")

    # micro ops the loss does not read, made from forward values alone: activations
    # recomputed for the backward (`ir/remat.py`), a derivative's factor; their readers
    # rank with what they are made from, as with a forward value
    made_fwd = [False] * n
    for op in ops:
        if region[op.id] == "micro" and not forward[op.id]:
            src = [producer[x] for x in op.inputs if x is not None and x in producer
                   and region[producer[x]] == "micro"]
            made_fwd[op.id] = bool(src) and all(forward[j] or made_fwd[j] for j in src)

    # parameters: rank at first forward use (through pre ops)
    first: dict[int, int] = {}
    params_of: list[set] = [set() for _ in range(n)]  # pre ops: the state leaves they read
    leaf = {t: i for i, t in enumerate(state)}
    for op in ops:
        direct = set()
        for x in op.inputs:
            if x in leaf:
                direct.add(leaf[x])
            elif x in producer and region[producer[x]] == "pre":
                direct |= params_of[producer[x]]
        params_of[op.id] = direct
        if forward[op.id]:
            for p in direct:
                first.setdefault(p, op.id)

    # input-only ops: no parameter, no forward value upstream
    input_only = [False] * n
    for op in ops:
        if region[op.id] != "micro":
            continue
        input_only[op.id] = not params_of[op.id] and all(
            x is None or x in data or (x in producer and input_only[producer[x]])
            or x not in producer and x not in leaf for x in op.inputs)

    rank = [-1] * n
    for op in ops:  # forward: the latest parameter upstream
        if forward[op.id] and not input_only[op.id]:
            r = max((first[p] for p in params_of[op.id]), default=-1)
            for x in op.inputs:
                if x in producer and forward[producer[x]]:
                    r = max(r, rank[producer[x]])
            rank[op.id] = r
    for op in reversed(ops):  # a forward op reading no parameter runs where it is read
        if forward[op.id] and not input_only[op.id] and not params_of[op.id]:
            later = [rank[j] for t in op.outputs for j in readers.get(t, ())
                     if forward[j] and not input_only[j]]
            if later:
                rank[op.id] = max(rank[op.id], min(later))

    owner = [first.get(i, -1) for i in range(len(state))]
    out_leaf = {o: i for i, o in enumerate(outputs[:num_state_leaves]) if o is not None}
    down = [-1] * n
    for op in reversed(ops):
        d = max((owner[out_leaf[t]] for t in op.outputs if t in out_leaf), default=-1)
        for t in op.outputs:
            for j in readers.get(t, ()):
                # a reduction after the batch's work (a global norm) reaches every update:
                # it says nothing of which parameter a gradient belongs to
                if region[j] == "micro" or _size(graph, ops[j].outputs[0]) >= _size(graph, t):
                    d = max(d, down[j])
        down[op.id] = d
    backward = [region[i] == "micro" and not forward[i] and not input_only[i]
                and i not in moved for i in range(n)]
    fed = [-1] * n  # backward ops: the latest rank of the forward values they read
    for op in ops:  # backward ops
        if backward[op.id]:
            r = max((first.get(p, -1) for p in params_of[op.id]), default=-1)
            for x in op.inputs:
                if x in producer and (forward[producer[x]] or made_fwd[producer[x]]):
                    fed[op.id] = max(fed[op.id], rank[producer[x]])
            rank[op.id] = max(r, fed[op.id], down[op.id])
    for op in reversed(ops):  # cotangents flow to earlier stages only: a producer's rank is
        if backward[op.id]:   # at least its backward readers'
            for x in op.inputs:
                if x in producer and backward[producer[x]]:
                    rank[producer[x]] = max(rank[producer[x]], rank[op.id])
    rank = _fewest_crossing(graph, rank, forward, backward, params_of, first, down, fed,
                            sorted({r for r in first.values() if r > 0}), layouts)
    for i in moved:
        rank[i] = rank[producer[next(x for x in ops[i].inputs if x is not None)]]
    for op in ops:  # post ops
        if region[op.id] != "post":
            continue
        r = max((first.get(p, -1) for p in params_of[op.id]), default=-1)
        for x in op.inputs:
            if x in producer and forward[producer[x]]:
                r = max(r, rank[producer[x]])
        here = max([r] + [rank[producer[x]] for x in op.inputs if x in producer])
        biggest = max((_size(graph, x) for x in op.inputs if x is not None), default=0)
        if down[op.id] < 0 or _size(graph, op.outputs[0]) < biggest:
            rank[op.id] = here  # a reduction (a gradient's norm) runs where its operand is
        else:
            rank[op.id] = max(r, down[op.id])
    for i, o in enumerate(outputs[:num_state_leaves]):
        if owner[i] < 0:  # state the forward never reads (optimizer moments, counters)
            owner[i] = rank[producer[o]] if o in producer else 0
    rank = [r if r >= 0 or region[i] in ("pre", "data") or input_only[i] else 0
            for i, r in enumerate(rank)]
    for op in ops:  # a partial sum never crosses a cut: its readers share its rank
        for x in op.inputs:
            if region[op.id] == "micro" and x in producer and layouts[x].kind == "P" \
                    and region[producer[x]] == "micro" and rank[producer[x]] != rank[op.id]:
                raise NotPipelineable(f"op {op.id} ({op.primitive}) reads the per-microbatch "
                                      f"partial sum t{x} away from where it is made")
    owner = [max(0, r) for r in owner]
    return Regions(tuple(region), tuple(forward), tuple(rank), tuple(owner), batch,
                   tuple(frozenset(p) for p in params_of), frozenset(moved))


_FIXED = 1 << 50  # "infinite" capacity: above any step's bytes


def _fewest_crossing(graph: Graph, rank, forward, backward, params_of, first, down, fed,
                     points, layouts) -> list[int]:
    """Ranks moved, op by op, to the side of each cut point where the fewest bytes cross
    it: a minimum cut per point over the per-example ops (forward values flow to later
    stages, cotangents to earlier ones). The first ranks place a parameter-free op by
    one rule (where it is read), which sends two tensors across a block boundary where
    one would do (a residual and its layer norm's output, rather than the residual
    alone); the cut keeps ops reading parameters where they are, gradient sums with the
    parameter they sum for (unless made from forward values past the cut: a tied
    embedding's gradient from the output layer, where the logits' cotangent is), and
    moves only what costs nothing to move."""
    ops = graph.ops
    movable = [i for i in range(len(ops)) if (forward[i] or backward[i]) and rank[i] >= 0]
    if not points or not movable:
        return rank
    node = {i: k for k, i in enumerate(movable)}
    readers: dict[int, list[int]] = {}
    for i in movable:
        for x in ops[i].inputs:
            if x is not None:
                readers.setdefault(x, []).append(node[i])
    tails, heads, caps = [], [], []
    nt = len(movable)
    for i in movable:
        u = node[i]
        for t in ops[i].outputs:
            vs = readers.get(t, ())
            if not vs:
                continue
            b = int(graph.tensors[t].nbytes)
            if forward[i]:  # crosses when u is early and a reader late; u late: readers late
                tails += [u, *([nt] * len(vs)), *vs]
                heads += [nt, *vs, *([u] * len(vs))]
            else:  # a cotangent: crosses when u is late and a reader early; a reader late: u late
                tails += [nt, *vs, *([u] * len(vs))]
                heads += [u, *([nt] * len(vs)), *vs]
            caps += [b, *([_FIXED] * (2 * len(vs)))]
            nt += 1
    tails, heads, caps = (np.asarray(a, np.int64) for a in (tails, heads, caps))
    source, sink = nt, nt + 1
    fwd_fixed = [(node[i], rank[i]) for i in movable if forward[i] and params_of[i]]
    lo = [max([down[i]] + [first.get(p, -1) for p in params_of[i]]) if backward[i] else -1
          for i in movable]
    sums = {node[i] for i in movable if backward[i]
            and any(layouts[t].kind == "P" for t in ops[i].outputs)}
    late_at = [-1] * len(movable)
    for c in points:
        early = [u for u, r in fwd_fixed if r < c] + [u for u in sums if lo[u] < c
                                                          and fed[movable[u]] < c]
        late = [u for u, r in fwd_fixed if r >= c] + [u for u in range(len(movable)) if lo[u] >= c]
        flow = max_flow.SimpleMaxFlow()
        flow.add_arcs_with_capacity(
            np.concatenate([tails, np.full(len(early), source), np.asarray(late, np.int64)]),
            np.concatenate([heads, np.asarray(early, np.int64), np.full(len(late), sink)]),
            np.concatenate([caps, np.full(len(early) + len(late), _FIXED)]))
        if flow.solve(source, sink) != flow.OPTIMAL:
            return rank
        for u in flow.get_sink_side_min_cut():
            if u < len(movable):
                late_at[u] = c
    out = list(rank)
    for i in movable:
        new = max(late_at[node[i]], 0)
        if bisect_right(points, new) != bisect_right(points, rank[i]):
            out[i] = new
    return out


#: Ops that only rearrange a tensor's elements: a sum over the batch commutes with them.
LAYOUT_ONLY = frozenset({"transpose", "reshape", "squeeze", "expand_dims", "copy", "copy_p"})


def _moves_sum(graph: Graph, op, ins, outs, layouts, producer, region) -> bool:
    """Whether `op` only rearranges a per-microbatch partial sum (a weight's gradient
    transposed to the weight's shape): it runs per microbatch, where XLA folds it into the
    contraction making it, and the sum is kept in the layout the optimizer reads (read
    transposed after the microbatches, it runs several times slower on XLA's CPU backend)."""
    if op.primitive not in LAYOUT_ONLY or len(ins) != 1 or len(outs) != 1:
        return False
    x = ins[0][0]
    return (outs[0].kind == "P" and layouts[x].kind == "P" and x in producer
            and region[producer[x]] == "micro" and _size(graph, x) == _size(graph, op.outputs[0]))


def _size(graph: Graph, t: int) -> int:
    size = 1
    for d in graph.tensors[t].shape:
        size *= d
    return size


def _batch_rows(graph: Graph, layouts, data) -> int:
    """The global batch: the leading dim shared by the data inputs that are read sharded."""
    sizes = {graph.tensors[t].shape[0] for t in data if graph.tensors[t].shape}
    if len(sizes) != 1:
        raise NotPipelineable(f"the data inputs' leading dims differ ({sorted(sizes)}): "
                              "microbatches need one batch")
    return sizes.pop()
