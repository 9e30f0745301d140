"""The groups of devices a pipeline's stages may hold, and the rows each device takes.

A stage holds one island, an equal part of one (`stage_parts`), or every device
(`stage_groups`: gradient accumulation across the islands). Inside its group a stage
is data parallel at FLOP/s-proportional whole rows (`rows_of`).
"""
from __future__ import annotations

import math

import numpy as np

from hapsynth.cluster import Cluster

__all__ = ["islands_of", "islands_differ", "stage_parts", "stage_groups", "part_name",
           "rows_of"]


def islands_of(cluster: Cluster) -> list[tuple[int, ...]]:
    """Per island, its devices."""
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
