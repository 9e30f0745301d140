"""What each op of a step costs per microbatch on each group of devices a stage may hold.

An op run per microbatch works on 1/M of the batch's rows: its flops and per-example
bytes scale with the rows a device holds, while the bytes of values without rows in
them (state read, or made from it alone; a weight's gradient, a partial sum) are
touched whole by every microbatch. A group mixing device classes is priced at its
slowest class, each class at the most rows one of its devices holds.
"""
from __future__ import annotations

import functools

import numpy as np

from hapsynth.cluster import Cluster
from hapsynth.ir.graph import Cost, Graph
from hapsynth.synth.costmodel import compute_time
from hapsynth.synth.stages import Regions
from hapsynth.synth.stagegroups import rows_of

__all__ = ["OpCosts"]


class OpCosts:
    """Per op and group of devices (`stage_groups`): seconds of one microbatch (cached)."""

    def __init__(self, graph: Graph, cluster: Cluster, regions: Regions, islands, layouts):
        self.graph, self.cluster, self.regions = graph, cluster, regions
        self.islands = islands
        self._micro: dict = {}
        self._rows: dict = {}
        self._running: dict = {}
        self._whole: dict = {}
        self.fixed = _fixed_bytes(graph, regions, layouts)
        self.share = [_flops_shares(cluster, devs) for devs in islands]

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

    def whole(self, op, island: int) -> float:
        """Seconds of the op run once, unsplit, on the island (an op after the
        microbatches: the optimizer)."""
        key = (op, island)
        if key not in self._whole:
            self._whole[key] = max(compute_time(self.graph.ops[op].cost, self.cluster.classes[c])
                                   for c in self.share[island])
        return self._whole[key]

    def _at(self, op, share: dict, M: int) -> float:
        cost = self.graph.ops[op].cost
        fixed = min(self.fixed[op], cost.bytes)
        return max(compute_time(Cost(cost.flops * f / M, cost.transcendentals * f / M,
                                     (cost.bytes - fixed) * f / M + fixed), self.cluster.classes[c])
                   for c, f in share.items())


def _fixed_bytes(graph: Graph, regions: Regions, layouts) -> list:
    """Per op: the bytes of its values without the batch's rows in them, which every
    microbatch touches whole."""
    state = set(graph.inputs[:len(regions.owner_rank)])
    whole = {t for t, x in enumerate(graph.tensors) if t in state or layouts[t].kind == "P"
             or x.producer is not None and regions.region[x.producer] == "pre"}
    return [sum(graph.tensors[t].nbytes for t in {*op.inputs, *op.outputs} & whole)
            * op.repeat for op in graph.ops]


def _flops_shares(cluster: Cluster, devices) -> dict:
    """Per device class among `devices`, its share of their FLOP/s."""
    total = sum(cluster.device_class(d).flops for d in devices)
    classes = sorted({cluster.class_of(d) for d in devices})
    return {c: cluster.classes[c].flops / total for c in classes}
