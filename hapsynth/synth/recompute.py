"""Plan a traced step: which program of it is planned, and which plan is kept.

`plan_program` plans the step as written; with `remat="auto"` it also plans the step
with cheap activations recomputed in the backward pass (`ir/remat.py`) when no plan
holds it as written, or when that lets the faster devices hold it alone and prices
faster (`faster_recomputed`), and the step with its own recomputation undone
(`ir/cse.py`); `choose.sooner` keeps the faster. A plan records the rewrite it was made
for (`plan.remat`, `plan.pipeline`), and `rewrites.program_of` redoes it.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import jax

from hapsynth.cluster import Cluster
from hapsynth.ir import lift_program
from hapsynth.ir.checkpoint import checkpointed
from hapsynth.ir.cse import merge_recomputed
from hapsynth.ir.remat import cannot_fit, describe, peak_bytes, rematerialize, room, undone
from hapsynth.ir.unroll import written_out
from hapsynth.synth.choose import (check_remat, considers_pipeline, data_parallel_or_none,
                                   dp_prices, fitting_data_parallel, make_plan, sooner,
                                   spmd_time)
from hapsynth.synth.plan import Plan
from hapsynth.synth.rewrites import by_program, program_of, undone_program
from hapsynth.synth.subsets import candidates
from hapsynth.synth.synthesize import InfeasibleMemory, Options


def plan_program(prog, cluster, *, num_state_leaves: int, remat="auto",
                 **kw) -> tuple[Plan, object]:
    """`make_plan` for a traced step, and the program the plan runs: the step as written
    or, with `remat="auto"`, with cheap activations recomputed in the backward pass
    (`plan.remat` says so) when no plan holds them, or when that lets the faster devices
    hold the step alone and prices faster (`faster_recomputed`)."""
    check_remat(remat)
    planning = Planning(prog, cluster, num_state_leaves, kw)
    if remat is False:
        return planning.done(planning.plan_of(prog))
    if planning.hopeless:  # no plan holds it as written: skip that try
        return planning.recomputed(unfit=None)
    try:
        plan = planning.plan_of(prog)
    except InfeasibleMemory as err:
        return planning.recomputed(unfit=err)
    return planning.done(planning.improved(plan))


class Planning:
    """One step's planning: each program of it lifted (and its recomputation merged)
    once, and planned with the same options."""

    def __init__(self, prog, cluster: Cluster, num_state_leaves: int, options: dict):
        self.prog, self.cluster, self.n, self.options = prog, cluster, num_state_leaves, options
        self.lift = by_program(lift_program)
        self.merge = by_program(merge_recomputed)
        self.pipeline = options.get("pipeline", False)
        self.min_gain = options.get("min_gain", Options.min_gain)
        self.memories = [cluster.device_class(i).memory for i in range(cluster.num_devices)]
        self.hopeless = cannot_fit(prog, self.memories)

    def plan_of(self, p, **override) -> Plan:
        """`make_plan` for program `p` of the step (`override`: options changed)."""
        options = {**self.options, **override}
        graph = self.lift(p)
        straight = None
        if considers_pipeline(self.cluster, options.get("pipeline", False),
                              options.get("strategy", "auto")):
            straight = self.straight(p, graph)
        return make_plan(graph, self.cluster, num_state_leaves=self.n,
                         data_inputs=graph.inputs[self.n:], straight=straight, **options)

    def straight(self, p, graph) -> list | None:
        """Where a pipeline of `p` may be cut besides `graph`: `p` with its loops written
        out, and (for the step as written) with its own recomputation undone."""
        u = written_out(p, self.n)
        unrolled = {"unrolled": self.n} if u else {}
        q, n = u or (p, self.n)
        merged = self.merge(q) if p is self.prog else None
        straight = None
        if u or merged is not None:
            straight = [(lift_program(q) if u else graph, n, unrolled)]
        if merged is not None:  # the step's own recomputation undone, stages cut in it
            straight.append((lift_program(merged), n, {**unrolled, "merged": True}))
        return straight

    def fitting(self, p, **override) -> Plan | None:
        """`plan_of(p)`, or None where no plan holds it."""
        try:
            return self.plan_of(p, **override)
        except InfeasibleMemory:
            return None

    def done(self, plan: Plan) -> tuple[Plan, object]:
        return plan, program_of(plan, self.prog, self.merge)

    def improved(self, plan: Plan) -> Plan:
        """`plan` of the step as written, or a faster one of the step with activations
        recomputed (`faster_recomputed`) or with its own recomputation undone (SPMD runs
        it so too)."""
        prog = self.prog
        again, target = faster_recomputed(prog, plan, self.cluster, self.n, self.lift,
                                          **self.options)
        if again is not None:
            other = self.fitting(again)
            if other is not None:
                other = replace(other, remat=describe(prog, again, target))
            plan = sooner(plan, other, self.pipeline, self.min_gain)
        pair = undone_program(prog, self.n, self.merge)
        if pair is not None and self.pipeline is not True:
            other = self.fitting(pair[1], pipeline=False)
            if other is not None:
                other = replace(other, remat={
                    **undone(*pair), **({"unrolled": self.n} if prog.loops else {})})
            plan = sooner(plan, other, self.pipeline, self.min_gain)
        return plan

    def recomputed(self, unfit: InfeasibleMemory | None) -> tuple[Plan, object]:
        """No plan holds the step as written (`unfit`; None: not tried, hopeless): as
        little recomputation as the memory may need (data parallelism holds the state
        whole on every device), then all cheap activations, then the forward pass
        recomputed segment by segment (`ir/checkpoint.py`: contractions too)."""
        prog = self.prog
        state = sum(prog.avals[t].nbytes for t in prog.inputs[:self.n])
        target = 0.9 * room(self.memories, state)
        # (a try whose activations no set of devices can hold even beside fully sharded
        # state is skipped: planning a 6.7B model costs minutes a try; recomputing less
        # than all the cheap activations holds more)
        spread = room(self.memories, state / len(self.memories))
        full = rematerialize(prog)
        light = (rematerialize(prog, target) if full is None or peak_bytes(full) <= spread
                 else None)
        tries = [(p, t) for p, t in ((light, target), (full, None)) if p is not None]
        if light is not None and full is not None and len(light.eqns) == len(full.eqns):
            tries = [(full, None)]
        segments = checkpointed(prog)
        if segments is not None:
            tries.append((segments, "segments"))
        tries = [x for x in tries[:-1] if peak_bytes(x[0]) <= spread] + tries[-1:]
        if not tries:  # nothing cheap to recompute
            if unfit is None:
                return self.plan_of(prog), prog  # raises, naming the device class and the shortfall
            raise unfit
        for again, t in tries:
            try:
                plan = replace(self.plan_of(again), remat=describe(prog, again, t))
            except InfeasibleMemory as err:
                unfit = err
                continue
            if isinstance(t, float) and plan.devices is not None and full is not None:
                plan = self.on_every_device(plan, full)
            return self.done(plan)
        raise InfeasibleMemory(f"{unfit} (with activations recomputed in the backward pass)")

    def on_every_device(self, plan: Plan, full) -> Plan:
        """`plan` (the light rewrite, leaving devices idle), or the plan of `full` (all of
        it recomputed) where that lets every device work and prices faster."""
        graph = lift_program(full)
        every = fitting_data_parallel(graph, self.cluster, self.n, graph.inputs[self.n:])
        if every < plan.predicted_step_time * (1 - self.min_gain):
            other = replace(self.plan_of(full), remat=describe(self.prog, full, None))
            if other.predicted_step_time < plan.predicted_step_time:
                return other  # (data parallelism fits there: so does this plan)
        return plan


def faster_recomputed(prog, plan: Plan, cluster: Cluster, num_state_leaves: int,
                      lift=lift_program, *,
                      strategy="auto", devices="auto", min_gain=Options.min_gain, **_):
    """When `plan` fits only because the step's activations are spread over more (or
    slower) devices than its work needs: `prog` with as much recomputed as lets the
    faster devices hold it, and the memory target it was recomputed to (None: all), if
    data parallelism there then prices `min_gain` faster than `plan` (than its SPMD-only
    time, for a pipeline); else (None, None)."""
    if strategy == "data-parallel" or plan.remat:
        return None, None
    best = (spmd_time(plan) * (1 - min_gain), None, None)  # a pipeline's SPMD-only too
    flops = plan.baselines.get("ideal", 0.0) * cluster.total_flops
    state = sum(prog.avals[t].nbytes for t in prog.inputs[:num_state_leaves])
    whole = tuple(range(cluster.num_devices))
    subsets = [whole] + ([] if devices == "all" or jax.process_count() > 1 else candidates(cluster))
    graph, full = lift(prog), ()
    for devs in subsets:
        sub = cluster if devs == whole else cluster.subset(devs)
        if flops / sub.total_flops >= best[0] or devs == plan.devices:
            continue  # too few FLOP/s even without recomputing, or where the plan runs

        @functools.lru_cache(maxsize=None)
        def price_on(p, sub=sub):
            g = lift(p)
            return fitting_data_parallel(g, sub, num_state_leaves, g.inputs[num_state_leaves:])

        # data parallelism as written there, memory aside (the plan has the whole cluster's)
        dp = plan if devs == whole else data_parallel_or_none(
            graph, sub, num_state_leaves, graph.inputs[num_state_leaves:])
        fitting, alone = dp_prices(dp, sub)
        if fitting < float("inf") or alone >= best[0]:
            continue  # it fits as written there, or is not faster even without recomputing
        full = rematerialize(prog) if full == () else full
        if full is None or price_on(full) == float("inf"):
            continue  # not even all of it recomputed fits there: nor does less
        if price_on(full) < best[0]:
            best = (price_on(full), full, None)
        target = 0.9 * room([sub.device_class(d).memory for d in range(sub.num_devices)], state)
        light = rematerialize(prog, target)  # less recomputed: faster, when it fits
        if light is not None and price_on(light) < best[0]:
            best = (price_on(light), light, target)
    return best[1], best[2]
