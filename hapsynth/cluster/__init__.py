"""Cluster descriptions: device classes on hosts, link levels, their TOML files and presets.

catalogue.py (device types) and units.py (quantities) -> values.py (`LinkLevel`,
`DeviceClass`) -> schema.py (the TOML format) and library.py (presets: TOML package
data in `hapsynth.cluster.presets`, the repository's `clusters/`) -> cluster.py
(`Cluster`).  No JAX here: `hapsynth.lower.devices` maps a cluster onto devices.
"""
from hapsynth.cluster.cluster import Cluster, Device
from hapsynth.cluster.errors import ClusterError
from hapsynth.cluster.units import parse_bandwidth, parse_flops, parse_latency, parse_memory
from hapsynth.cluster.values import DEFAULT_LINKS, DeviceClass, LinkLevel

__all__ = ["Cluster", "ClusterError", "DEFAULT_LINKS", "Device", "DeviceClass", "LinkLevel",
           "parse_bandwidth", "parse_flops", "parse_latency", "parse_memory"]
