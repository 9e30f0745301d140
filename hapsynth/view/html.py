"""HTML for Jupyter's `_repr_html_`: a plan, a cluster and an inspect report as tables.

Standard library only, plain inline CSS and no scripts, so the output is safe to embed
and the same for the same value."""
from __future__ import annotations

from html import escape

from hapsynth.cluster.units import human_bandwidth, human_flops, human_latency, human_memory
from hapsynth.cluster.values import LEVEL_KEYS

__all__ = ["cluster_html", "plan_html", "report_html"]

_GIB = 2**30
_TABLE = "border-collapse:collapse;margin:4px 0 10px 0;font-size:12px"
_CELL = "border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top"
_HEAD = _CELL + ";background:#f0f0f0"
_MARK = _CELL + ";background:#fde2e2"
_CAPTION = "caption-side:top;text-align:left;font-weight:bold;padding:2px 0"
_BOX = "font-family:monospace"


# ---- building blocks

def _cell(text, style: str = _CELL, tag: str = "td") -> str:
    """One cell; `text` is escaped, and a list of lines is joined by line breaks."""
    lines = text if isinstance(text, (list, tuple)) else [text]
    body = "<br>".join(escape(str(t)) for t in lines)
    return f'<{tag} style="{style}">{body}</{tag}>'


def _table(name: str, caption: str, headers, rows, marked=()) -> str:
    """A captioned table of class `name`; rows whose index is in `marked` are highlighted."""
    head = "<tr>" + "".join(_cell(h, _HEAD, "th") for h in headers) + "</tr>"
    body = "".join("<tr>" + "".join(_cell(c, _MARK if i in marked else _CELL) for c in row)
                   + "</tr>" for i, row in enumerate(rows))
    return (f'<table class="{name}" style="{_TABLE}">'
            f'<caption style="{_CAPTION}">{escape(caption)}</caption>'
            f"<thead>{head}</thead><tbody>{body}</tbody></table>")


def _para(text: str) -> str:
    return f'<p style="margin:4px 0">{escape(text)}</p>'


def _box(name: str, parts) -> str:
    return f'<div class="{name}" style="{_BOX}">' + "".join(parts) + "</div>"


def _s(x: float) -> str:
    """Seconds as `summary()` prints them."""
    return f"{x:.4g}"


def _gib(x: float, digits: int) -> str:
    return f"{x / _GIB:.{digits}f}"


# ---- plan

def plan_html(plan) -> str:
    """A `Plan` as HTML: header, per-class shares and memory, breakdown, baselines,
    collectives, unsupported primitives and a collapsible per-node explanation."""
    parts = [_plan_header(plan), _plan_classes(plan), _plan_stages(plan), _plan_breakdown(plan),
             _plan_baselines(plan), _plan_collectives(plan), _plan_unsupported(plan),
             _plan_nodes(plan)]
    return _box("hapsynth-plan", parts)


def _plan_header(plan) -> str:
    ideal = plan.baselines["ideal"]
    head = (f"plan on {plan.cluster} ({plan.chosen}): predicted step "
            f"{_s(plan.predicted_step_time)} s, {ideal / plan.predicted_step_time:.0%} of "
            f"the ideal limit ({_s(ideal)} s)")
    sharded = sum(1 for f in plan.op_factors if f >= 0)
    s = plan.solver
    gap = "n/a" if s.get("gap") is None else f"{s['gap']:.1%}"
    solver = (f"ops: {sharded} of {len(plan.op_factors)} sharded; solver {s.get('status')} "
              f"gap {gap}, {s.get('wall', 0):.1f} s, {s.get('rounds', 0)} rounds, "
              f"{s.get('decisions', 0)} decisions")
    devices = ("" if plan.devices is None else
               _para(f"devices: {s.get('devices', len(plan.devices))}"))
    remat = _para(f"remat: {plan.remat_text()}") if plan.remat else ""
    return (f'<p style="margin:4px 0"><b>{escape(head)}</b></p>' + _para(solver) + devices
            + remat)


def _plan_classes(plan) -> str:
    b = plan.breakdown
    busy, idle = b.get("compute_per_class", {}), b.get("idle_per_class", {})
    rows = []
    for k in plan.classes:
        m = plan.memory.get(k, {})
        rows.append((k, f"{plan.ratios.get(k, 0.0):.3f}", _opt(busy.get(k), _s),
                     _opt(idle.get(k), _s), _opt(m.get("need"), lambda x: _gib(x, 2)),
                     _opt(m.get("capacity"), lambda x: _gib(x, 1))))
    return _table("hapsynth-plan hapsynth-plan-classes", "device classes",
                  ("class", "share", "busy (s)", "idle (s)", "memory need (GiB)",
                   "capacity (GiB)"), rows)


def _plan_stages(plan) -> str:
    """A pipeline plan's stages (nothing for an SPMD plan)."""
    if not plan.stages:
        return ""
    rows = [(str(k), st["island"], str(st["from_rank"]), " ".join(map(str, st["rows"])),
             _s(st["forward"]), _s(st["backward"]), _s(st["tail"]), _gib(st["memory"], 2),
             str(st["in_flight"])) for k, st in enumerate(plan.stages)]
    return (_para(plan.stage_lines()[0].strip())
            + _table("hapsynth-plan hapsynth-plan-stages", "pipeline stages",
                     ("stage", "devices", "from op", "rows per microbatch", "forward (s)",
                      "backward (s)", "tail (s)", "memory (GiB)", "in flight"), rows))


def _opt(x, fmt) -> str:
    return "" if x is None else fmt(x)


def _plan_breakdown(plan) -> str:
    b = plan.breakdown
    rows = [("compute", _s(b["compute"])), ("inline comm", _s(b["inline_comm"])),
            ("gradient sync", _s(b["deferred_comm"])),
            ("of which exposed", _s(b["exposed_comm"]))]
    if b.get("prefetched_comm"):
        rows += [("state gathered ahead", _s(b["prefetched_comm"])),
                 ("of which exposed", _s(b["prefetch_wait"]))]
    return _table("hapsynth-plan hapsynth-plan-breakdown", "step time breakdown",
                  ("part", "seconds"), rows)


def _plan_baselines(plan) -> str:
    base, n_ops = plan.baselines, len(plan.op_factors)
    cap = min(m["capacity"] for m in plan.memory.values())
    rows, marked = [], set()
    for k in ("DP-EV", "DP-CP", "FSDP"):
        if k not in base:
            continue
        need = plan.baseline_memory[k]
        if need > cap:
            marked.add(len(rows))
        ops = (plan.baseline_ops or {}).get(k)
        fits = base[k] != float("inf")
        rows.append((k, _s(base[k]) if fits else "-", f"{plan.speedups[k]:.2f}x" if fits else "",
                     "" if ops is None else f"{ops} of {n_ops}",
                     f"{_gib(need, 1)} GiB" + (": does not fit" if need > cap else "")))
    ideal = base["ideal"]
    rows.append(("ideal", _s(ideal), f"{ideal / plan.predicted_step_time:.0%} of the limit",
                 "", ""))
    table = _table("hapsynth-plan hapsynth-plan-baselines", "baselines",
                   ("baseline", "seconds", "plan speed-up", "ops sharded",
                    "memory per device"), rows, marked)
    if len(rows) > 1:
        return table
    return _para("no data-parallel baseline: no op reads a data input's leading dim") + table


def _plan_collectives(plan) -> str:
    coll = sorted(plan.collectives().items(), key=lambda kv: (-kv[1][1], kv[0][0], kv[0][1] or ""))
    if not coll:
        return _para("collectives: none")
    rows = [(c, form or "", str(n), _s(s)) for (c, form), (n, s) in coll]
    return _table("hapsynth-plan hapsynth-plan-collectives", "collectives",
                  ("collective", "form", "count", "seconds"), rows)


def _plan_unsupported(plan) -> str:
    if not plan.unsupported:
        return ""
    rows = [(k, str(v)) for k, v in sorted(plan.unsupported.items())]
    return _table("hapsynth-plan hapsynth-plan-unsupported",
                  "replicated for lack of a rule", ("primitive", "count"), rows,
                  marked=set(range(len(rows))))


def _plan_nodes(plan) -> str:
    """One <details> holding a row per node, its cells as `plan.explain()` words them."""
    rows = [(str(k), n.kind, n.strategy, t["ops"], t["in"], t["out"], t["conversions"])
            for k, (n, t) in enumerate(zip(plan.nodes, plan.node_texts()))]
    table = _table("hapsynth-plan hapsynth-plan-nodes", "per node",
                   ("node", "kind", "strategy", "ops", "in", "out", "conversions"), rows)
    summary = f"per-node explanation ({len(plan.nodes)} nodes)"
    return f"<details><summary>{escape(summary)}</summary>{table}</details>"


# ---- cluster

def cluster_html(cluster) -> str:
    """A `Cluster` as HTML: its totals, a row per device class and one per link level."""
    head = (f"cluster {cluster.name}: {cluster.num_devices} devices, {cluster.num_hosts} "
            f"host(s), {human_flops(cluster.total_flops)} effective in total")
    return _box("hapsynth-cluster", [f'<p style="margin:4px 0"><b>{escape(head)}</b></p>',
                                      _cluster_classes(cluster), _cluster_links(cluster)])


def _cluster_classes(cluster) -> str:
    rows = []
    for ci, c in enumerate(cluster.classes):
        devs = cluster.class_devices(ci)
        rows.append((str(ci), c.name, c.type or "", str(c.count), f"{devs[0]}-{devs[-1]}",
                     human_flops(c.flops), human_memory(c.memory),
                     human_bandwidth(c.mem_bandwidth),
                     ", ".join(map(str, sorted(set(c.hosts))))))
    return _table("hapsynth-cluster hapsynth-cluster-classes", "device classes",
                  ("#", "name", "type", "count", "devices", "FLOP/s", "memory",
                   "memory bandwidth", "hosts"), rows)


def _cluster_links(cluster) -> str:
    keys = LEVEL_KEYS if len(LEVEL_KEYS) == len(cluster.links) else ("",) * len(cluster.links)
    rows = [(key, l.name, human_bandwidth(l.beta), human_latency(l.alpha))
            for key, l in zip(keys, cluster.links)]
    return _table("hapsynth-cluster hapsynth-cluster-links", "link levels (innermost first)",
                  ("level", "name", "bandwidth", "latency"), rows)


# ---- inspect report

_TOTALS = (("eqns", "eqns"), ("traced_eqns", "traced eqns"), ("nodes", "nodes"),
           ("flops", "flops"), ("transcendentals", "transcendentals"), ("bytes", "bytes"),
           ("seconds", "seconds (trace + lift)"))


def report_html(report: dict) -> str:
    """An `inspect` report as HTML: its totals, then primitives, unsupported (highlighted),
    replicated by design with reasons, and node kinds."""
    totals = [(label, _num(report[k])) for k, label in _TOTALS if k in report]
    unsupported = report.get("unsupported") or {}
    parts = [
        _table("hapsynth-report hapsynth-report-totals", "inspect", ("", "value"), totals),
        _counts("primitives", "primitives", report.get("primitives") or {}),
        _counts("unsupported", "unsupported (planned replicated)", unsupported,
                marked=set(range(len(unsupported))))
        if unsupported else _para("unsupported: none"),
        _table("hapsynth-report hapsynth-report-replicated", "replicated by design",
               ("primitive", "reason"), list(report["replicated"].items()))
        if report.get("replicated") else _para("replicated by design: none"),
        _counts("node_kinds", "node kinds", report.get("node_kinds") or {}, header="kind"),
    ]
    return _box("hapsynth-report", parts)


def _counts(part: str, caption: str, counts: dict, marked=(), header: str = "primitive") -> str:
    rows = [(k, str(v)) for k, v in counts.items()]
    return _table(f"hapsynth-report hapsynth-report-{part.replace('_', '-')}", caption,
                  (header, "count"), rows, marked)


def _num(x) -> str:
    """Integers whole (a float that is one too), other floats to four digits."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def page(title: str, body: str) -> str:
    """A standalone HTML document around `body` (what `hapsynth plan --html` writes)."""
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}'
            f'</title></head>\n<body style="font-family: sans-serif">\n{body}\n</body></html>\n')
