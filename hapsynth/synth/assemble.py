"""From a chosen assignment to the `Plan` value: layouts, conversions, names, breakdown."""
from __future__ import annotations

from dataclasses import dataclass

from hapsynth.ir.layout import R
from hapsynth.ir.signature import of_graph
from hapsynth.synth.plan import Conversion, NodePlan, Plan, class_memory
from hapsynth.synth.pricing import paid_groups
from hapsynth.synth.search import Priced
from hapsynth.synth.timeline import timeline
from hapsynth.synth.timing import evaluate


@dataclass(frozen=True)
class Choice:
    """An assignment (strategy index per node) at one set of shares, and its step time."""

    name: str           # "synthesized", "DP-CP", "DP-EV" or "DP"
    priced: Priced
    assign: tuple[int, ...]
    time: float

    def sharded_ops(self, structure) -> int:
        """How many ops the assignment shards."""
        return sum(ch.factor is not None for n, s in enumerate(self.assign)
                   for _, ch in structure.strategies[n][s].choices)


def assemble(problem, choice: Choice, base: dict[str, Choice], solver: dict) -> Plan:
    graph, cluster = problem.graph, problem.cluster
    st, tables, assign = problem.structure, choice.priced.tables, choice.assign
    ev = evaluate(tables, assign)
    mem = choice.priced.memory.per_device(assign)
    op_factors = [-1] * len(graph.ops)
    op_inputs = [()] * len(graph.ops)
    layouts = [R] * len(graph.tensors)
    for n, s in enumerate(assign):
        strat = st.strategies[n][s]
        for t, lay in strat.layouts.items():
            layouts[t] = lay
        for op_id, ch in strat.choices:
            op_factors[op_id] = -1 if ch.factor is None else ch.factor
            op_inputs[op_id] = ch.inputs
    busy = _busy(choice)
    convs = []
    # a combined group's one latency, shown on its first all-reduce paid
    latency = {k: tables.group_latency for _, _, k in paid_groups(tables, assign)}
    for k, e in enumerate(tables.edges):
        lay = e.layouts[assign[e.src]]
        if not e.seconds(lay) or not e.needed(assign):
            continue
        coll, form, sec = e.conversions[lay]
        sec += latency.get(k, 0.0)
        convs.append(Conversion(e.tensor, lay, e.need, coll, form, sec, e.deferred,
                                int(graph.tensors[e.tensor].nbytes), e.src, e.repeat))
    names = {c.name: c for c in cluster.classes}
    return Plan(
        cluster=cluster.name, classes=tuple(names),
        ratios={c.name: float(s) for c, s in zip(cluster.classes, choice.priced.shares)},
        predicted_step_time=ev.step,
        breakdown={"compute": ev.compute, "inline_comm": ev.inline_comm,
                   "deferred_comm": ev.deferred_comm, "exposed_comm": ev.exposed_comm,
                   "prefetched_comm": ev.prefetched_comm, "prefetch_wait": ev.prefetch_wait,
                   "compute_per_class": dict(zip(names, busy)),
                   "idle_per_class": {k: ev.step - b for k, b in zip(names, busy)}},
        baselines={**{k: b.time for k, b in base.items()},
                   "ideal": graph.flops / cluster.total_flops},
        baseline_memory={k: int(b.priced.memory.total(b.assign)) for k, b in base.items()},
        baseline_ops={k: b.sharded_ops(st) for k, b in base.items()},
        baseline_busy={k: dict(zip(names, _busy(b))) for k, b in base.items()},
        memory={c.name: class_memory(c.memory, mem.state, mem.activations, mem.buffers)
                for c in cluster.classes},
        solver=solver, nodes=_nodes(graph, st, assign, layouts, op_inputs),
        op_factors=tuple(op_factors), tensor_layouts=tuple(layouts), op_inputs=tuple(op_inputs),
        conversions=tuple(convs), shard_units={int(k): tuple(v) for k, v in tables.units.items()},
        signature=of_graph(graph), unsupported=dict(graph.unsupported),
        chosen=choice.name, state_leaves=st.num_state_leaves,
        timeline=timeline(tables, assign, tuple(names)))


def _busy(choice: Choice) -> list[float]:
    """Per class, the busiest device's compute seconds in one step of `choice`."""
    tables = choice.priced.tables
    st = tables.structure
    busy = [0.0] * tables.pricer.cluster.num_classes
    for n, s in enumerate(choice.assign):
        for op_id, ch in st.strategies[n][s].choices:
            for c, t in enumerate(tables.pricer.class_times(st.graph.ops[op_id], ch)):
                busy[c] += t
    return busy


def _nodes(graph, st, assign, layouts, op_inputs) -> tuple[NodePlan, ...]:
    """Per node: ops, strategy name, the tensors it reads from elsewhere (as read) and the
    ones it makes that others read (as made)."""
    node_of_tensor = {t: graph.ops[graph.tensors[t].producer].node for t in range(len(graph.tensors))
                      if graph.tensors[t].producer is not None}
    read_elsewhere = {t for op in graph.ops for t in op.inputs
                      if t is not None and node_of_tensor.get(t, -1) != op.node}
    read_elsewhere.update(t for t in graph.outputs if t is not None)
    out = []
    for node, s in zip(graph.nodes, assign):
        ins: dict = {}
        outs = []
        for op_id in node.ops:
            op = graph.ops[op_id]
            for t, lay in zip(op.inputs, op_inputs[op_id]):
                if t is not None and node_of_tensor.get(t, -1) != node.id:
                    ins.setdefault((t, lay), None)
            outs += [(t, layouts[t]) for t in op.outputs if t in read_elsewhere]
        out.append(NodePlan(node.ops, node.kind, st.strategies[node.id][s].name,
                            tuple(ins), tuple(outs)))
    return tuple(out)
