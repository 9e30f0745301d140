"""`inspect`: what the IR sees in a train step (coverage, size, cost)."""
from __future__ import annotations

import time
from collections import Counter

from hapsynth.ir.lift import lift


class Report(dict):
    """`inspect`'s result: a plain dict (equal to one, JSON-ready) that Jupyter shows as tables."""

    def _repr_html_(self) -> str:
        from hapsynth.view.html import report_html
        return report_html(self)


def inspect(fn, *args) -> Report:
    """Trace and lift `fn(*args)`; args may be arrays or `jax.ShapeDtypeStruct`s.

    Returns a `Report` (a dict): `eqns` (after inlining and dead-code removal), `traced_eqns`
    (top-level eqns of the jaxpr), `nodes` (after coarsening), `flops` and
    `transcendentals` (XLA's `cost_analysis()` convention), `bytes` (moved once XLA has
    fused elementwise chains: `fusion.py`; its "bytes accessed"),
    `primitives` ({name: count}), `unsupported` ({name: count} of primitives with no
    rule: planned replicated), `replicated` ({name: reason} of primitives kept
    whole by design), `node_kinds` ({kind: count}) and `seconds` (trace + lift).
    """
    t0 = time.perf_counter()
    prog, graph = lift(fn, *args)
    seconds = time.perf_counter() - t0
    by_design = {op.primitive: op.rule.note for op in graph.ops
                 if op.rule.supported and op.rule.note}
    return Report({
        "eqns": len(graph.ops),
        "traced_eqns": prog.traced_eqns,
        "nodes": len(graph.nodes),
        "flops": graph.flops,
        "transcendentals": sum(op.cost.transcendentals for op in graph.ops),
        "bytes": sum(op.cost.bytes for op in graph.ops),
        "unsupported": dict(graph.unsupported),
        "replicated": dict(sorted(by_design.items())),
        "primitives": dict(sorted(Counter(op.primitive for op in graph.ops).items())),
        "node_kinds": dict(sorted(Counter(n.kind for n in graph.nodes).items())),
        "seconds": round(seconds, 3),
    })
