"""The search for a pipeline across islands: stage cuts, stage orders, microbatch counts
and schedules, each candidate priced by `pipeprice.Pricer`.

A pipeline here is one stage per island or per equal part of one (`stage_parts`), in
some order of the islands, each stage a contiguous range of ranks (`stages.py`); or one
stage over every device (`stage_groups`: gradient accumulation across the islands).
Cuts are shortlisted where stages balance, with or without the slowest link's transfers
added, then priced in order of a bound while it could beat the best found; the best
(cut, order, microbatches, schedule) is returned with every schedule's price at that
point for comparison. A what-if the lowering does not run yet (`plan_vshape`): a V
shape, the first and last stages on one group of devices (running one work at a time)
and the middle on another.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from hapsynth.cluster import Cluster
from hapsynth.ir.graph import Graph
from hapsynth.synth.opcosts import OpCosts
from hapsynth.synth.pipeprice import Pipeline, Pricer
from hapsynth.synth.stagegroups import stage_groups, stage_parts
from hapsynth.synth.stages import Regions

__all__ = ["plan_pipeline", "plan_vshape", "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b", "hetero-1f1b")


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
    costs, pricer = _pricer(graph, cluster, regions, layouts, num_state_leaves, free_running,
                            whole_islands)
    one_stage = _whole_stage(costs, S) if whole == "only" or whole and by_links else []
    points = regions.cut_points()
    if whole == "only" or len(points) < S - 1:
        return _cheapest(pricer, one_stage, kinds, whole_islands)
    combos = np.array(list(itertools.combinations(points, S - 1)), np.int64).reshape(-1, S - 1)
    if len(combos) > 20000:  # many islands and layers: every other cut point
        combos = combos[np.all(np.isin(combos, points[::2]), axis=1)]
    orders = [tuple(p for k in perm for p in range(S) if island_of_part[p] == k)
              for perm in itertools.permutations(range(cluster.num_islands))]
    short = _shortlist(graph, cluster, regions, costs, islands, orders, points, combos, keep,
                       by_links)
    found = _CheapPrices(pricer, kinds, regions.batch, islands)
    for order, cuts in short.cuts:
        found.add(order, cuts)
    listed = {k: sorted(v)[:4] for k, v in found.got.items()}
    # then, lowest bound first, every other cut whose bound is below the best step that
    # fits so far: the shortlists judge cuts by balance, and may miss an unbalanced cut
    # pricing better (where little crosses, or an island adds less than the bubble costs)
    tried = set(short.cuts)
    for j in np.argsort(short.floor, kind="stable")[:max_cuts if by_links else 0]:
        if short.floor[j] >= found.fit:
            break
        order, cuts = orders[j // len(combos)], tuple(int(c) for c in combos[j % len(combos)])
        if (order, cuts) not in tried:
            found.add(order, cuts)
    return _cheapest(pricer, found.best(listed, short.balanced) + one_stage, kinds,
                     whole_islands)


def _pricer(graph, cluster, regions, layouts, num_state_leaves, free_running, whole_islands
            ) -> tuple[OpCosts, Pricer]:
    """The ops' costs on each group of devices a stage may hold, and the pricing over them."""
    costs = OpCosts(graph, cluster, regions, stage_groups(cluster, whole_islands)[0], layouts)
    return costs, Pricer(graph, cluster, regions, num_state_leaves, costs, layouts, free_running)


@dataclass(frozen=True, eq=False)
class _Shortlist:
    """The cuts to price first, as (order, cuts): per stage order the `keep` most
    balanced (`balanced`), and the `keep` balanced once the slowest link's transfers are
    added (a tick waits for what it sends: where little crosses a slow link); `floor`,
    per order and then per row of cuts, a bound on the step."""

    cuts: list
    balanced: frozenset
    floor: np.ndarray


def _shortlist(graph, cluster, regions, costs: OpCosts, islands, orders, points, combos,
               keep: int, by_links: bool) -> _Shortlist:
    """The shortlist of `combos` (rows of cuts) under each of `orders` (stage `s` on
    `islands[order[s]]`)."""
    S = combos.shape[1] + 1
    prefix = [costs.running(k) for k in range(S)]
    bounds = _spans(costs.ranked[1], combos)
    own_ranks, least = _least_work(costs, regions, S)
    own_bounds = _spans(own_ranks, combos)
    crossing = _crossing(graph, regions, points)
    where = np.searchsorted(points, combos)
    picked, balanced, floors = [], set(), []
    for order in orders:
        worst, floor = _busiest(prefix, bounds, order), _busiest(least, own_bounds, order)
        links = np.stack([crossing[where[:, s]] / cluster.link_between(
            islands[order[s]][0], islands[order[s + 1]][0]).beta for s in range(S - 1)], axis=1)
        floors.append(np.maximum(floor, links.max(axis=1)))  # (a link carries its bytes too)
        best = dict.fromkeys([*np.argsort(worst, kind="stable")[:keep], *(
            np.argsort(worst + links.max(axis=1), kind="stable")[:keep] if by_links else ())])
        picked += [(order, tuple(int(c) for c in combos[k])) for k in best]
        balanced |= {(order, tuple(int(c) for c in combos[k]))
                     for k in np.argsort(worst, kind="stable")[:keep]}
    return _Shortlist(picked, frozenset(balanced), np.concatenate(floors))


def _least_work(costs: OpCosts, regions: Regions, S: int) -> tuple[np.ndarray, list]:
    """A bound on any step with given cuts: a stage's own work, the whole batch at once
    (its microbatches cost no less), and its ops after the microbatches (the optimizer).
    Their ranks, sorted, and per group of devices the running sum of their seconds."""
    micro_ops = costs.ranked[0]
    own = sorted([(regions.rank[i], i, False) for i in micro_ops if i not in regions.folded]
                 + [(regions.rank[i], i, True) for i, r in enumerate(regions.region)
                    if r == "post" and regions.rank[i] >= 0])
    least = [np.concatenate([[0.0], np.cumsum([costs.whole(i, k) if post else costs.least(i, k)
                                               for _, i, post in own])]) for k in range(S)]
    return np.array([x[0] for x in own], np.int64), least


class _CheapPrices:
    """Cuts priced at every microbatch count under the cheap schedules asked for (plain
    1F1B standing in for hetero-1F1B, which searches its depths): per schedule, its
    ((unfit?, step), order, cuts, microbatches); `fit`, the best step that fits so far."""

    def __init__(self, pricer: Pricer, kinds, batch: int, islands):
        self.pricer, self.batch, self.islands = pricer, batch, islands
        self.kinds = tuple(k for k in kinds if k in ("1f1b", "gpipe")) or ("1f1b",)
        self.got: dict = {k: [] for k in self.kinds}
        self.fit = np.inf

    def add(self, order, cuts) -> None:
        for M in _micro_counts(self.batch, len(self.islands),
                               max(len(self.islands[k]) for k in order)):
            for kind in self.kinds:
                p = self.pricer.price(order, cuts, M, kind)
                if p is not None:
                    self.got[kind].append(((not p.fits, p.step), order, cuts, M))
                    if p.fits:
                        self.fit = min(self.fit, p.step)

    def best(self, listed: dict, balanced) -> list:
        """The (order, cuts, microbatches) to price under every schedule asked for: per
        schedule its best few, the shortlists' best few (`listed`: under the other
        schedules they may still price best), and the best few of the `balanced` cuts
        (where the schedules differ most)."""
        again = []
        for kind, got in self.got.items():
            got.sort()
            again += got[:4] + listed[kind] + [x for x in got if (x[1], x[2]) in balanced][:4]
        return list(dict.fromkeys((o, c, m) for _, o, c, m in again))


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
    if cluster.num_islands < 2:
        return None
    parts, island = stage_parts(cluster, whole_islands)
    costs, pricer = _pricer(graph, cluster, regions, layouts, num_state_leaves, free_running,
                            whole_islands)
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
            rough = np.maximum(_busiest_v(costs, spans, o, v, M), crossing / beta)
            ranked = [tuple(int(c) for c in combos[k])
                      for k in np.argsort(rough, kind="stable")[:keep]]
            mine = _price_vs(pricer, (o, v, o), M, ranked, few, top)
            first += mine
            best += sorted(mine)[:few]
            top = sorted(first)[:12]
    picked = [x[1:] for x in sorted(first)[:12] + best]
    return _cheapest(pricer, list(dict.fromkeys(picked)), kinds, whole_islands)


def _busiest_v(costs: OpCosts, spans, o: int, v: int, M: int) -> np.ndarray:
    """Per row of `spans` (two cuts): the work of the busier group, the ends' on `o` or
    the middle's on `v`, at M microbatches."""
    pre = {k: costs.running(k, M) for k in (o, v)}
    outer = (pre[o][spans[:, 1]] - pre[o][spans[:, 0]]
             + pre[o][spans[:, 3]] - pre[o][spans[:, 2]])
    return np.maximum(outer, pre[v][spans[:, 2]] - pre[v][spans[:, 1]]) * M


def _price_vs(pricer: Pricer, order, M: int, ranked, few: int, top) -> list:
    """The V `order` at `ranked` cuts priced under plain 1F1B, as ((unfit?, step), order,
    cuts, M); a cut whose bound is above the `few` best of these and the dozen best of
    all (`top`), each fitting, is picked by neither and skipped."""
    mine = []
    for cuts in ranked:
        if len(mine) >= few and len(top) + len(mine) >= 12:
            mine.sort()
            worst = max(mine[few - 1][0], sorted(top + mine)[11][0])
            if not worst[0] and pricer.floor(order, cuts, M) > worst[1]:
                continue
        p = pricer.price(order, cuts, M, "1f1b")
        if p is not None:
            mine.append(((not p.fits, p.step), order, cuts, M))
    return mine


def _whole_stage(costs, S: int) -> list:
    """One stage over every device (gradient accumulation across the islands; where links
    are fast, the microbatches' memory without a pipeline's bubble or crossings): its
    (order, cuts, microbatches) to price."""
    return [((S,), (), m) for m in _micro_counts(costs.regions.batch, 1, len(costs.islands[S]))
            if m > 1]


def _cheapest(pricer: Pricer, candidates, kinds, whole_islands: bool = False) -> Pipeline | None:
    """The best of (order, cuts, microbatches) `candidates` under `kinds` (one that fits
    first), with its step under every schedule (`whole_islands`: what its groups are)."""
    best = None
    for order, cuts, M in candidates:
        if best is not None and best.fits and pricer.floor(order, cuts, M) > best.step:
            continue  # (it could not beat the best so far, fitting or not)
        for kind in kinds:
            p = pricer.price(order, cuts, M, kind)
            if p is not None and (best is None or (not p.fits, p.step) < (not best.fits, best.step)):
                best = p
    if best is None:
        return None
    by_kind = {k: pricer.price(best.order, best.cuts, best.micros, k).step for k in SCHEDULES}
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
