"""hapsynth: synthesise SPMD programs with uneven shards for heterogeneous GPU clusters.

The pipeline, one folder per stage: `ir/` (trace a train step, lift it to the sharding
IR) -> `synth/` (price strategies on a `cluster/` description, search, CP-SAT: a `Plan`)
-> `lower/` (the Plan as one `jit(shard_map)` program) -> `api.py` (what users call);
`view/` shows plans, clusters and reports (HTML, matplotlib pictures).
"""
from hapsynth.api import Parallelized, inspect, parallelize
from hapsynth.cluster import Cluster, ClusterError, DeviceClass, LinkLevel
from hapsynth.lower.values import Sharded, Staged, StagedRows, gather
from hapsynth.synth.plan import Plan, PlanMismatch
from hapsynth.synth.synthesize import InfeasibleMemory, NoDataParallelism


def plot_plans(plans, labels=None, ax=None):
    """Several plans side by side (needs `hapsynth[plot]`); see `hapsynth.view.plots`."""
    from hapsynth.view.plots import plot_plans as draw
    return draw(plans, labels=labels, ax=ax)


__all__ = ["Cluster", "ClusterError", "DeviceClass", "InfeasibleMemory", "LinkLevel",
           "NoDataParallelism", "Parallelized", "Plan", "PlanMismatch", "Sharded", "Staged", "StagedRows", "gather",
           "inspect", "parallelize", "plot_plans"]
__version__ = "0.1.0"
