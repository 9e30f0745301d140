"""`Plan`: the synthesizer's output, a plain value that reads on its own and round-trips
exactly through JSON (layouts written as "R", "P", "S<dim>/<units>")."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from hapsynth.ir.layout import Layout
from hapsynth.ir.signature import Signature, difference
from hapsynth.synth.timeline import Span


class PlanMismatch(ValueError):
    """A plan applied to a program other than the one it was made for."""


def class_memory(capacity: float, state: float = 0.0, activations: float = 0.0,
                 buffers: float = 0.0) -> dict:
    """One class's entry of `Plan.memory`: bytes per device of that class, what it holds
    (state, activations at the peak, collectives' buffers at the peak), their total, and
    its capacity; "need" is the total too (the older name)."""
    total = int(state) + int(activations) + int(buffers)
    return {"state": int(state), "activations": int(activations), "buffers": int(buffers),
            "total": total, "need": total, "capacity": int(capacity)}


@dataclass(frozen=True)
class Conversion:
    """One layout change the plan pays: `tensor` from `src` to `dst` by `collective`."""

    tensor: int
    src: Layout
    dst: Layout
    collective: str     # all_gather, all_reduce, reduce_scatter, all_to_all
    form: str | None    # padded / grouped / ring
    seconds: float
    deferred: bool      # overlaps the backward pass (gradient sync)
    nbytes: int
    node: int = -1      # the node making the tensor
    repeat: int = 1     # paid every iteration of a loop (`seconds` is the total)


@dataclass(frozen=True)
class NodePlan:
    """One node's decision: its ops, the strategy's name, and the layouts at its edges."""

    ops: tuple[int, ...]
    kind: str                                  # compute, elementwise, optimizer, opaque
    strategy: str                              # e.g. "shard the batch (a=128 of dot_general)"
    inputs: tuple[tuple[int, Layout], ...]     # tensors read from elsewhere, as read
    outputs: tuple[tuple[int, Layout], ...]    # tensors others read, as made


@dataclass(frozen=True)
class Plan:
    cluster: str                      # cluster name
    classes: tuple[str, ...]          # class names, device order
    ratios: dict                      # {class name: share of every sharded dim (sums to 1)}
    predicted_step_time: float        # seconds
    breakdown: dict                   # compute, inline_comm, deferred_comm, exposed_comm,
    #                                   prefetched_comm, prefetch_wait, per class
    baselines: dict                   # {"DP-EV": s, "DP-CP": s, "FSDP": s (inf: does not fit), "ideal": s}
    baseline_memory: dict             # {"DP-EV": bytes, "DP-CP": bytes} per device
    memory: dict                      # {class: `class_memory(...)`}: bytes per device
    solver: dict                      # status, gap, objective, bound, wall, rounds, ...
    nodes: tuple[NodePlan, ...]       # per node: ops, strategy name, edge layouts
    op_factors: tuple[int, ...]       # sharded factor per op (-1: replicated)
    tensor_layouts: tuple[Layout, ...]  # layout of every tensor as produced (R for inputs)
    op_inputs: tuple[tuple, ...]      # per op, the layout each operand is read in (None: literal)
    conversions: tuple[Conversion, ...]
    shard_units: dict                 # {units: per-device units}
    signature: Signature              # the program the plan was made for
    state_leaves: int = 0             # leading input leaves fed back from the outputs
    unsupported: dict = None          # primitives planned replicated for lack of a rule
    chosen: str = "synthesized"       # or "DP-CP"/"DP-EV" when a baseline was already best
    baseline_ops: dict = None         # {"DP-EV": ops sharded, "DP-CP": ops sharded}
    baseline_busy: dict = None        # {"DP-EV": {class: busy seconds}, "DP-CP": {...}}
    timeline: tuple[Span, ...] = ()   # one step per class lane and the sync lane (`timeline.py`)
    stages: list = field(default_factory=list)  # pipeline stages; [] for an SPMD-only plan
    pipeline: dict = None             # a pipeline's microbatches, cuts and schedule table
    devices: tuple | None = None      # the cluster's devices it runs on (None: all; others idle)
    remat: dict | None = None         # activations recomputed (`ir/remat.py`): eqns, peaks

    def remat_text(self) -> str:
        """What recomputation did, in words ("" when the step runs as written)."""
        if not self.remat:
            return ""
        r = self.remat
        if r.get("undone"):
            return (f"the step's own recomputation undone, {r['merged']} ops merged into the "
                    f"forward (activations at the peak {r['peak_before'] / 2**30:.1f} -> "
                    f"{r['peak_after'] / 2**30:.1f} GiB in all)")
        how = (" (the forward pass checkpointed by segments, contractions too)"
               if r.get("target") == "segments" else "")
        return (f"{r['recomputed']} ops recomputed in the backward pass{how} (activations at the "
                f"peak {r['peak_before'] / 2**30:.1f} -> {r['peak_after'] / 2**30:.1f} GiB in all)")

    @property
    def strategies(self) -> tuple[str, ...]:
        """The chosen strategy's name per node."""
        return tuple(n.strategy for n in self.nodes)

    def check(self, signature: Signature, cluster=None) -> None:
        """Raise `PlanMismatch` naming what differs if `signature` is not this plan's
        program (or `cluster`, if given, not its cluster's classes and devices)."""
        diff = difference(self.signature, signature)
        if diff:
            raise PlanMismatch(f"this plan was made for another program: {diff}")
        if cluster is not None and self.devices is not None:
            if max(self.devices) >= cluster.num_devices:
                raise PlanMismatch(f"this plan runs on devices up to {max(self.devices)} of "
                                   f"cluster {self.cluster!r}; {cluster.name!r} has "
                                   f"{cluster.num_devices}")
            cluster = cluster.subset(self.devices, name=cluster.name)
        if cluster is not None:
            names = tuple(c.name for c in cluster.classes)
            counts = {len(v) for v in self.shard_units.values()}
            if names != self.classes or counts - {cluster.num_devices}:
                raise PlanMismatch(
                    f"this plan was made for cluster {self.cluster!r} (classes "
                    f"{', '.join(self.classes)}; {', '.join(map(str, counts)) or '?'} devices), "
                    f"not for {cluster.name!r} (classes {', '.join(names)}; "
                    f"{cluster.num_devices} devices)")

    # -- serialisation -----------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(_encode(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        lay = Layout.parse
        d["classes"] = tuple(d["classes"])
        d["nodes"] = tuple(NodePlan(tuple(n["ops"]), n["kind"], n["strategy"],
                                    tuple((t, lay(x)) for t, x in n["inputs"]),
                                    tuple((t, lay(x)) for t, x in n["outputs"]))
                           for n in d["nodes"])
        d["op_factors"] = tuple(d["op_factors"])
        d["tensor_layouts"] = tuple(lay(x) for x in d["tensor_layouts"])
        d["op_inputs"] = tuple(tuple(None if x is None else lay(x) for x in ins)
                               for ins in d["op_inputs"])
        d["conversions"] = tuple(Conversion(**{**c, "src": lay(c["src"]), "dst": lay(c["dst"])})
                                 for c in d["conversions"])
        d["timeline"] = tuple(Span(**x) for x in d.get("timeline", ()))
        d["stages"] = list(d.get("stages", []))
        if d.get("devices") is not None:
            d["devices"] = tuple(d["devices"])
        d["shard_units"] = {int(k): tuple(v) for k, v in d["shard_units"].items()}
        d["signature"] = Signature(**{k: v if k == "digest" else tuple(v)
                                      for k, v in d["signature"].items()})
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    # -- reading -----------------------------------------------------------------
    @property
    def speedups(self) -> dict:
        return {k: v / self.predicted_step_time for k, v in self.baselines.items()
                if k != "ideal"}

    def schedule(self):
        """A pipeline plan's schedule as a `PipeSchedule` (slots, table, plot); None for SPMD."""
        if not self.stages:
            return None
        from hapsynth.synth.pipeschedule import PipeSchedule, Slot
        p = self.pipeline
        slots = tuple(Slot(int(a), int(m), ph, float(x), float(y)) for a, m, ph, x, y in p["slots"])
        # stages on one group of devices (a V's ends) share it: one work at a time there
        groups = [tuple(s.get("devices", (k,))) for k, s in enumerate(self.stages)]
        place = tuple(list(dict.fromkeys(groups)).index(g) for g in groups)
        return PipeSchedule(p["schedule"], len(self.stages), int(p["micros"]), slots,
                            float(p["makespan"]), tuple(s["in_flight"] for s in self.stages),
                            ticks=tuple(tuple(r) for r in p["table"]),
                            place=place if len(set(place)) < len(place) else ())

    def stage_lines(self) -> list[str]:
        """A pipeline plan's stages and schedule, a line each (what `summary` prints)."""
        if not self.stages:
            return []
        p = self.pipeline
        kinds = ", ".join(f"{k} {v:.4g} s" for k, v in p["by_kind"].items())
        spmd = self.baselines.get("SPMD")
        vs = ("" if spmd is None or spmd != spmd else
              f"; SPMD-only {spmd:.4g} s ({spmd / self.predicted_step_time:.2f}x)")
        sent = ("run free: each stage's next work once its inputs are there"
                if p.get("runtime") == "free" else "messages cross during the next tick's work"
                if p.get("delay") else "messages cross after the tick's work")
        S = len(self.stages)
        out = [f"  pipeline:    {S} stage{'s' if S > 1 else ''}, {p['micros']} microbatches, "
               f"{p['schedule']} (bubble {p['bubble']:.0%}; {kinds}){vs}; {sent}"]
        if p.get("unrolled") is not None:
            out.append(f"  written out: loops as layers, the {p['unrolled']} state leaves fed as "
                       f"{self.state_leaves} inputs (layer-stacked ones by rows)")
        if p.get("merged"):
            out.append("  merged:      the step's own recomputation undone (`jax.checkpoint`'s "
                       "forward ops in the backward pass read from the forward)")
        for k, st in enumerate(self.stages):
            out.append(f"  stage {k} {st['island']}: from op {st['from_rank']}, rows {st['rows']}, "
                       f"forward {st['forward'] * 1e3:.4g} ms, backward {st['backward'] * 1e3:.4g} ms "
                       f"per microbatch, tail {st['tail'] * 1e3:.4g} ms, "
                       f"{st['memory'] / 2**30:.2f} GiB, {st['in_flight']} in flight"
                       + (", holds no ops" + ("" if any(
                           o.get("ops", 1) and st.get("devices") is not None
                           and o.get("devices") == st["devices"] for o in self.stages)
                           else " (its devices idle)") if st.get("ops", 1) == 0 else ""))
        working = [st for st in self.stages if st.get("ops", 1)]
        if len(working) == 1 < S:
            out.append(f"  in effect:   gradient accumulation on {working[0]['island']} in "
                       f"{p['micros']} microbatches: no other stage holds an op")
        elif S == 1:
            out.append(f"  in effect:   gradient accumulation over every device "
                       f"({self.stages[0]['island']}) in {p['micros']} microbatches, the "
                       f"gradients all-reduced once a step")
        return out

    def collectives(self) -> dict:
        """{(collective, form): (count, seconds)} over all conversions."""
        out: dict = {}
        for c in self.conversions:
            n, s = out.get((c.collective, c.form), (0, 0.0))
            out[(c.collective, c.form)] = (n + 1, s + c.seconds)
        return out

    def summary(self) -> str:
        b = self.breakdown
        lines = [f"plan on {self.cluster} ({self.chosen}): predicted step {self.predicted_step_time:.4g} s",
                 "  shares:      " + ", ".join(f"{k} {v:.3f}" for k, v in self.ratios.items()),
                 f"  breakdown:   compute {b['compute']:.4g} s, inline comm {b['inline_comm']:.4g} s, "
                 f"gradient sync {b['deferred_comm']:.4g} s of which exposed {b['exposed_comm']:.4g} s"
                 + (f", state gathered ahead {b['prefetched_comm']:.4g} s of which exposed "
                    f"{b['prefetch_wait']:.4g} s" if b.get("prefetched_comm") else ""),
                 "  per class:   " + ", ".join(
                     f"{k} busy {v:.4g} s idle {b['idle_per_class'][k]:.4g} s"
                     for k, v in b["compute_per_class"].items())]
        base = self.baselines
        cap = min(m["capacity"] for m in self.memory.values())
        n_ops = len(self.op_factors)
        dp = []
        for k in ("DP-EV", "DP-CP", "FSDP"):
            if k not in base:
                continue
            fits = base[k] != float("inf")
            ops = (self.baseline_ops or {}).get(k)
            notes = [f"{self.speedups[k]:.2f}x" if fits else "",
                     "" if ops is None else f"shards {ops} of {n_ops} ops",
                     "" if self.baseline_memory[k] <= cap else
                     f"needs {self.baseline_memory[k] / 2**30:.3g} GiB: does not fit"]
            dp.append(f"{k} {f'{base[k]:.4g} s' if fits else '-'} "
                      f"({', '.join(n for n in notes if n)})")
        lines.append("  baselines:   " + ("; ".join(dp) if dp else
                     "none: no op reads a data input's leading dim (data parallelism does "
                     "not apply)"))
        lines.append(f"  ideal:       {base['ideal']:.4g} s (the plan is at "
                     f"{base['ideal'] / self.predicted_step_time:.0%} of the limit)")
        if self.devices is not None:
            lines.append(f"  devices:     {self.solver.get('devices', len(self.devices))}")
        if self.remat:
            lines.append(f"  remat:       {self.remat_text()}")
        lines += self.stage_lines()
        if self.solver.get("pipeline") and not self.stages:
            lines.append(f"  pipeline:    not chosen: {self.solver['pipeline']}")
        sharded = sum(1 for f in self.op_factors if f >= 0)
        lines.append(f"  ops:         {sharded} of {len(self.op_factors)} sharded")
        for (coll, form), (n, s) in sorted(self.collectives().items(), key=lambda kv: -kv[1][1]):
            lines.append(f"  {coll:<12s} {form or '':<8s} x{n:<5d} {s:.4g} s")
        for cls, m in self.memory.items():
            parts = ", ".join(f"{k} {m[k] / 2**30:.3g}" for k in ("state", "activations", "buffers")
                              if k in m)
            lines.append(f"  memory {cls}: {m['need'] / 2**30:.3g} of {m['capacity'] / 2**30:.3g} GiB"
                         + (f" ({parts})" if parts else ""))
        s = self.solver
        gap = "n/a" if s.get("gap") is None else f"{s['gap']:.1%}"
        lines.append(f"  solver:      {s.get('status')} gap {gap}, {s.get('wall', 0):.1f} s, "
                     f"{s.get('rounds', 0)} rounds, {s.get('decisions', 0)} decisions")
        if s.get("cached"):
            lines.append(f"  read from the plan cache: {s['cached']}")
        if self.unsupported:
            lines.append(f"  replicated (no rule): {self.unsupported}")
        return "\n".join(lines)

    def explain(self) -> str:
        """Per node: its ops, the chosen strategy, the layouts it reads and makes, and each
        conversion of a tensor it makes (collective, form, predicted seconds)."""
        out = [f"plan on {self.cluster} ({self.chosen}), predicted step "
               f"{self.predicted_step_time:.4g} s; per node:"]
        for k, (n, parts) in enumerate(zip(self.nodes, self.node_texts())):
            out.append(f"node {k} [{n.kind}] {n.strategy}")
            out.append(f"  ops: {parts['ops']}")
            if parts["in"]:
                out.append("  in:  " + parts["in"])
            if parts["out"]:
                out.append("  out: " + parts["out"])
            out += [f"  {c}" for c in parts["conversions"]]
        return "\n".join(out)

    def node_texts(self) -> list[dict]:
        """Per node, what `explain()` says of it: "ops", "in", "out" (text) and
        "conversions" (a line per conversion of a tensor it makes)."""
        prims = self.signature.ops
        by_node: dict[int, list[Conversion]] = {}
        for c in self.conversions:
            by_node.setdefault(c.node, []).append(c)
        out = []
        for k, n in enumerate(self.nodes):
            convs = []
            for c in by_node.get(k, ()):
                when = "overlapped" if c.deferred else "inline"
                if c.repeat > 1:
                    when += f", x{c.repeat} iterations"
                convs.append(f"t{c.tensor} {c.src} -> {c.dst}: {c.collective} {c.form or ''} "
                             f"{c.nbytes / 2**20:.3g} MiB, {c.seconds * 1e3:.4g} ms ({when})")
            out.append({"ops": _ops_text(n.ops, prims),
                        "in": _edges_text(n.inputs) if n.inputs else "",
                        "out": _edges_text(n.outputs) if n.outputs else "",
                        "conversions": convs})
        return out

    def _repr_html_(self) -> str:
        from hapsynth.view.html import plan_html
        return plan_html(self)

    # -- pictures (the `[plot]` extra: matplotlib) ---------------------------------
    def plot_timeline(self, ax=None):
        """One step as a Gantt chart per device class (a pipeline: per stage, its
        microbatches' forward and backward); returns the matplotlib Figure."""
        from hapsynth.view.plots import plot_schedule, plot_timeline
        if self.stages:
            return plot_schedule(self.schedule(), ax=ax)
        return plot_timeline(self, ax=ax)

    def plot_balance(self, ax=None):
        """Busy and idle seconds per class, beside DP-EV and DP-CP; returns the Figure."""
        from hapsynth.view.plots import plot_balance
        return plot_balance(self, ax=ax)


def _ops_text(ops, prims, limit: int = 8) -> str:
    """"3 dot_general, 4 add, ..." for a node's ops (the first `limit`, then a count)."""
    text = ", ".join(f"{i} {prims[i]}" for i in ops[:limit])
    return text + (f", ... ({len(ops)} ops)" if len(ops) > limit else "")


def _edges_text(pairs, limit: int = 6) -> str:
    """"t3 S0/128, t7 R" for a node's edge tensors; past `limit`, counts per layout first."""
    text = ", ".join(f"t{t} {lay}" for t, lay in pairs[:limit])
    if len(pairs) <= limit:
        return text
    counts: dict = {}
    for _, lay in pairs:
        counts[str(lay)] = counts.get(str(lay), 0) + 1
    per = ", ".join(f"{k} x{v}" for k, v in counts.items())
    return f"{len(pairs)} tensors ({per}): {text}, ..."


def _encode(x):
    """A JSON-ready copy: layouts as text, dataclasses as dicts, tuples as lists."""
    if isinstance(x, Layout):
        return str(x)
    if hasattr(x, "__dataclass_fields__"):
        return {f.name: _encode(getattr(x, f.name)) for f in fields(x)}
    if isinstance(x, dict):
        return {str(k): _encode(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_encode(v) for v in x]
    return x
