"""hapsynth: synthesise SPMD programs with uneven shards for heterogeneous GPU clusters.

Pipeline, one folder per stage: `ir/` (trace + sharding IR) -> `synth/` (cluster,
cost model, CP-SAT) -> `lower/` (shard_map program) -> `api.py` (what users call).
"""
from hapsynth.api import Parallelized, inspect, parallelize
from hapsynth.lower.values import Sharded, gather
from hapsynth.synth.cluster import Cluster, ClusterError, DeviceClass, LinkLevel
from hapsynth.synth.plan import Plan
from hapsynth.synth.synthesize import InfeasibleMemory

__all__ = ["Cluster", "ClusterError", "DeviceClass", "InfeasibleMemory", "LinkLevel",
           "Parallelized", "Plan", "Sharded", "gather", "inspect", "parallelize"]
__version__ = "0.1.0"
