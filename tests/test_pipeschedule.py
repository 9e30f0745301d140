"""Pipeline schedules as data: GPipe, 1F1B and the heterogeneity-aware 1F1B, simulated."""
from __future__ import annotations

import random

import pytest

from hapsynth.synth.pipeschedule import KINDS, schedule


def _check_dependencies(sched, fwd, bwd, send, send_back):
    """Every (stage, microbatch, phase) once; work takes its time; a stage runs one thing
    at a time; inputs arrive first (activations forward, cotangents back)."""
    at = {(s.stage, s.micro, s.phase): s for s in sched.slots}
    S, M = sched.stages, sched.micros
    assert len(at) == len(sched.slots) == 2 * S * M
    for (s, m, ph), slot in at.items():
        assert slot.end - slot.start == pytest.approx(fwd[s] if ph == "F" else bwd[s])
        if ph == "F" and s > 0:
            assert slot.start >= at[(s - 1, m, "F")].end + send[s - 1] - 1e-9
        if ph == "B":
            assert slot.start >= at[(s, m, "F")].end - 1e-9
            if s < S - 1:
                assert slot.start >= at[(s + 1, m, "B")].end + send_back[s] - 1e-9
    for g in {sched.group(s) for s in range(S)}:  # a group of devices: one work at a time
        lane = sorted((x for x in sched.slots if sched.group(x.stage) == g), key=lambda x: x.start)
        assert all(a.end <= b.start + 1e-9 for a, b in zip(lane, lane[1:]))
    assert sched.makespan == max(x.end for x in sched.slots)


@pytest.mark.parametrize("S,M", [(2, 4), (4, 8), (3, 3)])
def test_equal_stages_take_the_textbook_time(S, M):
    f, b = 1.0, 2.0
    g = schedule("gpipe", [f] * S, [b] * S, M)
    o = schedule("1f1b", [f] * S, [b] * S, M)
    assert g.makespan == pytest.approx((M + S - 1) * (f + b))
    assert o.makespan == pytest.approx(g.makespan)      # same bubble ...
    assert g.in_flight == (M,) * S                      # ... but GPipe keeps every activation
    assert o.in_flight == tuple(min(S - s, M) for s in range(S))
    assert o.order(S - 1)[:4] == ["F0", "B0", "F1", "B1"][:4]
    assert g.bubble() == pytest.approx((S - 1) / (M + S - 1))


def test_every_schedule_respects_dependencies_links_and_stages():
    rng = random.Random(0)
    for _ in range(12):
        S, M = rng.randint(2, 4), rng.randint(1, 7)
        fwd = [rng.uniform(0.2, 2.0) for _ in range(S)]
        bwd = [2 * x * rng.uniform(0.8, 1.2) for x in fwd]
        send = [rng.uniform(0.0, 1.0) for _ in range(S - 1)]
        back = [rng.uniform(0.0, 1.0) for _ in range(S - 1)]
        runs = {k: schedule(k, fwd, bwd, M, send=send, send_back=back) for k in KINDS}
        for sched in runs.values():
            _check_dependencies(sched, fwd, bwd, send, back)
        assert runs["hetero-1f1b"].makespan <= runs["1f1b"].makespan + 1e-9


def test_the_heterogeneity_aware_schedule_hides_a_slow_link_next_to_unequal_stages():
    """A slow first stage and a 0.8 s link: plain 1F1B waits on cotangents it could cover
    with more microbatches in flight; the aware schedule keeps stage 0 busy."""
    fwd, bwd, send = [1.0, 0.5], [2.0, 1.0], [0.8]
    plain = schedule("1f1b", fwd, bwd, 8, send=send)
    aware = schedule("hetero-1f1b", fwd, bwd, 8, send=send)
    assert plain.makespan / aware.makespan >= 1.05
    assert aware.makespan >= 8 * (fwd[0] + bwd[0])      # stage 0's own work bounds it
    assert aware.depths[0] > plain.in_flight[0]          # deeper warm-up where it pays
    capped = schedule("hetero-1f1b", fwd, bwd, 8, send=send, memory_cap=[2, 1])
    assert capped.in_flight[0] <= 2 and capped.makespan >= aware.makespan


def test_schedule_table_and_bad_input():
    sched = schedule("1f1b", [1, 1], [2, 2], 2)
    lines = sched.table().splitlines()
    assert len(lines) == 1 + 8 and lines[1].split()[2:] == ["0", "0", "F"]
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        schedule("zb", [1], [1], 1)
    with pytest.raises(ValueError, match="3 stages have 2 boundaries"):
        schedule("1f1b", [1, 1, 1], [1, 1, 1], 2, send=[0.1])


def test_schedule_picture_has_a_row_per_stage_and_a_bar_per_slot():
    pytest.importorskip("matplotlib")
    sched = schedule("hetero-1f1b", [1.0, 0.5], [2.0, 1.0], 4, send=[0.8])
    ax = sched.plot().axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1"]
    widths = sorted(round(r.get_width(), 9) for c in ax.containers for r in c)
    assert widths == sorted(round(s.end - s.start, 9) for s in sched.slots)


def test_the_memory_cap_holds_even_below_plain_1f1b():
    sched = schedule("hetero-1f1b", [1.0] * 4, [2.0] * 4, 6, memory_cap=[1, 1, 1, 1])
    assert max(sched.in_flight) <= 1 and max(sched.depths) <= 1


@pytest.mark.parametrize("kind", KINDS)
def test_what_crossed_before_the_first_microbatch_delays_its_stage_and_link(kind):
    """`ready` (parameters copied before the first tick): the stage they went to starts
    no work before they arrive, and its link carries nothing sooner; other stages don't wait."""
    fwd, bwd, send, back = [1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [0.5, 0.5], [0.5, 0.5]
    plain = schedule(kind, fwd, bwd, 4, send, back)
    late = schedule(kind, fwd, bwd, 4, send, back, ready={("F", 1): 5.0})
    _check_dependencies(late, fwd, bwd, send, back)

    def first(sched, s):
        return min(x.start for x in sched.slots if x.stage == s)

    assert first(plain, 2) < 5.0
    assert first(late, 0) == 0.0 and first(late, 1) == first(plain, 1)  # they don't wait
    # stage 1's first activation leaves once the link is free: 5.0 + 0.5 s on the way
    assert first(late, 2) >= 5.0 + 0.5 - 1e-9
    assert late.makespan > plain.makespan


@pytest.mark.parametrize("kind", KINDS)
def test_stages_on_one_group_of_devices_run_one_work_at_a_time(kind):
    """`place`: a V shape (stages 0 and 2 on one group) keeps every dependency and runs its
    group's works one after another; each stage on a group of its own is the plain
    schedule; two stages on one group take the sum of their work; a V's two boundaries
    using one direction of a link take turns on it."""
    fwd, bwd = [2.0, 1.0, 2.0], [4.0, 2.0, 4.0]
    send, back = [0.4, 0.4], [0.4, 0.4]
    v = schedule(kind, fwd, bwd, 5, send, back, place=(0, 1, 0))
    assert v.place == (0, 1, 0) and v.groups == 2
    _check_dependencies(v, fwd, bwd, send, back)
    plain = schedule(kind, fwd, bwd, 5, send, back)
    assert schedule(kind, fwd, bwd, 5, send, back, place=(2, 0, 1)).slots == plain.slots
    # group 0 runs stages 0 and 2 one after another: at least 5 x 12 s, more than when apart
    assert v.makespan >= 5 * 12.0 - 1e-9 > plain.makespan
    one = schedule(kind, [1.0, 2.0], [2.0, 4.0], 3, place=(0, 0))
    assert one.makespan == pytest.approx(3 * (1.0 + 2.0 + 2.0 + 4.0)) and one.bubble() == 0
    # group 0 -> 1 carries stage 0's activations and stage 2's cotangents: 2 x 5 x 3 s
    wire = schedule(kind, [0.1] * 3, [0.1] * 3, 5, [3.0, 3.0], [3.0, 3.0], place=(0, 1, 0))
    assert wire.makespan >= 2 * 5 * 3.0
    with pytest.raises(ValueError, match="place"):
        schedule(kind, fwd, bwd, 5, send, back, place=(0, 2, 0))


@pytest.mark.parametrize("free", [True, False])
def test_the_depth_search_finds_what_trying_every_depth_finds(free):
    """hetero-1F1B skips depths that would run a schedule already run, and (pricing the
    makespan) gives a run up once it passes the best: the schedule it returns is the one
    trying every depth in full returns (random stages, links, caps and V shapes)."""
    from itertools import product

    from hapsynth.synth import pipeschedule as ps

    rng = random.Random(7)
    for trial in range(40):
        S, M = rng.choice([(2, 4), (3, 6), (4, 8), (3, 3)])
        fwd = [rng.uniform(0.5, 2.0) for _ in range(S)]
        bwd = [2 * f * rng.uniform(0.8, 1.2) for f in fwd]
        send = [rng.choice([0.0, 0.3, 1.5]) for _ in range(S - 1)]
        back = [rng.choice([0.0, 0.3, 1.5]) for _ in range(S - 1)]
        cap = [rng.choice([1, 2, M]) for _ in range(S)] if trial % 3 == 0 else None
        place = (0, 1, 0) if S == 3 and trial % 2 else None

        def cost(x):  # a cost other than the makespan: no run is given up early
            return x.makespan + 0.01 * sum(x.in_flight)

        got = schedule("hetero-1f1b", fwd, bwd, M, send, back, memory_cap=cap,
                       cost=None if free else cost, place=place)
        times = (tuple(fwd), tuple(bwd), tuple(send), tuple(back), {}, place or ())
        base = [min(S - s, M) for s in range(S)]
        top = [M if cap is None else max(1, min(M, cap[s])) for s in range(S)]
        price = (lambda x: x.makespan) if free else cost
        runs = [ps._run("hetero-1f1b", times, M, depths=d) for d in product(
            *[sorted({min(c, b + k) for k in (0, 1, 2, 4)}) for b, c in zip(base, top)])]
        if all(b <= c for b, c in zip(base, top)):
            runs.insert(0, ps._run("hetero-1f1b", times, M,
                                   orders=[ps._one_f_one_b(S, s, M) for s in range(S)]))
        want = min(price(r) for r in runs)
        assert price(got) == pytest.approx(want, rel=1e-12)
        assert got.slots in {r.slots for r in runs if price(r) <= want * (1 + 1e-12)}
