"""The price of one candidate pipeline's step: (order, cuts, microbatches, schedule).

Priced per microbatch: every stage's forward and backward at its rows (`opcosts.py`),
each op's overhead, and the backward's add of its gradients into the sums at memory
speed; each tensor crossing a boundary over the link between the two groups of devices,
once (`pipelinks.py`). The schedule is simulated (`pipeschedule.py`) for its order, then
priced in lock step as the lowering runs it (`lockstep.py`: sending what a tick made
after it, or, where collectives run asynchronously, during the next tick: the cheaper);
hetero-1F1B is made shallower until the program fits (`pipememory.py`). Once per step:
the parameter copies before the first tick; after the last, each stage all-reduces its
gradients over its devices, receives the sums other stages made for its parameters, and
runs its optimizer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hapsynth.synth.collectives import all_reduce
from hapsynth.synth.cutscan import CutScan, grouped_bytes, op_table, scan_cut
from hapsynth.synth.lockstep import lockstep
from hapsynth.synth.pipelinks import (Copies, Crossings, Placement, crossings, parameter_copies,
                                      placement, received)
from hapsynth.synth.pipememory import Messages, buffer_bytes, fixed_bytes, keep_caps, messages
from hapsynth.synth.pipeschedule import PipeSchedule, schedule

__all__ = ["Pipeline", "Pricer", "OP_OVERHEAD", "OP_OVERHEAD_GPU"]

#: Seconds each op costs beyond its work, per run (a kernel launch on a GPU, a thunk of
#: XLA's CPU runtime). SPMD plans run every op once, so it does not tell them apart; a
#: pipeline runs its per-example ops once per microbatch, so it pays it M - 1 more times.
OP_OVERHEAD = {"CPU": 1e-5}
OP_OVERHEAD_GPU = 2e-6


@dataclass(frozen=True)
class Pipeline:
    """A priced pipeline: `order[s]` the group of devices of stage s (`stage_groups`: an
    island, a part of one, or every device), `cuts` the ranks where stages
    2.. start, `micros`, `kind` (schedule), `step` seconds, per-stage details."""

    order: tuple[int, ...]
    cuts: tuple[int, ...]
    micros: int
    kind: str
    step: float
    schedule: PipeSchedule
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    tail: tuple[float, ...]          # per stage: gradient all-reduce + received sums + optimizer
    head: float                      # parameters sent before the first microbatch
    send: tuple[float, ...]          # per boundary, per microbatch, forward direction
    send_back: tuple[float, ...]
    memory: tuple[float, ...]        # per stage: bytes per device (the largest)
    fits: bool
    rows: tuple[tuple[int, ...], ...]  # per stage, per device: rows of each microbatch
    by_kind: dict = field(default_factory=dict)  # schedule kind -> step at this point
    delay: int = 0                   # ticks between making a message and sending it (`lockstep`)
    ops: tuple[int, ...] = ()        # per stage: the ops it runs per microbatch (0: idle)
    place: tuple[int, ...] = ()      # per stage: its group of devices where groups repeat
    whole_islands: bool = False      # `order` indexes `stage_groups(cluster, True)`


@dataclass(frozen=True)
class _Memory:
    """A candidate's bytes per device: the least `capacity` of its devices, the `fixed`
    bytes, per stage one microbatch's kept bytes (`per_micro`) and the microbatches in
    flight its keep pool allows (`caps`); the tick table's channels (`messages`) and the
    stages of each group of devices (`members`), for the buffers a schedule adds."""

    capacity: float
    fixed: float
    per_micro: list
    caps: list
    messages: Messages
    members: list

    def used(self, sch: PipeSchedule, delay: int) -> float:
        """Bytes per device running `sch` (`delay`: its messages sent a tick late)."""
        return self.fixed + buffer_bytes(sch, delay, self.messages, self.per_micro, self.members)


@dataclass(frozen=True)
class _Run:
    """What a candidate's schedule is simulated from: the per-stage seconds of one
    microbatch's phases, its crossings and parameter copies."""

    kind: str
    micros: int
    forward: list
    backward: list
    moves: Crossings
    copies: Copies
    place: tuple


class Pricer:
    """Prices candidates of one step on one cluster (`price`), given its ops' costs
    (`OpCosts`); caches what each cut and microbatch count cost whatever the schedule.
    `free_running`: every stage runs its next work as soon as it is ready, every transfer
    and copy under later work (for comparison: not what the tick loop runs)."""

    def __init__(self, graph, cluster, regions, num_state_leaves, costs, layouts,
                 free_running=False):
        self.graph, self.cluster, self.regions, self.costs = graph, cluster, regions, costs
        self.free_running = free_running
        # collectives run beside independent work (XLA's async collectives on GPUs; XLA's
        # CPU runtime runs a step's ops one after another)
        self.overlaps = all(c.type != "CPU" for c in cluster.classes)
        self.op_overhead = max(OP_OVERHEAD.get(c.type, OP_OVERHEAD_GPU) for c in cluster.classes)
        # the step's data, whole on every device (each reads its microbatches' rows)
        self.data_bytes = float(sum(graph.tensors[t].nbytes
                                    for t in graph.inputs[num_state_leaves:]))
        self.table = op_table(graph, regions, layouts, num_state_leaves)
        self._scans: dict = {}
        self._phases: dict = {}
        self._groups: dict = {}
        self._post: dict = {}   # island -> seconds of each op after the microbatches
        self._micro: dict = {}  # (island, M) -> seconds of each op per microbatch

    @property
    def partials(self) -> frozenset:
        """The partial sums the microbatches add to, summed after the last one."""
        return self.table.summed

    def scan(self, order, cuts) -> CutScan:
        """What a cut costs whatever the microbatches (`cutscan.scan_cut`, cached)."""
        key = (tuple(order), tuple(cuts))
        if key not in self._scans:
            self._scans[key] = scan_cut(self.table, self.graph, self.regions, cuts,
                                        [self._post_seconds(k) for k in order])
        return self._scans[key]

    def work(self, order, cuts, M) -> tuple[list, list]:
        """Per stage, the seconds of one microbatch's forward and backward ops (`phases`
        adds what else a microbatch costs)."""
        sc = self.scan(order, cuts)
        return tuple([float(self._micro_seconds(k, M)[ops].sum()) for ops, k in zip(way, order)]
                     for way in (sc.fwd, sc.bwd))

    def phases(self, order, cuts, M) -> tuple[list, list]:
        """Per stage, one microbatch's forward and backward seconds as priced: its ops,
        each op's overhead, and a backward's adds into the sums (cached)."""
        key = (tuple(order), tuple(cuts), M)
        if key not in self._phases:
            sc = self.scan(order, cuts)
            extra = self.op_overhead * (M - 1) / M  # per op and microbatch, see OP_OVERHEAD
            fwd, bwd = self.work(order, cuts, M)
            fwd = [x + n * extra for x, (n, _) in zip(fwd, sc.nops)]
            # a backward adds its gradients to the sums: each buffer it writes into read
            # twice and written once, at the stage's slowest memory (M of them a step)
            add = [3 * n / min(self.cluster.device_class(d).mem_bandwidth for d in devs)
                   for n, devs in zip(sc.added, (self.costs.islands[k] for k in order))]
            bwd = [x + n * extra + a for x, (_, n), a in zip(bwd, sc.nops, add)]
            self._phases[key] = (fwd, bwd)
        return self._phases[key]

    def floor(self, order, cuts, M) -> float:
        """A lower bound on `price(order, cuts, M, kind).step` under every schedule: per
        group of devices (a V's ends share one), its stages' microbatches one after
        another and then their ops after the microbatches."""
        fwd, bwd = self.phases(order, cuts, M)
        whole, busy = self.scan(order, cuts).whole, {}
        for s, k in enumerate(order):
            busy[k] = busy.get(k, 0.0) + M * (fwd[s] + bwd[s]) + whole[s]
        return max(busy.values()) * (1 - 1e-9)  # (the simulation sums in another order)

    def price(self, order, cuts, M, kind) -> Pipeline | None:
        """The candidate's step, or None where its schedule cannot run. `order` may name a
        group twice (a V shape: stages on one group run one work at a time, and nothing
        crosses between them); the planner's orders do not, and the lowering runs none
        that does (`Pipeline.place` says so)."""
        at = placement(self.cluster, self.costs.islands, order, self.regions.batch // M)
        sc = self.scan(order, cuts)
        fwd, bwd = self.phases(order, cuts, M)
        send = sc.send / M
        run = _Run(kind, M, fwd, bwd, crossings(at, send),
                   parameter_copies(at, self.graph, sc, self.free_running), at.place)
        memory = self._memory(at, cuts, M, send)
        got = self._schedule(run, memory, at.stages)
        if got is None:
            return None
        sch, delay, used = got
        tail, step = self._step(at, sc, sch, run.copies.head)
        return Pipeline(tuple(order), tuple(cuts), M, kind, step, sch, tuple(fwd), tuple(bwd),
                        tuple(tail), run.copies.head, tuple(run.moves.send),
                        tuple(run.moves.send_back), (used,) * at.stages, used <= memory.capacity,
                        at.rows, delay=delay, ops=tuple(f + b for f, b in sc.nops),
                        place=at.place)

    def _memory(self, at: Placement, cuts, M: int, send) -> _Memory:
        """The candidate's bytes per device whatever its schedule, its keep pool's caps
        and its tick table's channels (`pipememory.py`); `send` as `crossings` reads it."""
        sc = self.scan(at.order, cuts)
        capacity = min(self.cluster.classes[self.cluster.class_of(d)].memory
                       for devs in at.devices for d in devs)
        share = [max(x / (self.regions.batch // M) for x in rs) for rs in at.rows]
        per_micro = [sc.resid[s] / M * share[s] for s in range(at.stages)]
        state, sums = sc.state, sc.sums
        if at.place:  # a group holds the state and sums of every stage on it
            state, sums = self._grouped(at.order, cuts, at.members)
        fixed = fixed_bytes(self.graph, sc, at.order, at.members, state, sums, self.data_bytes)
        return _Memory(capacity, fixed, per_micro, keep_caps(capacity, fixed, per_micro, M),
                       messages(send, share, at.rows, at.devices, sc.readers), at.members)

    def _schedule(self, run: _Run, memory: _Memory, S: int) -> tuple | None:
        """The best run of `run`'s schedule, its delay (1: sent a tick late, where
        collectives run beside the work) and bytes per device: one that fits first."""
        best = None
        for late in (0, 1) if self.overlaps and not self.free_running and S > 1 else (0,):
            got = self._fit(run, memory, late)
            if got is None:
                return None
            sch, used = got
            if best is None or (used > memory.capacity, sch.makespan) < (
                    best[2] > memory.capacity, best[0].makespan):
                best = (sch, late, used)
        return best

    def _fit(self, run: _Run, memory: _Memory, late: int) -> tuple | None:
        """`run`'s schedule priced as it runs (`late`: sending a tick late), and its bytes
        per device: hetero-1F1B made shallower until it fits (the caps count the keep
        pool alone: its mailboxes and wires grow with its depths too). None where the
        schedule cannot run."""
        S, M = len(run.forward), run.micros
        base, caps = [min(S - s, M) for s in range(S)], memory.caps
        while True:
            try:
                got = self._simulate(run, late, caps)
            except RuntimeError:
                return None
            used = memory.used(got, late)
            tighter = [min(c, d - 1) if d > b else c
                       for c, d, b in zip(caps, got.depths or base, base)]
            if used <= memory.capacity or run.kind != "hetero-1f1b" or tighter == list(caps):
                return got, used
            caps = tighter

    def _simulate(self, run: _Run, late: int, caps) -> PipeSchedule:
        """`run`'s schedule simulated, then priced as the lowering runs it (`lockstep`),
        unless free-running."""
        moves, free = run.moves, self.free_running

        def as_run(x):
            return x if free else lockstep(x, run.forward, run.backward, moves.send,
                                           moves.send_back, moves.wire if late else None)

        return as_run(schedule(run.kind, run.forward, run.backward, run.micros, moves.send,
                               moves.send_back, memory_cap=caps,
                               cost=None if free else (lambda x: as_run(x).makespan),
                               ready=run.copies.ready if free else None,
                               place=run.place or None))

    def _step(self, at: Placement, sc: CutScan, sch: PipeSchedule, head: float
              ) -> tuple[list, float]:
        """Per stage its once-per-step rounds (gradient all-reduce, received sums,
        optimizer), and the step's seconds."""
        S = at.stages
        sync = [all_reduce(self.cluster, sc.acc[s], at.devices[s]) for s in range(S)]
        tail = [sync[s] + received(at, sc.once, s) + sc.whole[s] for s in range(S)]
        if at.place:
            return tail, self._grouped_step(at, sch, head, tail)
        if self.free_running:  # a stage sums and sends its part once its own last work is done
            done = [max([0.0] + [x.end for x in sch.slots if x.stage == s]) + sync[s]
                    for s in range(S)]
            return tail, max(max([done[s]] + [done[a] + at.seconds(a, s, sc.once[a, s])
                                              for a in range(S) if a != s]) + sc.whole[s]
                             for s in range(S))
        # as lowered: the copies before the tick loop, the once-per-step rounds after it
        return tail, head + sch.makespan + max(tail)

    def _grouped_step(self, at: Placement, sch: PipeSchedule, head: float, tail) -> float:
        """The step where groups of devices run several stages: a group's stages run
        their once-per-step rounds one after another, from its last work (free-running;
        the copies already under the works) or the last tick."""
        last = {j: sch.makespan + head for j in set(at.place)}
        if self.free_running:
            last = {j: max(x.end for x in sch.slots if at.place[x.stage] == j) for j in last}
        return max(last[j] + sum(t for t, k in zip(tail, at.place) if k == j) for j in last)

    def _grouped(self, order, cuts, members) -> tuple[int, int]:
        """`cutscan.grouped_bytes` of the cut (cached)."""
        key = (tuple(order), tuple(cuts))
        if key not in self._groups:
            self._groups[key] = grouped_bytes(self.scan(order, cuts), members)
        return self._groups[key]

    def _post_seconds(self, island: int) -> np.ndarray:
        """Seconds of each op after the microbatches (`OpTable.post`) on the island, whole."""
        if island not in self._post:
            self._post[island] = np.array([self.costs.whole(i, island) for i in self.table.post])
        return self._post[island]

    def _micro_seconds(self, island: int, M: int) -> np.ndarray:
        """Per op (by id; 0 for those not run per microbatch), one microbatch's seconds
        on the island (`OpCosts.micro`)."""
        key = (island, M)
        if key not in self._micro:
            out = np.zeros(len(self.graph.ops))
            ids = self.table.counted
            out[ids] = [self.costs.micro(int(i), island, M) for i in ids]
            self._micro[key] = out
        return self._micro[key]
