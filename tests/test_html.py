"""Rich HTML display: plan, cluster and inspect report tables, parsed back and checked
against the objects' own numbers; well formed, escaped and deterministic."""
from __future__ import annotations

import dataclasses
import json
from html.parser import HTMLParser

import pytest

import hapsynth as hs
from hapsynth.ir.report import Report
from hapsynth.models import get
from hapsynth.view.html import cluster_html, plan_html, report_html

CPU26 = hs.Cluster.load("cpu-2-6")


class _El:
    """A parsed element: tag, attributes, children (elements and text)."""

    def __init__(self, tag: str, attrs):
        self.tag, self.attrs, self.children = tag, dict(attrs), []

    @property
    def text(self) -> str:
        return "".join("\n" if isinstance(c, _El) and c.tag == "br" else
                       c.text if isinstance(c, _El) else c for c in self.children)

    def all(self, tag: str, cls: str | None = None) -> list["_El"]:
        out = []
        for c in self.children:
            if isinstance(c, _El):
                if c.tag == tag and (cls is None or cls in c.attrs.get("class", "").split()):
                    out.append(c)
                out.extend(c.all(tag, cls))
        return out


class _Tree(HTMLParser):
    """Builds an element tree and fails on any tag closed out of order or left open."""

    VOID = {"br"}

    def __init__(self):
        super().__init__()
        self.root = _El("root", ())
        self.stack = [self.root]

    def handle_starttag(self, tag, attrs):
        el = _El(tag, attrs)
        self.stack[-1].children.append(el)
        if tag not in self.VOID:
            self.stack.append(el)

    def handle_endtag(self, tag):
        assert tag not in self.VOID and self.stack[-1].tag == tag, \
            f"</{tag}> closes <{self.stack[-1].tag}>"
        self.stack.pop()

    def handle_data(self, data):
        self.stack[-1].children.append(data)


def parse(text: str) -> _El:
    t = _Tree()
    t.feed(text)
    t.close()
    assert t.stack == [t.root], f"unclosed: {[e.tag for e in t.stack[1:]]}"
    assert "<script" not in text.lower()
    return t.root


def table(root: _El, cls: str) -> list[list[str]]:
    """The body rows (cell texts) of the one table with class `cls`."""
    [t] = root.all("table", cls)
    assert t.all("caption") and t.all("th")
    return [[td.text for td in tr.all("td")] for tr in t.all("tbody")[0].all("tr")]


def marked(root: _El, cls: str) -> list[bool]:
    """Per body row of table `cls`: whether its cells are highlighted."""
    [t] = root.all("table", cls)
    return ["background" in tr.all("td")[0].attrs["style"] for tr in t.all("tbody")[0].all("tr")]


@pytest.fixture(scope="module")
def plan():
    step, args = get("mlp", "tiny")
    return hs.parallelize(step, cluster=CPU26, time_limit=1, devices="all").plan(*args)


@pytest.fixture(scope="module")
def report():
    step, args = get("mlp", "tiny")
    return hs.inspect(step, *args)


def test_plan_header_and_one_row_per_device_class(plan):
    root = parse(plan_html(plan))
    [box] = root.all("div", "hapsynth-plan")
    head = box.all("p")[0].text
    frac = plan.baselines["ideal"] / plan.predicted_step_time
    assert f"plan on {plan.cluster} ({plan.chosen})" in head
    assert f"{plan.predicted_step_time:.4g} s" in head and f"{frac:.0%} of the ideal limit" in head
    rows = table(root, "hapsynth-plan-classes")
    assert [r[0] for r in rows] == list(plan.classes) == list(plan.ratios)
    b = plan.breakdown
    for name, share, busy, idle, need, cap in rows:
        assert share == f"{plan.ratios[name]:.3f}"
        assert busy == f"{b['compute_per_class'][name]:.4g}"
        assert idle == f"{b['idle_per_class'][name]:.4g}"
        assert need == f"{plan.memory[name]['need'] / 2**30:.2f}"
        assert cap == f"{plan.memory[name]['capacity'] / 2**30:.1f}"
    assert sum(float(r[1]) for r in rows) == pytest.approx(1.0, abs=1e-3 * len(rows))


def test_plan_breakdown_baselines_and_collectives(plan):
    root = parse(plan_html(plan))
    b = plan.breakdown
    assert table(root, "hapsynth-plan-breakdown") == [
        ["compute", f"{b['compute']:.4g}"], ["inline comm", f"{b['inline_comm']:.4g}"],
        ["gradient sync", f"{b['deferred_comm']:.4g}"],
        ["of which exposed", f"{b['exposed_comm']:.4g}"]]
    base = {r[0]: r for r in table(root, "hapsynth-plan-baselines")}
    assert set(base) == {"DP-EV", "DP-CP", "FSDP", "ideal"} & (set(plan.baselines) | {"ideal"})
    for k in set(base) - {"ideal"}:
        assert base[k][1] == f"{plan.baselines[k]:.4g}"
        assert base[k][2] == f"{plan.speedups[k]:.2f}x"
        assert base[k][3] == f"{plan.baseline_ops[k]} of {len(plan.op_factors)}"
        assert "does not fit" not in base[k][4]
    assert base["ideal"][1] == f"{plan.baselines['ideal']:.4g}"
    coll = table(root, "hapsynth-plan-collectives")
    assert len(coll) == len(plan.collectives())
    for c, form, n, s in coll:
        want = plan.collectives()[(c, form or None)]
        assert (int(n), s) == (want[0], f"{want[1]:.4g}")
    assert not root.all("table", "hapsynth-plan-unsupported")


def test_plan_nodes_collapse_into_one_details_with_a_row_per_node(plan):
    root = parse(plan_html(plan))
    [details] = root.all("details")
    assert details.all("summary")[0].text == f"per-node explanation ({len(plan.nodes)} nodes)"
    rows = table(details, "hapsynth-plan-nodes")
    assert len(rows) == len(plan.nodes)
    text = plan.explain()
    per_node = {}
    for c in plan.conversions:
        per_node[c.node] = per_node.get(c.node, 0) + 1
    for k, (row, node) in enumerate(zip(rows, plan.nodes)):
        idx, kind, strategy, ops, ins, outs, conv = row
        assert (int(idx), kind, strategy) == (k, node.kind, node.strategy)
        assert f"  ops: {ops}\n" in text and ops.startswith(f"{node.ops[0]} ")
        assert (ins == "") == (not node.inputs) and (outs == "") == (not node.outputs)
        assert len([x for x in conv.split("\n") if x]) == per_node.get(k, 0)
        assert all(f"  {x}" in text for x in conv.split("\n") if x)


def test_plan_marks_a_baseline_that_does_not_fit_and_lists_unsupported(plan):
    huge = {k: 10 * 2**40 for k in plan.baseline_memory}
    odd = dataclasses.replace(plan, baseline_memory=huge, unsupported={"my<prim>": 2})
    root = parse(plan_html(odd))
    rows = table(root, "hapsynth-plan-baselines")
    dp = [r[0] != "ideal" for r in rows]
    assert all("does not fit" in r[4] for r, is_dp in zip(rows, dp) if is_dp)
    assert marked(root, "hapsynth-plan-baselines") == dp
    assert table(root, "hapsynth-plan-unsupported") == [["my<prim>", "2"]]
    assert marked(root, "hapsynth-plan-unsupported") == [True]


def test_plan_text_is_escaped_and_output_deterministic(plan):
    odd = dataclasses.replace(plan, cluster="<b>x & y</b>")
    text = plan_html(odd)
    assert "<b>x & y</b>" not in text and "&lt;b&gt;x &amp; y&lt;/b&gt;" in text
    assert "plan on <b>x & y</b>" in parse(text).all("p")[0].text
    again = hs.Plan.from_json(plan.to_json())
    assert plan_html(again) == plan_html(plan)


@pytest.mark.parametrize("cluster", [
    CPU26,
    hs.Cluster.simulated([("CPU", 4, {"name": "a<b"}), ("CPU", 2), ("CPU", 2, {"name": "c"})],
                         devices_per_host=2, name="multi & <host>")])
def test_cluster_tables_have_a_row_per_class_and_per_link_level(cluster):
    text = cluster._repr_html_()
    assert text == cluster_html(cluster)
    root = parse(text)
    head = root.all("p")[0].text
    assert head.startswith(f"cluster {cluster.name}: {cluster.num_devices} devices, "
                           f"{cluster.num_hosts} host(s)")
    rows = table(root, "hapsynth-cluster-classes")
    assert [r[1] for r in rows] == list(cluster.class_names)
    for ci, (r, c) in enumerate(zip(rows, cluster.classes)):
        devs = cluster.class_devices(ci)
        assert r[2] == c.type and int(r[3]) == c.count and r[4] == f"{devs[0]}-{devs[-1]}"
        assert r[8].split(", ") == [str(h) for h in sorted(set(c.hosts))]
    links = table(root, "hapsynth-cluster-links")
    assert [r[1] for r in links] == [l.name for l in cluster.links]
    assert all(f"{l.beta / 1e9:.4g} GB/s" in r[2] and r[3] == f"{l.alpha * 1e6:.4g} us"
               for r, l in zip(links, cluster.links))


def test_report_is_still_a_plain_json_ready_dict(report):
    assert isinstance(report, Report) and isinstance(report, dict)
    plain = dict(report)
    assert report == plain and json.loads(json.dumps(report)) == plain
    assert json.dumps(report, sort_keys=True) == json.dumps(plain, sort_keys=True)


def test_report_tables_list_every_primitive_with_its_count(report):
    root = parse(report._repr_html_())
    totals = dict(table(root, "hapsynth-report-totals"))
    assert int(totals["eqns"]) == report["eqns"] and int(totals["nodes"]) == report["nodes"]
    assert int(totals["traced eqns"]) == report["traced_eqns"]
    assert int(totals["flops"]) == report["flops"] and int(totals["bytes"]) == report["bytes"]
    prims = table(root, "hapsynth-report-primitives")
    assert {k: int(v) for k, v in prims} == report["primitives"]
    kinds = table(root, "hapsynth-report-node-kinds")
    assert {k: int(v) for k, v in kinds} == report["node_kinds"]


def test_report_highlights_unsupported_and_gives_reasons():
    rep = {"eqns": 3, "nodes": 2, "flops": 1.5e9, "primitives": {"a<b": 2, "dot": 1},
           "unsupported": {"a<b": 2}, "replicated": {"sort": "kept whole: <order> matters"},
           "node_kinds": {"opaque": 1, "compute": 1}}
    text = report_html(rep)
    assert "a<b" not in text and "<order>" not in text
    root = parse(text)
    assert table(root, "hapsynth-report-unsupported") == [["a<b", "2"]]
    assert marked(root, "hapsynth-report-unsupported") == [True]
    assert marked(root, "hapsynth-report-primitives") == [False, False]
    assert table(root, "hapsynth-report-replicated") == [["sort", "kept whole: <order> matters"]]
    assert dict(table(root, "hapsynth-report-totals"))["flops"] == "1500000000"
