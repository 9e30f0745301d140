"""The plain values a cluster is made of: link levels and device classes, validated on creation.

* :class:`LinkLevel` — latency ``alpha`` (s) and bandwidth ``beta`` (bytes/s); a
  message of ``n`` bytes over a level costs ``alpha + n / beta``.
* :data:`LEVELS` — the levels of the link hierarchy, innermost first: the TOML key
  under ``[links]`` and the default of each.  Three: ``intra_host`` joins
  devices on one host (NVLink/PCIe), ``inter_host`` devices on different hosts of one
  island, ``inter_island`` devices on different islands (groups of hosts joined by a
  slower link; a cluster without islands is one island).
* :class:`Island` — a named group of hosts.
* :class:`DeviceClass` — a group of identical devices with their host ids.

Fields accept numbers in base units or strings with units (:mod:`.units`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from . import catalogue as cat
from .errors import fail, host_id, nonempty_str, pos_int
from .units import parse_bandwidth, parse_flops, parse_latency, parse_memory

__all__ = ["LinkLevel", "DeviceClass", "Island", "LEVELS", "LEVEL_KEYS", "DEFAULT_LINKS"]


@dataclass(frozen=True)
class LinkLevel:
    """One level of the link hierarchy: latency ``alpha`` (s), bandwidth ``beta`` (bytes/s)."""

    name: str
    alpha: float
    beta: float

    def __post_init__(self):
        nonempty_str(self.name, "name")
        object.__setattr__(self, "alpha", parse_latency(self.alpha, "alpha"))
        object.__setattr__(self, "beta", parse_bandwidth(self.beta, "beta"))

    def time(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` over this level once: ``alpha + nbytes / beta``."""
        return self.alpha + nbytes / self.beta


#: The link levels, innermost first: (key of its ``[links.<key>]`` TOML table, the
#: level used when that table is absent).  Defaults: a PCIe 3.0 x16-class host,
#: 10 Gbps Ethernet between hosts.
LEVELS: tuple[tuple[str, LinkLevel], ...] = (
    ("intra_host", LinkLevel("intra-host", 5e-6, 10e9)),
    ("inter_host", LinkLevel("inter-host", 20e-6, 10e9 / 8)),
    ("inter_island", LinkLevel("inter-host", 20e-6, 10e9 / 8)),  # absent: as inter_host
)
LEVEL_KEYS: tuple[str, ...] = tuple(key for key, _ in LEVELS)
#: Used when a TOML file has no ``[links.*]`` table or ``Cluster.simulated`` gets
#: ``links=None``.
DEFAULT_LINKS: tuple[LinkLevel, ...] = tuple(level for _, level in LEVELS)


@dataclass(frozen=True)
class DeviceClass:
    """A group of ``count`` identical devices.

    ``name`` is unique in a cluster; ``type`` is stored as the catalogue's canonical
    name; ``flops`` is effective FLOP/s, ``memory`` bytes, ``mem_bandwidth``
    bytes/s; ``hosts`` holds the host id of each device (length ``count``; classes
    may share a host).  Use :meth:`from_catalogue` to fill the numbers from the
    catalogue.
    """

    name: str
    type: str
    count: int
    flops: float
    memory: int
    mem_bandwidth: float
    hosts: tuple[int, ...]

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "name", nonempty_str(self.name, "name"))
        try:
            set_(self, "type", cat.canonical_name(self.type))
        except cat.UnknownDeviceType as e:
            raise fail("type", str(e)) from None
        set_(self, "count", pos_int(self.count, "count"))
        set_(self, "flops", parse_flops(self.flops, "flops"))
        set_(self, "memory", parse_memory(self.memory, "memory"))
        set_(self, "mem_bandwidth", parse_bandwidth(self.mem_bandwidth, "mem_bandwidth"))
        if isinstance(self.hosts, (str, bytes)) or not isinstance(self.hosts, Iterable):
            raise fail("hosts", f"must be a sequence of host ids, got {self.hosts!r}")
        hosts = tuple(host_id(h, f"hosts[{k}]") for k, h in enumerate(self.hosts))
        if len(hosts) != self.count:
            raise fail("hosts", f"has {len(hosts)} host ids for count = {self.count}")
        set_(self, "hosts", hosts)

    @classmethod
    def from_catalogue(cls, type: str, count: int, *, name: str | None = None,
                       hosts: Sequence[int] | None = None, flops: Any = None,
                       memory: Any = None, mem_bandwidth: Any = None) -> "DeviceClass":
        """A class of catalogue devices; ``name`` defaults to ``type`` as written,
        ``hosts`` to all on host 0; flops/memory/mem_bandwidth override the catalogue."""
        try:
            entry = cat.lookup(type)
        except cat.UnknownDeviceType as e:
            raise fail("type", str(e)) from None
        count = pos_int(count, "count")
        return cls(
            name=type.strip() if name is None else name,
            type=entry.name,
            count=count,
            flops=entry.flops if flops is None else flops,
            memory=entry.memory if memory is None else memory,
            mem_bandwidth=entry.mem_bandwidth if mem_bandwidth is None else mem_bandwidth,
            hosts=(0,) * count if hosts is None else hosts,
        )


@dataclass(frozen=True)
class Island:
    """Hosts joined by fast links (a rack, a site); islands are joined by ``inter_island``."""

    name: str
    hosts: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "name", nonempty_str(self.name, "name"))
        if isinstance(self.hosts, (str, bytes)) or not isinstance(self.hosts, Iterable):
            raise fail("hosts", f"must be a sequence of host ids, got {self.hosts!r}")
        hosts = tuple(host_id(h, f"hosts[{k}]") for k, h in enumerate(self.hosts))
        if not hosts:
            raise fail("hosts", "an island needs at least one host")
        if len(set(hosts)) != len(hosts):
            raise fail("hosts", f"lists a host twice: {list(hosts)}")
        object.__setattr__(self, "hosts", tuple(sorted(hosts)))
