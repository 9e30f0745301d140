"""Per-device memory of an assignment: state (params + optimizer) plus peak activations.

Sharded tensors are stored padded to the largest shard (DESIGN.md's lowering), so
a sharded tensor costs every device `max(units) * bytes / units_total`, whatever
its own share: per-device memory is the same on every device, and the class with
the least memory is the one that binds.
"""
from __future__ import annotations

from dataclasses import dataclass

from hapsynth.synth.pricing import Structure, Tables
from hapsynth.synth.strategy import R


def layout_bytes(tables: Tables, layout, nbytes: float) -> float:
    if isinstance(layout, tuple):
        u = tables.pricer.units(layout[2])
        return max(u) * nbytes / layout[2]
    return float(nbytes)


@dataclass(frozen=True)
class MemoryTerms:
    """Tensors whose bytes count: state tensors always, activations live at `peak_op`."""

    state: tuple[int, ...]        # state output tensors (their layout is the state's)
    live_at_peak: tuple[int, ...]  # intermediates live at the peak op
    peak_op: int


def memory_terms(st: Structure, assign: list[int] | None = None, tables: Tables | None = None
                 ) -> MemoryTerms:
    """Find the op where live activation bytes peak (under `assign`, or replicated)."""
    g = st.graph
    last_use: dict[int, int] = {}
    for op in g.ops:
        for t in op.inputs:
            if t is not None:
                last_use[t] = op.id
    outputs = {t for t in g.outputs if t is not None}

    def size(t):
        if assign is None or tables is None:
            return g.tensors[t].nbytes
        return layout_bytes(tables, tensor_layout(st, assign, t), g.tensors[t].nbytes)

    live, cur, best, best_at = set(), 0.0, -1.0, 0
    for op in g.ops:
        for t in op.outputs:
            if t in last_use or t in outputs:
                live.add(t)
                cur += size(t)
        if cur > best:
            best, best_at, best_live = cur, op.id, tuple(sorted(live))
        for t in op.inputs:
            if t is not None and last_use.get(t) == op.id and t in live and t not in outputs:
                live.discard(t)
                cur -= size(t)
    return MemoryTerms(tuple(sorted(st.pairs.values())), best_live if best >= 0 else (), best_at)


def tensor_layout(st: Structure, assign, t):
    node = st.producer_node.get(t)
    return R if node is None else st.strategies[node][assign[node]].layouts.get(t, R)


def memory_per_device(st: Structure, tables: Tables, assign) -> dict:
    """{"state": bytes, "activations": bytes, "total": bytes} on every device."""
    g = st.graph
    terms = memory_terms(st, assign, tables)
    state = sum(layout_bytes(tables, tensor_layout(st, assign, t), g.tensors[t].nbytes)
                for t in terms.state)
    act = sum(layout_bytes(tables, tensor_layout(st, assign, t), g.tensors[t].nbytes)
              for t in terms.live_at_peak if t not in set(terms.state))
    return {"state": state, "activations": act, "total": state + act}


def memory_rows(st: Structure, tables: Tables, terms: MemoryTerms) -> list[tuple[int, list[float]]]:
    """(node, bytes per strategy) for each counted tensor: the solver's memory constraint."""
    rows = []
    for t in dict.fromkeys(terms.state + terms.live_at_peak):
        node = st.producer_node.get(t)
        if node is None:
            continue
        nbytes = st.graph.tensors[t].nbytes
        rows.append((node, [layout_bytes(tables, s.layouts.get(t, R), nbytes)
                            for s in st.strategies[node]]))
    return rows
