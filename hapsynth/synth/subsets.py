"""Plans that leave devices idle: when the slowest class or the slowest links cost more
than their devices add (a small step on a big cluster, a few fast GPUs beside many slow
ones), the step runs faster on part of the cluster.

Candidates are the fastest classes and, for a cluster of several hosts or islands, the
strongest island and host (fast links only). One is searched only when its lower bound
(the step's FLOPs over its FLOP/s) beats the best plan so far, and either by 3x or
data parallelism there beats it too: a step that needs the whole cluster costs little
more to plan.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from hapsynth.cluster import Cluster
from hapsynth.ir.graph import Graph
from hapsynth.synth.plan import Plan, class_memory

ALL = "all-devices"  # the baselines key: the best plan found that uses every device


def flops_of(cluster: Cluster, devices) -> float:
    """The FLOP/s of `devices` together."""
    return sum(cluster.device_class(d).flops for d in devices)


def candidates(cluster: Cluster) -> list[tuple[int, ...]]:
    """Device subsets worth planning on, fastest-first: the k fastest classes (k below the
    number of classes), the island and the host with the most FLOP/s."""
    order = sorted(range(cluster.num_classes), key=lambda ci: -cluster.classes[ci].flops)
    out = [tuple(sorted(d for ci in order[:k] for d in cluster.class_devices(ci)))
           for k in range(1, cluster.num_classes)]
    groups = []
    if cluster.num_islands > 1:
        groups.append([cluster.island_devices(k) for k in range(cluster.num_islands)])
    if cluster.num_hosts > 1:
        hosts = sorted({d.host for d in cluster.devices})
        groups.append([tuple(d.index for d in cluster.devices if d.host == h) for h in hosts])
    for group in groups:
        out.append(max(group, key=lambda ds: flops_of(cluster, ds)))
    full = tuple(range(cluster.num_devices))
    return [s for s in dict.fromkeys(out) if s != full]


def on_fewer_devices(graph: Graph, cluster: Cluster, best: Plan | None, plan_on: Callable,
                     probe: Callable, baselines_of: Callable, min_gain: float,
                     unfit: Exception | None = None):
    """The best of `best` (the plan on every device; None when none fits, `unfit` saying
    why) and plans on `candidates`, each made by `plan_on(subcluster)` when its lower
    bound beats the best so far by `min_gain` and, unless it is under a third of it, so
    does `probe(subcluster)` (a quick price there: data parallelism that fits, else
    infinity). `baselines_of()`: the data-parallel plan on every device (or None), asked
    for only when `best` is None. A plan on fewer devices keeps the whole cluster's
    baselines and ideal (what a user would otherwise run there) and reports the plan on
    every device as `baselines["all-devices"]`. Raises `unfit` when nothing fits."""
    target = best.predicted_step_time if best is not None else float("inf")
    winner = None
    for devs in sorted(candidates(cluster), key=lambda ds: -flops_of(cluster, ds)):
        bound = graph.flops / flops_of(cluster, devs)
        if bound >= target * (1 - min_gain):
            continue  # even perfectly balanced, these devices are too few
        sub = cluster.subset(devs)
        if bound > target / 3 and probe(sub) >= target * (1 - min_gain):
            continue  # little headroom and data parallelism there no better: not worth a search
        try:
            plan = plan_on(sub)
        except ValueError:  # infeasible memory or no data parallelism on these devices
            continue
        if plan.predicted_step_time < target * (1 - min_gain):
            winner, target = (devs, plan), plan.predicted_step_time
    if winner is None:
        if best is None:
            raise unfit
        return best
    devs, plan = winner
    base = best if best is not None else baselines_of()  # None: no data parallelism at all
    return replace(
        plan, cluster=cluster.name, devices=devs,
        chosen=f"{plan.chosen} on {len(devs)} of {cluster.num_devices} devices",
        baselines={**{k: v for k, v in (base.baselines if base else {}).items() if k != "ideal"},
                   "ideal": graph.flops / cluster.total_flops,
                   ALL: best.predicted_step_time if best else float("nan")},
        baseline_memory=base.baseline_memory if base else {},
        baseline_ops=base.baseline_ops if base else {},
        baseline_busy=base.baseline_busy if base else {},
        ratios={c.name: plan.ratios.get(c.name, 0.0) for c in cluster.classes},
        memory={c.name: plan.memory.get(c.name, class_memory(c.memory))
                for c in cluster.classes},  # idle classes too: the baselines run there
        solver={**plan.solver, "devices": _why(cluster, devs, best, unfit)})


def _describe(cluster: Cluster, devs) -> str:
    counts: dict = {}
    for d in devs:
        name = cluster.device_class(d).name
        counts[name] = counts.get(name, 0) + 1
    hosts = sorted({cluster.host_of(d) for d in devs})
    return (" + ".join(f"{n} x{k}" for n, k in counts.items())
            + f" on host{'s' if len(hosts) > 1 else ''} {', '.join(map(str, hosts))}")


def _why(cluster: Cluster, devs, best: Plan | None, unfit) -> str:
    idle = cluster.num_devices - len(devs)
    every = (f"{best.predicted_step_time:.4g} s with every device" if best is not None
             else f"no plan on every device fits: {unfit}")
    return f"{len(devs)} of {cluster.num_devices} devices ({_describe(cluster, devs)}), " \
           f"{idle} idle; {every}"
