"""The cluster file format: TOML (or its dict) <-> name, device classes and link levels.

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

    [links.intra_host]             # optional table per level of values.LEVELS;
    name = "PCIe 3.0 x16"          #   default: that level's default.  Optional label
    bandwidth = "10GB/s"           # required in the table
    latency = "5us"                # required in the table

    [links.inter_host]
    bandwidth = "10.4Gbps"
    latency = "20us"

    # islands (optional): hosts on fast links, joined by [links.inter_island] (default:
    # as inter_host). Per class, `island = "a"` in its [[class]] table (a class without
    # one is in island "0"; islands never share a host), or as tables:
    # [[island]]
    # name = "v100-rack"
    # classes = ["v100"]           # the hosts of these classes, or host_ids = [0, 1]
    [links.inter_island]
    bandwidth = "10Gbps"
    latency = "30us"

"New hosts" are numbered from one past the largest host id used by the classes
above.  Quantities are numbers in base units or strings with units (:mod:`.units`).
Every error is a :class:`ClusterError` naming the field path and the value, e.g.
``class[1].type: unknown device type 'V1OO' (...)``; unknown keys are rejected
(typos do not silently fall back to defaults).

Reading uses :mod:`tomllib`; writing uses ``tomlkit``, with comments giving the
numbers in readable units.  By default only the values that differ from the
catalogue are written (``explicit=True`` writes all of them, which keeps a saved
cluster stable if the catalogue changes).  Reading the text back gives equal values.
"""
from __future__ import annotations

import tomllib
from typing import Any, Mapping, Sequence

import tomlkit

from . import catalogue as cat
from .errors import ClusterError, check_keys, fail, host_id, nonempty_str, pos_int
from .units import (human_bandwidth, human_flops, human_latency, human_memory,
                    parse_bandwidth, parse_flops, parse_latency, parse_memory)
from .values import LEVELS, LEVEL_KEYS, DeviceClass, Island, LinkLevel

__all__ = ["Parsed", "from_dict", "read_toml", "to_dict", "to_toml"]

_TOP_KEYS = ("name", "class", "links", "island")
_ISLAND_KEYS = ("name", "host_ids", "classes")
_CLASS_KEYS = ("type", "name", "count", "hosts", "devices_per_host", "host", "host_ids",
               "flops", "memory", "mem_bandwidth", "island")
_LINK_KEYS = ("name", "bandwidth", "latency")

#: What a description holds: (name, classes, links, islands).
Parsed = tuple[str, tuple[DeviceClass, ...], tuple[LinkLevel, ...], tuple[Island, ...]]


# --------------------------------------------------------------------------- reading


def read_toml(text: str) -> dict[str, Any]:
    """The dict of a TOML text; a syntax error is a :class:`ClusterError`."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ClusterError(f"TOML syntax error: {e}") from None


def from_dict(data: Any, default_name: str) -> Parsed:
    """(name, classes, links, islands) of a description in the TOML schema, as a dict."""
    if not isinstance(data, Mapping):
        raise fail(None, f"a cluster description must be a table, got {type(data).__name__}")
    check_keys(data, _TOP_KEYS, None)
    name = nonempty_str(data["name"], "name") if "name" in data else default_name
    if "class" not in data:
        raise fail("class", "missing required field: at least one [[class]] table")
    tables = data["class"]
    if isinstance(tables, Mapping):
        raise fail("class", "must be an array of tables ([[class]]), got a single table ([class])")
    if not isinstance(tables, list) or not tables:
        raise fail("class", f"must be a non-empty array of tables ([[class]]), got {tables!r}")
    classes: list[DeviceClass] = []
    next_host = 0
    for i, tbl in enumerate(tables):
        c = _class_from_table(tbl, f"class[{i}]", next_host)
        classes.append(c)
        next_host = max(next_host, max(c.hosts) + 1)
    links_tbl = data.get("links", {})
    if not isinstance(links_tbl, Mapping):
        raise fail("links", f"must be a table, got {links_tbl!r}")
    check_keys(links_tbl, LEVEL_KEYS, "links")
    links: list[LinkLevel] = []
    for key, default in LEVELS:
        if key in links_tbl:
            links.append(_link_from_table(links_tbl[key], key, default.name))
        else:  # an absent inter-island level is the inter-host one
            links.append(links[-1] if key == "inter_island" else default)
    per_class = [tbl.get("island") for tbl in tables]
    if any(k is not None for k in per_class):
        if "island" in data:
            raise fail("island", "give islands per class (island = ...) or as [[island]] "
                       "tables, not both")
        return name, tuple(classes), tuple(links), _class_islands(per_class, classes)
    return name, tuple(classes), tuple(links), _islands(data.get("island", []), classes)


def _class_islands(names, classes: Sequence[DeviceClass]) -> tuple[Island, ...]:
    """Islands from each class's ``island`` key (a class without one is in island "0")."""
    hosts: dict[str, set] = {}
    for i, (n, c) in enumerate(zip(names, classes)):
        if n is None:
            n = "0"
        elif isinstance(n, bool) or not isinstance(n, (str, int)):
            raise fail(f"class[{i}].island", f"must be an island name, got {n!r}")
        hosts.setdefault(nonempty_str(str(n), f"class[{i}].island"), set()).update(c.hosts)
    shared = [h for a, b in _pairs(list(hosts.values())) for h in a & b]
    if shared:
        raise fail("class", f"host {sorted(shared)[0]} holds classes of different islands; "
                   "islands never share a host")
    return tuple(Island(n, tuple(h)) for n, h in hosts.items())


def _pairs(xs):
    return [(a, b) for k, a in enumerate(xs) for b in xs[k + 1:]]


def _islands(tables: Any, classes: Sequence[DeviceClass]) -> tuple[Island, ...]:
    """The ``[[island]]`` tables: each names its hosts by id or by the classes on them."""
    if not isinstance(tables, list):
        raise fail("island", f"must be an array of tables ([[island]]), got {tables!r}")
    by_name = {c.name: c for c in classes}
    out = []
    for k, tbl in enumerate(tables):
        p = f"island[{k}]"
        if not isinstance(tbl, Mapping):
            raise fail(p, f"must be a table, got {tbl!r}")
        check_keys(tbl, _ISLAND_KEYS, p)
        if ("host_ids" in tbl) == ("classes" in tbl):
            raise fail(p, "give exactly one of 'host_ids' or 'classes'")
        if "classes" in tbl:
            names = tbl["classes"]
            if not isinstance(names, list) or not names:
                raise fail(f"{p}.classes", f"must be a non-empty array of class names, got {names!r}")
            for n in names:
                if n not in by_name:
                    raise fail(f"{p}.classes", f"no class named {n!r} (classes: "
                               f"{', '.join(by_name)})")
            hosts = sorted({h for n in names for h in by_name[n].hosts})
        else:
            hosts = tbl["host_ids"]
            if not isinstance(hosts, list):
                raise fail(f"{p}.host_ids", f"must be an array of host ids, got {hosts!r}")
        name = nonempty_str(tbl["name"], f"{p}.name") if "name" in tbl else f"island{k}"
        try:
            out.append(Island(name, tuple(hosts)))
        except ClusterError as e:
            field = "host_ids" if (e.field or "").startswith("hosts") else e.field
            raise fail(f"{p}.{field}", e.message) from None
    return tuple(out)


def _link_from_table(tbl: Any, key: str, default_name: str) -> LinkLevel:
    path = f"links.{key}"
    if not isinstance(tbl, Mapping):
        raise fail(path, f"must be a table, got {tbl!r}")
    check_keys(tbl, _LINK_KEYS, path)
    for req in ("bandwidth", "latency"):
        if req not in tbl:
            raise fail(f"{path}.{req}", "missing required field")
    return LinkLevel(
        name=nonempty_str(tbl["name"], f"{path}.name") if "name" in tbl else default_name,
        alpha=parse_latency(tbl["latency"], f"{path}.latency"),
        beta=parse_bandwidth(tbl["bandwidth"], f"{path}.bandwidth"),
    )


def _class_from_table(tbl: Any, p: str, next_host: int) -> DeviceClass:
    if not isinstance(tbl, Mapping):
        raise fail(p, f"must be a table, got {tbl!r}")
    check_keys(tbl, _CLASS_KEYS, p)
    if "type" not in tbl:
        raise fail(f"{p}.type", "missing required field (a device type such as 'V100')")
    typ = tbl["type"]
    if not isinstance(typ, str):
        raise fail(f"{p}.type", f"must be a string, got {typ!r}")
    try:
        entry = cat.lookup(typ)
    except cat.UnknownDeviceType as e:
        raise fail(f"{p}.type", str(e)) from None
    name = nonempty_str(tbl["name"], f"{p}.name") if "name" in tbl else typ.strip()
    hosts = _hosts(tbl, p, next_host)
    return DeviceClass(
        name=name,
        type=entry.name,
        count=len(hosts),
        flops=parse_flops(tbl["flops"], f"{p}.flops") if "flops" in tbl else entry.flops,
        memory=parse_memory(tbl["memory"], f"{p}.memory") if "memory" in tbl else entry.memory,
        mem_bandwidth=(parse_bandwidth(tbl["mem_bandwidth"], f"{p}.mem_bandwidth")
                       if "mem_bandwidth" in tbl else entry.mem_bandwidth),
        hosts=hosts,
    )


def _hosts(tbl: Mapping[str, Any], p: str, next_host: int) -> tuple[int, ...]:
    """The host id of each device of the ``[[class]]`` table ``tbl`` (its placement keys)."""
    if "hosts" in tbl:
        nh = pos_int(tbl["hosts"], f"{p}.hosts")
        if "devices_per_host" not in tbl:
            raise fail(f"{p}.devices_per_host", "missing required field (needed with 'hosts')")
        dph = pos_int(tbl["devices_per_host"], f"{p}.devices_per_host")
        for k in ("host", "host_ids"):
            if k in tbl:
                raise fail(f"{p}.{k}", "cannot be combined with 'hosts' "
                           "(classes given by 'hosts' get new hosts)")
        count = nh * dph
        if "count" in tbl and pos_int(tbl["count"], f"{p}.count") != count:
            raise fail(f"{p}.count", f"{tbl['count']!r} does not match hosts × devices_per_host"
                       f" = {nh} × {dph} = {count}")
        return tuple(next_host + d // dph for d in range(count))
    if "host_ids" in tbl:
        ids = tbl["host_ids"]
        if not isinstance(ids, list):
            raise fail(f"{p}.host_ids", f"must be an array of host ids, got {ids!r}")
        for k in ("host", "devices_per_host"):
            if k in tbl:
                raise fail(f"{p}.{k}", "cannot be combined with 'host_ids'")
        hosts = tuple(host_id(h, f"{p}.host_ids[{k}]") for k, h in enumerate(ids))
        if not hosts:
            raise fail(f"{p}.host_ids", "must not be empty")
        if "count" in tbl and pos_int(tbl["count"], f"{p}.count") != len(hosts):
            raise fail(f"{p}.count", f"{tbl['count']!r} does not match the "
                       f"{len(hosts)} entries of host_ids")
        return hosts
    if "count" not in tbl:
        raise fail(f"{p}.count", "missing required field "
                   "(give 'count', or 'hosts' with 'devices_per_host')")
    count = pos_int(tbl["count"], f"{p}.count")
    if "host" in tbl and "devices_per_host" in tbl:
        raise fail(f"{p}.devices_per_host", "cannot be combined with 'host'")
    if "host" in tbl:
        return (host_id(tbl["host"], f"{p}.host"),) * count
    if "devices_per_host" in tbl:
        dph = pos_int(tbl["devices_per_host"], f"{p}.devices_per_host")
        return tuple(next_host + d // dph for d in range(count))
    return (next_host,) * count


# --------------------------------------------------------------------------- writing


def to_dict(name: str, classes: Sequence[DeviceClass], links: Sequence[LinkLevel], *,
            explicit: bool = True, islands: Sequence[Island] = ()) -> dict[str, Any]:
    """The TOML schema as plain data (JSON-serialisable); :func:`from_dict` reads it back.

    ``explicit=True`` writes flops/memory/mem_bandwidth of every class; ``False``
    only those that differ from the catalogue.
    """
    tables = []
    next_host = 0
    for c in classes:
        entry = cat.CATALOGUE[c.type]
        t: dict[str, Any] = {"type": c.type}
        if c.name != c.type:
            t["name"] = c.name
        t.update(_placement(c, next_host))
        next_host = max(next_host, max(c.hosts) + 1)
        for k in ("flops", "memory", "mem_bandwidth"):
            if explicit or getattr(c, k) != getattr(entry, k):
                t[k] = getattr(c, k)
        tables.append(t)
    link_tables = {}
    for (key, default), level in zip(LEVELS, links):
        if key == "inter_island" and not islands and level == links[1]:
            continue  # as the inter-host level: nothing to say
        lt: dict[str, Any] = {}
        if level.name != default.name:
            lt["name"] = level.name
        lt["bandwidth"] = level.beta
        lt["latency"] = level.alpha
        link_tables[key] = lt
    out = {"name": name, "class": tables, "links": link_tables}
    by_class = _island_per_class(classes, islands)
    if by_class is not None:
        for t, n in zip(tables, by_class):
            t["island"] = n
    elif islands:
        out["island"] = [{"name": i.name, "host_ids": list(i.hosts)} for i in islands]
    return out


def _island_per_class(classes: Sequence[DeviceClass], islands: Sequence[Island]):
    """Each class's island name, when every island is exactly the hosts of whole classes
    (the short form: ``island = ...`` in ``[[class]]``); else None."""
    if not islands:
        return None
    names = []
    for c in classes:
        home = [i for i in islands if set(c.hosts) <= set(i.hosts)]
        if not home:
            return None
        names.append(home[0].name)
    for i in islands:
        if set(i.hosts) != {h for c, n in zip(classes, names) if n == i.name for h in c.hosts}:
            return None
    return names


def _placement(c: DeviceClass, next_host: int) -> dict[str, Any]:
    """The shortest placement keys that give ``c.hosts`` when new hosts start at ``next_host``."""
    ids, n = c.hosts, c.count
    if all(h == ids[0] for h in ids):
        return {"count": n} if ids[0] == next_host else {"count": n, "host": ids[0]}
    dph = next(k for k, h in enumerate(ids) if h != ids[0])
    if ids == tuple(next_host + d // dph for d in range(n)):
        if n % dph == 0:
            return {"hosts": n // dph, "devices_per_host": dph}
        return {"count": n, "devices_per_host": dph}
    return {"count": n, "host_ids": list(ids)}


_READABLE = {"memory": human_memory, "mem_bandwidth": human_bandwidth, "flops": human_flops,
             "bandwidth": human_bandwidth, "latency": human_latency}


def to_toml(name: str, classes: Sequence[DeviceClass], links: Sequence[LinkLevel], *,
            explicit: bool = False, comments: Sequence[str] = (),
            islands: Sequence[Island] = ()) -> str:
    """TOML text of the description (:func:`to_dict`), with readable numbers in comments.

    ``comments``: lines for the top of the file.
    """
    d = to_dict(name, classes, links, explicit=explicit, islands=islands)
    num_hosts = len({h for c in classes for h in c.hosts})
    num_devices = sum(c.count for c in classes)
    doc = tomlkit.document()
    for line in comments:
        doc.add(_comment(line))
    doc.add(_comment(f"hapsynth cluster: {num_devices} devices in {len(classes)} "
                     f"class(es) on {num_hosts} host(s)"))
    doc.add("name", d["name"])
    aot = tomlkit.aot()
    first = 0
    for c, t in zip(classes, d["class"]):
        tbl = tomlkit.table()
        tbl.add(_comment(f"devices {first}-{first + c.count - 1} on host(s) "
                         f"{_ranges(sorted(set(c.hosts)))}"))
        first += c.count
        _add_all(tbl, t)
        if not explicit:
            e = cat.CATALOGUE[c.type]
            tbl.add(_comment(f"catalogue {e.name}: flops = {e.flops!r} ({human_flops(e.flops)}"
                             f"), memory = {human_memory(e.memory)}, mem_bandwidth = "
                             f"{e.mem_bandwidth / 1e9:.4g} GB/s"))
        aot.append(tbl)
    doc.add("class", aot)
    if "island" in d:
        isl = tomlkit.aot()
        for t in d["island"]:
            tbl = tomlkit.table()
            _add_all(tbl, t)
            isl.append(tbl)
        doc.add("island", isl)
    link_tables = tomlkit.table(is_super_table=True)
    for key, lt in d["links"].items():
        tbl = tomlkit.table()
        _add_all(tbl, lt)
        link_tables.add(key, tbl)
    doc.add("links", link_tables)
    return tomlkit.dumps(doc)


def _add_all(tbl: Any, values: Mapping[str, Any]) -> None:
    """Add ``values`` to the tomlkit table ``tbl``, numbers with a readable comment."""
    for k, v in values.items():
        item = tomlkit.item(v)
        if k in _READABLE:
            item.comment(_READABLE[k](v))
            item.trivia.comment_ws = "  "
        tbl.add(k, item)


def _comment(text: str) -> Any:
    return tomlkit.comment(" ".join(text.splitlines()))


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
