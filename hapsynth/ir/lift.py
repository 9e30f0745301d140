"""Lift a traced `Program` to the sharding IR `Graph` (rules, costs, nodes)."""
from __future__ import annotations

from collections import Counter

from hapsynth.ir.coarsen import coarsen
from hapsynth.ir.fusion import fused_away, fused_costs
from hapsynth.ir.graph import Cost, Graph, Node, Op, Tensor
from hapsynth.ir.rules import cost_for, partial_of, rule_for
from hapsynth.ir.signature import input_paths
from hapsynth.ir.trace import Program, trace


def _dtype_name(dtype) -> str:
    return getattr(dtype, "name", str(dtype))


def lift_program(prog: Program) -> Graph:
    producer = {t: i for i, e in enumerate(prog.eqns) for t in e.outputs}
    inputs = set(prog.inputs)
    plain = [cost_for(e) for e in prog.eqns]
    fused = fused_away(prog, plain)
    tensors = tuple(
        Tensor(t, a.shape, _dtype_name(a.dtype), producer.get(t),
               "input" if t in inputs else "const" if t in prog.consts else "intermediate",
               getattr(a.dtype, "itemsize", 4), t in fused)
        for t, a in enumerate(prog.avals))
    op_inputs = [tuple(x if isinstance(x, int) else None for x in e.inputs) for e in prog.eqns]
    node_of, kinds = coarsen([(e.name, ins, e.outputs) for e, ins in zip(prog.eqns, op_inputs)],
                             producer, inputs, lambda t: prog.avals[t].shape)
    length = {lp.id: lp.length for lp in prog.loops}
    costs = fused_costs(prog, plain)
    ops = tuple(Op(i, e.name, op_inputs[i], e.outputs, rule_for(e),
                   _times(costs[i], length.get(e.loop, 1)), node_of[i], e.loop,
                   length.get(e.loop, 1), partial_of(e))
                for i, e in enumerate(prog.eqns))
    members: dict[int, list[int]] = {}
    for op in ops:
        members.setdefault(op.node, []).append(op.id)
    nodes = tuple(Node(k, tuple(members[k]), kinds[k]) for k in range(len(kinds)))
    unsupported = Counter(op.primitive for op in ops if not op.rule.supported)
    return Graph(tensors=tensors, ops=ops, nodes=nodes, inputs=prog.inputs,
                 outputs=tuple(o if isinstance(o, int) else None for o in prog.outputs),
                 unsupported=dict(sorted(unsupported.items())),
                 input_paths=tuple(input_paths(prog)),
                 batch_dims={t: v[1] for t, v in zip(prog.inputs, prog.input_views) if v})


def _times(c: Cost, n: int) -> Cost:
    return c if n == 1 else Cost(c.flops * n, c.transcendentals * n, c.bytes * n)


def lift(fn, *args) -> tuple[Program, Graph]:
    """Trace `fn(*args)` and lift it: the flat program (for lowering) and its IR."""
    prog = trace(fn, *args)
    return prog, lift_program(prog)
