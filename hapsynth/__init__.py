"""hapsynth: synthesise SPMD programs with uneven shards for heterogeneous GPU clusters.

Pipeline, one folder per stage: `ir/` (trace + sharding IR) -> `synth/` (cluster,
cost model, CP-SAT) -> `lower/` (shard_map program) -> `api.py` (what users call).
"""
from hapsynth.api import inspect
from hapsynth.synth.cluster import Cluster, ClusterError, DeviceClass, LinkLevel

__all__ = ["Cluster", "ClusterError", "DeviceClass", "LinkLevel", "inspect"]
__version__ = "0.1.0"
