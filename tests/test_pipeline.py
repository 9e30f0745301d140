"""Pipelines across islands: stage analysis, the choice against SPMD, the schedule table,
and pipelined programs equal to `jax.jit(train_step)` on one device."""
from __future__ import annotations

import re

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hapsynth as hs
from hapsynth.args import state_arity
from hapsynth.ir import lift_program, trace
from hapsynth.lower.packing import dtype_of
from hapsynth.models import get
from hapsynth.synth.lockstep import late_ticks, ticks
from hapsynth.synth.pipeline import SCHEDULES
from hapsynth.synth.pipeschedule import schedule
from hapsynth.synth.slots import wire_rounds
from hapsynth.synth.stagegroups import stage_parts
from hapsynth.synth.stages import NotPipelineable, analyse, stage_of
from hapsynth.synth.synthesize import data_parallel_plan


def two_islands(inter_island: str = "10Gbps") -> hs.Cluster:
    """Two islands of 4 simulated devices (a fast and a slow class), one host each."""
    return hs.Cluster.simulated([("A100", 4), ("V100", 4)], devices_per_host=4,
                                islands={"a": ["A100"], "b": ["V100"]},
                                links={"inter_island": {"bandwidth": inter_island,
                                                        "latency": "50us"}})


def four_islands() -> hs.Cluster:
    """Four islands of 2 devices; the first mixes a fast and a slow device (uneven rows)."""
    return hs.Cluster.simulated(
        [("A100", 1), ("V100", 1, {"host": 0}), ("T4", 2), ("P100", 2), ("L4", 2)],
        devices_per_host=2,
        islands={"a": ["A100", "V100"], "b": ["T4"], "c": ["P100"], "d": ["L4"]})


def _regions(step, args, cluster):
    k = state_arity(step, args)
    n = len(jax.tree.leaves(args[:k]))
    graph = lift_program(trace(step, *args))
    dp = data_parallel_plan(graph, cluster, num_state_leaves=n, data_inputs=graph.inputs[n:])
    return graph, dp, analyse(graph, dp.tensor_layouts, dp.op_inputs, n), n


def test_stage_analysis_of_a_tied_gpt():
    """Forward ops rank in program order by the layer they belong to; each gradient ranks
    with its parameter (so it is computed where the parameter is stored); the tied
    embedding is stored by the first stage although the last one reads it too."""
    step, args = get("gpt", "tiny")
    graph, dp, r, n = _regions(step, args, two_islands())
    assert set(r.region) <= {"pre", "micro", "post", "data"} and "micro" in r.region
    fwd = [i for i, f in enumerate(r.forward) if f and r.rank[i] >= 0]
    assert fwd and all(r.region[i] == "micro" for i in fwd)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args[0])[0]]
    tok = next(i for i, p in enumerate(paths) if "tok" in p)
    cuts = r.cut_points()
    assert len(cuts) > 4 and r.owner_rank[tok] == min(r.owner_rank[:len(paths)])
    # the last layer's parameters and their optimizer state sit on the same stage
    cut = [cuts[len(cuts) // 2]]
    owners = {}
    for i, p in enumerate(paths):
        owners.setdefault(p, set()).add(stage_of(r.owner_rank[i], cut))
    assert {0, 1} <= {s for v in owners.values() for s in v}
    # an op making a parameter's gradient runs on the stage storing the parameter
    producer = {t: op.id for op in graph.ops for t in op.outputs}
    for i in range(len(paths)):
        out = graph.outputs[i]
        if out in producer:
            assert stage_of(r.rank[producer[out]], cut) == stage_of(r.owner_rank[i], cut)


@pytest.mark.slow  # (state through the buffers: the round-trip and fed-back tests stay)
def test_the_new_state_is_written_into_its_buffers():
    """Each stage writes its new state over its state buffers (dynamic-update-slice, in
    place), not as a concatenation padded to the largest stage's buffer: on XLA's CPU
    backend that ran far below memory speed (1.3-1.7 s a step for the zoo's paper MLP)."""
    step, args = get("gpt", "tiny")
    low = hs.parallelize(step, cluster=two_islands(), pipeline=True, pipeline_runtime="ticks", time_limit=1).lowered(*args)
    hlo = {"float32": "f32", "int32": "s32", "uint32": "u32", "bfloat16": "bf16", "float16": "f16"}
    sizes = {f"{hlo[np.dtype(k).name]}[{n}]" for k, n in low.state_sizes.items()}
    text = low.compile(*args).as_text()
    built = [ln for ln in text.splitlines() for s in sizes
             if f"= {s}{{0}} " in ln and ("concatenate" in ln or " pad(" in ln)]
    updated = [ln for ln in text.splitlines() for s in sizes
               if f"= {s}{{0}} " in ln and "dynamic-update-slice" in ln]
    assert updated and not built, built[:2]


@pytest.mark.slow  # traces two outside models (~14 s): run by .ci/run
def test_steps_that_cannot_run_as_microbatches_say_why(monkeypatch):
    """Batch statistics; a loop too long to write out layer by layer (a scan over layers
    shorter than `MAX_TRIPS` is written out and pipelined)."""
    from test_elsewhere import get as elsewhere

    import hapsynth.ir.unroll as unroll
    step, args = elsewhere("haiku_resnet")
    with pytest.raises(NotPipelineable, match="summed over the whole batch"):
        _regions(step, args, two_islands())
    plan = hs.parallelize(step, cluster=two_islands(), time_limit=1).plan(*args)
    assert plan.stages == [] and "not pipelineable" in plan.solver["pipeline"]
    assert plan.baselines["SPMD"] == plan.predicted_step_time
    step, args = elsewhere("scan_gpt")
    monkeypatch.setattr(unroll, "MAX_TRIPS", 1)
    with pytest.raises(NotPipelineable, match="loop region"):
        hs.parallelize(step, cluster=two_islands(), time_limit=1, pipeline=True, pipeline_runtime="ticks").plan(*args)


def test_schedule_table_keeps_every_dependency():
    """The static (tick, stage, microbatch, F/B) table: one piece of work per stage and
    tick, a forward after the previous stage's, a backward after the next stage's and
    after its own forward."""
    for kind in SCHEDULES:
        sch = schedule(kind, [1.0, 2.0, 1.5], [2.0, 4.0, 3.0], 6, [0.5, 0.2], [0.5, 0.2])
        rows = ticks(sch)
        assert len(rows) == 2 * 6 * 3
        at = {(s, m, ph): t for t, s, m, ph in rows}
        assert len({(t, s) for t, s, _, _ in rows}) == len(rows)
        for (s, m, ph), t in at.items():
            if ph == "F" and s > 0:
                assert t > at[(s - 1, m, "F")]
            if ph == "B":
                assert t > at[(s, m, "F")]
                if s < 2:
                    assert t > at[(s + 1, m, "B")]


def test_keep_buffers_are_reused_once_their_backwards_ran():
    """The lowering's pool of keep buffers, counted over a tick table: under 1F1B a
    buffer is written again after its backwards (fewer buffers than forward ticks);
    under GPipe every forward's is live until the backwards start."""
    from hapsynth.synth.slots import keep_pool
    for kind, reuse in (("1f1b", True), ("gpipe", False)):
        rows = ticks(schedule(kind, [1.0, 2.0, 1.5], [2.0, 4.0, 3.0], 6, [0.5, 0.2], [0.5, 0.2]))
        pool = len(set(keep_pool(rows, [True, True, False]).values()))
        forwards = {t for t, s, _, ph in rows if ph == "F" and s < 2}
        assert (pool < len(forwards)) == reuse and pool >= 1


ONE = {(ph, s): 1 for ph in "FB" for s in range(2)}


def test_opposite_shifts_share_a_round_only_where_no_stage_sends_or_receives_twice():
    two = {1: [(0, 1)], -1: [(1, 0)]}
    assert wire_rounds(two) == [(1, -1)]
    assert wire_rounds(two, alone={-1}) == [(1,), (-1,)]  # gathered first: apart
    # three stages: the middle one sends both ways, so its forward and backward cross apart
    three = {1: [(0, 1), (1, 2)], -1: [(1, 0), (2, 1)], 2: [(0, 2)]}
    assert wire_rounds(three) == [(1,), (-1,), (2,)]
    # a forward skipping a stage and the backward on the other boundary: one round
    assert wire_rounds({2: [(0, 2)], -2: [(3, 1)], 1: [(2, 3)]}) == [(1,), (2, -2)]


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("lag,delay", [({}, 0), ({("F", 0): 2, ("B", 1): 3}, 0), (ONE, 1),
                                       ({**ONE, ("F", 0): 2, ("B", 1): 3}, 1)])
def test_tick_tables_deliver_every_message_and_keep(kind, lag, delay):
    """Run the loop's tables as a machine with slots: every backward reads the keep
    buffer its own forward wrote, and every reader finds in its mailbox slot the
    message it waits for (none overwritten first), with fewer slots than messages; a
    message is stored `delay` ticks after the tick that made it (after that tick's reads)."""
    from hapsynth.synth.slots import B, F, IDLE, tick_tables
    sch = schedule(kind, [1.0, 2.0, 1.5], [2.0, 4.0, 3.0], 6, [0.5, 0.2], [0.5, 0.2])
    rows = ticks(sch, lag)
    # forwards send on to the next stage's forward and to its backward (a skip); backwards
    # send back to the previous stage's backward; stage 2 keeps nothing
    chans = {(1, "F"): {0: ["F", "B"], 1: ["F"]}, (-1, "B"): {1: ["B"], 2: ["B"]}}
    tb = tick_tables(rows, 3, [True, True, False], chans, delay)
    last = max(r[0] for r in rows)
    assert tb.ticks == (last + 1 if delay else len({r[0] for r in rows}))
    pool = np.full((tb.keep_slots + 1, 3), -1)  # (+ 1: writing at "none" would show)
    mail = {c: np.full((tb.mail_slots[c] + 1, 3, 2), -1) for c in chans}
    sent, made = 0, {}
    for i in range(tb.ticks):
        for s in range(3):
            ph, m = tb.phase[i, s], tb.micro[i, s]
            if ph == B and s < 2:
                assert pool[tb.keep_in[i, s], s] == m
            for (d, pha), senders in chans.items():
                a = s - d
                if ph != IDLE and "FB"[ph - 1] in senders.get(a, []):
                    assert tuple(mail[(d, pha)][tb.mail_in[(d, pha)][i, s], s]) == (a, m)
        for s in range(3):
            ph, m = tb.phase[i, s], tb.micro[i, s]
            if ph == F and s < 2:
                assert tb.keep_out[i, s] < tb.keep_slots
                pool[tb.keep_out[i, s], s] = m
            else:
                assert tb.keep_out[i, s] == tb.keep_slots  # none
            for (d, pha), senders in chans.items():
                if ph != IDLE and "FB"[ph - 1] == pha and s in senders:
                    made.setdefault(i + delay, []).append((d, pha, s, m))
        for d, pha, s, m in made.pop(i, []):
            assert tb.mail_out[(d, pha)][i, s + d] < tb.mail_slots[(d, pha)]
            mail[(d, pha)][tb.mail_out[(d, pha)][i, s + d], s + d] = (s, m)
            sent += 1
    assert not made and sum(tb.mail_slots.values()) < sent
    for c in chans:  # a receiver stores nothing at ticks its sender sent it nothing
        assert (tb.mail_out[c] < tb.mail_slots[c]).sum() == sum(
            1 for t, s, m, ph in rows if ph == c[1] and s in chans[c])
    if delay:  # a table whose readers sit right after the sender's tick cannot be sent late
        with pytest.raises(ValueError, match="not after it arrived"):
            tick_tables(ticks(sch, {}), 3, [True, True, False], chans, delay)


def test_readers_of_a_slow_transfer_may_sit_ticks_later():
    """A tick table whose readers across the boundary wait extra ticks (as `lockstep`
    tries for slow links) keeps every dependency, and the program running it still
    equals `jax.jit` on one device."""

    from hapsynth.synth.pipeschedule import PipeSchedule, Slot
    from test_lowering import compare
    step, args = get("mlp", "tiny")
    plan = hs.parallelize(step, cluster=two_islands(), pipeline=True, pipeline_runtime="ticks", time_limit=1).plan(*args)
    p = plan.pipeline
    assert [list(r) for r in ticks(plan.schedule())] == p["table"]  # the table it runs
    sch = PipeSchedule(p["schedule"], 2, p["micros"], tuple(Slot(*x) for x in p["slots"]),
                       p["makespan"], (1, 1))
    plain, lagged = ticks(sch, {}), ticks(sch, {("F", 0): 2, ("B", 0): 3})
    at = {(s, m, ph): t for t, s, m, ph in lagged}
    for m in range(p["micros"]):
        assert at[(1, m, "F")] >= at[(0, m, "F")] + 3 and at[(0, m, "B")] >= at[(1, m, "B")] + 4
    assert max(r[0] for r in lagged) > max(r[0] for r in plain)
    want = jax.jit(step)(*args)
    for delay in (0, 1):  # sent in the tick that made it, or during the next one
        again = replace(plan, pipeline={**p, "table": [list(r) for r in lagged], "delay": delay})
        par = hs.parallelize(step, cluster=two_islands(), plan=again)
        compare(hs.gather(par(*args)), want, rtol=2e-3)
    again = replace(plan, pipeline={**p, "table": [list(r) for r in lagged], "delay": 2})
    with pytest.raises(ValueError, match="not 2 ticks later"):
        hs.parallelize(step, cluster=two_islands(), plan=again)(*args)


def _program_text(par, args) -> str:
    """The StableHLO of the pipelined program `par` runs on `args`."""
    low = par.lowered(*args)
    fn, seen = low._fn, {}

    def spy(*xs):
        seen["args"] = xs
        return fn(*xs)
    low._fn = spy
    try:
        par(*args)
    finally:
        low._fn = fn
    return fn.lower(*seen["args"]).as_text()


@pytest.mark.slow
def test_the_program_does_not_grow_with_its_ticks():
    """The ticks run in one loop whose body is the same every tick: a table with more
    ticks (readers of each transfer waiting longer) gives a program of the same size."""

    from hapsynth.synth.pipeschedule import PipeSchedule, Slot
    step, args = get("mlp", "tiny")
    plan = hs.parallelize(step, cluster=two_islands(), pipeline=True, pipeline_runtime="ticks", time_limit=1).plan(*args)
    p = plan.pipeline
    sch = PipeSchedule(p["schedule"], 2, p["micros"], tuple(Slot(*x) for x in p["slots"]),
                       p["makespan"], (1, 1))
    longer = ticks(sch, {("F", 0): 6, ("B", 0): 7})
    assert max(r[0] for r in longer) > max(r[0] for r in p["table"])
    texts = [_program_text(hs.parallelize(step, cluster=two_islands(), plan=q), args) for q in (
        plan, replace(plan, pipeline={**p, "table": [list(r) for r in longer]}))]
    for op in ("stablehlo.while", "stablehlo.case"):
        assert texts[0].count(op) == texts[1].count(op) > 0, op
    assert abs(len(texts[1]) - len(texts[0])) < 0.02 * len(texts[0])


@pytest.mark.slow  # (buffers priced as allocated: test_large_state_leaves_... stays)
@pytest.mark.parametrize("cluster", [two_islands, four_islands])
def test_every_device_holds_the_buffers_priced(cluster):
    """One SPMD program gives every device the same buffers, each sized for the stage
    needing most: every stage is priced that (near what XLA allocates per device, a V100
    stage holding no layers included), and no tick copies the keep pool or a mailbox
    whole (they are updated in place), nor the backward's sums (the zoo's paper MLP: its
    58.6M-float gradient sums copied in every tick's idle and forward branches)."""
    step, args = get("gpt", "tiny")
    par = hs.parallelize(step, cluster=cluster(), pipeline=True, pipeline_runtime="ticks", time_limit=1)
    plan, low = par.plan(*args), par.lowered(*args)
    compiled = low.compile(*args)
    m = compiled.memory_analysis()
    held = m.argument_size_in_bytes + m.temp_size_in_bytes
    for st in plan.stages:
        assert 0.5 * held <= st["memory"] <= held + m.output_size_in_bytes, (st, m)
    tb = low.tables  # (a mailbox has a spare row, written by ticks storing nothing)
    whole = {f"[{low.keep_buffers},{n}]" for n in low.keep_sizes.values()} | {
        f"[{tb.mail_slots[c] + 1},{low.D},{n}]" if low.chunked[c[0]] else
        f"[{tb.mail_slots[c] + 1},{n}]" for c in low.chan_pack for n in low.chan_sizes[c].values()}
    hlo = {"float32": "f32", "int32": "s32", "uint32": "u32", "bfloat16": "bf16"}
    sums = {f"= {hlo[dtype_of(k)]}[{n}]{{0}}" for k, n in low.acc_sizes["B"].items()}
    copies = []  # in the tick loop (its body and the computations it calls)
    for line in _in_loop(compiled.as_text()):
        if " copy(" in line and (any(w in line.split(" copy(")[0] for w in whole)
                                 or any(w in line for w in sums)
                                 and "broadcast" not in line.split(" copy(")[1]):
            copies.append(line)  # (a copy of zeros is a buffer's first value, not a copy)
    assert low.keep_buffers > 1 and not copies, copies[:3]


def _in_loop(hlo: str) -> list[str]:
    """The lines of HLO text's computations run in a while loop: the loops' bodies and
    what they call, transitively."""
    comps, name = {}, None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and "{" in line:
            name = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            comps[name] = []
        elif name and line.startswith(" "):
            comps[name].append(line)
    called = lambda lines: {m for x in lines for m in re.findall(r"%([\w.\-]+)", x) if m in comps}
    todo = [m for x in comps.values() for line in x if " while(" in line
            for m in re.findall(r"body=%([\w.\-]+)", line)]
    seen: set = set()
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            todo += called(comps[c])
    return [line for c in seen for line in comps[c]]


def _jaxprs(jaxpr):
    """`jaxpr` and every jaxpr inside it (loop bodies, branches, shard_map and jit bodies)."""
    yield jaxpr
    for e in jaxpr.eqns:
        for v in e.params.values():
            for x in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(x, "jaxpr", x)
                if hasattr(inner, "eqns"):
                    yield from _jaxprs(inner)


def test_every_process_crosses_the_shifts_in_one_order():
    """Sent in the tick that made it, each shift crosses in a cond (the stages sending
    then); each such cond reads what the one before it made, so every process runs the
    permutes in one order (XLA's CPU runtime does not order collectives inside two
    independent conds, and gloo pairs a permute's messages by arrival)."""
    step, args = get("mlp", "tiny")
    plan = hs.parallelize(step, cluster=two_islands(), pipeline=True, pipeline_runtime="ticks", time_limit=1).plan(*args)
    plan = replace(plan, pipeline={**plan.pipeline, "delay": 0})
    low = hs.parallelize(step, cluster=two_islands(), plan=plan).lowered(*args)
    leaves = jax.tree.leaves(args)
    top = jax.make_jaxpr(low._fn)(*low._arguments(leaves)).jaxpr

    def permutes(j):
        return any(e.primitive.name == "ppermute" for x in _jaxprs(j) for e in x.eqns)

    chained = 0
    for j in _jaxprs(top):
        conds = [e for e in j.eqns if e.primitive.name == "cond" and any(
            permutes(b.jaxpr) for b in e.params["branches"])]
        made = {v: e for e in j.eqns for v in e.outvars}

        def reads(e, seen):  # every eqn whose outputs e reads, transitively
            for v in e.invars:
                src = made.get(v) if not hasattr(v, "val") else None
                if src is not None and id(src) not in seen:
                    seen[id(src)] = src
                    reads(src, seen)
            return seen
        for a, b in zip(conds, conds[1:]):
            assert id(a) in reads(b, {}), "two shifts' permutes in independent conds"
            chained += 1
    assert chained >= 1  # the forward's shift and the backward's, in every tick


@pytest.mark.slow
def test_only_the_stages_sending_cross_a_link():
    """Sent in the tick that made it: per tick and shift, the program's `ppermute` pairs
    are the stages sending then (a tick where none does moves nothing)."""
    step, args = get("mlp", "tiny")
    plan = hs.parallelize(step, cluster=two_islands(), pipeline=True, pipeline_runtime="ticks", time_limit=1).plan(*args)
    plan = replace(plan, pipeline={**plan.pipeline, "delay": 0})
    par = hs.parallelize(step, cluster=two_islands(), plan=plan)
    low = par.lowered(*args)
    table = plan.pipeline["table"]
    order = sorted({r[0] for r in table})
    seen_empty = False
    for d in sorted(low.wire_sizes):
        index, patterns, _ = low._senders(d)
        for i, t in enumerate(order):
            want = sorted((s, s + d) for tt, s, m, ph in table if tt == t
                          and s in low.chan_pack.get((d, ph), {}))
            assert list(patterns[index[i]]) == want
            seen_empty |= not want
    assert seen_empty  # e.g. the first tick: no cotangent comes back yet


def _subs(eqn):
    """The jaxprs inside an eqn (a call's, a loop's, a switch's branches, shard_map's)."""
    out = []
    for v in eqn.params.values():
        for j in v if isinstance(v, (tuple, list)) else (v,):
            j = getattr(j, "jaxpr", j)
            if hasattr(j, "eqns"):
                out.append(j)
    return out


def _holds(eqn, name) -> bool:
    return eqn.primitive.name == name or any(_holds(e, name) for j in _subs(eqn) for e in j.eqns)


def _tick_loop(jaxpr):
    """The body of the loop over ticks (a `fori_loop`: a scan or a while loop, holding the
    work's switch)."""
    for eqn in jaxpr.eqns:
        body = {"scan": "jaxpr", "while": "body_jaxpr"}.get(eqn.primitive.name)
        if body and any(_holds(e, "cond") for e in eqn.params[body].jaxpr.eqns):
            return eqn.params[body].jaxpr
        for j in _subs(eqn):
            got = _tick_loop(j)
            if got is not None:
                return got
    return None


def test_a_message_crosses_beside_the_next_ticks_work():
    """Sent a tick late (`delay` 1): in the tick
    loop's body every `ppermute` sits outside the work's switch and reads nothing the
    switch makes, so an asynchronous collective can run under the work, and the two
    stages' forwards and backwards cross in one, both ways at once; sent in its own
    tick (`delay` 0), the crossings sit in a switch after the work. Both equal `jit`."""

    from test_lowering import compare
    step, args = get("mlp", "tiny")
    plan = hs.parallelize(step, cluster=two_islands("1Gbps"), pipeline=True, pipeline_runtime="ticks",
                          time_limit=1).plan(*args)
    want = jax.jit(step)(*args)
    lagged = [list(r) for r in late_ticks(plan.schedule())]
    for delay in (1, 0):
        again = replace(plan, pipeline={**plan.pipeline, "delay": delay, "table": lagged})
        assert ("cross during the next tick's work" in again.summary()) == bool(delay)
        par = hs.parallelize(step, cluster=two_islands("1Gbps"), plan=again)
        compare(hs.gather(par(*args)), want, rtol=2e-3)
        low = par.lowered(*args)
        fn, seen = low._fn, {}
        low._fn = lambda *xs: seen.setdefault("args", xs) and fn(*xs)
        try:
            par(*args)
        finally:
            low._fn = fn
        body = _tick_loop(jax.make_jaxpr(fn)(*seen["args"]).jaxpr)
        made = {id(v): e for e in body.eqns for v in e.outvars}

        def upstream(e, seen_ids):
            for v in e.invars:
                p = made.get(id(v))
                if p is not None and id(p) not in seen_ids:
                    seen_ids.add(id(p))
                    yield p
                    yield from upstream(p, seen_ids)
        sends = [e for e in body.eqns if e.primitive.name == "ppermute"]
        assert bool(sends) == bool(delay)
        # two stages: the forwards' crossing and the backwards' in one permute, both ways
        assert all(sorted(e.params["perm"]) == [(0, 1), (1, 0)] for e in sends)
        for e in sends:
            assert not any(_holds(p, "cond") for p in upstream(e, set()))
        # nor does the work wait for a crossing of its own tick
        works = [e for e in body.eqns if e.primitive.name == "cond"
                 and not _holds(e, "ppermute") and _holds(e, "dot_general")]
        assert works
        for e in works:
            assert not any(_holds(p, "ppermute") for p in upstream(e, set()))


def test_islands_are_cut_into_equal_stages():
    parts, of = stage_parts(hs.Cluster.load("three-islands"))
    assert [len(p) for p in parts] == [8, 8, 8, 8] and of == [0, 1, 2, 2]
    parts, of = stage_parts(hs.Cluster.load("hap-islands"))
    assert [len(p) for p in parts] == [16] * 4 and of == [0, 1, 1, 1]


def test_auto_keeps_spmd_where_a_pipeline_prices_worse():
    """`pipeline="auto"` on a tiny GPT over a slow inter-island link: replicating the step
    on every device costs no communication at all and beats any pipeline, so SPMD is
    kept and reported as the pipeline=False plan; `pipeline=True` still gives (and
    reports) the best pipeline, slower than SPMD."""
    step, args = get("gpt", "tiny")
    auto = hs.parallelize(step, cluster=two_islands("0.1Gbps"), time_limit=1).plan(*args)
    assert auto.stages == [] and "SPMD prices better" in auto.solver["pipeline"]
    spmd = hs.parallelize(step, cluster=two_islands("0.1Gbps"), time_limit=1,
                          pipeline=False).plan(*args)
    assert auto.predicted_step_time == pytest.approx(spmd.predicted_step_time, rel=0.05)
    forced = hs.parallelize(step, cluster=two_islands("0.1Gbps"), time_limit=1,
                            pipeline=True, pipeline_runtime="ticks").plan(*args)
    assert len(forced.stages) == 2 and forced.chosen == "pipeline"
    assert forced.predicted_step_time >= auto.predicted_step_time
    assert forced.baselines["SPMD"] == pytest.approx(spmd.predicted_step_time, rel=0.05)
    assert forced.pipeline["micros"] >= 2 and forced.pipeline["table"]
    assert "pipeline:" in forced.summary() and "pipeline stages" in forced._repr_html_()
    back = hs.Plan.from_json(forced.to_json())
    assert back.stages == forced.stages and back.pipeline == forced.pipeline


@pytest.mark.slow
def test_auto_pipelines_where_it_prices_better():
    """GPT at its paper size over a 0.1 Gbps inter-island link, every device working: the
    pipeline prices better than the best SPMD-only plan and is chosen. Allowed to leave
    devices idle, the planner runs on the A100 island alone: nothing crosses the link."""
    step, args = get("gpt", "paper")
    plan = hs.parallelize(step, cluster=two_islands("0.1Gbps"), time_limit=1,
                          devices="all").plan(*args)
    assert len(plan.stages) == 2 and plan.chosen == "pipeline"
    assert plan.predicted_step_time < plan.baselines["SPMD"]
    auto = hs.parallelize(step, cluster=two_islands("0.1Gbps"), time_limit=1).plan(*args)
    assert auto.devices is not None and not auto.stages
    assert auto.predicted_step_time < plan.predicted_step_time


def test_pipeline_true_on_one_island_says_why():
    step, args = get("mlp", "tiny")
    with pytest.raises(NotPipelineable, match="one island"):
        hs.parallelize(step, cluster="cpu-2-6", pipeline=True, pipeline_runtime="ticks", time_limit=1).plan(*args)


def test_a_pipeline_with_one_working_stage_says_it_is_gradient_accumulation():
    """A pipeline whose other stages hold no ops (the target row's: the V100 stage idle)
    is gradient accumulation on one island; the summary says so, and names idle stages."""
    step, args = get("mlp", "tiny")
    plan = hs.parallelize(step, cluster=two_islands(), pipeline=False, time_limit=1).plan(*args)
    stage = {"island": "a", "from_rank": 0, "rows": [4, 4], "forward": 1e-3, "backward": 2e-3,
             "tail": 0.0, "memory": 2**30, "in_flight": 2, "ops": 7}
    pipe = {"micros": 4, "schedule": "1f1b", "bubble": 0.2, "by_kind": {"1f1b": 1.0}}
    idle = replace(plan, pipeline=pipe, stages=[
        stage, {**stage, "island": "b", "from_rank": 9, "ops": 0}])
    lines = idle.stage_lines()
    assert lines[-1] == ("  in effect:   gradient accumulation on a in 4 microbatches: "
                         "no other stage holds an op")
    assert lines[-2].endswith("holds no ops (its devices idle)")
    assert not lines[-3].endswith("(its devices idle)")
    working = replace(idle, stages=[stage, {**stage, "island": "b", "ops": 3}])
    assert not any("in effect" in x or "holds no ops" in x for x in working.stage_lines())


@pytest.mark.slow  # (~30 s; CI runs it)
def test_one_stage_over_every_device_is_gradient_accumulation():
    """Beside pipelines, the search prices one stage over every device: data parallel at
    FLOP/s-proportional rows in microbatches, the gradients summed over all devices once
    a step (gradient accumulation across the islands). `whole=True` returns the better
    of it and the pipelines; lowered (every device holding rows), it equals `jit` over 3
    steps; `pipeline=True` asks for two stages or more."""
    from hapsynth.synth.opcosts import OpCosts as _Costs
    from hapsynth.synth.pipeline import _cheapest, plan_pipeline
    from hapsynth.synth.pipeplan import as_plan
    from hapsynth.synth.pipeprice import Pricer as _Evaluator
    from hapsynth.synth.stagegroups import stage_groups
    from test_lowering import compare
    step, args = get("gpt", "tiny")
    # batch 32 (16 more rows, the first 16 reversed): 16 rows a microbatch at 2
    args = (*args[:2], *jax.tree.map(lambda x: jnp.concatenate([x, x[::-1]]), args[2:]))
    cluster = two_islands("400Gbps")
    graph, dp, r, n = _regions(step, args, cluster)
    groups, of = stage_groups(cluster)
    assert groups[-1] == tuple(range(8)) and of[-1] == -1
    one = plan_pipeline(graph, cluster, r, dp.tensor_layouts, n, whole="only")
    many = plan_pipeline(graph, cluster, r, dp.tensor_layouts, n, whole=False)
    both = plan_pipeline(graph, cluster, r, dp.tensor_layouts, n)
    assert one.order == (len(groups) - 1,) and one.cuts == () and one.micros > 1
    assert len(many.order) == 2
    assert (both.step, both.order) == min((one.step, one.order), (many.step, many.order))
    # lowered at 2 microbatches of 16 rows, every device holding some
    ev = _Evaluator(graph, cluster, r, n, _Costs(graph, cluster, r, groups, dp.tensor_layouts),
                    dp.tensor_layouts)
    two = _cheapest(ev, [(one.order, (), 2)], ("1f1b",))
    spmd = hs.parallelize(step, cluster=cluster, pipeline=False, time_limit=1).plan(*args)
    plan = as_plan(two, dp, spmd, cluster)
    (stage,) = plan.stages
    assert stage["devices"] == list(range(8)) and stage["island"] == "a+b"
    assert min(stage["rows"]) > 0 and len(set(stage["rows"])) > 1  # the A100s hold more
    assert plan.ratios["A100"] > plan.ratios["V100"] > 0
    assert plan.stage_lines()[-1].startswith(
        "  in effect:   gradient accumulation over every device (a+b)")
    assert hs.Plan.from_json(plan.to_json()) == plan
    assert plan.schedule().makespan == pytest.approx(plan.pipeline["makespan"])
    par = hs.parallelize(step, cluster=cluster, plan=plan)
    got = want = args
    for _ in range(3):
        want = jax.jit(step)(*want[:2], *args[2:])
        got = par(*got[:2], *args[2:])
        compare(hs.gather(got), want, rtol=2e-3)
    asked = hs.parallelize(step, cluster=cluster, pipeline=True, pipeline_runtime="ticks", time_limit=1).plan(*args)
    assert len(asked.stages) == 2


def test_a_stage_is_priced_at_the_whole_rows_its_devices_hold():
    """Rows are split in whole rows by FLOP/s (`rows_of`): with few rows a device, the
    A100s of a stage over both islands take all 8 rows of a microbatch and the V100s
    none, so an A100 is priced at a quarter of them (not at its FLOP/s share, a fifth:
    that priced gpt-medium's gradient accumulation over both islands at 400 Gbps 18%
    fast)."""
    from hapsynth.ir.graph import Cost
    from hapsynth.synth.costmodel import compute_time
    from hapsynth.synth.opcosts import OpCosts as _Costs
    from hapsynth.synth.stagegroups import rows_of, stage_groups
    step, args = get("gpt", "tiny")
    cluster = two_islands()
    graph, dp, r, n = _regions(step, args, cluster)
    groups, _ = stage_groups(cluster)
    costs = _Costs(graph, cluster, r, groups, dp.tensor_layouts)
    whole, M = len(groups) - 1, 2
    assert rows_of(cluster, groups[whole], r.batch // M) == (2, 2, 2, 2, 0, 0, 0, 0)
    assert costs.rows_share(whole, M) == {0: 0.25, 1: 0.0}
    op = max(range(len(graph.ops)), key=lambda i: graph.ops[i].cost.flops
             if r.region[i] == "micro" else -1)
    c = graph.ops[op].cost
    fixed = min(costs.fixed[op], c.bytes)
    a100 = compute_time(Cost(c.flops * 0.25 / M, c.transcendentals * 0.25 / M,
                             (c.bytes - fixed) * 0.25 / M + fixed), cluster.classes[0])
    assert costs.micro(op, whole, M) == pytest.approx(a100)


def _three_steps(step, args, cluster, rtol=2e-3, late=False):
    """3 steps of the pipeline found equal `jit`; `late`: with its messages sent a tick
    late (readers a tick later), whatever the planner chose."""

    from test_lowering import compare

    k = state_arity(step, args)
    par = hs.parallelize(step, cluster=cluster, pipeline=True, pipeline_runtime="ticks", time_limit=1)
    plan = par.plan(*args)
    if late:
        plan = replace(plan, pipeline={**plan.pipeline, "delay": 1, "table": [
            list(r) for r in late_ticks(plan.schedule())]})
        par = hs.parallelize(step, cluster=cluster, plan=plan)
    ref = jax.jit(step)
    got = want = args
    low = par.lowered(*args)
    for _ in range(3):
        before = list(low._scratch or ())
        want = ref(*want[:k], *args[k:])
        got = par(*got[:k], *args[k:])
        compare(hs.gather(got), want, rtol=rtol)
        # what forwards keep sits in a pool of buffers kept between steps (donated, so
        # no step fills them with zeros), each written again once its backwards ran
        assert all(x.is_deleted() for x in before)
        assert len(low._scratch) == len(low.keep_sizes)  # per dtype: each device's slots
        assert all(x.shape[0] == low.mesh.devices.size * low.keep_buffers
                   for x in low._scratch)
    keeping = {row[0] for row in plan.pipeline["table"] if row[3] == "F" and low.keeps[row[1]]}
    assert 0 < low.keep_buffers <= len(keeping)
    assert all(isinstance(x, hs.Staged) for x in jax.tree.leaves(
        got[:k], is_leaf=lambda v: isinstance(v, hs.Staged)))
    # an activation read by both phases of a later stage crosses once (kept there)
    sends = par.lowered(*args).sends
    for dests in sends.values():
        for (b, ph), xs in dests.items():
            assert ph == "B" or not xs & dests.get((b, "B"), set())
    return plan, got


@pytest.mark.parametrize("model,layout", [
    ("mlp", "2x4"),  # (late sends: tests below)
    pytest.param("bert", "4x2", marks=pytest.mark.slow),
    pytest.param("bert", "4x2 late", marks=pytest.mark.slow),
    pytest.param("gpt", "2x4", marks=pytest.mark.slow),
    pytest.param("gpt", "4x2", marks=pytest.mark.slow),
    pytest.param("gpt", "4x2 late", marks=pytest.mark.slow),
    pytest.param("bert", "2x4", marks=pytest.mark.slow)])
def test_pipelined_zoo_equals_one_device(model, layout):
    """3 steps of the pipelined program equal `jax.jit` on one device; 2 stages of 4
    devices, or 4 stages with uneven layer counts and uneven rows inside a stage; "late":
    messages sent during the next tick's work."""
    step, args = get(model, "tiny")
    cluster = two_islands() if layout == "2x4" else four_islands()
    plan, got = _three_steps(step, args, cluster, late=layout.endswith("late"))
    layout = layout.split()[0]
    assert len(plan.stages) == (2 if layout == "2x4" else 4)
    if layout == "4x2":
        assert any(len(set(st["rows"])) > 1 for st in plan.stages)  # uneven inside a stage
        owned = [sum(x.size for x in jax.tree.leaves(got[:2], is_leaf=lambda v: isinstance(
            v, hs.Staged)) if x.stage == s) for s in range(4)]
        assert len(set(owned)) > 1 and min(owned) > 0  # uneven stages, none empty


@pytest.mark.slow
@pytest.mark.parametrize("name", ["linen_transformer", "nnx_gpt", "unrolled_gpt", "bf16_mixed",
                                  "nnx_gpt late"])
def test_pipelined_outside_models_equal_one_device(name):
    """Train steps written elsewhere (dropout rng, a real-token count, tied embeddings);
    "late": over four stages, messages sent during the next tick's work."""
    from test_elsewhere import get as elsewhere
    late = name.endswith("late")
    step, args = elsewhere(name.split()[0])
    plan, _ = _three_steps(step, args, four_islands() if late else two_islands(),
                           rtol=2e-2 if name == "bf16_mixed" else 2e-3, late=late)
    assert len(plan.stages) == (4 if late else 2)


@pytest.mark.slow  # ~30 s and ~15 s
@pytest.mark.parametrize("layout", ["4x2", "2x4"])
def test_pipelined_scan_over_layers_equals_one_device(layout):
    """The scan-over-layers GPT, written out layer by layer: its stacked parameters and
    Adam moments come back as `StagedRows`, each layer's rows on the stage holding that
    layer; 4 stages take unequal parts of the layers (uneven rows inside one)."""
    from test_elsewhere import get as elsewhere
    step, args = elsewhere("scan_gpt")
    cluster = four_islands() if layout == "4x2" else two_islands()
    plan, got = _three_steps(step, args, cluster)
    assert plan.pipeline["unrolled"] == len(jax.tree.leaves(args[:2]))
    rows = [x for x in jax.tree.leaves(got[:2], is_leaf=lambda v: isinstance(v, hs.Staged))
            if isinstance(x, hs.StagedRows)]
    assert len(rows) == 3 * 12  # 12 layer-stacked parameters, each with two Adam moments
    again = hs.Plan.from_json(plan.to_json())  # a saved plan re-makes the same program
    assert hs.parallelize(step, cluster=cluster, plan=again).plan(*args) is again
    par = hs.parallelize(step, cluster=cluster, plan=plan)
    stored = par.shard(*args)  # shard then gather: exactly what was given, rows restacked
    assert isinstance(stored[0]["layers"]["attn"]["w_qkv"], hs.StagedRows)
    for a, b in zip(jax.tree.leaves(args), jax.tree.leaves(hs.gather(stored))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if layout == "4x2":
        layer_stages = {s for x in rows for s in x.stages}
        assert len(layer_stages) >= 2  # the layers spread over stages, not held by one
        assert any(len(set(st["rows"])) > 1 for st in plan.stages)


@pytest.mark.slow  # the harness's knob (~13 s): `hapsynth bench pipeline` relies on it
def test_a_branch_hook_knows_each_device_by_its_number():
    """A measurement hook slows devices by their number in the cluster; the (stage,
    data) mesh orders them by stage, so with the second island's devices as the first
    stage the mesh place and the device number differ: the hook must get the number."""

    from hapsynth.lower.devices import local_devices
    from hapsynth.lower.pipeline import Pipelined

    step, args = get("mlp", "tiny")
    cluster = two_islands()
    par = hs.parallelize(step, cluster=cluster, pipeline=True, pipeline_runtime="ticks", time_limit=1)
    plan = par.plan(*args)
    a, b = plan.stages
    swapped = replace(plan, stages=[{**a, "devices": b["devices"]}, {**b, "devices": a["devices"]}])
    seen = set()

    class Where:
        def inputs(self, mesh):
            return ()

        def wrap(self, branch, entry, extra, index=None):
            def wrapped(*ops):
                jax.debug.callback(lambda i, s, d: seen.add((int(i), int(s), int(d))),
                                   index, jax.lax.axis_index("stage"), jax.lax.axis_index("data"))
                return branch(*ops)
            return wrapped

    low = Pipelined(par._programs[next(iter(par._programs))], swapped, local_devices(cluster),
                    branch_hook=Where())
    from test_lowering import compare
    compare(hs.gather(low(*args)), jax.jit(step)(*args), rtol=2e-3)
    assert {(s, d) for _, s, d in seen} == {(s, d) for s in range(2) for d in range(4)}
    assert all(i == swapped.stages[s]["devices"][d] for i, s, d in seen)
    assert any(i != s * 4 + d for i, s, d in seen)


def test_pipelined_state_round_trips_through_gather():
    """State fed back as `Staged` leaves, gathered, or given as arrays: the same step;
    `shard` then `gather` gives back exactly what was given."""
    step, args = get("mlp", "tiny")
    par = hs.parallelize(step, cluster=two_islands(), pipeline=True, pipeline_runtime="ticks", time_limit=1)
    out = par(*args)
    again = par(*out[:2], args[2])
    whole = par(*hs.gather(out[:2]), args[2])
    for a, b in zip(jax.tree.leaves(hs.gather(again)), jax.tree.leaves(hs.gather(whole))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    stored = par.shard(*args)
    assert all(isinstance(x, hs.Staged) for x in jax.tree.leaves(
        stored[:2], is_leaf=lambda v: isinstance(v, hs.Staged)))
    for a, b in zip(jax.tree.leaves(args), jax.tree.leaves(hs.gather(stored))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the batch read through `load` (as a process of a multi-host run would) runs the same
    leaves = {jax.tree_util.keystr(p): np.asarray(x)
              for p, x in jax.tree_util.tree_flatten_with_path(args)[0]}
    reads = []

    def load(path, dim, start, stop):
        reads.append((path, dim, start, stop))
        return leaves[path][start:stop]
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args[2])
    loaded = par.load(load, *args[:2], spec)
    assert sorted(reads) == sorted((p, 0, 0, len(v)) for p, v in leaves.items()
                                   if p.startswith("[2]"))
    for a, b in zip(jax.tree.leaves(hs.gather(par(*loaded))), jax.tree.leaves(hs.gather(out))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- steps written by hand: what a pipeline must carry besides a loss -------------------

def _mlp(sizes=(16, 32, 32, 32, 4), seed=0):
    ks = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    return {f"l{i}": {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros((b,))}
            for i, (k, a, b) in enumerate(zip(ks, sizes[:-1], sizes[1:]))}


def _forward(p, x, skip=False):
    first = None
    for i in range(len(p)):
        x = x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
        if i < len(p) - 1:
            x = jnp.tanh(x)
            first = x if first is None else first
    return x + (first[:, :x.shape[1]] if skip else 0.0)


def _batch(n=32, d=16, c=4):
    kx, ky = jax.random.split(jax.random.key(1))
    return jax.random.normal(kx, (n, d)), jax.random.randint(ky, (n,), 0, c)


def _hand_step(extras=(), skip=False):
    tx = optax.adam(1e-2)

    def step(p, o, x, y):
        def loss_fn(p):
            logits = _forward(p, x, skip)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits
        (loss, logits), g = jax.value_and_grad(loss_fn, has_aux=True)(p)
        u, o = tx.update(g, o, p)
        new = optax.apply_updates(p, u)
        aux = {"loss": loss}
        if "grad_norm" in extras:  # made from the gradients: not part of the forward pass
            aux["grad_norm"] = jnp.sqrt(sum(jnp.sum(v ** 2) for v in jax.tree.leaves(g)))
        if "weights" in extras:    # made from state alone, on the stage storing it
            aux["w0"] = jnp.sum(p["l0"]["w"] ** 2)
            aux["b_last"] = p[f"l{len(p) - 1}"]["b"]
        if "correct" in extras:    # an integer count over the batch
            aux["correct"] = jnp.sum(jnp.argmax(logits, -1) == y)
        return new, o, aux

    p = _mlp()
    return step, (p, tx.init(p), *_batch())


@pytest.mark.slow
def test_outputs_besides_the_loss_and_long_skips():
    """A gradient norm, values of the state, an integer count; a skip connection across
    four stages: all equal to one device (each of these once broke the pipeline)."""
    step, args = _hand_step(("grad_norm", "weights", "correct"))
    _, _, r, _ = _regions(step, args, two_islands())
    assert 0 < sum(r.forward) < r.region.count("micro")  # a backward pass remains to cut
    _three_steps(step, args, two_islands("0.1Gbps"))
    step, args = _hand_step(skip=True)
    plan, _ = _three_steps(step, args, four_islands())
    assert len(plan.stages) == 4
    plan, _ = _three_steps(step, args, four_islands(), late=True)  # skips sent a tick late too
    assert plan.pipeline["delay"] == 1


def test_fed_back_state_is_read_leaf_by_leaf():
    """`Staged` leaves of two different steps fed back together are each read from their
    own step; donating only some of the state donates nothing the caller still holds."""
    step, args = _hand_step()
    par = hs.parallelize(step, cluster=two_islands(), pipeline=True, pipeline_runtime="ticks", time_limit=1,
                         donate_argnums=(0,))
    ref = jax.jit(step)
    one = par(*args)
    two = par(*one[:2], *args[2:])
    mixed = par(two[0], one[1], *args[2:])   # the optimizer state of step 1
    want = ref(*ref(*ref(*args)[:2], *args[2:])[:1], ref(*args)[1], *args[2:])
    from test_lowering import compare
    compare(hs.gather(mixed[:2]), want[:2])
    hs.gather(one[1])  # not donated: still readable


def test_no_fitting_plan_names_the_class_on_one_island():
    """The default `pipeline="auto"` on one island: SPMD's memory error, as before."""
    step, args = get("mlp", "tiny")
    tiny = hs.Cluster.simulated([("CPU", 8, {"name": "tiny-mem", "memory": "64KiB"})])
    with pytest.raises(hs.InfeasibleMemory, match="tiny-mem"):
        hs.parallelize(step, cluster=tiny, time_limit=1).plan(*args)


def test_ticks_are_priced_as_the_loop_runs_them():
    """Sent in the tick that made it (XLA's CPU runtime, which runs ops one after
    another): a tick lasts its longest work plus its longest transfer forward and then
    back (the lowering orders the two shifts). Sent a tick late
    beside the next tick's work (GPUs' asynchronous collectives): every tick lasts its
    longest work or the carried crossing (every pair; the two stages' forwards and
    backwards in one permute, both ways at once), whichever is longer, and readers sit a tick later; GPU clusters get the cheaper of the
    two. Either way the step adds the parameter copies before the loop and the
    once-per-step work after it (the tied embedding's copy and gradient here)."""
    from hapsynth.synth.lockstep import lockstep
    from hapsynth.synth.opcosts import OpCosts as _Costs
    from hapsynth.synth.pipeprice import Pricer as _Evaluator
    step, args = get("gpt", "tiny")
    cluster = two_islands("1Gbps")
    assert all(c.type != "CPU" for c in cluster.classes)
    graph, dp, r, n = _regions(step, args, cluster)
    parts, _ = stage_parts(cluster)
    cut = (r.cut_points()[len(r.cut_points()) // 2],)
    costs = _Costs(graph, cluster, r, parts, dp.tensor_layouts)
    ev = _Evaluator(graph, cluster, r, n, costs, dp.tensor_layouts)
    assert ev.overlaps
    p = ev.price((0, 1), cut, 4, "1f1b")
    ev.overlaps = False  # as on CPUs
    p0 = ev.price((0, 1), cut, 4, "1f1b")
    assert p0.delay == 0 and p0.head > 0 and max(p0.tail) > 0
    assert p0.send[0] > 0 and p0.send_back[0] > 0
    want = 0.0
    for t in sorted({row[0] for row in p0.schedule.ticks}):
        work = [(s, ph) for tt, s, _, ph in p0.schedule.ticks if tt == t]
        keys = {(s, m, ph) for tt, s, m, ph in p0.schedule.ticks if tt == t}
        starts = [x.start for x in p0.schedule.slots if (x.stage, x.micro, x.phase) in keys]
        assert len(starts) == len(work) and starts == pytest.approx([want] * len(work))
        want += max(p0.forward[s] if ph == "F" else p0.backward[s] for s, ph in work)
        # the forwards' crossing, then the backwards' (one shift after the other)
        want += max([0.0] + [p0.send[s] for s, ph in work if ph == "F" and s == 0])
        want += max([0.0] + [p0.send_back[0] for s, ph in work if ph == "B" and s == 1])
    assert p0.schedule.makespan == pytest.approx(want)
    assert p0.step == pytest.approx(p0.head + p0.schedule.makespan + max(p0.tail))
    first = min((x for x in p0.schedule.slots if x.stage == 1), key=lambda x: x.start)
    assert first.start == pytest.approx(p0.forward[0] + p0.send[0])  # the copy came before

    wire = max(p.send[0], p.send_back[0])
    late = lockstep(schedule("1f1b", p.forward, p.backward, 4, p.send, p.send_back),
                    p.forward, p.backward, p.send, p.send_back, wire)
    at = {(s, m, ph): t for t, s, m, ph in late.ticks}
    for (s, m, ph), t in at.items():
        if ph == "F" and s == 1:
            assert t >= at[(0, m, "F")] + 2
        if ph == "B" and s == 0:
            assert t >= at[(1, m, "B")] + 2
    want = sum(max([wire] + [p.forward[s] if ph == "F" else p.backward[s]
                             for tt, s, _, ph in late.ticks if tt == t])
               for t in range(max(at.values()) + 1))
    assert late.makespan == pytest.approx(want)
    assert p.delay == (late.makespan < p0.schedule.makespan)
    assert p.step == pytest.approx(p.head + min(late.makespan, p0.schedule.makespan) + max(p.tail))
    # with the microbatches in flight that fill the longer round trip, sending late pays
    on_cpu = ev.price((0, 1), cut, 8, "hetero-1f1b")
    ev.overlaps = True
    q = ev.price((0, 1), cut, 8, "hetero-1f1b")
    assert q.delay == 1 and on_cpu.delay == 0 and q.step < on_cpu.step
    both_ways = lockstep(q.schedule, q.forward, q.backward, q.send, q.send_back,
                         max(q.send[0], q.send_back[0]))
    one_way_then_back = lockstep(q.schedule, q.forward, q.backward, q.send, q.send_back,
                                 q.send[0] + q.send_back[0])
    assert q.schedule.makespan == pytest.approx(both_ways.makespan)
    assert q.schedule.makespan < one_way_then_back.makespan


def test_free_running_pricing_drops_only_the_lock_step():
    """`free_running` prices each stage's next work as soon as it is ready (what the lock
    step of the lowering's ticks costs, for comparison): at the same cut and order never
    slower, the copy of the tied embedding still delaying the stage reading it."""
    from hapsynth.synth.opcosts import OpCosts as _Costs
    from hapsynth.synth.pipeprice import Pricer as _Evaluator
    step, args = get("gpt", "tiny")
    cluster = two_islands("1Gbps")
    graph, dp, r, n = _regions(step, args, cluster)
    parts, _ = stage_parts(cluster)
    cut = (r.cut_points()[len(r.cut_points()) // 2],)
    costs = _Costs(graph, cluster, r, parts, dp.tensor_layouts)
    ticked = _Evaluator(graph, cluster, r, n, costs, dp.tensor_layouts).price((0, 1), cut, 4, "1f1b")
    free = _Evaluator(graph, cluster, r, n, costs, dp.tensor_layouts,
                      free_running=True).price((0, 1), cut, 4, "1f1b")
    assert ticked.schedule.ticks and not free.schedule.ticks
    assert free.head == ticked.head > 0
    first = {s: min((x for x in free.schedule.slots if x.stage == s), key=lambda x: x.start)
             for s in (0, 1)}  # the copy holds the link: the first activation waits for it
    assert first[1].start == pytest.approx(max(first[0].end, free.head) + free.send[0])
    assert first[0].end < free.head
    assert free.schedule.makespan <= ticked.schedule.makespan + 1e-12
    assert free.step <= ticked.step + 1e-12
    assert (free.forward, free.backward, free.send) == (ticked.forward, ticked.backward, ticked.send)


def test_pricing_counts_each_crossing_once():
    """A tensor read by several ops of the next stage is priced as one transfer, the
    size of what the lowering sends."""
    from hapsynth.synth.opcosts import OpCosts as _Costs
    from hapsynth.synth.pipeprice import Pricer as _Evaluator
    step, args = get("gpt", "tiny")
    cluster = two_islands()
    graph, dp, r, n = _regions(step, args, cluster)
    parts, _ = stage_parts(cluster)
    ev = _Evaluator(graph, cluster, r, n, _Costs(graph, cluster, r, parts, dp.tensor_layouts), dp.tensor_layouts)
    cut = (r.cut_points()[len(r.cut_points()) // 2],)
    sc = ev.scan((0, 1), cut)
    st = [stage_of(x, cut) if x >= 0 else -1 for x in r.rank]
    producer = {t: op.id for op in graph.ops for t in op.outputs}
    crossing = {(t, "B" if not r.forward[op.id] else "F") for op in graph.ops
                if r.region[op.id] == "micro" and st[op.id] == 0
                for t in op.inputs if t in producer and r.region[producer[t]] == "micro"
                and st[producer[t]] == 1}
    want = sum(graph.tensors[t].nbytes for t, ph in crossing
               if not r.forward[producer[t]])
    assert sc.send[1, 0, 1] == want


def _residual_for_backward_alone():
    """An MLP whose later layers' backward reads the first layer's output through a
    custom VJP's residual: a value crossing stages that only a backward reads."""
    @jax.custom_vjp
    def act(x, first):
        return jnp.tanh(x)

    def act_fwd(x, first):
        y = jnp.tanh(x)
        return y, (y, first)

    def act_bwd(res, ct):
        y, first = res
        return ct * (1 - y * y) * first, jnp.zeros_like(first)

    act.defvjp(act_fwd, act_bwd)

    def forward(p, x):
        first = None
        for i in range(len(p)):
            x = x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
            if i < len(p) - 1:
                x = jnp.tanh(x) if first is None else act(x, first)
                first = x if first is None else first
        return x

    tx = optax.adam(1e-2)

    def step(p, o, x, y):
        loss, g = jax.value_and_grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
            forward(p, x), y).mean())(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, {"loss": loss}

    p = _mlp()
    return step, (p, tx.init(p), *_batch())


@pytest.mark.parametrize("which", ["gpt", "skips", "backward alone"])
def test_what_crosses_a_cut_is_priced_as_the_lowering_sends_and_keeps_it(which):
    """Per pair of stages and direction, the pricing sends the bytes the lowering sends,
    each stage keeps what the lowering keeps, and a message waits for the phases that
    read it there. The activation entering a stage is read by its forward and again by
    its backward (a layer norm's input): the lowering sends it once and the forward keeps
    it (it was priced crossing twice); a value only a backward reads waits in the
    mailbox for that backward (it was priced read by the forward)."""
    import itertools
    import random

    from hapsynth.lower.devices import local_devices
    from hapsynth.lower.pipeline import Pipelined
    from hapsynth.synth.opcosts import OpCosts as _Costs
    from hapsynth.synth.pipeprice import Pricer as _Evaluator

    step, args, cluster = {
        "gpt": lambda: (*get("gpt", "tiny"), two_islands()),
        "skips": lambda: (*_hand_step(skip=True), four_islands()),
        "backward alone": lambda: (*_residual_for_backward_alone(), two_islands()),
    }[which]()
    par = hs.parallelize(step, cluster=cluster, pipeline=True, pipeline_runtime="ticks", time_limit=1)
    plan = par.plan(*args)
    prog = par._programs[next(iter(par._programs))]
    graph, dp, r, n = _regions(step, args, cluster)
    parts, _ = stage_parts(cluster)
    ev = _Evaluator(graph, cluster, r, n, _Costs(graph, cluster, r, parts, dp.tensor_layouts),
                    dp.tensor_layouts)
    nbytes = lambda xs: sum(graph.tensors[x].nbytes for x in xs)
    S = len(plan.stages)
    combos = list(itertools.combinations([int(c) for c in r.cut_points()], S - 1))
    random.Random(0).shuffle(combos)
    seen = {"both": 0, "backward alone": 0}
    for cuts in combos[:12] if S > 2 else combos:
        low = Pipelined(prog, replace(plan, pipeline={**plan.pipeline, "cuts": list(cuts)}),
                        local_devices(cluster))
        sc = ev.scan(tuple(range(S)), cuts)
        for a, b in itertools.permutations(range(S), 2):
            for way, ph in enumerate("FB"):
                dests = {phb: xs for (bb, phb), xs in low.sends.get((a, ph), {}).items()
                         if bb == b}
                sent = set().union(*dests.values())
                assert sc.send[a, b, way] == nbytes(sent), (cuts, a, b, ph)
                if sent:
                    assert sc.readers[(a, b, way)] == sorted(dests), (cuts, a, b, ph)
                    seen["backward alone"] += ph == "F" and "B" in dests
        for s in range(S):
            assert sc.resid[s] == nbytes(low.keeps[s]), (cuts, s)
            own = set(low.reads.get((s, "B"), {}).get((s, "F"), ()))
            seen["both"] += bool(set(low.keeps[s]) - own)
    # some cut sends a value both phases read (gpt), or one a backward reads alone
    assert seen["backward alone" if which == "backward alone" else "both"], seen


def test_a_group_of_devices_keeps_the_values_of_all_its_stages():
    """In a V's lock step the group running two stages runs both in a tick, each keeping
    its values in a pool of its own: the priced pools hold, at every tick, every
    microbatch kept on the group and not yet back (they were sized as one stage's)."""
    from hapsynth.synth.lockstep import lockstep
    from hapsynth.synth.pipememory import buffer_bytes, messages
    from hapsynth.synth.slots import tick_tables

    place, fwd, bwd = (0, 1, 0), [1.0, 2.0, 1.0], [2.0, 4.0, 2.0]
    for kind in ("gpipe", "1f1b"):
        sch = lockstep(schedule(kind, fwd, bwd, 12, place=place), fwd, bwd, [0.1] * 2, [0.1] * 2)
        rows = ticks(sch)
        f = {(s, m): t for t, s, m, ph in rows if ph == "F"}
        b = {(s, m): t for t, s, m, ph in rows if ph == "B"}
        live = max(sum(1 for k in f if place[k[0]] == 0 and f[k] <= t <= b[k])
                   for t in range(max(r[0] for r in rows) + 1))
        pool = buffer_bytes(sch, 0, messages(np.zeros((3, 3, 2)), [1.0] * 3, [(1,)] * 3,
                                             [(0,), (1,), (0,)], {}), [1.0] * 3, [[0, 2], [1]])
        assert pool >= live, (kind, pool, live)
        if kind == "gpipe":  # a pool sized for one stage's keeps would not hold them
            assert live > tick_tables(rows, 3, [True] * 3, {}).keep_slots + 1


def test_sums_apart_put_each_value_in_a_buffer_of_its_own():
    """`Packing(apart=True)`: per dtype, each stage's largest value in the first buffer,
    the next in the second; `bundle` sizes each buffer for the stage needing most; a
    value packed and unpacked comes back exactly, the rest of its buffer zeros."""
    from hapsynth.lower.packing import Packing, bundle
    a = Packing([("b", (3,), "float32"), ("w", (4, 5), "float32"), ("n", (2,), "int32")],
                apart=True)
    b = Packing([("v", (7,), "float32"), ("u", (2, 2), "float32")], apart=True)
    assert a.slots == {"w": ("float32/0", 0, (4, 5)), "b": ("float32/1", 0, (3,)),
                       "n": ("int32/0", 0, (2,))}
    assert b.slots == {"v": ("float32/0", 0, (7,)), "u": ("float32/1", 0, (2, 2))}
    sizes = bundle([a, b])
    assert sizes == {"float32/0": 20, "float32/1": 4, "int32/0": 2}
    vals = {"w": jnp.arange(20.0).reshape(4, 5), "b": jnp.asarray([1.0, 2.0, 3.0]),
            "n": jnp.asarray([7, 8], jnp.int32)}
    bufs = a.pack(vals, sizes)
    assert [x.dtype for x in bufs] == [jnp.float32, jnp.float32, jnp.int32]
    assert [x.shape for x in bufs] == [(20,), (4,), (2,)]
    assert float(bufs[1][3]) == 0.0
    back = a.unpack(bufs, tuple(sizes))
    for k, v in vals.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k], v)


def test_bf16_gradients_are_summed_over_microbatches_in_float32():
    """Mixed precision: each microbatch's bf16 gradients are added into float32 sums (a
    bf16 running sum rounds at every microbatch, where one step on one device rounds
    once), summed over the stage's devices in float32, cast back once for the optimizer;
    the pricing counts those float32 buffers. The step equals `jit` on one device."""
    from hapsynth.synth.opcosts import OpCosts as _Costs
    from hapsynth.synth.pipeprice import Pricer as _Evaluator

    def step(params, x):
        def loss(p):
            h = jnp.tanh(x.astype(jnp.bfloat16) @ p["w1"].astype(jnp.bfloat16))
            return jnp.sum((h @ p["w2"].astype(jnp.bfloat16)).astype(jnp.float32) ** 2)
        value, g = jax.value_and_grad(loss)(params)
        # (the bf16 gradient returned too: its sum is cast back once summed)
        return (jax.tree.map(lambda p, g: p - 1e-3 * g.astype(jnp.float32), params, g),
                (value, g["w2"].astype(jnp.bfloat16)))

    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.normal(size=(16, 64)), jnp.float32) * 0.3,
              "w2": jnp.asarray(rng.normal(size=(64, 8)), jnp.float32) * 0.3}
    args = (params, jnp.asarray(rng.normal(size=(32, 16)), jnp.float32))
    cluster = two_islands()
    par = hs.parallelize(step, cluster=cluster, pipeline=True, pipeline_runtime="ticks", time_limit=1)
    plan = par.plan(*args)
    low = par.lowered(*args)
    assert plan.pipeline["micros"] > 1
    made = {str(low.prog.avals[t].dtype) for ps in low.acc_packing.values() for p in ps
            for t in p.slots}
    assert "bfloat16" in made  # the backward makes bf16 gradients ...
    assert {dtype_of(k) for k in low.acc_sizes["B"]} == {"float32"}  # ... summed in f32
    from test_lowering import compare
    got, want = par(*args), jax.jit(step)(*args)
    assert got[1][1].dtype == want[1][1].dtype == jnp.bfloat16
    compare(hs.gather(got), want, rtol=2e-2)
    graph, dp, r, n = _regions(step, args, cluster)
    parts, _ = stage_parts(cluster)
    ev = _Evaluator(graph, cluster, r, n, _Costs(graph, cluster, r, parts, dp.tensor_layouts),
                    dp.tensor_layouts)
    order = tuple(next(k for k, d in enumerate(parts) if list(d) == st["devices"])
                  for st in plan.stages)
    sums = ev.scan(order, tuple(plan.pipeline["cuts"])).sums
    assert sums == sum(m * np.dtype(dtype_of(k)).itemsize
                       for ph in "FB" for k, m in low.acc_sizes[ph].items())


def test_the_sums_are_priced_as_the_lowering_allocates_and_adds_them():
    """Each gradient has a buffer of its own (the largest of each stage in the first, and
    so on): the pricing counts the bytes the lowering allocates, and every backward pays
    an add over the buffers it writes into (read twice, written once) at memory speed,
    not over the other stages' (the paper MLP's loss stage was priced 133 ms a backward
    for the 234 MB of gradients it never adds)."""
    from hapsynth.synth.opcosts import OpCosts as _Costs
    from hapsynth.synth.pipeprice import Pricer as _Evaluator
    step, args = get("gpt", "tiny")
    cluster = two_islands()
    plan = hs.parallelize(step, cluster=cluster, pipeline=True, pipeline_runtime="ticks", time_limit=1).plan(*args)
    low = hs.parallelize(step, cluster=cluster, plan=plan).lowered(*args)
    graph, dp, r, n = _regions(step, args, cluster)
    parts, _ = stage_parts(cluster)
    ev = _Evaluator(graph, cluster, r, n, _Costs(graph, cluster, r, parts, dp.tensor_layouts), dp.tensor_layouts)
    order = tuple(next(k for k, d in enumerate(parts) if list(d) == st["devices"])
                  for st in plan.stages)
    cuts = tuple(plan.pipeline["cuts"])
    sc = ev.scan(order, cuts)
    size = {ph: sum(m * np.dtype(dtype_of(k)).itemsize for k, m in low.acc_sizes[ph].items())
            for ph in "FB"}
    assert len(low.acc_sizes["B"]) > 2 and sc.sums == size["F"] + size["B"]
    written = [sum(low.acc_sizes["B"][k] * np.dtype(dtype_of(k)).itemsize
                   for k in {b for b, _, _ in low.acc_packing["B"][s].slots.values()})
               for s in range(len(order))]
    assert sc.added == written and min(written) < max(written) <= size["B"]
    M = plan.pipeline["micros"]
    p = ev.price(order, cuts, M, plan.pipeline["schedule"])
    for s, k in enumerate(order):
        bw = min(cluster.device_class(d).mem_bandwidth for d in parts[k])
        assert p.backward[s] >= 3 * written[s] / bw
    slow = _Evaluator(graph, cluster, r, n, _Costs(graph, cluster, r, parts, dp.tensor_layouts), dp.tensor_layouts)
    slow._scans[order, cuts] = replace(slow.scan(order, cuts), added=[2 * x for x in written])
    q = slow.price(order, cuts, M, plan.pipeline["schedule"])
    for s, k in enumerate(order):
        bw = min(cluster.device_class(d).mem_bandwidth for d in parts[k])
        assert q.backward[s] - p.backward[s] == pytest.approx(3 * written[s] / bw)
        assert q.forward[s] == p.forward[s]


def test_a_stage_keeping_nothing_is_not_capped_by_the_keep_pool():
    """The keep pool's memory caps the microbatches in flight on stages that keep
    something for their backward; a stage keeping nothing takes no slot, whatever its
    depth (capped too, hetero-1F1B could not choose plain 1F1B's depths beside it)."""
    import hapsynth.synth.pipeprice as pipeline
    from hapsynth.synth.opcosts import OpCosts as _Costs
    from hapsynth.synth.pipeprice import Pricer as _Evaluator
    step, args = get("gpt", "tiny")
    cluster = two_islands()
    graph, dp, r, n = _regions(step, args, cluster)
    parts, _ = stage_parts(cluster)
    ev = _Evaluator(graph, cluster, r, n, _Costs(graph, cluster, r, parts, dp.tensor_layouts), dp.tensor_layouts)
    cut = (r.cut_points()[0],)
    sc = ev.scan((0, 1), cut)
    assert sc.resid[0] == 0 < sc.resid[1]
    caps = []
    real = pipeline.schedule

    def spy(*a, memory_cap=None, **kw):
        caps.append(list(memory_cap))
        return real(*a, memory_cap=memory_cap, **kw)

    pipeline.schedule = spy
    try:
        ev.price((0, 1), cut, 4, "hetero-1f1b")
    finally:
        pipeline.schedule = real
    # the stage keeping nothing may hold every microbatch; the other, what memory allows
    assert caps and all(c[0] == 4 and c[1] != 4 for c in caps)


def test_cut_points_are_priced_by_what_crosses_them():
    """The bytes a cut sends one way, for shortlisting cuts where little crosses: the
    backward of a 2-stage cut matches the pricing scan; every cut between sub-blocks
    sends the residual stream alone, and others send more (a block cut inside)."""
    from hapsynth.synth.opcosts import OpCosts as _Costs
    from hapsynth.synth.pipeline import _crossing
    from hapsynth.synth.pipeprice import Pricer as _Evaluator
    step, args = get("gpt", "tiny")
    cluster = two_islands()
    graph, dp, r, n = _regions(step, args, cluster)
    points = r.cut_points()
    got = _crossing(graph, r, points)
    residual = 16 * 16 * 64 * 4  # batch x sequence x width, f32
    inside = got[got > 0]
    assert inside.min() == residual and inside.max() >= 2 * residual
    # before each attention and each MLP (their layer norm's scale), the residual stream
    # alone: the norm runs after the cut, the residual add before it (the fewest bytes)
    layers = 2  # gpt "tiny"
    assert np.sum(got == residual) >= 2 * layers
    parts, _ = stage_parts(cluster)
    ev = _Evaluator(graph, cluster, r, n, _Costs(graph, cluster, r, parts, dp.tensor_layouts), dp.tensor_layouts)
    producer = {t: op.id for op in graph.ops for t in op.outputs}
    for k in (len(points) // 3, len(points) // 2):
        cut = (points[k],)
        st = [stage_of(x, cut) if x >= 0 else -1 for x in r.rank]
        ahead = {t for op in graph.ops if r.region[op.id] == "micro" and st[op.id] == 1
                 for t in op.inputs if t in producer and r.region[producer[t]] == "micro"
                 and st[producer[t]] == 0}  # made before the cut, read after: each once
        back = ev.scan((0, 1), cut).send[1, 0, 1]
        assert got[k] == max(sum(graph.tensors[t].nbytes for t in ahead), back) > 0


def test_a_gradient_rearranged_for_its_parameter_is_summed_as_the_optimizer_reads_it():
    """A weight's gradient transposed (or reshaped) to the weight's shape is rearranged
    per microbatch, on the stage making it, and summed in the shape the optimizer reads:
    read transposed once after the microbatches, the optimizer ran several times slower
    on XLA's CPU backend. The sums and their price follow."""
    from hapsynth.synth.opcosts import OpCosts as _Costs
    from hapsynth.synth.pipeprice import Pricer as _Evaluator
    from hapsynth.synth.stages import LAYOUT_ONLY
    step, args = get("gpt", "tiny")
    cluster = two_islands()
    graph, dp, r, n = _regions(step, args, cluster)
    producer = {t: op.id for op in graph.ops for t in op.outputs}
    moved = [op for op in graph.ops if op.primitive in LAYOUT_ONLY
             and [x for x in op.inputs if x is not None][0] in producer
             and dp.tensor_layouts[op.inputs[0]].kind == "P"
             and r.region[producer[op.inputs[0]]] == "micro"]
    assert sum(op.primitive == "transpose" for op in moved) >= 4
    for op in moved:
        assert r.region[op.id] == "micro" and r.rank[op.id] == r.rank[producer[op.inputs[0]]]
    plan = hs.parallelize(step, cluster=cluster, pipeline=True, pipeline_runtime="ticks", time_limit=1).plan(*args)
    low = hs.parallelize(step, cluster=cluster, plan=plan).lowered(*args)
    summed = {t for ts in low.acc.values() for t in ts}
    later = {x for op in graph.ops if r.region[op.id] == "post" for x in op.inputs}
    for op in moved:  # (the last of a chain, a reshape then a transpose, is summed)
        assert op.inputs[0] not in summed
        assert (op.outputs[0] in summed) == (op.outputs[0] in later)
    parts, _ = stage_parts(cluster)
    costs = _Costs(graph, cluster, r, parts, dp.tensor_layouts)
    ev = _Evaluator(graph, cluster, r, n, costs, dp.tensor_layouts)
    assert ev.partials == summed
    # XLA folds them into the contractions: priced neither time nor an op of their own
    assert r.folded == {op.id for op in moved}
    cut = (r.cut_points()[len(r.cut_points()) // 2],)
    sc = ev.scan((0, 1), cut)
    for s in (0, 1):
        mine = [i for i in range(len(graph.ops)) if r.region[i] == "micro" and r.rank[i] >= 0
                and not r.forward[i] and stage_of(r.rank[i], cut) == s]
        assert sc.nops[s][1] == len(set(mine) - r.folded) < len(mine)
        assert sc.bwd[s] == [i for i in mine if i not in r.folded]
        assert ev.work((0, 1), cut, 2)[1][s] == pytest.approx(
            sum(costs.micro(i, s, 2) for i in mine if i not in r.folded))


def test_large_state_leaves_have_buffers_of_their_own_priced_as_allocated(monkeypatch):
    """`Packing(apart=n)`: arrays of at least n bytes each in a buffer of their own
    (ranked largest first), the rest end to end; a pipelined program stores each stage's
    large state leaves so (read and written whole, not sliced out of one shared buffer
    and written into a copy of it), the pricing counts the bytes it allocates, and the
    state round-trips exactly."""
    import hapsynth.lower.pipeline as lowering
    import hapsynth.synth.cutscan as pricing
    from hapsynth.lower.packing import Packing, bundle
    from hapsynth.synth.opcosts import OpCosts as _Costs
    from hapsynth.synth.pipeprice import Pricer as _Evaluator
    from hapsynth.synth.slots import packed_bytes
    a = Packing([("b", (3,), "float32"), ("w", (4, 5), "float32"), ("v", (6,), "float32"),
                 ("c", (2,), "float32")], apart=24)
    assert a.slots == {"b": ("float32", 0, (3,)), "c": ("float32", 3, (2,)),
                       "w": ("float32/0", 0, (4, 5)), "v": ("float32/1", 0, (6,))}
    b = Packing([("u", (30,), "float32"), ("d", (5,), "float32")], apart=24)
    assert bundle([a, b]) == {"float32": 5, "float32/0": 30, "float32/1": 6}
    assert packed_bytes([[("s", "float32", 12), ("s", "float32", 80), ("s", "float32", 24),
                          ("s", "float32", 8)],
                         [("s", "float32", 120), ("s", "float32", 20)]], 24) == 4 * (5 + 30 + 6)
    least = 16 * 1024  # gpt "tiny": its 64x64 and 64x128 weights apart, the rest together
    monkeypatch.setattr(lowering, "APART_BYTES", least)
    monkeypatch.setattr(pricing, "APART_BYTES", least)
    step, args = get("gpt", "tiny")
    cluster = two_islands()
    plan = hs.parallelize(step, cluster=cluster, pipeline=True, pipeline_runtime="ticks", time_limit=1).plan(*args)
    low = hs.parallelize(step, cluster=cluster, plan=plan).lowered(*args)
    assert "float32" in low.state_sizes and len(low.state_sizes) > 4
    for p in low.state_packing:
        for key, (k, off, shape) in p.slots.items():
            big = np.prod(shape) * np.dtype(dtype_of(k)).itemsize >= least
            assert ("/" in k) == big and (off == 0 or not big)
    graph, dp, r, n = _regions(step, args, cluster)
    parts, _ = stage_parts(cluster)
    ev = _Evaluator(graph, cluster, r, n, _Costs(graph, cluster, r, parts, dp.tensor_layouts), dp.tensor_layouts)
    order = tuple(next(k for k, d in enumerate(parts) if list(d) == st["devices"])
                  for st in plan.stages)
    sc = ev.scan(order, tuple(plan.pipeline["cuts"]))
    assert sc.state == sum(m * np.dtype(dtype_of(k)).itemsize
                              for k, m in low.state_sizes.items())
    staged = jax.tree.leaves(low.shard(*args)[:2], is_leaf=lambda v: isinstance(v, hs.Staged))
    for x, y in zip(jax.tree.leaves(args[:2]), staged):
        assert np.array_equal(np.asarray(x), np.asarray(hs.gather(y)))
    # three steps with large leaves apart equal one device's
    step, args = get("mlp", "tiny")
    _, got = _three_steps(step, args, cluster)
    keys = {x.key for x in jax.tree.leaves(got[:2], is_leaf=lambda v: isinstance(v, hs.Staged))}
    assert "float32" in keys and "float32/0" in keys and "float32/1" in keys


def test_hetero_1f1b_keeps_fewer_in_flight_where_its_deepest_does_not_fit():
    """hetero-1F1B's depth search bounds its keep pool; its mailboxes and wires grow with
    its depths too, so where the deepest schedule does not fit, a shallower one that does
    is priced, never worse than plain 1F1B."""
    from hapsynth.synth.opcosts import OpCosts as _Costs
    from hapsynth.synth.pipeprice import Pricer as _Evaluator
    step, args = get("gpt", "tiny")

    def evaluator(memory=None):
        extra = {} if memory is None else {"memory": memory}
        cluster = hs.Cluster.simulated(
            [("A100", 4, extra), ("V100", 4, extra)], devices_per_host=4,
            islands={"a": ["A100"], "b": ["V100"]},
            links={"inter_island": {"bandwidth": "1Gbps", "latency": "50us"}})
        graph, dp, r, n = _regions(step, args, cluster)
        parts, _ = stage_parts(cluster)
        return _Evaluator(graph, cluster, r, n, _Costs(graph, cluster, r, parts, dp.tensor_layouts),
                          dp.tensor_layouts), r

    ev, r = evaluator()
    found = None
    for cut in r.cut_points():
        deep = ev.price((0, 1), (cut,), 8, "hetero-1f1b")
        plain = ev.price((0, 1), (cut,), 8, "1f1b")
        if deep.memory[0] > plain.memory[0] and deep.step < plain.step:
            found = cut, deep, plain
            break
    assert found, "no cut where hetero-1F1B keeps more in flight than 1F1B"
    cut, deep, plain = found
    tight, _ = evaluator(int((deep.memory[0] + plain.memory[0]) / 2))
    got = tight.price((0, 1), (cut,), 8, "hetero-1f1b")
    assert got.fits and got.memory[0] < deep.memory[0]
    assert got.step <= tight.price((0, 1), (cut,), 8, "1f1b").step + 1e-12


def test_a_pipeline_on_cpu_devices_names_the_flag_it_needs(monkeypatch):
    """Without the XLA flag the tests set (conftest), a pipelined program over several CPU
    devices of one process warns and names it."""
    step, args = get("mlp", "tiny")
    par = hs.parallelize(step, cluster=two_islands(), pipeline=True, pipeline_runtime="ticks", time_limit=1)
    par.plan(*args)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    with pytest.warns(RuntimeWarning, match="concurrency_optimized_scheduler=false"):
        par.lowered(*args)


def test_every_microbatch_reads_the_weights_whole():
    """A microbatch's op works on 1/M of the rows but reads its weights (and writes a
    weight's gradient) whole: M microbatches touch them M times. Priced on a cluster
    where memory binds, M microbatches of a matmul cost M - 1 more reads of its weight
    than the whole batch at once; an elementwise op on the rows alone costs the same."""
    from hapsynth.synth.opcosts import OpCosts as _Costs
    step, args = get("mlp", "tiny")
    cluster = hs.Cluster.simulated([("A100", 4, {"flops": "1PFLOP/s", "mem_bandwidth": "1GB/s"}),
                                    ("V100", 4, {"flops": "1PFLOP/s", "mem_bandwidth": "1GB/s"})],
                                   devices_per_host=4, islands={"a": ["A100"], "b": ["V100"]})
    graph, dp, r, n = _regions(step, args, cluster)
    parts, _ = stage_parts(cluster)
    costs = _Costs(graph, cluster, r, parts, dp.tensor_layouts)
    lay = dp.tensor_layouts
    micro = [op for op in graph.ops if r.region[op.id] == "micro" and r.rank[op.id] >= 0
             and op.id not in r.folded]
    dots = [op for op in micro if op.primitive == "dot_general" and r.forward[op.id]
            and any(x in graph.inputs[:n] for x in op.inputs)]
    rows_only = [op for op in micro if op.primitive in ("tanh", "mul", "add", "max")
                 and all(x is None or lay[x].kind == "S" for x in (*op.inputs, *op.outputs))]
    assert dots and rows_only
    for op in dots:
        weight = sum(graph.tensors[x].nbytes for x in op.inputs if x in graph.inputs[:n])
        extra = 4 * costs.micro(op.id, 0, 4) - costs.micro(op.id, 0, 1)
        assert extra == pytest.approx(3 * weight / 1e9, rel=0.05)
    for op in rows_only:
        assert 4 * costs.micro(op.id, 0, 4) == pytest.approx(costs.micro(op.id, 0, 1))


@pytest.mark.parametrize("fast,slow,kind", [("A100", "V100", "1f1b"), ("H100", "P100", "1f1b"),
                                            ("A100", "V100", "gpipe")])
def test_the_search_finds_the_best_cut_under_its_own_prices(fast, slow, kind):
    """The pipeline found is the best of every stage order, cut and microbatch count under
    the schedule asked for, as the search prices them: its shortlists judge cuts by
    balance, and cuts they pass over (here the fast island holding nearly all the layers,
    over a fast link) are priced until none could beat the best found. A faster slow
    island made `auto` drop gpt-medium's best pipeline when they were not."""
    import itertools

    from hapsynth.synth import pipeline as P
    from hapsynth.synth.opcosts import OpCosts as _Costs
    from hapsynth.synth.pipeprice import Pricer as _Evaluator

    cluster = hs.Cluster.simulated([(fast, 4), (slow, 4)], devices_per_host=4,
                                   islands={"a": [fast], "b": [slow]},
                                   links={"inter_island": {"bandwidth": "100Gbps",
                                                           "latency": "50us"}})
    step, args = get("gpt", "tiny")
    graph, dp, regions, n = _regions(step, args, cluster)
    found = P.plan_pipeline(graph, cluster, regions, dp.tensor_layouts, n, kinds=(kind,))
    islands, island_of_part = stage_parts(cluster)
    S = len(islands)
    costs = _Costs(graph, cluster, regions, islands, dp.tensor_layouts)
    ev = _Evaluator(graph, cluster, regions, n, costs, dp.tensor_layouts)
    every = []
    for perm in itertools.permutations(range(cluster.num_islands)):
        order = tuple(p for k in perm for p in range(S) if island_of_part[p] == k)
        for cuts in itertools.combinations(regions.cut_points(), S - 1):
            for M in P._micro_counts(regions.batch, S, max(len(islands[k]) for k in order)):
                p = ev.price(order, tuple(int(c) for c in cuts), M, kind)
                if p is not None:
                    every.append((not p.fits, p.step))
    assert found.fits and (False, found.step) == min(every)


@pytest.mark.slow  # (a V runs free in test_freerun's gpt-V)
def test_a_v_shaped_pipeline_is_priced_with_its_ends_on_one_island():
    """`plan_vshape` (run free only, `lower/freerun.py`): the first and last stages on one island, the
    middle on the other. The tied embedding's two ends then share devices, so nothing of
    it crosses (the straight pipeline copies it over the link first); the island running
    two stages runs one work at a time (in lock step, a tick runs one work per stage, the
    island's two one after another); its once-per-step rounds add up. The search finds
    the best V under its own prices."""
    import itertools

    from hapsynth.synth import pipeline as P
    from hapsynth.synth.opcosts import OpCosts as _Costs
    from hapsynth.synth.pipeplan import as_plan
    from hapsynth.synth.pipeprice import Pricer as _Evaluator
    from hapsynth.synth.slots import APART_BYTES, packed_bytes
    from hapsynth.synth.stagegroups import stage_groups

    cluster = two_islands()
    step, args = get("gpt", "tiny")
    graph, dp, regions, n = _regions(step, args, cluster)
    found = P.plan_vshape(graph, cluster, regions, dp.tensor_layouts, n, kinds=("1f1b",),
                          keep=10**6)
    parts, _ = stage_parts(cluster)
    costs = _Costs(graph, cluster, regions, stage_groups(cluster)[0], dp.tensor_layouts)
    ev = _Evaluator(graph, cluster, regions, n, costs, dp.tensor_layouts)
    every = []
    for o, v in itertools.permutations(range(len(parts)), 2):
        for cuts in itertools.combinations(regions.cut_points(), 2):
            for M in P._micro_counts(regions.batch, 2, len(parts[o])):
                p = ev.price((o, v, o), tuple(int(c) for c in cuts), M, "1f1b")
                every.append((not p.fits, p.step))
    assert (not found.fits, found.step) == min(every)
    o, v = found.order[:2]
    assert found.order == (o, v, o) and found.place == (0, 1, 0)
    rounds = max(found.tail[0] + found.tail[2], found.tail[1])
    assert found.step == pytest.approx(found.head + found.schedule.makespan + rounds)
    # the lookup on the first stage, the head on the last: on one island in a V
    points = regions.cut_points()
    vee = ev.price((0, 1, 0), (int(points[1]), int(points[-2])), 2, "1f1b")
    straight = ev.price((0, 1), (int(points[1]),), 2, "1f1b")
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args[:2])[0]]
    tok = graph.tensors[graph.inputs[next(i for i, p in enumerate(paths) if "tok" in p)]].nbytes
    link = cluster.link_between(parts[0][0], parts[1][0])
    # the straight pipeline copies the embedding to the head's island before the first
    # tick; the V copies only what its middle stage reads (the optimizer's step count)
    assert min(vee.ops) > 0 and straight.head >= tok / link.beta
    assert vee.head == pytest.approx(link.alpha + 4 / link.beta)
    # the island running two stages runs them one after another, and holds both's state
    assert vee.schedule.place == (0, 1, 0)
    assert vee.schedule.makespan >= vee.micros * (vee.forward[0] + vee.backward[0]
                                                  + vee.forward[2] + vee.backward[2])
    held = ev.scan((0, 1, 0), vee.cuts).held
    assert vee.memory[0] >= packed_bytes([held[0] + held[2], held[1]], APART_BYTES)
    with pytest.raises(ValueError, match="runs free only"):  # not in one tick loop
        as_plan(vee, dp, dp, cluster)
    # in lock step a tick runs one work per stage, a group's stages one after another
    rows = ticks(vee.schedule)
    both = 0
    for t in {r[0] for r in rows}:
        stages = [s for tt, s, _, _ in rows if tt == t]
        assert len(stages) == len(set(stages))
        both += {0, 2} <= set(stages)
    assert both  # the island running two stages works on both in some tick
    by_group: dict = {}
    for x in vee.schedule.slots:
        by_group.setdefault(vee.schedule.group(x.stage), []).append((x.start, x.end))
    for spans in by_group.values():  # never two works at once on a group
        spans.sort()
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))


@pytest.mark.slow  # traces GPT-2-medium and searches its V shapes (~40 s): run by .ci/run
def test_the_v_search_prices_each_island_pair_s_best_cuts_under_every_schedule():
    """The V search ranks cuts under plain 1F1B, whose warm-up is fixed; a V whose stages
    need deeper warm-ups ranks low there and best under hetero-1F1B. On the target row
    (GPT-2-medium, 8 A100 + 8 V100 over 10 Gbps) every dozen best under 1F1B has the
    V100s at the ends, and a V with the A100s at the ends (cuts found by hand, the
    pair's third best under 1F1B at 8 microbatches) prices better free-running: the
    search must keep each group pair's best few to find it."""
    from hapsynth.ir.unroll import written_out
    from hapsynth.synth import pipeline as P
    from hapsynth.synth.opcosts import OpCosts as _Costs
    from hapsynth.synth.pipeprice import Pricer as _Evaluator
    from hapsynth.synth.stagegroups import stage_groups

    cluster = hs.Cluster.load("a100x8-v100x8-islands-10g")
    step, args = get("gpt", "medium", devices=cluster.num_devices)
    n = len(jax.tree.leaves(args[:state_arity(step, args)]))
    prog = trace(step, *args)
    prog, n = written_out(prog, n) or (prog, n)
    graph = lift_program(prog)
    dp = data_parallel_plan(graph, cluster, num_state_leaves=n, data_inputs=graph.inputs[n:])
    regions = analyse(graph, dp.tensor_layouts, dp.op_inputs, n)
    parts, island = stage_parts(cluster)
    a100 = next(k for k, p in enumerate(parts)
                if cluster.classes[cluster.class_of(p[0])].name.startswith("A100"))
    found = P.plan_vshape(graph, cluster, regions, dp.tensor_layouts, n,
                          kinds=("hetero-1f1b",), free_running=True)
    costs = _Costs(graph, cluster, regions, stage_groups(cluster)[0], dp.tensor_layouts)
    ev = _Evaluator(graph, cluster, regions, n, costs, dp.tensor_layouts, free_running=True)
    vee = (a100, 1 - a100, a100)
    witness = ev.price(vee, (1228, 1846), 8, "hetero-1f1b")
    assert witness.fits and witness.ops[1] > 0
    assert ev.price(vee, (1228, 1846), 8, "1f1b").step > 1.15 * witness.step
    assert found.fits and found.step <= witness.step + 1e-12


@pytest.mark.parametrize("free", [False, True])
def test_the_search_s_floor_is_below_every_price(free):
    """The bound the search skips candidates by (`_Evaluator.floor`: per group of devices,
    its stages' microbatches and their ops after them) is below the step priced under
    every schedule, straight and V-shaped, in the tick loop and run free."""
    import itertools

    from hapsynth.synth.opcosts import OpCosts as _Costs
    from hapsynth.synth.pipeprice import Pricer as _Evaluator
    from hapsynth.synth.stagegroups import stage_groups
    step, args = get("gpt", "tiny")
    cluster = four_islands()
    graph, dp, r, n = _regions(step, args, cluster)
    parts, _ = stage_parts(cluster)
    costs = _Costs(graph, cluster, r, stage_groups(cluster)[0], dp.tensor_layouts)
    ev = _Evaluator(graph, cluster, r, n, costs, dp.tensor_layouts, free)
    points = r.cut_points()
    rng = np.random.default_rng(0)
    ratios = []
    for order in [(0, 1), (1, 0, 2), (0, 1, 0), (2, 3, 2), (3, 2, 1, 0)]:
        combos = list(itertools.combinations(points, len(order) - 1))
        for k in rng.choice(len(combos), size=min(6, len(combos)), replace=False):
            for M in (2, 4):
                floor = ev.floor(order, combos[k], M)
                for kind in SCHEDULES:
                    p = ev.price(order, combos[k], M, kind)
                    if p is not None:
                        assert floor <= p.step, (order, combos[k], M, kind)
                        ratios.append(floor / p.step)
    assert len(ratios) > 100 and min(ratios) > 0
    assert max(ratios) > 0.5  # (where work, not the links, sets the step: a tight bound)


def test_why_spmd_was_kept_names_the_min_gain_when_the_pipeline_is_faster():
    from hapsynth.synth.pipechoice import spmd_kept
    assert spmd_kept(1.0, 1.2, 0.05).startswith("SPMD prices better: 1 s vs the best pipeline's 1.2 s")
    why = spmd_kept(0.5122, 0.4973, 0.05, " (hetero-1f1b, 8 microbatches)")
    assert "better" not in why and "2.9% faster than SPMD's 0.5122 s, under min_gain 5%" in why
