"""Cluster descriptions: device classes, host placement and a two-level link hierarchy.

A :class:`Cluster` is plain, immutable data.  Planning needs no real devices;
only :meth:`Cluster.jax_devices` touches JAX, and it maps the cluster's devices
onto the local JAX devices in order (device ``i`` of the cluster is
``jax.devices()[i]``).

Model
-----
* :class:`DeviceClass` — a group of identical devices: ``name`` (unique in the
  cluster; defaults to the device type as written), ``type`` (a catalogue entry,
  see :mod:`hapsynth.synth.catalogue`), ``count``, effective ``flops`` (FLOP/s),
  ``memory`` (bytes), ``mem_bandwidth`` (bytes/s) and ``hosts``: the host id of
  each of its devices (a tuple of ``count`` ints; classes may share a host).
* Devices are numbered globally in class order: class 0's devices first.
* :class:`LinkLevel` — latency ``alpha`` (s) and bandwidth ``beta`` (bytes/s).
  A cluster has exactly two levels, innermost first: ``links[0]`` joins devices
  on one host (NVLink/PCIe), ``links[1]`` joins devices on different hosts.
  A message of ``n`` bytes over a level costs ``alpha + n / beta``.

TOML format
-----------
::

    name = "hap-v100x16-p100x48"   # optional; default: the file name's stem

    [[class]]                      # one table per device class, in device order
    type = "V100"                  # required: catalogue type or alias (any case)
    name = "v100"                  # optional: default = type as written; unique
    hosts = 2                      # placement, one of:
    devices_per_host = 8           #   hosts + devices_per_host: that many new hosts
    # count = 12                   #   count (+ devices_per_host): new hosts filled in order
    # host = 0                     #   count + host: all on host id `host` (may be shared)
    # host_ids = [0, 0, 1, 1]      #   count + host_ids: explicit host id per device
    # flops = "15TFLOP/s"          # overrides of the catalogue numbers (optional)
    # memory = "32GiB"
    # mem_bandwidth = "900GB/s"

    [links.intra_host]             # optional table; default: DEFAULT_LINKS[0]
    name = "PCIe 3.0 x16"          # optional label
    bandwidth = "10GB/s"           # required in the table
    latency = "5us"                # required in the table

    [links.inter_host]             # optional table; default: DEFAULT_LINKS[1]
    bandwidth = "10.4Gbps"
    latency = "20us"

"New hosts" are numbered from one past the largest host id used by the classes
above.  Quantities are numbers in base units or strings with units:

=============  ==============  =============================================
field          base unit       string units
=============  ==============  =============================================
bandwidth,     bytes/s         ``bps kbps Mbps Gbps Tbps`` or ``Gb/s`` (bits);
mem_bandwidth                  ``B/s kB/s MB/s GB/s TB/s KiB/s MiB/s GiB/s``
latency        seconds         ``s ms us µs ns``
memory         bytes (int)     ``B kB MB GB TB KiB MiB GiB TiB``
flops          FLOP/s          ``FLOP/s kFLOP/s … PFLOP/s`` or ``TFLOPS`` etc.
=============  ==============  =============================================

Unit prefixes are case-insensitive; ``b`` (bits) and ``B`` (bytes) are not.
Every error is a :class:`ClusterError` naming the source, the field path and the
value, e.g. ``clusters/x.toml: class[1].type: unknown device type 'V1OO' (...)``.
Unknown keys are rejected (typos do not silently fall back to defaults).

:meth:`Cluster.to_toml` writes this format by hand; reading it back gives an
equal cluster.  By default it writes only the values that differ from the
catalogue (``explicit=True`` writes all of them, which keeps a saved cluster
stable if the catalogue changes; :meth:`Cluster.to_dict` defaults to that).

Presets
-------
Built-in clusters are defined in this module (:data:`_PRESET_SPECS`, same schema
as the TOML files) so that they work in an installed package; ``clusters/*.toml``
in the repository are exports of them, checked equal by the tests.
:meth:`Cluster.load` accepts a preset name (case-insensitive, ``_`` = ``-``), or
a path; a ``*.toml`` path that does not exist but whose stem names a preset (or
the alias ``hap_v100_p100``) loads that preset.
"""
from __future__ import annotations

import difflib
import math
import numbers
import os
import re
import tomllib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from . import catalogue as _cat

__all__ = [
    "ClusterError",
    "DeviceClass",
    "LinkLevel",
    "Device",
    "Cluster",
    "DEFAULT_LINKS",
    "parse_bandwidth",
    "parse_latency",
    "parse_memory",
    "parse_flops",
    "export_presets",
]


# --------------------------------------------------------------------------- errors


class ClusterError(ValueError):
    """An invalid cluster description.

    ``str(err)`` is ``"<source>: <field>: <message>"`` (parts omitted when
    unknown); the parts are also available as attributes.
    """

    def __init__(self, message: str, *, field: str | None = None, source: str | None = None):
        self.message = message
        self.field = field
        self.source = source
        super().__init__(": ".join([p for p in (source, field) if p] + [message]))

    def _at(self, *, source: str | None = None, prefix: str | None = None) -> "ClusterError":
        fld = self.field
        if prefix:
            fld = f"{prefix}.{fld}" if fld else prefix
        return ClusterError(self.message, field=fld, source=source or self.source)


def _fail(field: str | None, message: str) -> ClusterError:
    return ClusterError(message, field=field)


# --------------------------------------------------------------------------- units

_NUM_RE = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*(\S.*?)?\s*$")
_DEC = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_BIN = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40, "pi": 2.0**50}
_PREFIX = {**_DEC, **_BIN}
# divisors (dividing by 1e6 rounds "5us" to the double nearest 5e-06; multiplying
# by 1e-6 does not)
_TIME = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "μs": 1e6, "ns": 1e9}


def _split(value: Any, field: str | None, expected: str) -> tuple[float, str | None]:
    """(number, unit or None) from a TOML/Python value; rejects bools and other types."""
    if isinstance(value, bool):
        raise _fail(field, f"expected {expected}, got {value!r}")
    if isinstance(value, numbers.Real):
        return float(value), None
    if isinstance(value, str):
        m = _NUM_RE.match(value)
        if m:
            return float(m.group(1)), m.group(2)
        raise _fail(field, f"cannot parse {value!r} (expected {expected})")
    raise _fail(field, f"expected {expected}, got {type(value).__name__} {value!r}")


def _check_range(x: float, value: Any, field: str | None, *, allow_zero: bool = False) -> float:
    if not math.isfinite(x) or x < 0 or (x == 0 and not allow_zero):
        need = "non-negative" if allow_zero else "positive"
        raise _fail(field, f"must be finite and {need}, got {value!r}")
    return x


def parse_bandwidth(value: Any, field: str | None = "bandwidth") -> float:
    """Bandwidth in bytes/s from a number (bytes/s) or a string such as ``"10.4Gbps"``."""
    expected = "bytes/s or a string such as '10.4Gbps', '12GB/s', '11GiB/s'"
    x, unit = _split(value, field, expected)
    if unit is not None:
        if unit.endswith("bps"):
            prefix, scale = unit[:-3], 1 / 8
        elif unit.endswith("b/s"):
            prefix, scale = unit[:-3], 1 / 8
        elif unit.endswith("B/s"):
            prefix, scale = unit[:-3], 1.0
        else:
            raise _fail(field, f"cannot parse {value!r} (expected {expected})")
        if prefix.lower() not in _PREFIX:
            raise _fail(field, f"cannot parse {value!r} (expected {expected})")
        x = x * _PREFIX[prefix.lower()] * scale
    return _check_range(x, value, field)


def parse_latency(value: Any, field: str | None = "latency") -> float:
    """Latency in seconds from a number (s) or a string such as ``"20us"``."""
    expected = "seconds or a string such as '20us', '1.5ms'"
    x, unit = _split(value, field, expected)
    if unit is not None:
        if unit not in _TIME:
            raise _fail(field, f"cannot parse {value!r} (expected {expected})")
        x /= _TIME[unit]
    return _check_range(x, value, field, allow_zero=True)


def parse_memory(value: Any, field: str | None = "memory") -> int:
    """Memory in bytes (int) from an int or a string such as ``"32GiB"``."""
    expected = "bytes (an integer) or a string such as '32GiB', '16GB'"
    x, unit = _split(value, field, expected)
    if unit is not None:
        if not unit.endswith("B") or unit[:-1].lower() not in _PREFIX:
            raise _fail(field, f"cannot parse {value!r} (expected {expected})")
        x *= _PREFIX[unit[:-1].lower()]
    elif not isinstance(value, str) and not float(x).is_integer():
        raise _fail(field, f"expected {expected}, got {value!r}")
    _check_range(x, value, field)
    n = int(round(x))
    if n <= 0:
        raise _fail(field, f"must be at least 1 byte, got {value!r}")
    return n


def parse_flops(value: Any, field: str | None = "flops") -> float:
    """Effective FLOP/s from a number or a string such as ``"15.6TFLOP/s"`` / ``"15.6 TFLOPS"``."""
    expected = "FLOP/s or a string such as '15.6TFLOP/s', '90 GFLOPS'"
    x, unit = _split(value, field, expected)
    if unit is not None:
        low = unit.lower()
        if low.endswith("flop/s"):
            prefix = low[:-6]
        elif low.endswith("flops"):
            prefix = low[:-5]
        else:
            raise _fail(field, f"cannot parse {value!r} (expected {expected})")
        if prefix not in _DEC:
            raise _fail(field, f"cannot parse {value!r} (expected {expected})")
        x *= _DEC[prefix]
    return _check_range(x, value, field)


def _pos_int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise _fail(field, f"must be a positive integer, got {value!r}")
    return int(value)


def _host_id(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise _fail(field, f"must be a non-negative integer host id, got {value!r}")
    return int(value)


def _name(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(field, f"must be a non-empty string, got {value!r}")
    return value


def _check_keys(table: Mapping[str, Any], allowed: Sequence[str], prefix: str | None) -> None:
    for key in table:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), list(allowed), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            path = f"{prefix}.{key}" if prefix else str(key)
            raise _fail(path, f"unknown key {key!r} ({hint}allowed: {', '.join(allowed)})")


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class LinkLevel:
    """One level of the link hierarchy: latency ``alpha`` (s), bandwidth ``beta`` (bytes/s)."""

    name: str
    alpha: float
    beta: float

    def __post_init__(self):
        _name(self.name, "name")
        object.__setattr__(self, "alpha", parse_latency(self.alpha, "alpha"))
        object.__setattr__(self, "beta", parse_bandwidth(self.beta, "beta"))

    @property
    def latency(self) -> float:
        return self.alpha

    @property
    def bandwidth(self) -> float:
        return self.beta

    def time(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` over this level once: ``alpha + nbytes / beta``."""
        return self.alpha + nbytes / self.beta


#: Used when a TOML file has no ``[links.*]`` table or ``Cluster.simulated`` gets
#: ``links=None``: a PCIe 3.0 x16-class host, 10 Gbps Ethernet between hosts.
DEFAULT_LINKS: tuple[LinkLevel, LinkLevel] = (
    LinkLevel("intra-host", 5e-6, 10e9),
    LinkLevel("inter-host", 20e-6, 10e9 / 8),
)
_LEVEL_KEYS = ("intra_host", "inter_host")
_LEVEL_NAMES = ("intra-host", "inter-host")


@dataclass(frozen=True)
class DeviceClass:
    """A group of ``count`` identical devices.

    ``type`` is stored as the catalogue's canonical name; ``hosts`` holds the host
    id of each device (length ``count``).  Use :meth:`from_catalogue` to fill the
    numbers from the catalogue.
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
        set_(self, "name", _name(self.name, "name"))
        try:
            set_(self, "type", _cat.canonical_name(self.type))
        except _cat.UnknownDeviceType as e:
            raise _fail("type", str(e)) from None
        set_(self, "count", _pos_int(self.count, "count"))
        set_(self, "flops", parse_flops(self.flops, "flops"))
        set_(self, "memory", parse_memory(self.memory, "memory"))
        set_(self, "mem_bandwidth", parse_bandwidth(self.mem_bandwidth, "mem_bandwidth"))
        if isinstance(self.hosts, (str, bytes)) or not isinstance(self.hosts, Iterable):
            raise _fail("hosts", f"must be a sequence of host ids, got {self.hosts!r}")
        hosts = tuple(_host_id(h, f"hosts[{k}]") for k, h in enumerate(self.hosts))
        if len(hosts) != self.count:
            raise _fail("hosts", f"has {len(hosts)} host ids for count = {self.count}")
        set_(self, "hosts", hosts)

    @classmethod
    def from_catalogue(cls, type: str, count: int, *, name: str | None = None,
                       hosts: Sequence[int] | None = None, flops: Any = None,
                       memory: Any = None, mem_bandwidth: Any = None) -> "DeviceClass":
        """A class of catalogue devices; ``name`` defaults to ``type`` as written,
        ``hosts`` to all on host 0; flops/memory/mem_bandwidth override the catalogue."""
        try:
            entry = _cat.lookup(type)
        except _cat.UnknownDeviceType as e:
            raise _fail("type", str(e)) from None
        count = _pos_int(count, "count")
        return cls(
            name=type.strip() if name is None else name,
            type=entry.name,
            count=count,
            flops=entry.flops if flops is None else flops,
            memory=entry.memory if memory is None else memory,
            mem_bandwidth=entry.mem_bandwidth if mem_bandwidth is None else mem_bandwidth,
            hosts=(0,) * count if hosts is None else hosts,
        )

    @property
    def catalogue_entry(self) -> _cat.DeviceType:
        return _cat.CATALOGUE[self.type]

    @property
    def num_hosts(self) -> int:
        return len(set(self.hosts))


class Device(NamedTuple):
    """One device of a cluster: global index, index of its class, host id."""

    index: int
    class_index: int
    host: int


# --------------------------------------------------------------------------- parsing


def _link_from_table(tbl: Any, key: str, level_name: str) -> LinkLevel:
    path = f"links.{key}"
    if not isinstance(tbl, Mapping):
        raise _fail(path, f"must be a table, got {tbl!r}")
    _check_keys(tbl, ("name", "bandwidth", "latency"), path)
    for req in ("bandwidth", "latency"):
        if req not in tbl:
            raise _fail(f"{path}.{req}", "missing required field")
    return LinkLevel(
        name=_name(tbl["name"], f"{path}.name") if "name" in tbl else level_name,
        alpha=parse_latency(tbl["latency"], f"{path}.latency"),
        beta=parse_bandwidth(tbl["bandwidth"], f"{path}.bandwidth"),
    )


_TOP_KEYS = ("name", "class", "links")
_CLASS_KEYS = ("type", "name", "count", "hosts", "devices_per_host", "host", "host_ids",
               "flops", "memory", "mem_bandwidth")


def _class_from_table(tbl: Any, p: str, next_host: int) -> DeviceClass:
    if not isinstance(tbl, Mapping):
        raise _fail(p, f"must be a table, got {tbl!r}")
    _check_keys(tbl, _CLASS_KEYS, p)
    if "type" not in tbl:
        raise _fail(f"{p}.type", "missing required field (a device type such as 'V100')")
    typ = tbl["type"]
    if not isinstance(typ, str):
        raise _fail(f"{p}.type", f"must be a string, got {typ!r}")
    try:
        entry = _cat.lookup(typ)
    except _cat.UnknownDeviceType as e:
        raise _fail(f"{p}.type", str(e)) from None
    name = _name(tbl["name"], f"{p}.name") if "name" in tbl else typ.strip()

    # placement
    has = lambda k: k in tbl  # noqa: E731
    if has("hosts"):
        nh = _pos_int(tbl["hosts"], f"{p}.hosts")
        if not has("devices_per_host"):
            raise _fail(f"{p}.devices_per_host", "missing required field (needed with 'hosts')")
        dph = _pos_int(tbl["devices_per_host"], f"{p}.devices_per_host")
        for k in ("host", "host_ids"):
            if has(k):
                raise _fail(f"{p}.{k}", "cannot be combined with 'hosts' "
                            "(classes given by 'hosts' get new hosts)")
        count = nh * dph
        if has("count") and _pos_int(tbl["count"], f"{p}.count") != count:
            raise _fail(f"{p}.count", f"{tbl['count']!r} does not match hosts × devices_per_host"
                        f" = {nh} × {dph} = {count}")
        hosts = tuple(next_host + d // dph for d in range(count))
    elif has("count") or has("host_ids"):
        if has("host_ids"):
            ids = tbl["host_ids"]
            if not isinstance(ids, list):
                raise _fail(f"{p}.host_ids", f"must be an array of host ids, got {ids!r}")
            for k in ("host", "devices_per_host"):
                if has(k):
                    raise _fail(f"{p}.{k}", "cannot be combined with 'host_ids'")
            hosts = tuple(_host_id(h, f"{p}.host_ids[{k}]") for k, h in enumerate(ids))
            if not hosts:
                raise _fail(f"{p}.host_ids", "must not be empty")
            if has("count") and _pos_int(tbl["count"], f"{p}.count") != len(hosts):
                raise _fail(f"{p}.count", f"{tbl['count']!r} does not match the "
                            f"{len(hosts)} entries of host_ids")
        else:
            count = _pos_int(tbl["count"], f"{p}.count")
            if has("host") and has("devices_per_host"):
                raise _fail(f"{p}.devices_per_host", "cannot be combined with 'host'")
            if has("host"):
                hosts = (_host_id(tbl["host"], f"{p}.host"),) * count
            elif has("devices_per_host"):
                dph = _pos_int(tbl["devices_per_host"], f"{p}.devices_per_host")
                hosts = tuple(next_host + d // dph for d in range(count))
            else:
                hosts = (next_host,) * count
    else:
        raise _fail(f"{p}.count", "missing required field "
                    "(give 'count', or 'hosts' with 'devices_per_host')")

    return DeviceClass(
        name=name,
        type=entry.name,
        count=len(hosts),
        flops=parse_flops(tbl["flops"], f"{p}.flops") if has("flops") else entry.flops,
        memory=parse_memory(tbl["memory"], f"{p}.memory") if has("memory") else entry.memory,
        mem_bandwidth=(parse_bandwidth(tbl["mem_bandwidth"], f"{p}.mem_bandwidth")
                       if has("mem_bandwidth") else entry.mem_bandwidth),
        hosts=hosts,
    )


def _cluster_from_mapping(data: Any, default_name: str) -> "Cluster":
    if not isinstance(data, Mapping):
        raise _fail(None, f"a cluster description must be a table, got {type(data).__name__}")
    _check_keys(data, _TOP_KEYS, None)
    name = _name(data["name"], "name") if "name" in data else default_name
    if "class" not in data:
        raise _fail("class", "missing required field: at least one [[class]] table")
    tables = data["class"]
    if isinstance(tables, Mapping):
        raise _fail("class", "must be an array of tables ([[class]]), got a single table ([class])")
    if not isinstance(tables, list) or not tables:
        raise _fail("class", f"must be a non-empty array of tables ([[class]]), got {tables!r}")
    classes: list[DeviceClass] = []
    next_host = 0
    for i, tbl in enumerate(tables):
        c = _class_from_table(tbl, f"class[{i}]", next_host)
        classes.append(c)
        next_host = max(next_host, max(c.hosts) + 1)
    links_tbl = data.get("links", {})
    if not isinstance(links_tbl, Mapping):
        raise _fail("links", f"must be a table, got {links_tbl!r}")
    _check_keys(links_tbl, _LEVEL_KEYS, "links")
    links = tuple(
        _link_from_table(links_tbl[key], key, lname) if key in links_tbl else default
        for key, lname, default in zip(_LEVEL_KEYS, _LEVEL_NAMES, DEFAULT_LINKS)
    )
    return Cluster(classes=tuple(classes), links=links, name=name)


# --------------------------------------------------------------------------- writing


def _toml_str(s: str) -> str:
    out = []
    for ch in s:
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(v: Any) -> str:
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)  # shortest repr: reads back bit-exactly (inf/nan never reach here)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def _human_bw(b: float) -> str:
    return f"{b / 1e9:.4g} GB/s = {b * 8 / 1e9:.4g} Gbps"


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out: list[str] = []
    start = prev = ids[0]
    for h in ids[1:] + [None]:
        if h is not None and h == prev + 1:
            prev = h
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if h is not None:
            start = prev = h
    return ", ".join(out)


def _human_flops(f: float) -> str:
    return f"{f / 1e12:.4g} TFLOP/s" if f >= 1e12 else f"{f / 1e9:.4g} GFLOP/s"


def _human_mem(m: int) -> str:
    return f"{m / 2**30:.4g} GiB"


def _placement(c: DeviceClass, next_host: int) -> dict[str, Any]:
    ids, n = c.hosts, c.count
    if all(h == ids[0] for h in ids):
        return {"count": n} if ids[0] == next_host else {"count": n, "host": ids[0]}
    dph = next(k for k, h in enumerate(ids) if h != ids[0])
    if ids == tuple(next_host + d // dph for d in range(n)):
        if n % dph == 0:
            return {"hosts": n // dph, "devices_per_host": dph}
        return {"count": n, "devices_per_host": dph}
    return {"count": n, "host_ids": list(ids)}


# --------------------------------------------------------------------------- cluster


@dataclass(frozen=True)
class Cluster:
    """Device classes, their hosts and the link hierarchy (see the module docstring).

    Equality and hashing are by value (classes, links, name).
    """

    classes: tuple[DeviceClass, ...]
    links: tuple[LinkLevel, LinkLevel] = DEFAULT_LINKS
    name: str = "cluster"

    def __post_init__(self):
        classes = tuple(self.classes)
        if not classes:
            raise _fail("class", "a cluster needs at least one device class")
        seen: dict[str, int] = {}
        for i, c in enumerate(classes):
            if not isinstance(c, DeviceClass):
                raise _fail(f"class[{i}]", f"must be a DeviceClass, got {c!r}")
            if c.name in seen:
                raise _fail(f"class[{i}].name", f"duplicate class name {c.name!r} (also "
                            f"class[{seen[c.name]}]); give classes of one type distinct names")
            seen[c.name] = i
        links = tuple(self.links)
        if len(links) != 2 or not all(isinstance(l, LinkLevel) for l in links):
            raise _fail("links", "must be two LinkLevels (intra-host, inter-host), "
                        f"got {self.links!r}")
        object.__setattr__(self, "classes", classes)
        object.__setattr__(self, "links", links)
        object.__setattr__(self, "name", _name(self.name, "name"))

    def __repr__(self) -> str:
        parts = " + ".join(f"{c.count}×{c.name}" for c in self.classes)
        return f"Cluster({self.name!r}: {parts} on {self.num_hosts} host(s))"

    # ---- devices

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
    def host_ids(self) -> tuple[int, ...]:
        """Sorted distinct host ids."""
        return tuple(sorted({d.host for d in self.devices}))

    @property
    def num_hosts(self) -> int:
        return len(self.host_ids)

    @property
    def class_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.classes)

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

    @property
    def device_flops(self) -> tuple[float, ...]:
        """Effective FLOP/s of each device, in global order."""
        return tuple(self.classes[d.class_index].flops for d in self.devices)

    @property
    def device_memory(self) -> tuple[int, ...]:
        return tuple(self.classes[d.class_index].memory for d in self.devices)

    @property
    def total_flops(self) -> float:
        return sum(c.count * c.flops for c in self.classes)

    # ---- links

    @property
    def intra_host(self) -> LinkLevel:
        return self.links[0]

    @property
    def inter_host(self) -> LinkLevel:
        return self.links[1]

    def link_between(self, i: int, j: int) -> LinkLevel:
        """The level joining devices ``i`` and ``j``: intra-host if they share a host."""
        return self.links[0] if self.host_of(i) == self.host_of(j) else self.links[1]

    def slowest_link(self, group: Iterable[int]) -> LinkLevel:
        """Lowest-bandwidth level used by any pair of distinct devices in ``group``.

        A group of fewer than two devices communicates over nothing; it returns the
        intra-host level.
        """
        ids = sorted({self._index(i) for i in group})
        per_host: dict[int, int] = {}
        for i in ids:
            per_host[self.host_of(i)] = per_host.get(self.host_of(i), 0) + 1
        used = []
        if any(n >= 2 for n in per_host.values()):
            used.append(self.links[0])
        if len(per_host) >= 2:
            used.append(self.links[1])
        if not used:
            return self.links[0]
        return min(used, key=lambda l: (l.beta, -l.alpha))

    # ---- JAX

    def jax_devices(self) -> list:
        """``jax.devices()[:num_devices]``: device ``i`` of the cluster runs on the i-th."""
        import jax

        devs = jax.devices()
        n = self.num_devices
        if len(devs) < n:
            plat = devs[0].platform if devs else "?"
            raise ClusterError(
                f"cluster {self.name!r} needs {n} devices but JAX sees only {len(devs)} "
                f"({plat}); for simulated CPU devices set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={n} (or JAX_NUM_CPU_DEVICES={n}) "
                "before JAX initialises")
        return list(devs[:n])

    # ---- construction

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str | None = None,
                  default_name: str = "cluster") -> "Cluster":
        """A cluster from the TOML schema as a dict (what ``tomllib`` returns)."""
        try:
            return _cluster_from_mapping(data, default_name)
        except ClusterError as e:
            raise e._at(source=source) from None

    @classmethod
    def from_toml(cls, text: str, *, source: str = "<string>",
                  default_name: str | None = None) -> "Cluster":
        """A cluster from TOML text; ``source`` names it in error messages."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ClusterError(f"TOML syntax error: {e}", source=source) from None
        if default_name is None:
            default_name = Path(source).stem if source != "<string>" else "cluster"
        return cls.from_dict(data, source=source, default_name=default_name)

    @classmethod
    def load(cls, name_or_path: str | os.PathLike) -> "Cluster":
        """A preset by name, or a TOML file (see the module docstring)."""
        s = os.fspath(name_or_path)
        path = Path(s)
        is_pathlike = (os.sep in s or "/" in s or path.suffix.lower() == ".toml"
                       or not isinstance(name_or_path, str))
        if not is_pathlike:
            key = _preset_key(s)
            if key in _PRESET_SPECS:
                return _preset(key)
        if path.is_file():
            try:
                text = path.read_bytes().decode("utf-8")
            except UnicodeDecodeError as e:
                raise ClusterError(f"not UTF-8 text: {e}", source=s) from None
            return cls.from_toml(text, source=s, default_name=path.stem)
        if path.suffix.lower() == ".toml" and _preset_key(path.stem) in _PRESET_SPECS:
            return _preset(_preset_key(path.stem))
        what = "file" if is_pathlike else "preset or file"
        raise ClusterError(f"no such cluster {what}: {s!r} (presets: "
                           f"{', '.join(_PRESET_SPECS)})")

    @staticmethod
    def presets() -> list[str]:
        """Names of the built-in clusters."""
        return list(_PRESET_SPECS)

    @classmethod
    def simulated(cls, entries: Sequence[Any], *, devices_per_host: int | None = None,
                  links: Any = None, name: str | None = None) -> "Cluster":
        """A cluster from ``[(type, count), ...]`` mapped onto local JAX devices in order.

        Entries: ``(type, count)``, ``(type, count, {overrides})`` with keys of a TOML
        ``[[class]]`` table (``name``, ``flops``, ``memory``, ``mem_bandwidth``,
        ``host``, ``host_ids``, …), or a :class:`DeviceClass`.  With
        ``devices_per_host=None`` all devices share host 0; with ``D`` each class
        fills new hosts of ``D`` devices.  ``links``: ``None`` (``DEFAULT_LINKS``),
        two :class:`LinkLevel`, or a dict like the TOML ``[links]`` table whose
        values are tables or :class:`LinkLevel`.  No devices are needed until
        :meth:`jax_devices`.
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
        tables = []
        next_host = 0
        for c in self.classes:
            entry = _cat.CATALOGUE[c.type]
            t: dict[str, Any] = {"type": c.type}
            if c.name != c.type:
                t["name"] = c.name
            t.update(_placement(c, next_host))
            next_host = max(next_host, max(c.hosts) + 1)
            for k in ("flops", "memory", "mem_bandwidth"):
                if explicit or getattr(c, k) != getattr(entry, k):
                    t[k] = getattr(c, k)
            tables.append(t)
        links = {}
        for key, lname, l in zip(_LEVEL_KEYS, _LEVEL_NAMES, self.links):
            lt: dict[str, Any] = {}
            if l.name != lname:
                lt["name"] = l.name
            lt["bandwidth"] = l.beta
            lt["latency"] = l.alpha
            links[key] = lt
        return {"name": self.name, "class": tables, "links": links}

    def to_toml(self, *, explicit: bool = False) -> str:
        """TOML text that :meth:`from_toml` / :meth:`load` read back into an equal cluster."""
        d = self.to_dict(explicit=explicit)
        lines = [f"# hapsynth cluster: {self.num_devices} devices in {self.num_classes} "
                 f"class(es) on {self.num_hosts} host(s)",
                 f"name = {_toml_value(d['name'])}"]
        for ci, (c, t) in enumerate(zip(self.classes, d["class"])):
            devs = self.class_devices(ci)
            lines += ["", "[[class]]", f"# devices {devs[0]}-{devs[-1]} on host(s) "
                      f"{_ranges(sorted(set(c.hosts)))}"]
            for k, v in t.items():
                comment = ""
                if k == "memory":
                    comment = f"  # {_human_mem(v)}"
                elif k == "mem_bandwidth":
                    comment = f"  # {_human_bw(v)}"
                elif k == "flops":
                    comment = f"  # {_human_flops(v)}"
                lines.append(f"{k} = {_toml_value(v)}{comment}")
            if not explicit:
                e = c.catalogue_entry
                lines.append(f"# catalogue {e.name}: flops = {e.flops!r} ({_human_flops(e.flops)}"
                             f"), memory = {_human_mem(e.memory)}, mem_bandwidth = "
                             f"{e.mem_bandwidth / 1e9:.4g} GB/s")
        for key, lt in d["links"].items():
            lines += ["", f"[links.{key}]"]
            if "name" in lt:
                lines.append(f"name = {_toml_value(lt['name'])}")
            lines.append(f"bandwidth = {_toml_value(lt['bandwidth'])}  # "
                         f"{_human_bw(lt['bandwidth'])}")
            lines.append(f"latency = {_toml_value(lt['latency'])}  # "
                         f"{lt['latency'] * 1e6:.4g} us")
        return "\n".join(lines) + "\n"

    def save(self, path: str | os.PathLike, *, explicit: bool = False) -> None:
        Path(path).write_text(self.to_toml(explicit=explicit), encoding="utf-8")

    def summary(self) -> str:
        """A small text table of classes and links."""
        rows = [f"cluster {self.name}: {self.num_devices} devices, {self.num_hosts} host(s), "
                f"{_human_flops(self.total_flops)} effective in total"]
        for ci, c in enumerate(self.classes):
            devs = self.class_devices(ci)
            rows.append(f"  [{ci}] {c.name:<12} {c.type:<10} ×{c.count:<4} devices "
                        f"{devs[0]}-{devs[-1]}  hosts {sorted(set(c.hosts))}  "
                        f"{_human_flops(c.flops)}  {_human_mem(c.memory)}")
        for l in self.links:
            rows.append(f"  link {l.name}: {_human_bw(l.beta)}, {l.alpha * 1e6:.4g} us")
        return "\n".join(rows)


def _links_arg(links: Any) -> dict[str, Any]:
    def level(v: Any) -> Any:
        if isinstance(v, LinkLevel):
            return {"name": v.name, "bandwidth": v.beta, "latency": v.alpha}
        return v

    if isinstance(links, Mapping):
        return {k: level(v) for k, v in links.items()}
    if isinstance(links, (tuple, list)) and len(links) == 2:
        return {k: level(v) for k, v in zip(_LEVEL_KEYS, links)}
    raise ClusterError(f"must be None, two LinkLevels or a dict like the TOML [links] "
                       f"table, got {links!r}", field="links", source="Cluster.simulated")


# --------------------------------------------------------------------------- presets

_PCIE3 = {"name": "PCIe 3.0 x16", "bandwidth": "10GB/s", "latency": "5us"}

#: Built-in clusters, in the TOML schema.  The single source of truth for presets;
#: ``clusters/<name>.toml`` are exports (``Cluster.load(name).save(...)``).
_PRESET_SPECS: dict[str, dict[str, Any]] = {
    # HAP's evaluation cluster (EuroSys '24): 2 machines × 8 V100 + 6 × 8 P100,
    # ~10.4 Gbps between machines; effective FLOP/s as HAP profiled them.
    # Intra-host assumption: one level for all hosts, PCIe 3.0 x16 class
    # (~10 GB/s effective; the P100 machines have no NVLink, and a collective over
    # both kinds of host is bound by the slower one).  Latencies are assumptions.
    "hap-v100x16-p100x48": {
        "class": [{"type": "V100", "hosts": 2, "devices_per_host": 8},
                  {"type": "P100", "hosts": 6, "devices_per_host": 8}],
        "links": {"intra_host": _PCIE3,
                  "inter_host": {"name": "10.4 Gbps Ethernet", "bandwidth": "10.4Gbps",
                                 "latency": "20us"}},
    },
    # An A100 server and a V100 server on 100 Gbps (RoCE/InfiniBand class).
    # Intra-host: NVLink, bounded by the V100 (DGX-1 class) host: ~100 GB/s
    # effective collective bandwidth.  "A100" is the catalogue's A100-40GB.
    "a100x8-v100x8-100g": {
        "class": [{"type": "A100", "hosts": 1, "devices_per_host": 8},
                  {"type": "V100", "hosts": 1, "devices_per_host": 8}],
        "links": {"intra_host": {"name": "NVLink", "bandwidth": "100GB/s", "latency": "5us"},
                  "inter_host": {"name": "100 Gbps RDMA", "bandwidth": "100Gbps",
                                 "latency": "10us"}},
    },
    # One 4×H100 host and three 4×T4 hosts (g4dn.12xlarge class: 4 T4, 50 Gbps).
    # Intra-host: PCIe 3.0 x16 class (T4 is PCIe-only and bounds a collective).
    "h100x4-t4x12": {
        "class": [{"type": "H100", "hosts": 1, "devices_per_host": 4},
                  {"type": "T4", "hosts": 3, "devices_per_host": 4}],
        "links": {"intra_host": _PCIE3,
                  "inter_host": {"name": "50 Gbps Ethernet", "bandwidth": "50Gbps",
                                 "latency": "20us"}},
    },
    # Simulated CPU clusters for tests (match conftest's 8 CPU devices).
    "cpu8-even": {
        "class": [{"type": "CPU", "count": 8}],
        "links": {"intra_host": {"name": "shared memory", "bandwidth": "10GB/s",
                                 "latency": "5us"},
                  "inter_host": {"bandwidth": "10Gbps", "latency": "20us"}},
    },
    # Two classes on one host: 2 "fast" CPU devices (catalogue speed) and 6 "slow"
    # ones declared 4× slower, so plans are uneven.
    "cpu-2-6": {
        "class": [{"type": "CPU", "name": "fast", "count": 2, "host": 0},
                  {"type": "CPU", "name": "slow", "count": 6, "host": 0,
                   "flops": "22.5GFLOP/s"}],
        "links": {"intra_host": {"name": "shared memory", "bandwidth": "10GB/s",
                                 "latency": "5us"},
                  "inter_host": {"bandwidth": "10Gbps", "latency": "20us"}},
    },
    # Two simulated hosts of 4 CPU devices joined by a slow 1 Gbps link, to
    # exercise the link hierarchy on CPU.
    "cpu2x4-hosts": {
        "class": [{"type": "CPU", "hosts": 2, "devices_per_host": 4}],
        "links": {"intra_host": {"name": "shared memory", "bandwidth": "10GB/s",
                                 "latency": "5us"},
                  "inter_host": {"bandwidth": "1Gbps", "latency": "50us"}},
    },
}
_PRESET_ALIASES = {"hap-v100-p100": "hap-v100x16-p100x48"}
_PRESET_CACHE: dict[str, Cluster] = {}


def _preset_key(s: str) -> str:
    k = s.strip().lower().replace("_", "-")
    return _PRESET_ALIASES.get(k, k)


def _preset(key: str) -> Cluster:
    if key not in _PRESET_CACHE:
        _PRESET_CACHE[key] = Cluster.from_dict({"name": key, **_PRESET_SPECS[key]},
                                               source=f"preset {key!r}")
    return _PRESET_CACHE[key]


def export_presets(directory: str | os.PathLike) -> list[Path]:
    """Write every preset to ``<directory>/<name>.toml``; returns the paths written.

    Regenerates the repository's ``clusters/`` folder:
    ``python -m hapsynth.synth.cluster clusters``.
    """
    out = []
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for key in _PRESET_SPECS:
        p = d / f"{key}.toml"
        _preset(key).save(p)
        out.append(p)
    return out


if __name__ == "__main__":  # pragma: no cover
    import sys

    for p in export_presets(sys.argv[1] if len(sys.argv) > 1 else "clusters"):
        print(p)
