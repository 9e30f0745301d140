"""The FSDP baseline: what MaxText's fsdp axis or PyTorch FSDP (ZeRO-3) runs, priced by
the same cost model as every plan.

Parameters, their gradients at the update and the optimizer state are sharded evenly
over every device on each leaf's largest dim; the batch is sharded evenly (data
parallelism everywhere else). A parameter is all-gathered for its readers, a gradient
reduce-scattered to its update. Our lowering keeps a gathered parameter from its first
reader to its last (forward and backward), and so does its price: FSDP implementations
that free it after the forward and gather it again are not modelled.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from hapsynth.ir.layout import R
from hapsynth.synth.search import switch_classes
from hapsynth.synth.structure import stored_copies


def fsdp_assign(tables, batch_assign) -> list[int]:
    """From data parallelism (`batch_assign`): every node updating a state leaf shards the
    class on that leaf's largest dim; the other tail nodes (gradient clipping's norms)
    holding one of those classes shard it too, as FSDP computes them on the shards."""
    st = tables.structure
    graph = st.graph
    out = list(batch_assign)
    chosen, done = [], set()
    for t_out in st.pairs.values():
        node = st.producer_node.get(t_out)
        shape = graph.tensors[t_out].shape
        if node is None or not shape or max(shape) < 2:
            continue
        dim = int(np.argmax(shape))
        for s, strat in enumerate(st.strategies[node]):
            lay = strat.layouts.get(t_out, R)
            if lay.sharded and lay.dim == dim:
                out[node] = s
                done.add(node)
                chosen.append(strat.klass)
                break
    tail = [n for n, node in enumerate(graph.nodes)
            if n not in done and min(node.ops) >= st.tail_start]
    switched = switch_classes(tables, out, list(dict.fromkeys(chosen)))
    for n in tail:
        out[n] = switched[n]
    return _copies_follow(st, out)


def _copies_follow(st, assign) -> list[int]:
    """A node copying a state leaf (checkpointing's copy for the backward pass,
    `ir/checkpoint.py`) keeps the leaf's stored layout for the copy where it has such a
    strategy: FSDP gathers the parameter again from its shards there."""
    out = list(assign)
    for copy, x in stored_copies(st.graph, st.pairs).items():
        n, t_out = st.producer_node[copy], st.pairs[x]
        owner = st.producer_node.get(t_out)
        if owner is None or owner == n:
            continue
        lay = st.strategies[owner][out[owner]].layouts.get(t_out, R)
        same = [s for s, strat in enumerate(st.strategies[n]) if strat.layouts.get(copy, R) == lay]
        if same and out[n] not in same:
            out[n] = same[0]
    return out


def fsdp_choice(problem, even):
    """The FSDP baseline as a `Choice` at `even`'s shares (DP-EV's), its time infinite
    where it does not fit memory; None where no state leaf can be sharded."""
    pr = even.priced
    assign = fsdp_assign(pr.tables, even.assign)
    if list(assign) == list(even.assign):
        return None
    choice = problem.choice("FSDP", pr, assign)
    return choice if pr.fits(assign) else replace(choice, time=float("inf"))
