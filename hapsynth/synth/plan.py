"""`Plan`: the synthesizer's output, a plain serialisable value (JSON round-trips exactly).

Layouts are written as strings: "R", "P", or "S<dim>/<units>" (sharded on `dim` in
`units` factor units; per-device units are in `shard_units[units]`).
"""
from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass, fields


def layout_str(layout) -> str:
    return f"S{layout[1]}/{layout[2]}" if isinstance(layout, tuple) else str(layout)


@dataclass(frozen=True)
class Conversion:
    tensor: int
    src: str
    dst: str
    collective: str     # all_gather, all_reduce, reduce_scatter, all_to_all, ...
    form: str | None    # padded / grouped / ring
    seconds: float
    deferred: bool      # overlaps the backward pass (gradient sync)
    nbytes: int


@dataclass(frozen=True)
class Plan:
    cluster: str                      # cluster name
    classes: tuple[str, ...]          # class names, device order
    ratios: dict                      # {class name: share of every sharded dim (sums to 1)}
    predicted_step_time: float        # seconds
    breakdown: dict                   # compute, inline_comm, deferred_comm, exposed_comm
    baselines: dict                   # {"DP-EV": s, "DP-CP": s, "ideal": s}
    baseline_memory: dict             # {"DP-EV": bytes, "DP-CP": bytes} per device
    memory: dict                      # {class: {"need": bytes, "capacity": bytes}}
    solver: dict                      # status, gap, objective, bound, wall, rounds, ...
    strategies: tuple[int, ...]       # strategy index per node
    op_factors: tuple[int, ...]       # sharded factor per op (-1: replicated)
    tensor_layouts: tuple[str, ...]   # layout of every tensor as produced ("R" for inputs)
    op_inputs: tuple[tuple, ...]      # per op, the layout each operand must arrive in (None: literal)
    conversions: tuple[Conversion, ...]
    shard_units: dict                 # {units: per-device units}
    signature: str                    # fingerprint of the IR the plan was made for
    state_leaves: int = 0             # leading input leaves fed back from the outputs
    unsupported: dict = None          # primitives planned replicated for lack of a rule
    chosen: str = "synthesized"       # or "DP-CP"/"DP-EV" when a baseline was already best

    # -- serialisation -----------------------------------------------------------
    def to_json(self) -> str:
        d = asdict(self)
        d["shard_units"] = {str(k): list(v) for k, v in self.shard_units.items()}
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        d["classes"] = tuple(d["classes"])
        d["strategies"] = tuple(d["strategies"])
        d["op_factors"] = tuple(d["op_factors"])
        d["tensor_layouts"] = tuple(d["tensor_layouts"])
        d["op_inputs"] = tuple(tuple(x) for x in d["op_inputs"])
        d["conversions"] = tuple(Conversion(**c) for c in d["conversions"])
        d["shard_units"] = {int(k): tuple(v) for k, v in d["shard_units"].items()}
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    # -- reading -----------------------------------------------------------------
    @property
    def speedups(self) -> dict:
        return {k: v / self.predicted_step_time for k, v in self.baselines.items()
                if k != "ideal"}

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
                 f"gradient sync {b['deferred_comm']:.4g} s of which exposed {b['exposed_comm']:.4g} s",
                 "  per class:   " + ", ".join(
                     f"{k} busy {v:.4g} s idle {b['idle_per_class'][k]:.4g} s"
                     for k, v in b["compute_per_class"].items())]
        base = self.baselines
        cap = min(m["capacity"] for m in self.memory.values())
        fit = {k: "" if v <= cap else f", needs {v / 2**30:.1f} GiB: does not fit"
               for k, v in self.baseline_memory.items()}
        lines.append(f"  baselines:   DP-EV {base['DP-EV']:.4g} s ({self.speedups['DP-EV']:.2f}x{fit['DP-EV']}), "
                     f"DP-CP {base['DP-CP']:.4g} s ({self.speedups['DP-CP']:.2f}x{fit['DP-CP']})")
        lines.append(f"  ideal:       {base['ideal']:.4g} s (the plan is at "
                     f"{base['ideal'] / self.predicted_step_time:.0%} of the limit)")
        sharded = sum(1 for f in self.op_factors if f >= 0)
        lines.append(f"  ops:         {sharded} of {len(self.op_factors)} sharded")
        for (coll, form), (n, s) in sorted(self.collectives().items(), key=lambda kv: -kv[1][1]):
            lines.append(f"  {coll:<12s} {form or '':<8s} x{n:<5d} {s:.4g} s")
        for cls, m in self.memory.items():
            lines.append(f"  memory {cls}: {m['need'] / 2**30:.2f} of {m['capacity'] / 2**30:.1f} GiB")
        s = self.solver
        gap = "n/a" if s.get("gap") is None else f"{s['gap']:.1%}"
        lines.append(f"  solver:      {s.get('status')} gap {gap}, {s.get('wall', 0):.1f} s, "
                     f"{s.get('rounds', 0)} rounds, {s.get('decisions', 0)} decisions")
        if self.unsupported:
            lines.append(f"  replicated (no rule): {self.unsupported}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return "<pre>" + html.escape(self.summary()) + "</pre>"
