"""Pipelines across islands, priced: stage cuts, microbatch counts, schedules.

A pipeline here is one stage per island or per equal part of one (`stage_parts`), in
some order of the islands, each stage a contiguous range of ranks (`stages.py`), data
parallel inside its devices at FLOP/s-proportional whole rows (uneven where the island
mixes classes; each class priced at the most rows one of its devices holds); or one
stage over every device (`stage_groups`: gradient accumulation across the islands).
Priced per microbatch: every stage's forward and
backward at its rows, each microbatch reading its weights (and writing their gradients)
whole, and the backward's add of its gradients into the sums, at memory speed; each
tensor crossing a boundary over the link between the two islands, once (one read by
both phases of its stage is kept there by the forward, as the lowering does); the schedule
simulated (`pipeschedule.py`) for its order, then priced in lock step as the lowering
runs it (`lockstep`: a tick lasts its longest work and then its longest
transfer each way, one way after the other, or, sending a tick late beside the next
work where collectives run asynchronously, the longer of the two). Once per step: the
parameters a stage reads but does not store (tied embeddings) are copied before the
first tick; after the last tick each stage all-reduces its gradients over its devices,
receives the sums other stages made for its parameters, and runs its optimizer. Memory:
one SPMD program gives every device the same buffers, each sized for the stage needing
most (state, copies, gradient sums, the keep pool's slots and the mailboxes of the
tick table, `slots.py`), so every device must hold the largest stage's.
Cuts are searched where stages balance, with or without the slowest link's transfers
added, then in order of a bound; the best (cut, order, microbatches, schedule) is
returned with every schedule's price at that point for comparison. Gradient sums are
held in float32 where the gradients are narrower (`slots.sum_dtype`). A what-if the
lowering does not run yet (`plan_vshape`): a V shape, the first and last stages on one
group of devices (running one work at a time) and the middle on another.
"""
from __future__ import annotations

import functools
import itertools
import math
import types
from dataclasses import dataclass, field

import numpy as np

from hapsynth.cluster import Cluster
from hapsynth.ir.graph import Cost, Graph
from hapsynth.synth.collectives import all_reduce
from hapsynth.synth.costmodel import compute_time
from hapsynth.synth.pipeschedule import PipeSchedule, Slot, schedule
from hapsynth.synth.plan import Plan
from hapsynth.synth.slots import (APART_BYTES, packed_bytes, sum_bytes, sum_dtype, tick_tables,
                                  touched_bytes, wire_rounds)
from hapsynth.synth.stages import Regions, stage_of

__all__ = ["Pipeline", "plan_pipeline", "plan_vshape", "rows_of", "islands_of", "islands_differ",
           "stage_parts", "stage_groups", "RUNTIMES"]

SCHEDULES = ("gpipe", "1f1b", "hetero-1f1b")

#: How a pipeline plan runs: "ticks", one SPMD program stepping its schedule's tick table
#: (`lower.pipeline.Pipelined`: every stage meets the others at each tick's crossing,
#: across processes too); "free", a program per stage and phase, each dispatched once its
#: inputs are there (`lower.freerun.FreeRunning`: priced free-running; one process).
RUNTIMES = ("ticks", "free")

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


def islands_of(cluster: Cluster) -> list[tuple[int, ...]]:
    return [cluster.island_devices(k) for k in range(cluster.num_islands)]


def islands_differ(cluster: Cluster) -> bool:
    """Whether the cluster's islands hold unequal device counts (a stage per whole island
    then runs free only)."""
    return len({len(d) for d in islands_of(cluster)}) > 1


def stage_parts(cluster: Cluster, whole_islands: bool = False
                ) -> tuple[list[tuple[int, ...]], list[int]]:
    """The device groups a stage may hold, and the island of each: every island cut in
    parts of as many devices as the smallest island divides them all into (the stages of
    one tick loop share a (stage, data) mesh, so they hold equal device counts); or
    `whole_islands`, each island one group (the free runtime runs stages of unequal
    device counts)."""
    islands = islands_of(cluster)
    if whole_islands:
        return list(islands), list(range(len(islands)))
    size = math.gcd(*[len(d) for d in islands])
    parts, of = [], []
    for k, devs in enumerate(islands):
        for i in range(0, len(devs), size):
            parts.append(tuple(devs[i:i + size]))
            of.append(k)
    return parts, of


def stage_groups(cluster: Cluster, whole_islands: bool = False
                 ) -> tuple[list[tuple[int, ...]], list[int]]:
    """`stage_parts`, then (with several islands) every device as one group, of island
    -1: one stage over the whole cluster, data parallel in microbatches (gradient
    accumulation across the islands, its sums all-reduced once a step)."""
    parts, of = stage_parts(cluster, whole_islands)
    if cluster.num_islands > 1:
        return [*parts, tuple(d for p in parts for d in p)], [*of, -1]
    return parts, of


def part_name(cluster: Cluster, parts, of, k: int) -> str:
    """"v100" for a whole island, "p100[2/3]" for the second of three parts, "a100+v100"
    for every device."""
    if of[k] < 0:
        return "+".join(i.name for i in cluster.islands) if cluster.islands else "all"
    name = cluster.islands[of[k]].name if cluster.islands else str(of[k])
    n = of.count(of[k])
    return name if n == 1 else f"{name}[{of[:k].count(of[k]) + 1}/{n}]"


def rows_of(cluster: Cluster, devices, rows: int) -> tuple[int, ...]:
    """`rows` split over `devices` in proportion to FLOP/s (largest remainders)."""
    w = np.array([cluster.device_class(d).flops for d in devices], float)
    exact = rows * w / w.sum()
    out = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - out), kind="stable")[: rows - int(out.sum())]:
        out[i] += 1
    return tuple(int(x) for x in out)


class _Costs:
    """Per op and group of devices (`stage_groups`): seconds of one microbatch."""

    def __init__(self, graph: Graph, cluster: Cluster, regions: Regions, islands, layouts):
        self.graph, self.cluster, self.regions = graph, cluster, regions
        self.islands = islands
        self._micro: dict = {}
        self._rows: dict = {}
        self._running: dict = {}
        self._whole: dict = {}
        # per op: the bytes of its values without the batch's rows in them (state read,
        # or made from it alone; a weight's gradient, a partial sum), which every
        # microbatch touches whole
        state = set(graph.inputs[:len(regions.owner_rank)])
        whole = {t for t, x in enumerate(graph.tensors) if t in state or layouts[t].kind == "P"
                 or x.producer is not None and regions.region[x.producer] == "pre"}
        self.fixed = [sum(graph.tensors[t].nbytes for t in {*op.inputs, *op.outputs} & whole)
                      * op.repeat for op in graph.ops]
        self.share = []   # per island: per device class in it, the share of the rows
        for devs in islands:
            total = sum(cluster.device_class(d).flops for d in devs)
            classes = sorted({cluster.class_of(d) for d in devs})
            self.share.append({c: cluster.classes[c].flops / total for c in classes})

    @functools.cached_property
    def ranked(self) -> tuple[list, np.ndarray]:
        """The ops run per microbatch, in rank order (stable), and their ranks."""
        r = self.regions
        ops = [i for i, x in enumerate(r.region) if x == "micro" and r.rank[i] >= 0]
        ranks = np.array([r.rank[i] for i in ops])
        ix = np.argsort(ranks, kind="stable")
        return [ops[j] for j in ix], ranks[ix]

    def running(self, island: int, M: int = 1) -> np.ndarray:
        """The running sum, in rank order, of one microbatch's seconds of those ops on the
        island (cached): a stage's work is the difference at its two ends."""
        key = (island, M)
        if key not in self._running:
            self._running[key] = np.concatenate(
                [[0.0], np.cumsum([self.micro(i, island, M) for i in self.ranked[0]])])
        return self._running[key]

    def rows_share(self, island: int, M: int) -> dict:
        """Per device class in the island, the largest share of a microbatch's rows one of
        its devices holds, in whole rows as the lowering splits them (`rows_of`: with few
        rows a device, rounding moves a fair part of the work)."""
        key = (island, M)
        if key not in self._rows:
            devs, n = self.islands[island], max(self.regions.batch // M, 1)
            most: dict = {}
            for d, r in zip(devs, rows_of(self.cluster, devs, n)):
                c = self.cluster.class_of(d)
                most[c] = max(most.get(c, 0), r)
            self._rows[key] = {c: r / n for c, r in sorted(most.items())}
        return self._rows[key]

    def least(self, op, island: int) -> float:
        """Seconds of the op on the island, the whole batch at once at FLOP/s shares of its
        rows (no rounding: below its price at any microbatch count, a bound)."""
        return self._at(op, self.share[island], 1)

    def micro(self, op, island: int, M: int = 1) -> float:
        """Seconds of one microbatch of 1/M of the batch at the island's rows: flops and
        per-example bytes scale with its rows, the `fixed` bytes do not."""
        key = (op, island, M)
        if key not in self._micro:
            self._micro[key] = self._at(op, self.rows_share(island, M), M)
        return self._micro[key]

    def _at(self, op, share: dict, M: int) -> float:
        cost = self.graph.ops[op].cost
        fixed = min(self.fixed[op], cost.bytes)
        return max(compute_time(Cost(cost.flops * f / M, cost.transcendentals * f / M,
                                     (cost.bytes - fixed) * f / M + fixed), self.cluster.classes[c])
                   for c, f in share.items())

    def whole(self, op, island: int) -> float:
        key = (op, island)
        if key not in self._whole:
            self._whole[key] = max(compute_time(self.graph.ops[op].cost, self.cluster.classes[c])
                                   for c in self.share[island])
        return self._whole[key]


def plan_pipeline(graph: Graph, cluster: Cluster, regions: Regions, layouts, num_state_leaves: int,
                  kinds=SCHEDULES, keep: int = 6, by_links: bool = True,
                  free_running: bool = False, max_cuts: int = 256,
                  whole: bool | str = True, whole_islands: bool = False) -> Pipeline | None:
    """The best pipeline found, or None when the cluster has one island. `whole`: one
    stage over every device (gradient accumulation across the islands) is a candidate
    too; "only": the best such (whatever `by_links`). `by_links=False` prices the most
    balanced cuts only (for comparison; no one-stage candidate). `free_running`: priced with
    every stage running its next work as soon as it is ready and every transfer and
    parameter copy under later work, not in the lowering's ticks (for comparison: what
    the lock step costs; not a program the lowering makes). `max_cuts`: at most this many
    cuts are priced beyond the shortlists, those whose bound could beat the best found.
    `whole_islands`: a stage per island, whatever their sizes (`stage_parts`; the free
    runtime's)."""
    if cluster.num_islands < 2:
        return None
    islands, island_of_part = stage_parts(cluster, whole_islands)
    S = len(islands)
    costs = _Costs(graph, cluster, regions, stage_groups(cluster, whole_islands)[0], layouts)
    evaluator = _Evaluator(graph, cluster, regions, num_state_leaves, costs, layouts,
                           free_running)
    one_stage = _whole_stage(costs, S) if whole == "only" or whole and by_links else []
    points = regions.cut_points()
    if whole == "only" or len(points) < S - 1:
        return _cheapest(evaluator, one_stage, kinds, whole_islands)
    micro_ops, sorted_ranks = costs.ranked
    prefix = [costs.running(k) for k in range(S)]
    # a bound on any step with given cuts: a stage's own work, the whole batch at once
    # (its microbatches cost no less), and its ops after the microbatches (the optimizer);
    # or a link's bytes (below)
    own = sorted([(regions.rank[i], i, False) for i in micro_ops if i not in regions.folded]
                 + [(regions.rank[i], i, True) for i, r in enumerate(regions.region)
                    if r == "post" and regions.rank[i] >= 0])
    own_ranks = np.array([x[0] for x in own], np.int64)
    least = [np.concatenate([[0.0], np.cumsum([costs.whole(i, k) if post else costs.least(i, k)
                                               for _, i, post in own])]) for k in range(S)]

    combos = np.array(list(itertools.combinations(points, S - 1)), np.int64).reshape(-1, S - 1)
    if len(combos) > 20000:  # many islands and layers: every other cut point
        combos = combos[np.all(np.isin(combos, points[::2]), axis=1)]
    bounds, own_bounds = _spans(sorted_ranks, combos), _spans(own_ranks, combos)
    shortlist, balanced, floors = [], set(), []
    orders = [tuple(p for k in perm for p in range(S) if island_of_part[p] == k)
              for perm in itertools.permutations(range(cluster.num_islands))]
    crossing = _crossing(graph, regions, points)
    where = np.searchsorted(points, combos)
    for order in orders:
        worst, floor = _busiest(prefix, bounds, order), _busiest(least, own_bounds, order)
        # beside the most balanced cuts, those balanced once the slowest link's transfers
        # are added (a tick waits for what it sends): where little crosses a slow link
        links = np.stack([crossing[where[:, s]] / cluster.link_between(
            islands[order[s]][0], islands[order[s + 1]][0]).beta for s in range(S - 1)], axis=1)
        floors.append(np.maximum(floor, links.max(axis=1)))  # (a link carries its bytes too)
        picked = dict.fromkeys([*np.argsort(worst, kind="stable")[:keep], *(
            np.argsort(worst + links.max(axis=1), kind="stable")[:keep] if by_links else ())])
        shortlist += [(order, tuple(int(c) for c in combos[k])) for k in picked]
        balanced |= {(order, tuple(int(c) for c in combos[k]))
                     for k in np.argsort(worst, kind="stable")[:keep]}
    # every cut, order and microbatch count under the cheap schedules asked for (plain
    # 1F1B standing in for hetero-1F1B, which searches its depths); the best few under
    # each schedule asked for, and the best few of the balanced cuts (where the
    # schedules differ most)
    cheap = tuple(k for k in kinds if k in ("1f1b", "gpipe")) or ("1f1b",)
    first, fit = {k: [] for k in cheap}, np.inf  # fit: the best step that fits so far

    def try_cut(order, cuts):
        nonlocal fit
        for M in _micro_counts(regions.batch, S, max(len(islands[k]) for k in order)):
            for kind in cheap:
                p = evaluator.price(order, cuts, M, kind)
                if p is not None:
                    first[kind].append(((not p.fits, p.step), order, cuts, M))
                    if p.fits:
                        fit = min(fit, p.step)

    for order, cuts in shortlist:
        try_cut(order, cuts)
    listed = {k: sorted(v)[:4] for k, v in first.items()}
    # then, lowest bound first, every other cut whose bound is below the best step that
    # fits so far: the shortlists judge cuts by balance, and may miss an unbalanced cut
    # pricing better (where little crosses, or an island adds less than the bubble costs)
    tried, floor = set(shortlist), np.concatenate(floors)
    for j in np.argsort(floor, kind="stable")[:max_cuts if by_links else 0]:
        if floor[j] >= fit:
            break
        order, cuts = orders[j // len(combos)], tuple(int(c) for c in combos[j % len(combos)])
        if (order, cuts) not in tried:
            try_cut(order, cuts)
    again = []
    for kind, got in first.items():  # (the shortlists' best too: under the other
        got.sort()                      # schedules they may still price best)
        again += got[:4] + listed[kind] + [x for x in got if (x[1], x[2]) in balanced][:4]
    cut = list(dict.fromkeys((o, c, m) for _, o, c, m in again))
    return _cheapest(evaluator, cut + one_stage, kinds, whole_islands)


def plan_vshape(graph: Graph, cluster: Cluster, regions: Regions, layouts,
                num_state_leaves: int, kinds=SCHEDULES, keep: int = 200, few: int = 4,
                free_running: bool = False, whole_islands: bool = False) -> Pipeline | None:
    """A what-if, not yet lowered: the best V-shaped pipeline found, its first and last
    stages on one group of devices (`stage_parts`) and the middle stage on another, so
    that a model's two ends (a tied embedding's lookup and head) sit on one island and
    nothing of them crosses. Priced as `plan_pipeline` prices (the group of two stages
    runs one work at a time; in lock step a tick runs one work per stage, the group's
    two one after another); per group pair and microbatch count, the `keep` cuts of the
    least of a rough measure (the busiest group's work, or both cuts' bytes over the link)
    are priced under plain 1F1B, and under `kinds` the best dozen of all and the best
    `few` of each group pair and microbatch count (plain 1F1B's warm-up is fixed, so a
    pair whose stages need deeper warm-ups than it gives may rank low under it while
    hetero-1F1B prices it best). None where no two islands exist. `whole_islands` as in
    `plan_pipeline`."""
    parts, island = stage_parts(cluster, whole_islands)
    if cluster.num_islands < 2:
        return None
    costs = _Costs(graph, cluster, regions, stage_groups(cluster, whole_islands)[0], layouts)
    evaluator = _Evaluator(graph, cluster, regions, num_state_leaves, costs, layouts,
                           free_running)
    points = regions.cut_points()
    combos = np.array(list(itertools.combinations(points, 2)), np.int64).reshape(-1, 2)
    spans = _spans(costs.ranked[1], combos)
    # each direction of the link carries both boundaries' bytes (one forward, one back)
    crossing = _crossing(graph, regions, points)[np.searchsorted(points, combos)].sum(axis=1)
    first, best, top = [], [], []  # every cut's price under plain 1F1B; the best few of
    # each pair and microbatch count, and of all, under every schedule
    for o, v in itertools.permutations(range(len(parts)), 2):
        if island[o] == island[v]:
            continue
        beta = cluster.link_between(parts[o][0], parts[v][0]).beta
        for M in _micro_counts(regions.batch, 2, max(len(parts[o]), len(parts[v]))):
            pre = {k: costs.running(k, M) for k in (o, v)}
            outer = (pre[o][spans[:, 1]] - pre[o][spans[:, 0]]
                     + pre[o][spans[:, 3]] - pre[o][spans[:, 2]])
            busiest = np.maximum(outer, pre[v][spans[:, 2]] - pre[v][spans[:, 1]]) * M
            mine = []
            for k in np.argsort(np.maximum(busiest, crossing / beta), kind="stable")[:keep]:
                cuts = tuple(int(c) for c in combos[k])
                # (a cut that prices above the `few` best of this pair and the dozen best
                # of all, each fitting, is picked by neither)
                if len(mine) >= few and len(top) + len(mine) >= 12:
                    mine.sort()
                    worst = max(mine[few - 1][0], sorted(top + mine)[11][0])
                    if not worst[0] and evaluator.floor((o, v, o), cuts, M) > worst[1]:
                        continue
                p = evaluator.price((o, v, o), cuts, M, "1f1b")
                if p is not None:
                    mine.append(((not p.fits, p.step), (o, v, o), cuts, M))
            first += mine
            best += sorted(mine)[:few]
            top = sorted(first)[:12]
    picked = [x[1:] for x in sorted(first)[:12] + best]
    return _cheapest(evaluator, list(dict.fromkeys(picked)), kinds, whole_islands)


def _whole_stage(costs, S: int) -> list:
    """One stage over every device (gradient accumulation across the islands; where links
    are fast, the microbatches' memory without a pipeline's bubble or crossings): its
    (order, cuts, microbatches) to price."""
    return [((S,), (), m) for m in _micro_counts(costs.regions.batch, 1, len(costs.islands[S]))
            if m > 1]


def _cheapest(evaluator, candidates, kinds, whole_islands: bool = False) -> Pipeline | None:
    """The best of (order, cuts, microbatches) `candidates` under `kinds` (one that fits
    first), with its step under every schedule (`whole_islands`: what its groups are)."""
    best = None
    for order, cuts, M in candidates:
        if best is not None and best.fits and evaluator.floor(order, cuts, M) > best.step:
            continue  # (it could not beat the best so far, fitting or not)
        for kind in kinds:
            p = evaluator.price(order, cuts, M, kind)
            if p is not None and (best is None or (not p.fits, p.step) < (not best.fits, best.step)):
                best = p
    if best is None:
        return None
    by_kind = {k: evaluator.price(best.order, best.cuts, best.micros, k).step for k in SCHEDULES}
    return Pipeline(**{**best.__dict__, "by_kind": by_kind, "whole_islands": whole_islands})


def _spans(ranks, combos) -> np.ndarray:
    """Per row of cuts `combos`: the index in sorted `ranks` where each stage starts, and
    the end."""
    at = np.searchsorted(ranks, combos, "left")
    return np.concatenate([np.zeros((len(at), 1), np.int64), at,
                           np.full((len(at), 1), len(ranks), np.int64)], axis=1)


def _busiest(prefix, spans, order) -> np.ndarray:
    """Per row of `spans`: the largest sum of a stage's costs (`prefix`: per island, the
    running sum of its ops' costs in rank order), the stage on island `order[s]`."""
    return np.max(np.stack([prefix[k][spans[:, s + 1]] - prefix[k][spans[:, s]]
                            for s, k in enumerate(order)], axis=1), axis=1)


def _crossing(graph: Graph, regions: Regions, points) -> np.ndarray:
    """Per cut point: the bytes a boundary there sends one way, the larger of the two
    (the whole batch's per-example values made before it and read after, in the
    forward; cotangents the other way)."""
    r = regions
    producer = {t: op.id for op in graph.ops for t in op.outputs}
    reach: dict = {}  # tensor -> (first, last) rank reading it
    for op in graph.ops:
        if r.region[op.id] != "micro" or r.rank[op.id] < 0:
            continue
        for x in op.inputs:
            if x is not None and x in producer:
                lo, hi = reach.get(x, (r.rank[op.id], r.rank[op.id]))
                reach[x] = (min(lo, r.rank[op.id]), max(hi, r.rank[op.id]))
    points = np.asarray(points)
    ways = np.zeros((2, len(points) + 1))
    for x, (lo, hi) in reach.items():
        j = producer[x]
        if r.region[j] != "micro" or r.rank[j] < 0:
            continue
        p, way = r.rank[j], 0 if r.forward[j] else 1
        a, b = (p, hi) if hi > p else (lo, p)  # crosses a cut c where a < c <= b
        if b > a:
            ways[way, np.searchsorted(points, a, "right")] += graph.tensors[x].nbytes
            ways[way, np.searchsorted(points, b, "right")] -= graph.tensors[x].nbytes
    return np.cumsum(ways, axis=1)[:, :len(points)].max(axis=0)


def _micro_counts(batch: int, S: int, devices: int) -> list[int]:
    """Microbatch counts: divisors of the batch from S up, each microbatch having a row per
    device of a stage (split by FLOP/s, a slow device's share may round to none)."""
    return [m for m in range(S, min(batch, 8 * S) + 1) if batch % m == 0 and batch // m >= devices]


class _Evaluator:
    def __init__(self, graph, cluster, regions, num_state_leaves, costs, layouts,
                 free_running=False):
        self.free_running = free_running
        # collectives run beside independent work (XLA's async collectives on GPUs; XLA's
        # CPU runtime runs a step's ops one after another)
        self.overlaps = all(c.type != "CPU" for c in cluster.classes)
        self.g, self.cluster, self.r, self.costs = graph, cluster, regions, costs
        self.nstate = num_state_leaves
        self.producer = {t: op.id for op in graph.ops for t in op.outputs}
        self.leaf = {t: i for i, t in enumerate(graph.inputs[:num_state_leaves])}
        # the partial sums each microbatch adds to: summed in the island after the last one
        self._scans: dict = {}
        self._phase: dict = {}
        self._groups: dict = {}
        self._post: dict = {}   # island -> seconds of each op after the microbatches
        self._micro: dict = {}  # (island, M) -> seconds of each op per microbatch
        self.op_overhead = max(OP_OVERHEAD.get(c.type, OP_OVERHEAD_GPU) for c in cluster.classes)
        # (those read once a step, by the ops after the microbatches or as outputs, as the
        # lowering accumulates them; not a gradient a microbatch's own ops rearrange first)
        later = {x for op in graph.ops if regions.region[op.id] == "post"
                 for x in op.inputs if x is not None} | set(graph.outputs)
        # the step's data, whole on every device (each reads its microbatches' rows)
        self.data_bytes = float(sum(graph.tensors[t].nbytes
                                    for t in graph.inputs[num_state_leaves:]))
        self.partials = {t for op in graph.ops if regions.region[op.id] == "micro"
                         for t in op.outputs if layouts[t].kind == "P" and t in later}

    def scan(self, order, cuts) -> dict:
        """What a cut costs whatever the microbatches: per stage its forward and backward
        ops, the bytes crossing, summed, kept and stored (cached)."""
        key = (tuple(order), tuple(cuts))
        if key in self._scans:
            return self._scans[key]
        g, r, t = self.g, self.r, self._table
        S = len(order)
        st = np.where(t.rank >= 0, np.searchsorted(np.asarray(cuts, np.int64), t.rank, "right"), -1)
        owner = [stage_of(x, cuts) for x in r.owner_rank]
        so = st[t.ops]  # the micro and post ops' stages
        sc, forward = so[t.counted_at], t.forward[t.counted_at]
        fwd = [t.counted[(sc == s) & forward].tolist() for s in range(S)]
        bwd = [t.counted[(sc == s) & ~forward].tolist() for s in range(S)]
        nops = [[len(f), len(b)] for f, b in zip(fwd, bwd)]
        # (an op after the microbatches reading only the step's data, stage -1: the last)
        post = np.where(so[t.post_at] < 0, S - 1, so[t.post_at])
        whole = [float(self._post_seconds(order[s])[post == s].sum()) for s in range(S)]
        sums: list[list] = [[] for _ in range(S)]  # per stage: (forward?, dtype, bytes)
        for k, items in t.partials:
            if so[k] >= 0:
                sums[so[k]] += items
        needs: list[set] = [set() for _ in range(S)]
        for k, leaves in t.leaves:
            if so[k] >= 0:
                needs[so[k]] |= leaves
        send = np.zeros((S, S, 2))       # bytes of the whole batch a -> b, forward/backward
        once = np.zeros((S, S))          # bytes per step a -> b after the microbatches (sums)
        resid = np.zeros(S)
        readers: dict = {}  # (a, s, way) -> the phases of s reading what a sends
        rs, ra = so[t.read_op], st[t.read_from]
        # a tensor is kept, sent or summed once per stage and phase, however many read it
        use = np.flatnonzero(rs >= 0)
        _, first = np.unique((t.read_value[use] * (S + 1) + rs[use]) * 2 + t.read_back[use],
                             return_index=True)
        use = use[np.sort(first)]
        rs, ra, nbytes = rs[use], ra[use], t.read_bytes[use]
        here = ra == rs
        np.add.at(resid, rs[here & t.read_made_fwd[use] & t.read_back[use]],
                  nbytes[here & t.read_made_fwd[use] & t.read_back[use]])
        away = (ra >= 0) & ~here
        cross = away & t.read_micro[use]  # (both ends in the microbatches)
        np.add.at(once, (ra[away & ~cross], rs[away & ~cross]), nbytes[away & ~cross])
        if cross.any():
            # a value read by both phases of a later stage crosses once and is kept there
            # by the forward for its backward, as the lowering sends it
            x, a, b = t.read_value[use][cross], ra[cross], rs[cross]
            way = np.where(t.read_made_fwd[use][cross], 0, 1)
            phase = t.read_fwd[use][cross]
            _, group, inv = np.unique((x * (S + 1) + a) * (S + 1) + b, return_index=True,
                                      return_inverse=True)
            has_f = np.zeros(len(group), bool)
            has_b = np.zeros(len(group), bool)
            np.logical_or.at(has_f, inv, phase)
            np.logical_or.at(has_b, inv, ~phase)
            nb = nbytes[cross][group]
            np.add.at(send, (a[group], b[group], way[group]), nb)
            np.add.at(resid, b[group][has_f & has_b], nb[has_f & has_b])
            for k, (aa, bb, w) in enumerate(zip(a[group], b[group], way[group])):
                readers.setdefault((int(aa), int(bb), int(w)), set()).add(
                    "F" if has_f[k] else "B")
        acc = [float(sum(x[2] for x in mine)) for mine in sums]
        held: list[list] = [[] for _ in range(S)]  # per stage: its state leaves
        for p, o in enumerate(owner):
            tensor = g.tensors[g.inputs[p]]
            held[o].append(("state", str(tensor.dtype), tensor.nbytes))
        out = dict(owner=owner, fwd=fwd, bwd=bwd, whole=whole, send=send, once=once, acc=acc,
                   readers={k: sorted(v) for k, v in readers.items()},
                   resid=[float(x) for x in resid], needs=needs, nops=nops,
                   sums=packed_bytes(sums), state=packed_bytes(held, APART_BYTES), held=held,
                   sum_items=sums,
                   added=touched_bytes([[x for x in mine if not x[0]] for mine in sums]))
        self._scans[key] = out
        return out

    def _post_seconds(self, island: int) -> np.ndarray:
        """Seconds of each op after the microbatches (`_table.post`) on the island, whole."""
        if island not in self._post:
            self._post[island] = np.array([self.costs.whole(i, island) for i in self._table.post])
        return self._post[island]

    @functools.cached_property
    def _table(self):
        """`_ops` as arrays (`scan` reads them for every cut it prices)."""
        ops = self._ops
        ids = np.array([o[0] for o in ops], np.int64)
        micro = np.array([o[1] == "micro" for o in ops], bool)
        counted_at = np.flatnonzero(micro & np.array([o[3] for o in ops], bool))
        reads = [(k, *x) for k, o in enumerate(ops) for x in o[6]]
        col = (lambda c, dtype: np.array([x[c] for x in reads], dtype)) if reads else (
            lambda c, dtype: np.zeros(0, dtype))
        read_op = col(0, np.int64)
        return types.SimpleNamespace(
            rank=np.array(self.r.rank, np.int64), ops=ids,
            forward=np.array([o[2] for o in ops], bool), counted_at=counted_at,
            counted=ids[counted_at], post_at=np.flatnonzero(~micro), post=ids[~micro],
            partials=[(k, o[4]) for k, o in enumerate(ops) if o[4]],
            leaves=[(k, o[5]) for k, o in enumerate(ops) if o[5]],
            read_op=read_op, read_value=col(1, np.int64), read_from=col(2, np.int64),
            read_micro=col(3, bool) & micro[read_op], read_made_fwd=col(4, bool),
            read_bytes=col(5, np.float64),
            read_fwd=np.array([ops[k][2] for k in read_op], bool),
            read_back=np.array([ops[k][1] == "micro" and not ops[k][2] for k in read_op], bool))

    @functools.cached_property
    def _ops(self) -> list:
        """What `scan` reads of each micro and post op, whatever the cut: (op, region,
        forward?, counted as an op of its own?, its partial sums (forward?, dtype,
        bytes), the state leaves it needs, and per value it reads from another op that
        is not a pre op: (value, producer, made by a micro op?, made forward?, bytes))."""
        g, r = self.g, self.r
        out = []
        for op in g.ops:
            i, reg = op.id, r.region[op.id]
            if reg not in ("micro", "post"):
                continue
            # (a transpose of a gradient XLA folds into the contraction making it: neither
            # time nor an op of its own)
            partial = [(r.forward[i], sum_dtype(g.tensors[o].dtype),
                        sum_bytes(g.tensors[o].dtype, g.tensors[o].nbytes))
                       for o in op.outputs if o in self.partials] if reg == "micro" else []
            leaves, reads = set(), []
            for x in op.inputs:
                if x is None:
                    continue
                if x in self.leaf:
                    leaves.add(self.leaf[x])
                    continue
                j = self.producer.get(x)
                if j is None:
                    continue
                if r.region[j] == "pre":
                    leaves |= r.reads[j]
                    continue
                reads.append((x, j, r.region[j] == "micro", bool(r.forward[j]),
                              g.tensors[x].nbytes))
            out.append((i, reg, bool(r.forward[i]) if reg == "micro" else False,
                        i not in r.folded, partial, frozenset(leaves), tuple(reads)))
        return out

    def work(self, order, cuts, M) -> tuple[list, list]:
        """Per stage, the seconds of one microbatch's forward and backward ops (`_phases`
        keeps them, with what else a microbatch costs)."""
        sc = self.scan(order, cuts)
        return tuple([float(self._micro_seconds(k, M)[ops].sum())
                      for ops, k in zip(sc[way], order)] for way in ("fwd", "bwd"))

    def _micro_seconds(self, island: int, M: int) -> np.ndarray:
        """Per op (by id; 0 for those not run per microbatch), one microbatch's seconds
        on the island (`_Costs.micro`)."""
        key = (island, M)
        if key not in self._micro:
            out = np.zeros(len(self.g.ops))
            ids = self._table.counted
            out[ids] = [self.costs.micro(int(i), island, M) for i in ids]
            self._micro[key] = out
        return self._micro[key]

    def _phases(self, order, cuts, M) -> tuple[list, list]:
        """Per stage, one microbatch's forward and backward seconds as priced: its ops,
        each op's overhead, and a backward's adds into the sums (cached)."""
        key = (tuple(order), tuple(cuts), M)
        if key not in self._phase:
            sc, cluster = self.scan(order, cuts), self.cluster
            extra = self.op_overhead * (M - 1) / M  # per op and microbatch, see OP_OVERHEAD
            fwd, bwd = self.work(order, cuts, M)
            fwd = [x + n * extra for x, (n, _) in zip(fwd, sc["nops"])]
            # a backward adds its gradients to the sums: each buffer it writes into read
            # twice and written once, at the stage's slowest memory (M of them a step)
            add = [3 * n / min(cluster.device_class(d).mem_bandwidth for d in devs)
                   for n, devs in zip(sc["added"], (self.costs.islands[k] for k in order))]
            bwd = [x + n * extra + a for x, (_, n), a in zip(bwd, sc["nops"], add)]
            self._phase[key] = (fwd, bwd)
        return self._phase[key]

    def _grouped(self, order, cuts, members) -> tuple[int, int]:
        """The bytes of the state and of the sums where groups of devices run `members`
        (their stages), each group holding its stages' (cached)."""
        key = (tuple(order), tuple(cuts))
        if key not in self._groups:
            sc = self.scan(order, cuts)
            self._groups[key] = (
                packed_bytes([[x for s in m for x in sc["held"][s]] for m in members],
                             APART_BYTES),
                packed_bytes([[x for s in m for x in sc["sum_items"][s]] for m in members]))
        return self._groups[key]

    def floor(self, order, cuts, M) -> float:
        """A lower bound on `price(order, cuts, M, kind).step` under every schedule: per
        group of devices (a V's ends share one), its stages' microbatches one after
        another and then their ops after the microbatches."""
        fwd, bwd = self._phases(order, cuts, M)
        whole, busy = self.scan(order, cuts)["whole"], {}
        for s, k in enumerate(order):
            busy[k] = busy.get(k, 0.0) + M * (fwd[s] + bwd[s]) + whole[s]
        return max(busy.values()) * (1 - 1e-9)  # (the simulation sums in another order)

    def price(self, order, cuts, M, kind) -> Pipeline | None:
        """`order` may name a group twice (a V shape: stages on one group run one work at a
        time, and nothing crosses between them); the planner's orders do not, and the
        lowering runs none that does (`Pipeline.place` says so)."""
        r, cluster, costs = self.r, self.cluster, self.costs
        S = len(order)
        islands = [costs.islands[k] for k in order]
        gid = {k: i for i, k in enumerate(dict.fromkeys(order))}
        place = tuple(gid[k] for k in order) if len(gid) < S else ()
        if any(order[s] == order[s + 1] for s in range(S - 1)):
            raise ValueError(f"stages {order} next to each other on one group: one stage")
        sc = self.scan(order, cuts)
        owner, whole, once, acc, needs = (sc[k] for k in ("owner", "whole", "once", "acc", "needs"))
        g = self.g
        fwd, bwd = self._phases(order, cuts, M)
        send = sc["send"] / M
        resid = [x / M for x in sc["resid"]]
        rows = tuple(rows_of(cluster, devs, r.batch // M) for devs in islands)
        direct = [rows[s] == rows[s + 1] for s in range(S - 1)]

        def link(a, b):
            return cluster.link_between(islands[a][0], islands[b][0])

        def seconds(a, b, nbytes, scale=1):
            if nbytes <= 0 or order[a] == order[b]:  # (stages on one group: held there)
                return 0.0
            return link(a, b).alpha + scale * nbytes / link(a, b).beta

        # per boundary, bytes each way (a transfer past the next stage priced on its last
        # hop; none between stages on one group)
        fbytes = [sum(send[a, s + 1, 0] for a in range(s + 1) if order[a] != order[s + 1])
                  for s in range(S - 1)]
        bbytes = [sum(send[b, s, 1] for b in range(s + 1, S) if order[b] != order[s])
                  for s in range(S - 1)]
        scale = [1 if direct[s] else len(islands[s]) for s in range(S - 1)]
        fw = [seconds(s, s + 1, fbytes[s], scale[s]) for s in range(S - 1)]
        bw = [seconds(s + 1, s, bbytes[s], scale[s]) for s in range(S - 1)]
        # a tick's crossing when the lowering sends it during the next tick (`lockstep`):
        # per shift between stages (skips too), every pair that ever sends on it crosses
        # with the shift's widest message (gathered over the stage's devices first if any
        # pair splits rows differently); one round after the other (`wire_rounds`)
        shift_s, pairs, gathered = {}, {}, set()
        for d in {b - a for a in range(S) for b in range(S) if a != b and send[a, b].any()}:
            pairs[d] = [(a, a + d) for a in range(S) if 0 <= a + d < S and send[a, a + d].any()]
            wide = max(send[a, b].max() for a, b in pairs[d])
            if any(rows[a] != rows[b] for a, b in pairs[d]):
                gathered.add(d)
            shift_s[d] = max(seconds(a, b, wide, len(islands[a]) if d in gathered else 1)
                             for a, b in pairs[d])
        wire = sum(max(shift_s[d] for d in rnd) for rnd in wire_rounds(pairs, gathered))
        copy = np.zeros((S, S))  # parameter bytes a -> b before the first tick (one buffer)
        for s in range(S):
            for p in needs[s]:
                if owner[p] != s:
                    copy[owner[p], s] += g.tensors[g.inputs[p]].nbytes
        copied = {(a, b): seconds(a, b, copy[a, b]) for a in range(S) for b in range(S)
                  if copy[a, b] > 0}
        on_link: dict = {}  # per direction of a link between groups, its copies one by one
        for (a, b), t in copied.items():
            on_link[order[a], order[b]] = on_link.get((order[a], order[b]), 0.0) + t
        head = max([0.0, *on_link.values()])
        ready: dict = {}  # free-running, the copies run under the first works, on their links
        for (a, b), t in copied.items() if self.free_running else ():
            key = ("F", b - 1) if a < b else ("B", b)
            ready[key] = max(ready.get(key, 0.0), on_link[order[a], order[b]])
        # memory: one SPMD program gives every device the same buffers, each sized for
        # the stage needing most (state, copies, sums, keep pool, mailboxes), and the data
        cap = min(cluster.classes[cluster.class_of(d)].memory for devs in islands for d in devs)
        # per group of devices, its stages (one each unless groups repeat): one copy each
        members = [[t for t in range(S) if place[t] == j] for j in range(max(place) + 1)
                   ] if place else [[s] for s in range(S)]
        copied_bytes = [sum(g.tensors[g.inputs[p]].nbytes for p in set().union(
            *(needs[t] for t in m)) if order[owner[p]] != order[m[0]]) for m in members]
        share = [max(x / (r.batch // M) for x in rs) for rs in rows]
        per_micro = [resid[s] * share[s] for s in range(S)]  # one microbatch's residuals, per device
        state, sums = sc["state"], sc["sums"]
        if place:  # a group holds the state and sums of every stage on it
            state, sums = self._grouped(order, cuts, members)
        fixed = state + max(copied_bytes) + sums + self.data_bytes
        keep = max(per_micro)
        # (a stage keeping nothing takes no slot of the pool, however deep its warm-up)
        memory_cap = [max(1, int((cap - fixed) // keep)) - 1 if keep and per_micro[s] > 0
                      else M for s in range(S)]
        base, best = [min(S - s, M) for s in range(S)], None
        for late in (0, 1) if self.overlaps and not self.free_running and S > 1 else (0,):
            def run(x, late=late):
                return x if self.free_running else lockstep(x, fwd, bwd, fw, bw,
                                                            wire if late else None)
            caps = memory_cap
            while True:  # hetero-1F1B shallower until it fits (the caps count the keep pool
                # alone: its mailboxes and wires grow with its depths too)
                try:
                    got = run(schedule(kind, fwd, bwd, M, fw, bw, memory_cap=caps,
                                       cost=None if self.free_running else (
                                           lambda x, run=run: run(x).makespan),
                                       ready=ready if self.free_running else None,
                                       place=place or None))
                except RuntimeError:
                    return None
                used = fixed + self._buffers(got, late, send, share, rows, islands, per_micro,
                                             sc["readers"], members)
                tighter = [min(c, d - 1) if d > b else c
                           for c, d, b in zip(caps, got.depths or base, base)]
                if used <= cap or kind != "hetero-1f1b" or tighter == list(caps):
                    break
                caps = tighter
            if best is None or (used > cap, got.makespan) < (best[2] > cap, best[0].makespan):
                best = (got, late, used)
        sch, delay, used = best
        tail, sync = [], [all_reduce(cluster, acc[s], islands[s]) for s in range(S)]
        for s in range(S):
            recv = sum(seconds(a, s, once[a, s]) for a in range(S) if a != s)
            tail.append(sync[s] + recv + whole[s])
        if place:  # a group's stages run their once-per-step rounds one after another, from
            # its last work (free-running; the copies already in `ready`) or the last tick
            last = {j: sch.makespan + head for j in set(place)}
            if self.free_running:
                last = {j: max(x.end for x in sch.slots if place[x.stage] == j) for j in last}
            step = max(last[j] + sum(t for t, k in zip(tail, place) if k == j) for j in last)
        elif self.free_running:  # a stage sums and sends its part once its own last work is done
            done = [max([0.0] + [x.end for x in sch.slots if x.stage == s]) + sync[s]
                    for s in range(S)]
            step = max(max([done[s]] + [done[a] + seconds(a, s, once[a, s])
                                        for a in range(S) if a != s]) + whole[s]
                       for s in range(S))
        else:  # as lowered: the copies before the tick loop, the once-per-step rounds after it
            step = head + sch.makespan + max(tail)
        memory = (used,) * S
        fits = memory[0] <= cap
        return Pipeline(tuple(order), tuple(cuts), M, kind, step, sch, tuple(fwd), tuple(bwd),
                        tuple(tail), head, tuple(fw), tuple(bw), memory, fits, rows,
                        delay=delay, ops=tuple(f + b for f, b in sc["nops"]), place=place)

    def _buffers(self, sch, delay, send, share, rows, islands, per_micro, readers,
                 members) -> float:
        """Per device, the bytes of the keep pool (its slots and the microbatch being
        worked on), the mailboxes and the wires the lowering allocates for `sch`'s table
        (`synth/slots.py`), each slot sized for the stage needing most. A group of devices
        running several stages (a V's what-if) keeps each stage's values in a pool of its
        own, as many slots as it has microbatches in flight at once, plus the one worked on."""
        S = sch.stages
        message, channels = {}, {}  # per channel (shift, phase): bytes per device, senders
        for a in range(S):
            for b in range(S):
                for way, ph in enumerate("FB"):
                    if a == b or send[a, b, way] <= 0:
                        continue
                    size = send[a, b, way] * share[a] * (len(islands[a]) if rows[a] != rows[b] else 1)
                    c = (b - a, ph)
                    message[c] = max(message.get(c, 0.0), size)
                    # (a message waits until its last reader: a backward reading it alone)
                    channels.setdefault(c, {})[a] = readers[(a, b, way)]
        rows = ticks(sch)
        tables = tick_tables(rows, S, [x > 0 for x in per_micro], channels, delay)
        mail = sum((tables.mail_slots[c] + 1) * n for c, n in message.items())  # + a spare row
        wires = {}
        for (d, _), n in message.items():
            wires[d] = max(wires.get(d, 0.0), n)
        pool = (tables.keep_slots + 1) * max(per_micro)
        if len(members) < S:
            fwd = {(s, m): t for t, s, m, ph in rows if ph == "F"}
            bwd = {(s, m): t for t, s, m, ph in rows if ph == "B"}
            live = [max([0] + [sum(1 for (x, m), f in fwd.items() if x == s and f <= t <= bwd[x, m])
                               for t in {r[0] for r in rows}]) for s in range(S)]
            pool = max(sum((live[s] + 1) * per_micro[s] for s in m) for m in members)
        return pool + mail + (1 + delay) * sum(wires.values())


def lockstep(sch: PipeSchedule, fwd, bwd, send, send_back, wire=None) -> PipeSchedule:
    """`sch` as the lowering runs it: a table of ticks (`ticks`), each tick's work in one
    switch on every device (a group of devices running several stages, a V shape's
    what-if: one work per stage, the group's one after another). Without `wire`, what a
    tick made crosses to its readers by `ppermute` after the work, in the same iteration
    of the tick loop: a tick lasts its longest work plus its forwards' longest transfer
    and then its backwards' (a link direction carrying one message at a time). With
    `wire` (seconds), what a tick made crosses during the next tick, on every pair its
    shift may use (device runtimes whose collectives run beside independent work: XLA's
    GPU async collectives): a tick lasts its longest work or `wire`, whichever is longer,
    and readers across a boundary sit a tick later."""
    S = sch.stages
    rows = ticks(sch) if wire is None else late_ticks(sch)
    by_tick: dict = {}
    for t, s, m, ph in rows:
        by_tick.setdefault(t, []).append((s, m, ph))
    slots, end = [], 0.0
    for t in sorted(by_tick) if wire is None else range(max(by_tick) + 1):
        work = by_tick.get(t, [])
        busy: dict = {}  # per group: its stages' work this tick, one after another
        for s, m, ph in work:
            d = fwd[s] if ph == "F" else bwd[s]
            at = end + busy.get(sch.group(s), 0.0)
            slots.append(Slot(s, m, ph, at, at + d))
            busy[sch.group(s)] = busy.get(sch.group(s), 0.0) + d
        length = list(busy.values())
        if wire is not None:  # a tick without work still carries the last one's messages
            end += max([wire, *length])
            continue
        moved: dict = {}  # per link direction, its messages this tick one after another
        for s, _, ph in work:
            if ph == "F" and s < S - 1:
                moved[("F", s)] = moved.get(("F", s), 0.0) + send[s]
            elif ph == "B" and s > 0:
                moved[("B", s - 1)] = moved.get(("B", s - 1), 0.0) + send_back[s - 1]
        # the forwards' shift, then the backwards' (the lowering orders them), each as
        # long as its slowest link
        end += max(length) + sum(max([0.0] + [t for (ph, _), t in moved.items() if ph == way])
                                 for way in "FB")
    return PipeSchedule(sch.kind, S, sch.micros, tuple(slots), end, sch.in_flight, sch.depths,
                        tuple(rows), sch.place)


def ticks(sch: PipeSchedule, lag=None) -> list[tuple[int, int, int, str]]:
    """The schedule as a static table of (tick, stage, microbatch, "F"/"B"): each stage's
    work in its simulated order, a tick after what it waits for (its previous work, the
    forward before it, the backward after it), as early as that allows and, across
    boundary s, `lag[("F" or "B", s)]` ticks later still. A tick runs one work per stage
    (a group of devices running several stages runs theirs one after another in it). A
    schedule run in lock step keeps the table it ran (`PipeSchedule.ticks`)."""
    if sch.ticks and lag is None:
        return [tuple(r) for r in sch.ticks]
    lag = lag or {}
    S = sch.stages
    before: dict = {}
    last: dict = {}
    for x in sch.slots:  # the simulation lists each stage's work in the order it ran it
        key = (x.phase, x.stage, x.micro)
        before[key] = last.get(x.stage)
        last[x.stage] = key
    when: dict = {}

    def tick(key) -> int:
        if key not in when:
            ph, s, m = key
            deps = [(before[key], 0)]
            if ph == "F" and s > 0:
                deps.append((("F", s - 1, m), lag.get(("F", s - 1), 0)))
            if ph == "B":
                deps.append((("F", s, m), 0))
                if s < S - 1:
                    deps.append((("B", s + 1, m), lag.get(("B", s), 0)))
            when[key] = 1 + max([-1] + [tick(d) + e for d, e in deps if d is not None])
        return when[key]

    return sorted((tick(k), k[1], k[2], k[0]) for k in before)


def late_ticks(sch: PipeSchedule) -> list[tuple[int, int, int, str]]:
    """The tick table of `sch` sending a tick late: every reader across a boundary a tick
    after the message crossed (what a plan with `delay` 1 runs; nothing crosses between
    stages on one group)."""
    return ticks(sch, {(ph, s): 1 for ph in "FB" for s in range(sch.stages - 1)
                       if sch.group(s) != sch.group(s + 1)})


def as_plan(pipe: Pipeline, dp: Plan, spmd: Plan, cluster: Cluster, runtime: str = "ticks") -> Plan:
    """The pipeline as a `Plan`: the data-parallel plan's layouts (each stage runs its ops
    at them, per microbatch), the pipeline's price, stages and schedule; `spmd` (the best
    SPMD-only plan) gives the baselines, with its own time as "SPMD". `runtime`: "ticks"
    (one SPMD program stepping the schedule's tick table, `lower.pipeline.Pipelined`) or
    "free" (a program per stage and phase, each run once its inputs are there,
    `lower.freerun.FreeRunning`: `pipe` priced free-running; it may run several stages on
    one group of devices)."""
    from dataclasses import replace

    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    if pipe.place and runtime != "free":
        raise ValueError(f"a pipeline running several stages on one group of devices "
                         f"({pipe.order}) runs free only (runtime='free'), not in ticks")
    M = pipe.micros
    names = [c.name for c in cluster.classes]
    if pipe.whole_islands and runtime != "free" and islands_differ(cluster):
        raise ValueError("a pipeline whose stages hold islands of unequal device counts "
                         f"({[len(d) for d in islands_of(cluster)]}) runs free only "
                         "(runtime='free'), not in ticks")
    islands, of = stage_groups(cluster, pipe.whole_islands)
    busy_stage = [M * (f + b) + t for f, b, t in zip(pipe.forward, pipe.backward, pipe.tail)]
    # (a group of devices running several stages, a V's, is busy with all of them)
    busy_stage = [sum(x for k, x in zip(pipe.order, busy_stage) if k == pipe.order[s])
                  for s in range(len(busy_stage))]
    work = sum(f + b for f, b in zip(pipe.forward, pipe.backward)) or 1.0
    ratios = dict.fromkeys(names, 0.0)
    busy = dict.fromkeys(names, 0.0)
    need = dict.fromkeys(names, 0)
    for s, k in enumerate(pipe.order):  # a class may hold parts of several stages
        devs = islands[k]
        for d, rows in zip(devs, pipe.rows[s]):  # the rows it holds, whole
            n = cluster.classes[cluster.class_of(d)].name
            ratios[n] += float((pipe.forward[s] + pipe.backward[s]) / work
                               * rows / max(sum(pipe.rows[s]), 1))
            busy[n] = max(busy[n], float(busy_stage[s]))
            need[n] = max(need[n], int(pipe.memory[s]))
    stages = []
    for s, k in enumerate(pipe.order):
        stages.append({"island": part_name(cluster, islands, of, k),
                       "devices": list(islands[k]),
                       "from_rank": 0 if s == 0 else int(pipe.cuts[s - 1]),
                       "rows": list(pipe.rows[s]), "forward": float(pipe.forward[s]),
                       "backward": float(pipe.backward[s]), "tail": float(pipe.tail[s]),
                       "memory": int(pipe.memory[s]), "ops": int(pipe.ops[s]),
                       "in_flight": int(pipe.schedule.in_flight[s])})
    sch = pipe.schedule
    pipeline = {"micros": M, "schedule": pipe.kind, "cuts": [int(c) for c in pipe.cuts],
                "table": [list(t) for t in ticks(sch)],
                "slots": [[x.stage, x.micro, x.phase, x.start, x.end] for x in sch.slots],
                "makespan": float(sch.makespan), "bubble": float(sch.bubble()),
                "head": float(pipe.head), "send": [float(x) for x in pipe.send],
                "send_back": [float(x) for x in pipe.send_back],
                "by_kind": {k: float(v) for k, v in pipe.by_kind.items()},
                "delay": int(pipe.delay), "runtime": runtime}
    compute = max(M * (f + b) for f, b in zip(pipe.forward, pipe.backward))
    return replace(
        dp, predicted_step_time=float(pipe.step), chosen="pipeline", ratios=ratios,
        breakdown={"compute": compute, "inline_comm": float(pipe.head + sum(pipe.send)
                                                            + sum(pipe.send_back)),
                   "deferred_comm": float(max(pipe.tail)),
                   "exposed_comm": float(pipe.step - compute),
                   "compute_per_class": busy,
                   "idle_per_class": {n: float(pipe.step - b) for n, b in busy.items()}},
        baselines={**spmd.baselines, "SPMD": spmd.predicted_step_time},
        baseline_memory=spmd.baseline_memory, baseline_ops=spmd.baseline_ops,
        baseline_busy=spmd.baseline_busy,
        memory={n: {"need": need[n], "capacity": int(cluster.classes[c].memory)}
                for c, n in enumerate(names)},
        solver={**spmd.solver}, timeline=(), stages=stages, pipeline=pipeline, conversions=())
