"""`Cluster`: device classes on hosts joined by a link hierarchy, and its topology queries.

A :class:`Cluster` is plain, immutable data; planning needs no real devices
(``hapsynth.lower.devices.local_devices`` maps a cluster onto JAX's devices).

* Devices are numbered globally in class order: class 0's devices first.
* ``links`` holds one :class:`LinkLevel` per level of :data:`~.values.LEVELS`,
  innermost first: ``links[0]`` joins devices on one host, ``links[1]`` devices
  on different hosts of one island, ``links[2]`` devices on different islands.
* ``islands`` groups the hosts (every host in exactly one); none declared: one island.

Descriptions are read and written in the TOML format of :mod:`.schema`; built-in
presets are found by :mod:`.library`.
"""
from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from . import library, schema
from .errors import ClusterError, fail, nonempty_str
from .units import human_bandwidth, human_flops, human_latency, human_memory
from .values import DEFAULT_LINKS, LEVEL_KEYS, DeviceClass, Island, LinkLevel

__all__ = ["Cluster", "Device"]


class Device(NamedTuple):
    """One device of a cluster: global index, index of its class, host id."""

    index: int
    class_index: int
    host: int


@dataclass(frozen=True)
class Cluster:
    """Device classes, their hosts and the link hierarchy (see the module docstring).

    Equality and hashing are by value (classes, links, name).
    """

    classes: tuple[DeviceClass, ...]
    links: tuple[LinkLevel, ...] = DEFAULT_LINKS
    name: str = "cluster"
    islands: tuple[Island, ...] = ()

    def __post_init__(self):
        classes = tuple(self.classes)
        if not classes:
            raise fail("class", "a cluster needs at least one device class")
        seen: dict[str, int] = {}
        for i, c in enumerate(classes):
            if not isinstance(c, DeviceClass):
                raise fail(f"class[{i}]", f"must be a DeviceClass, got {c!r}")
            if c.name in seen:
                raise fail(f"class[{i}].name", f"duplicate class name {c.name!r} (also "
                           f"class[{seen[c.name]}]); give classes of one type distinct names")
            seen[c.name] = i
        links = tuple(self.links)
        if len(links) == len(DEFAULT_LINKS) - 1:  # no inter-island level: as inter-host
            links = (*links, links[-1])
        if len(links) != len(DEFAULT_LINKS) or not all(isinstance(l, LinkLevel) for l in links):
            raise fail("links", f"must be {len(DEFAULT_LINKS)} LinkLevels "
                       f"({', '.join(LEVEL_KEYS)}), got {self.links!r}")
        object.__setattr__(self, "classes", classes)
        object.__setattr__(self, "links", links)
        object.__setattr__(self, "name", nonempty_str(self.name, "name"))
        object.__setattr__(self, "islands", _check_islands(self.islands, classes))

    def __repr__(self) -> str:
        parts = " + ".join(f"{c.count}×{c.name}" for c in self.classes)
        return f"Cluster({self.name!r}: {parts} on {self.num_hosts} host(s))"

    # ---- devices and classes

    @cached_property
    def devices(self) -> tuple[Device, ...]:
        """All devices in global order: (index, class_index, host)."""
        out = []
        for ci, c in enumerate(self.classes):
            for h in c.hosts:
                out.append(Device(len(out), ci, h))
        return tuple(out)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @cached_property
    def num_hosts(self) -> int:
        """Number of distinct host ids."""
        return len({d.host for d in self.devices})

    @property
    def class_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.classes)

    @property
    def total_flops(self) -> float:
        return sum(c.count * c.flops for c in self.classes)

    def _index(self, i: Any) -> int:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"device index must be an int, got {i!r}")
        if not 0 <= i < self.num_devices:
            raise IndexError(f"device index {i} out of range for cluster {self.name!r} "
                             f"with {self.num_devices} devices")
        return int(i)

    def class_of(self, i: int) -> int:
        """Index (into ``classes``) of device ``i``'s class."""
        return self.devices[self._index(i)].class_index

    def device_class(self, i: int) -> DeviceClass:
        """The :class:`DeviceClass` of device ``i``."""
        return self.classes[self.class_of(i)]

    def host_of(self, i: int) -> int:
        return self.devices[self._index(i)].host

    def class_index(self, name: str) -> int:
        """Index of the class called ``name``."""
        for ci, c in enumerate(self.classes):
            if c.name == name:
                return ci
        raise KeyError(f"no device class {name!r} in cluster {self.name!r} "
                       f"(classes: {', '.join(self.class_names)})")

    def class_devices(self, c: int | str) -> tuple[int, ...]:
        """Global indices of the devices of class ``c`` (index or name)."""
        ci = self.class_index(c) if isinstance(c, str) else c
        start = sum(k.count for k in self.classes[:ci])
        return tuple(range(start, start + self.classes[ci].count))

    def subset(self, indices: Iterable[int], name: str | None = None) -> "Cluster":
        """The cluster of devices `indices` only: device ``k`` of the result is the k-th
        smallest of `indices`; classes and islands left without a device are dropped."""
        keep = {self._index(i) for i in indices}
        if not keep:
            raise ValueError("a cluster subset needs at least one device")
        classes = []
        for ci, c in enumerate(self.classes):
            hosts = tuple(h for g, h in zip(self.class_devices(ci), c.hosts) if g in keep)
            if hosts:
                classes.append(replace(c, count=len(hosts), hosts=hosts))
        used = {h for c in classes for h in c.hosts}
        islands = tuple(replace(isl, hosts=tuple(h for h in isl.hosts if h in used))
                        for isl in self.islands if used.intersection(isl.hosts))
        return Cluster(tuple(classes), self.links,
                       name or f"{self.name}[{len(keep)} of {self.num_devices}]", islands)

    # ---- links

    @property
    def intra_host(self) -> LinkLevel:
        return self.links[0]

    @property
    def inter_host(self) -> LinkLevel:
        return self.links[1]

    @property
    def inter_island(self) -> LinkLevel:
        return self.links[2]

    def link_between(self, i: int, j: int) -> LinkLevel:
        """The level joining devices ``i`` and ``j``: intra-host if they share a host,
        inter-host if they share an island, else inter-island."""
        hi, hj = self.host_of(i), self.host_of(j)
        if hi == hj:
            return self.links[0]
        return self.links[1] if self._island_of_host[hi] == self._island_of_host[hj] else self.links[2]

    # ---- islands

    @cached_property
    def _island_of_host(self) -> dict[int, int]:
        return {h: k for k, isl in enumerate(self.islands) for h in isl.hosts} or {
            d.host: 0 for d in self.devices}

    @property
    def num_islands(self) -> int:
        return max(1, len(self.islands))

    def island_of(self, i: int) -> int:
        """Index of device ``i``'s island (0 when the cluster declares none)."""
        return self._island_of_host[self.host_of(i)]

    def island_devices(self, k: int) -> tuple[int, ...]:
        """Global indices of the devices of island ``k``."""
        return tuple(d.index for d in self.devices if self._island_of_host[d.host] == k)

    # ---- reading

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str | None = None,
                  default_name: str = "cluster") -> "Cluster":
        """A cluster from the TOML schema as a dict (what ``tomllib`` returns)."""
        try:
            name, classes, links, islands = schema.from_dict(data, default_name)
            return cls(classes=classes, links=links, name=name, islands=islands)
        except ClusterError as e:
            raise e.with_source(source) from None

    @classmethod
    def from_toml(cls, text: str, *, source: str = "<string>",
                  default_name: str | None = None) -> "Cluster":
        """A cluster from TOML text; ``source`` names it in error messages."""
        try:
            data = schema.read_toml(text)
        except ClusterError as e:
            raise e.with_source(source) from None
        if default_name is None:
            default_name = Path(source).stem if source != "<string>" else "cluster"
        return cls.from_dict(data, source=source, default_name=default_name)

    @classmethod
    def load(cls, name_or_path: str | os.PathLike) -> "Cluster":
        """A preset by name, or a TOML file (see :mod:`hapsynth.cluster.library`)."""
        found = library.locate(name_or_path)
        if isinstance(found, Path):
            s = os.fspath(name_or_path)
            return cls.from_toml(library.read_file(found, s), source=s, default_name=found.stem)
        return _preset(found)

    @staticmethod
    def presets() -> list[str]:
        """Names of the built-in clusters."""
        return library.preset_names()

    @classmethod
    def simulated(cls, entries: Sequence[Any], *, devices_per_host: int | None = None,
                  links: Any = None, name: str | None = None,
                  islands: Mapping[str, Sequence] | None = None) -> "Cluster":
        """A cluster from ``[(type, count), ...]`` (for simulated devices: tests, what-ifs).

        Entries: ``(type, count)``, ``(type, count, {overrides})`` with keys of a TOML
        ``[[class]]`` table (``name``, ``flops``, ``memory``, ``mem_bandwidth``,
        ``host``, ``host_ids``, …), or a :class:`DeviceClass`.  With
        ``devices_per_host=None`` all devices share host 0; with ``D`` each class
        fills new hosts of ``D`` devices.  ``links``: ``None`` (``DEFAULT_LINKS``),
        one :class:`LinkLevel` per level, or a dict like the TOML ``[links]`` table
        whose values are tables or :class:`LinkLevel`.  ``islands``: ``{name: host ids}``
        or ``{name: class names}`` (the hosts of those classes).  No devices are needed.
        """
        if isinstance(entries, (str, bytes)) or not isinstance(entries, Iterable):
            raise ClusterError(f"entries must be a list of (type, count), got {entries!r}",
                               source="Cluster.simulated")
        tables = []
        for i, e in enumerate(entries):
            if isinstance(e, DeviceClass):
                tables.append({"type": e.type, "name": e.name, "host_ids": list(e.hosts),
                               "flops": e.flops, "memory": e.memory,
                               "mem_bandwidth": e.mem_bandwidth})
                continue
            if not isinstance(e, (tuple, list)) or len(e) not in (2, 3) or (
                    len(e) == 3 and not isinstance(e[2], Mapping)):
                raise ClusterError(f"expected (type, count) or (type, count, {{overrides}}), "
                                   f"got {e!r}", field=f"class[{i}]", source="Cluster.simulated")
            tbl = {"type": e[0], "count": e[1]}
            if len(e) == 3:
                tbl.update(e[2])
            if not any(k in tbl for k in ("host", "host_ids", "hosts", "devices_per_host")):
                if devices_per_host is None:
                    tbl["host"] = 0
                else:
                    tbl["devices_per_host"] = devices_per_host
            tables.append(tbl)
        data: dict[str, Any] = {"class": tables}
        if links is not None:
            data["links"] = _links_arg(links)
        if islands:  # {name: host ids, or class names whose hosts it holds}
            data["island"] = [
                {"name": k, ("classes" if v and isinstance(v[0], str) else "host_ids"): list(v)}
                for k, v in islands.items()]
        if name is None:
            name = "sim-" + "-".join(f"{t.get('name', t['type'])}x{t.get('count', '?')}"
                                     for t in tables if isinstance(t.get("type"), str))
            name = name.lower().replace(" ", "_")
        data["name"] = name
        return cls.from_dict(data, source="Cluster.simulated")

    # ---- writing

    def to_dict(self, *, explicit: bool = True) -> dict[str, Any]:
        """The TOML schema as plain data (JSON-serialisable); ``from_dict`` reads it back.

        ``explicit=True`` (default) writes flops/memory/mem_bandwidth of every class;
        ``False`` only those that differ from the catalogue.
        """
        return schema.to_dict(self.name, self.classes, self.links, explicit=explicit,
                              islands=self.islands)

    def to_toml(self, *, explicit: bool = False) -> str:
        """TOML text that :meth:`from_toml` / :meth:`load` read back into an equal cluster."""
        return schema.to_toml(self.name, self.classes, self.links, explicit=explicit,
                              islands=self.islands)

    def save(self, path: str | os.PathLike, *, explicit: bool = False) -> None:
        Path(path).write_text(self.to_toml(explicit=explicit), encoding="utf-8")

    def summary(self) -> str:
        """A small text table of classes and links."""
        rows = [f"cluster {self.name}: {self.num_devices} devices, {self.num_hosts} host(s), "
                f"{human_flops(self.total_flops)} effective in total"]
        for ci, c in enumerate(self.classes):
            devs = self.class_devices(ci)
            rows.append(f"  [{ci}] {c.name:<12} {c.type:<10} ×{c.count:<4} devices "
                        f"{devs[0]}-{devs[-1]}  hosts {sorted(set(c.hosts))}  "
                        f"{human_flops(c.flops)}  {human_memory(c.memory)}")
        for isl in self.islands:
            rows.append(f"  island {isl.name}: hosts {list(isl.hosts)}")
        for key, l in zip(LEVEL_KEYS, self.links):
            if key == "inter_island" and not self.islands:
                continue
            rows.append(f"  link {key} ({l.name}): {human_bandwidth(l.beta)}, "
                        f"{human_latency(l.alpha)}")
        return "\n".join(rows)

    def _repr_html_(self) -> str:
        """Jupyter's rich display: the classes and link levels as tables."""
        from hapsynth.view.html import cluster_html
        return cluster_html(self)


def _check_islands(islands: Any, classes) -> tuple[Island, ...]:
    """Islands as given, checked: each an `Island`, names unique, every host of the
    classes in exactly one island (or no islands at all)."""
    islands = tuple(islands or ())
    if not islands:
        return ()
    hosts = {h for c in classes for h in c.hosts}
    seen: dict[int, str] = {}
    names: set[str] = set()
    for k, isl in enumerate(islands):
        if not isinstance(isl, Island):
            raise fail(f"island[{k}]", f"must be an Island, got {isl!r}")
        if isl.name in names:
            raise fail(f"island[{k}].name", f"duplicate island name {isl.name!r}")
        names.add(isl.name)
        for h in isl.hosts:
            if h not in hosts:
                raise fail(f"island[{k}].hosts", f"host {h} holds no device (hosts: "
                           f"{sorted(hosts)})")
            if h in seen:
                raise fail(f"island[{k}].hosts", f"host {h} is already in island {seen[h]!r}")
            seen[h] = isl.name
    missing = sorted(hosts - set(seen))
    if missing:
        raise fail("island", f"hosts {missing} are in no island; every host must be in one")
    return tuple(sorted(islands, key=lambda i: i.hosts[0]))  # in host order: one spelling


def _links_arg(links: Any) -> dict[str, Any]:
    """``Cluster.simulated``'s ``links`` as the TOML ``[links]`` table."""
    def level(v: Any) -> Any:
        if isinstance(v, LinkLevel):
            return {"name": v.name, "bandwidth": v.beta, "latency": v.alpha}
        return v

    if isinstance(links, Mapping):
        return {k: level(v) for k, v in links.items()}
    if isinstance(links, (tuple, list)) and len(links) in (len(LEVEL_KEYS) - 1, len(LEVEL_KEYS)):
        return {k: level(v) for k, v in zip(LEVEL_KEYS, links)}
    raise ClusterError(f"must be None, {len(LEVEL_KEYS)} LinkLevels or a dict like the TOML "
                       f"[links] table, got {links!r}", field="links", source="Cluster.simulated")


@lru_cache(maxsize=None)
def _preset(key: str) -> Cluster:
    return Cluster.from_toml(library.preset_text(key), source=f"preset {key!r}",
                             default_name=key)
