"""A plan's timeline, its pictures, `plan --png/--html`, and progress reporting."""
from __future__ import annotations

import collections

import pytest

import hapsynth as hs
from hapsynth import progress
from hapsynth.cli import main as cli_main
from hapsynth.models import get
from hapsynth.synth.timeline import SYNC
from hapsynth.view import plots

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module", params=[("gpt", "cpu-2-6", "auto"),
                                        ("bert", "hap-v100x16-p100x48", "auto"),
                                        ("gpt", "hap-v100x16-p100x48", "fsdp")])
def plan(request):
    model, cluster, strategy = request.param
    step, args = get(model, "tiny")
    return hs.parallelize(step, cluster=hs.Cluster.load(cluster), time_limit=2, devices="all",
                          strategy=strategy, verbose=False).plan(*args)


def _per(spans, kind):
    out = collections.defaultdict(float)
    for s in spans:
        if s.kind == kind:
            out[s.lane] += s.seconds
    return out


def test_timeline_covers_the_step_and_adds_up_to_the_breakdown(plan):
    step, b = plan.predicted_step_time, plan.breakdown
    assert max(s.end for s in plan.timeline) == pytest.approx(step, rel=1e-9)
    for c in plan.classes:  # each class lane is contiguous from 0 to the step
        lane = sorted((s for s in plan.timeline if s.lane == c), key=lambda s: s.start)
        assert lane[0].start == 0.0 and lane[-1].end == pytest.approx(step, rel=1e-9)
        for a, z in zip(lane, lane[1:]):
            assert z.start == pytest.approx(a.end, rel=1e-9, abs=1e-15)
    busy = _per(plan.timeline, "compute")
    for c in plan.classes:
        assert busy[c] == pytest.approx(b["compute_per_class"][c], rel=1e-9)
    assert _per(plan.timeline, "sync")[SYNC] == pytest.approx(b["deferred_comm"], rel=1e-9)
    inline = {round(s.start, 15): s.seconds for s in plan.timeline
              if s.kind == "collective" and s.lane == plan.classes[0]}
    assert sum(inline.values()) == pytest.approx(b["inline_comm"], rel=1e-9, abs=1e-15)
    assert _per(plan.timeline, "wait")[plan.classes[0]] == pytest.approx(
        b["exposed_comm"] + b["prefetch_wait"], rel=1e-9, abs=1e-15)
    assert _per(plan.timeline, "prefetch")[SYNC] == pytest.approx(b["prefetched_comm"], rel=1e-9)
    assert hs.Plan.from_json(plan.to_json()).timeline == plan.timeline


def _bars(ax):
    """{label: [(row, left, width)]} of a figure's horizontal bars."""
    out = {}
    for cont in ax.containers:
        out[cont.get_label()] = [(round(r.get_y() + r.get_height() / 2), r.get_x(), r.get_width())
                                 for r in cont]
    return out


def test_timeline_picture_has_a_row_per_class_and_bars_equal_to_the_plan(plan):
    fig = plan.plot_timeline()
    ax = fig.axes[0]
    rows = [t.get_text() for t in ax.get_yticklabels()]
    assert rows[:len(plan.classes)] == list(plan.classes)
    assert rows[len(plan.classes):] == ([SYNC] if plan.breakdown["deferred_comm"] else [])
    scale, _ = plots._unit(plan.predicted_step_time)
    bars = _bars(ax)
    for k, c in enumerate(plan.classes):
        drawn = sum(w for row, _, w in bars["compute"] if row == k) / scale
        assert drawn == pytest.approx(plan.breakdown["compute_per_class"][c], rel=1e-9)
    ends = [(x + w) / scale for v in bars.values() for _, x, w in v]
    assert max(ends) == pytest.approx(plan.predicted_step_time, rel=1e-9)


def test_balance_picture_shows_busy_and_idle_per_class_beside_the_baselines(plan):
    ax = plan.plot_balance().axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    bases = [k for k in ("DP-EV", "DP-CP") if k in plan.baselines]
    assert labels == [f"{c} · {k}" for c in plan.classes for k in ("plan", *bases)]
    scale, _ = plots._unit(max(plan.predicted_step_time, *(plan.baselines[k] for k in bases)))
    busy, idle = (ax.containers[0], ax.containers[1])
    for k, c in enumerate(plan.classes):
        row = k * (1 + len(bases))
        assert busy[row].get_width() / scale == pytest.approx(
            plan.breakdown["compute_per_class"][c], rel=1e-9)
        assert idle[row].get_width() / scale == pytest.approx(
            plan.breakdown["idle_per_class"][c], rel=1e-9)
        for j, base in enumerate(bases, 1):
            total = (busy[row + j].get_width() + idle[row + j].get_width()) / scale
            assert total == pytest.approx(plan.baselines[base], rel=1e-9)


def test_plans_compared_side_by_side(plan):
    ax = hs.plot_plans([plan, plan], labels=["one", "two"]).axes[0]
    bars = _bars(ax)
    assert [w for _, _, w in bars["plan"]] == [bars["plan"][0][2]] * 2
    assert bars["ideal"][0][2] <= bars["plan"][0][2]
    with pytest.raises(ValueError, match="2 plans but 1 labels"):
        hs.plot_plans([plan, plan], labels=["one"])


def test_cli_writes_a_png_and_an_html_page(tmp_path, capsys):
    png, page = tmp_path / "plan.png", tmp_path / "plan.html"
    assert cli_main(["plan", "mlp", "--config", "tiny", "--cluster", "cpu-2-6", "--time-limit",
                     "1", "--png", str(png), "--html", str(page)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    text = page.read_text()
    assert text.startswith("<!doctype html>") and "cpu-2-6" in text and "<table" in text


def test_progress_goes_through_the_phases_in_order_and_is_quiet_when_asked(monkeypatch):
    step, args = get("mlp", "tiny")
    seen = []
    token = progress._reporter.set(seen.append)
    try:
        hs.parallelize(step, cluster=hs.Cluster.load("cpu-2-6"), time_limit=1).plan(*args)
    finally:
        progress._reporter.reset(token)
    assert set(seen) == set(progress.PHASES)
    firsts = sorted(progress.PHASES, key=seen.index)
    assert firsts == list(progress.PHASES)
    monkeypatch.setenv("CI", "true")
    assert not progress.interactive()
    with progress.reporting(verbose=None):
        assert progress._reporter.get() is None
    with progress.reporting(verbose=True):
        assert progress._reporter.get() is not None
    assert list(progress.track(range(3), "x", verbose=False)) == [0, 1, 2]


def test_timeline_ends_at_evaluate_s_step_with_collectives_read_only_by_the_tail():
    """A gradient sync made in the tail and an output's all-reduce placed after it: the
    sync is ready when evaluate says (main compute and inline collectives up to its op)."""
    from types import SimpleNamespace as NS

    from hapsynth.ir.layout import P, R
    from hapsynth.synth.pricing import Edge, Tables
    from hapsynth.synth.timeline import timeline
    from hapsynth.synth.timing import evaluate

    seconds = {0: 5.0, 1: 1.0, 2: 1.0}
    strat = NS(choices=tuple((i, None) for i in range(3)))
    st = NS(strategies=((strat,),), graph=NS(ops=[NS(id=i) for i in range(3)]), tail_start=1)
    pricer = NS(class_times=lambda op, ch: (seconds[op.id],))
    out = Edge(0, 10, R, (P,), {-1: frozenset({0})}, {P: ("all_reduce", None, 2.0)}, False, 3)
    sync = Edge(0, 11, R, (P,), {0: frozenset({0})}, {P: ("all_reduce", None, 4.0)}, True, 1)
    tables = Tables(st, pricer, ((5.0,),), ((2.0,),), (({0: 5.0},),), (out, sync), 0.1)
    spans = timeline(tables, [0], ("a",))
    assert max(s.end for s in spans) == pytest.approx(evaluate(tables, [0]).step)
