"""Cluster descriptions: catalogue, presets, TOML round trips, validation messages."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hapsynth.cluster import (
    DEFAULT_LINKS,
    Cluster,
    ClusterError,
    DeviceClass,
    LinkLevel,
    parse_bandwidth,
    parse_flops,
    parse_latency,
    parse_memory,
)
from hapsynth.cluster import catalogue as cat
from hapsynth.lower.devices import local_devices

CLUSTERS_DIR = Path(__file__).resolve().parents[1] / "clusters"
REQUIRED_PRESETS = ["hap-v100x16-p100x48", "a100x8-v100x8-100g", "h100x4-t4x12",
                    "cpu8-even", "cpu-2-6"]
GiB = 2**30


# ------------------------------------------------------------------ catalogue


def test_catalogue_has_required_types_with_sane_numbers():
    for name in ["V100", "P100", "A100-40GB", "A100-80GB", "H100", "H200", "T4", "L4", "CPU"]:
        d = cat.lookup(name)
        assert d.name == name
        assert d.flops > 0 and d.memory > 0 and d.mem_bandwidth > 0 and d.notes
    assert cat.lookup("V100").flops == 3.86e12
    assert cat.lookup("P100").flops == 2.15e12
    assert cat.lookup("CPU").flops == 9e10
    # newer parts are faster than older ones
    assert cat.lookup("H100").flops > cat.lookup("A100").flops > cat.lookup("V100").flops
    assert cat.lookup("A100-80GB").memory == 2 * cat.lookup("A100-40GB").memory


@pytest.mark.parametrize("alias,canonical", [
    ("a100", "A100-40GB"), ("A100_80GB", "A100-80GB"), ("h100", "H100"),
    ("H100-SXM", "H100"), ("h100 80gb", "H100"), ("v100", "V100"), ("cpu", "CPU"),
    (" t4 ", "T4"), ("H200", "H200"),
])
def test_catalogue_lookup_case_insensitive_and_aliases(alias, canonical):
    assert cat.canonical_name(alias) == canonical
    assert cat.lookup(alias) is cat.CATALOGUE[canonical]


def test_catalogue_unknown_type_names_value_and_suggests():
    with pytest.raises(LookupError) as e:
        cat.lookup("V1OO")
    msg = str(e.value)
    assert "'V1OO'" in msg and "known:" in msg and "P100" in msg
    assert "did you mean 'V100'" in msg


# ------------------------------------------------------------------ presets


def test_required_presets_listed():
    names = Cluster.presets()
    for n in REQUIRED_PRESETS:
        assert n in names


@pytest.mark.parametrize("name", Cluster.presets())
def test_every_preset_loads(name):
    c = Cluster.load(name)
    assert c.name == name
    assert c.num_devices == len(c.devices) > 0
    assert [d.index for d in c.devices] == list(range(c.num_devices))


def test_hap_preset():
    c = Cluster.load("hap-v100x16-p100x48")
    assert c.num_devices == 64
    assert [cl.type for cl in c.classes] == ["V100", "P100"]
    assert [cl.count for cl in c.classes] == [16, 48]
    assert all(c.device_class(i).type == "V100" for i in range(16))
    assert all(c.device_class(i).type == "P100" for i in range(16, 64))
    assert c.class_of(15) == 0 and c.class_of(16) == 1
    assert c.host_of(0) == 0 and c.host_of(7) == 0 and c.host_of(8) == 1
    assert c.host_of(15) == 1 and c.host_of(16) == 2 and c.host_of(63) == 7
    assert c.num_hosts == 8
    assert c.link_between(0, 1) is c.intra_host is c.links[0]
    assert c.link_between(0, 8) is c.inter_host is c.links[1]
    assert c.inter_host.beta == pytest.approx(10.4e9 / 8)
    assert c.intra_host.beta > c.inter_host.beta
    assert c.total_flops == pytest.approx(16 * 3.86e12 + 48 * 2.15e12)
    assert c.classes[0].flops == 3.86e12 and c.classes[1].flops == 2.15e12
    assert c.class_devices("P100") == tuple(range(16, 64))


def test_a100_v100_preset():
    c = Cluster.load("a100x8-v100x8-100g")
    assert c.num_devices == 16 and c.num_hosts == 2
    assert [(cl.name, cl.type, cl.count) for cl in c.classes] == [
        ("A100", "A100-40GB", 8), ("V100", "V100", 8)]
    assert {c.host_of(i) for i in range(8)} == {0}
    assert {c.host_of(i) for i in range(8, 16)} == {1}
    assert c.inter_host.beta == pytest.approx(100e9 / 8)
    assert c.link_between(7, 8) is c.inter_host


def test_h100_t4_preset():
    c = Cluster.load("h100x4-t4x12")
    assert [(cl.type, cl.count) for cl in c.classes] == [("H100", 4), ("T4", 12)]
    assert c.num_hosts == 4
    assert [c.host_of(i) for i in (0, 3, 4, 7, 8, 15)] == [0, 0, 1, 1, 2, 3]
    assert 25e9 / 8 <= c.inter_host.beta <= 50e9 / 8


def test_cpu_presets():
    even = Cluster.load("cpu8-even")
    assert even.num_devices == 8 and even.num_classes == 1 and even.num_hosts == 1
    assert even.classes[0].type == "CPU" and even.classes[0].flops == 9e10
    c = Cluster.load("cpu-2-6")
    assert c.class_names == ("fast", "slow")
    assert [cl.count for cl in c.classes] == [2, 6]
    assert c.num_hosts == 1 and c.link_between(0, 7) is c.intra_host
    assert c.classes[0].flops > c.classes[1].flops
    two = Cluster.load("cpu2x4-hosts")
    assert two.num_hosts == 2 and two.link_between(3, 4) is two.inter_host


def test_load_names_are_case_insensitive_and_design_alias_works(tmp_path, monkeypatch):
    hap = Cluster.load("hap-v100x16-p100x48")
    assert Cluster.load("HAP_V100X16_P100X48") == hap
    assert Cluster.load("hap_v100_p100") == hap
    monkeypatch.chdir(tmp_path)  # no clusters/ folder here: falls back to the preset
    assert Cluster.load("clusters/hap_v100_p100.toml") == hap
    assert Cluster.load("clusters/cpu-2-6.toml") == Cluster.load("cpu-2-6")


def test_load_unknown_name_or_missing_file():
    with pytest.raises(ClusterError, match=r"no such cluster preset or file: 'nope'.*cpu8-even"):
        Cluster.load("nope")
    with pytest.raises(ClusterError, match=r"no such cluster file: 'does/not/exist.toml'"):
        Cluster.load("does/not/exist.toml")


def test_presets_are_the_committed_toml_files():
    assert Cluster.presets() == sorted(f.stem for f in CLUSTERS_DIR.glob("*.toml"))


def test_every_committed_toml_loads():
    files = sorted(CLUSTERS_DIR.glob("*.toml"))
    assert files
    for f in files:
        assert Cluster.load(f).num_devices > 0


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("name", Cluster.presets())
def test_preset_toml_round_trip(name, explicit, tmp_path):
    c = Cluster.load(name)
    text = c.to_toml(explicit=explicit)
    assert Cluster.from_toml(text) == c
    p = tmp_path / "other-name.toml"
    c.save(p, explicit=explicit)
    back = Cluster.load(p)
    assert back == c and back.name == name  # the name key wins over the file stem
    assert hash(back) == hash(c)


@pytest.mark.parametrize("name", Cluster.presets())
def test_preset_dict_json_round_trip(name):
    c = Cluster.load(name)
    assert Cluster.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert Cluster.from_dict(c.to_dict(explicit=False)) == c


HAND_WRITTEN = """
# a hand-written cluster with overrides and unit strings
[[class]]
type = "a100_80gb"
name = "big"
count = 3
host_ids = [0, 0, 1]
flops = "20 TFLOP/s"
memory = "78GiB"
mem_bandwidth = "1.9TB/s"

[[class]]
type = "v100"
count = 6
devices_per_host = 4
memory = 34359738368

[[class]]
type = "CPU"
name = "helper"
count = 2
host = 1
flops = 5e10

[links.intra_host]
name = "NVLink"
bandwidth = "150GB/s"
latency = "3us"

[links.inter_host]
bandwidth = "25Gbps"
latency = "0.05ms"
"""


def test_hand_written_file_with_overrides_and_units(tmp_path):
    p = tmp_path / "mixed-lab.toml"
    p.write_text(HAND_WRITTEN)
    c = Cluster.load(p)
    assert c.name == "mixed-lab"  # no name key: the file stem
    big, v100, helper = c.classes
    assert (big.name, big.type, big.count, big.hosts) == ("big", "A100-80GB", 3, (0, 0, 1))
    assert big.flops == 20e12 and big.memory == 78 * GiB and big.mem_bandwidth == 1.9e12
    # name defaults to the type as written; type is the catalogue name
    assert (v100.name, v100.type) == ("v100", "V100")
    assert v100.hosts == (2, 2, 2, 2, 3, 3)  # new hosts after host 1, 4 per host
    assert v100.memory == 32 * GiB and v100.flops == 3.86e12
    assert helper.hosts == (1, 1) and helper.flops == 5e10
    assert c.intra_host == LinkLevel("NVLink", 3e-6, 150e9)
    assert c.inter_host == LinkLevel("inter-host", 5e-5, 25e9 / 8)
    assert c.num_hosts == 4
    assert c.link_between(0, 1) is c.intra_host and c.link_between(1, 2) is c.inter_host
    assert c.link_between(2, 9) is c.intra_host  # big[2] and the helpers share host 1
    for explicit in (False, True):
        text = c.to_toml(explicit=explicit)
        back = Cluster.from_toml(text)
        assert back == c
        assert back.to_toml(explicit=explicit) == text


def test_missing_links_use_defaults():
    c = Cluster.from_toml('[[class]]\ntype = "T4"\ncount = 2\n')
    assert c.links == DEFAULT_LINKS and c.name == "cluster"


# ------------------------------------------------------------------ malformed files


def _load_error(tmp_path, text, fname="x.toml") -> str:
    p = tmp_path / fname
    p.write_text(text)
    with pytest.raises(ClusterError) as e:
        Cluster.load(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: "), msg
    return msg


GOOD_CLASS = '[[class]]\ntype = "V100"\nhosts = 1\ndevices_per_host = 8\n'


def test_error_unknown_device_type(tmp_path):
    msg = _load_error(tmp_path, GOOD_CLASS + '[[class]]\ntype = "V1OO"\ncount = 2\n')
    assert "class[1].type: unknown device type 'V1OO' (known: V100, P100" in msg
    assert "did you mean 'V100'" in msg


def test_error_negative_count(tmp_path):
    msg = _load_error(tmp_path, '[[class]]\ntype = "V100"\nhosts = -2\ndevices_per_host = 8\n')
    assert "class[0].hosts: must be a positive integer, got -2" in msg
    msg = _load_error(tmp_path, GOOD_CLASS + '[[class]]\ntype = "P100"\ncount = 0\n')
    assert "class[1].count: must be a positive integer, got 0" in msg
    msg = _load_error(tmp_path, '[[class]]\ntype = "V100"\ncount = 2.5\n')
    assert "class[0].count: must be a positive integer, got 2.5" in msg


def test_error_bad_unit(tmp_path):
    msg = _load_error(tmp_path, GOOD_CLASS + '[links.inter_host]\nbandwidth = "10 Gbit"\n'
                      'latency = "20us"\n')
    assert "links.inter_host.bandwidth: cannot parse '10 Gbit'" in msg
    msg = _load_error(tmp_path, GOOD_CLASS.replace("hosts = 1", 'memory = "32G"\nhosts = 1'))
    assert "class[0].memory: cannot parse '32G'" in msg
    msg = _load_error(tmp_path, GOOD_CLASS + '[links.intra_host]\nbandwidth = "10GB/s"\n'
                      'latency = "5 fortnights"\n')
    assert "links.intra_host.latency: cannot parse '5 fortnights'" in msg
    msg = _load_error(tmp_path, GOOD_CLASS + '[links.intra_host]\nbandwidth = -3\n'
                      'latency = "5us"\n')
    assert "links.intra_host.bandwidth: must be finite and positive, got -3" in msg


def test_error_unknown_key(tmp_path):
    msg = _load_error(tmp_path, GOOD_CLASS.replace("hosts = 1", "flop = 1e12\nhosts = 1"))
    assert "class[0].flop: unknown key 'flop' (did you mean 'flops'?" in msg
    msg = _load_error(tmp_path, 'nmae = "x"\n' + GOOD_CLASS)
    assert "nmae: unknown key 'nmae' (did you mean 'name'?" in msg
    msg = _load_error(tmp_path, GOOD_CLASS + '[links.inter_hosts]\nbandwidth = 1e9\n'
                      'latency = 0\n')
    assert "links.inter_hosts: unknown key 'inter_hosts' (did you mean 'inter_host'?" in msg
    msg = _load_error(tmp_path, GOOD_CLASS + '[links.inter_host]\nbandwith = 1e9\n'
                      'latency = 0\n')
    assert "links.inter_host.bandwith: unknown key 'bandwith'" in msg


def test_error_missing_field(tmp_path):
    msg = _load_error(tmp_path, '[[class]]\ncount = 4\n')
    assert "class[0].type: missing required field" in msg
    msg = _load_error(tmp_path, GOOD_CLASS + '[[class]]\ntype = "P100"\n')
    assert "class[1].count: missing required field" in msg
    msg = _load_error(tmp_path, '[[class]]\ntype = "P100"\nhosts = 2\n')
    assert "class[0].devices_per_host: missing required field" in msg
    msg = _load_error(tmp_path, GOOD_CLASS + '[links.inter_host]\nlatency = "20us"\n')
    assert "links.inter_host.bandwidth: missing required field" in msg
    msg = _load_error(tmp_path, 'name = "empty"\n')
    assert "class: missing required field" in msg


def test_error_syntax(tmp_path):
    msg = _load_error(tmp_path, GOOD_CLASS + 'oops this is not toml\n', fname="broken.toml")
    assert "broken.toml: TOML syntax error" in msg
    assert "line 5" in msg


def test_error_structure(tmp_path):
    msg = _load_error(tmp_path, '[class]\ntype = "V100"\ncount = 1\n')
    assert "class: must be an array of tables ([[class]])" in msg
    msg = _load_error(tmp_path, GOOD_CLASS + GOOD_CLASS)
    assert "class[1].name: duplicate class name 'V100'" in msg
    msg = _load_error(tmp_path, '[[class]]\ntype = "V100"\nhosts = 2\ndevices_per_host = 4\n'
                      'count = 7\n')
    assert "class[0].count: 7 does not match hosts × devices_per_host = 2 × 4 = 8" in msg
    msg = _load_error(tmp_path, '[[class]]\ntype = "V100"\ncount = 2\nhost_ids = [0, -1]\n')
    assert "class[0].host_ids[1]: must be a non-negative integer host id, got -1" in msg
    msg = _load_error(tmp_path, '[[class]]\ntype = 100\ncount = 2\n')
    assert "class[0].type: must be a string, got 100" in msg


def test_from_toml_string_source():
    with pytest.raises(ClusterError, match=r"^<string>: class\[0\]\.type: unknown device type"):
        Cluster.from_toml('[[class]]\ntype = "GTX"\ncount = 1\n')


# ------------------------------------------------------------------ units


@pytest.mark.parametrize("value,expected", [
    ("10.4Gbps", 1.3e9), ("100 Gbps", 12.5e9), ("10Gb/s", 1.25e9), ("12GB/s", 12e9),
    ("11GiB/s", 11 * 2**30), ("800 MB/s", 8e8), ("1e9", 1e9), (5e9, 5e9), (7, 7.0),
    ("1kbps", 125.0),
])
def test_parse_bandwidth(value, expected):
    assert parse_bandwidth(value) == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize("bad", ["10 Gbit", "GB/s", "10 GBps", "10 XB/s", "", "fast", True,
                                 [1], "0Gbps", "-1GB/s", float("inf")])
def test_parse_bandwidth_rejects(bad):
    with pytest.raises(ClusterError, match=r"^bw: "):
        parse_bandwidth(bad, "bw")


@pytest.mark.parametrize("value,expected", [
    ("5us", 5e-6), ("5 µs", 5e-6), ("1.5ms", 1.5e-3), ("200ns", 2e-7), ("2s", 2.0),
    (0, 0.0), ("0us", 0.0), (3e-6, 3e-6),
])
def test_parse_latency(value, expected):
    assert parse_latency(value) == expected


@pytest.mark.parametrize("value,expected", [
    ("32GiB", 32 * GiB), ("16GB", 16 * 10**9), ("1.5KiB", 1536), (1024, 1024),
    ("512 MiB", 512 * 2**20), (2.0**33, 2**33),
])
def test_parse_memory(value, expected):
    got = parse_memory(value)
    assert got == expected and isinstance(got, int)


@pytest.mark.parametrize("bad", ["32G", "32 gib", 1.5, -4, 0, "lots"])
def test_parse_memory_rejects(bad):
    with pytest.raises(ClusterError, match=r"^memory: "):
        parse_memory(bad)


@pytest.mark.parametrize("value,expected", [
    ("15.6TFLOP/s", 15.6e12), ("90 GFLOPS", 9e10), ("1 PFLOP/s", 1e15), (3.86e12, 3.86e12),
])
def test_parse_flops(value, expected):
    assert parse_flops(value) == pytest.approx(expected, rel=1e-15)


# ------------------------------------------------------------------ links


def test_index_errors():
    c = Cluster.load("cpu8-even")
    with pytest.raises(IndexError, match="device index 8 out of range .* 8 devices"):
        c.host_of(8)
    with pytest.raises(IndexError):
        c.class_of(-1)
    with pytest.raises(KeyError, match="no device class 'gpu'"):
        c.class_index("gpu")


def test_link_level_time_and_validation():
    l = LinkLevel("x", "10us", "1GB/s")
    assert (l.alpha, l.beta) == (1e-5, 1e9)
    assert l.time(1e9) == pytest.approx(1.00001)
    with pytest.raises(ClusterError, match="beta: must be finite and positive, got 0"):
        LinkLevel("x", 0, 0)


# ------------------------------------------------------------------ python API


def test_simulated_basic_and_jax_devices():
    import jax

    c = Cluster.simulated([("A100", 2), ("V100", 6)])
    assert c.num_devices == 8 and c.num_hosts == 1
    assert c.class_names == ("A100", "V100")
    assert [cl.type for cl in c.classes] == ["A100-40GB", "V100"]
    assert c.class_of(1) == 0 and c.class_of(2) == 1
    assert c.total_flops == pytest.approx(2 * 15.6e12 + 6 * 3.86e12)
    devs = local_devices(c)
    assert devs == jax.devices()[:8]
    assert Cluster.from_toml(c.to_toml()) == c


def test_simulated_with_more_devices_than_jax_sees():
    import jax

    n_jax = len(jax.devices())
    assert n_jax == 8  # tests/conftest.py
    c = Cluster.simulated([("H100", 4), ("T4", 12)], devices_per_host=4)  # no devices needed
    assert c.num_devices == 16 and c.num_hosts == 4
    assert [c.host_of(i) for i in (0, 3, 4, 15)] == [0, 0, 1, 3]
    with pytest.raises(ClusterError) as e:
        local_devices(c)
    msg = str(e.value)
    assert "needs 16 devices" in msg and f"only {n_jax}" in msg


def test_simulated_overrides_and_links():
    c = Cluster.simulated(
        [("CPU", 2, {"name": "fast"}), ("CPU", 6, {"name": "slow", "flops": "22.5 GFLOPS"})],
        links={"inter_host": {"bandwidth": "10Gbps", "latency": "20us"}},
        name="cpu-2-6",
    )
    assert c.class_names == ("fast", "slow")
    assert c.classes[1].flops == 2.25e10
    assert c.intra_host == DEFAULT_LINKS[0]
    assert c.inter_host.beta == 1.25e9
    # the same devices and numbers as the preset (link names differ)
    preset = Cluster.load("cpu-2-6")
    assert c.classes == preset.classes
    c2 = Cluster.simulated([("cpu", 8)], links=list(preset.links), name="x")
    assert c2.links == preset.links
    dc = DeviceClass.from_catalogue("P100", 3, name="p", hosts=[0, 1, 1])
    c3 = Cluster.simulated([dc, ("T4", 1)])
    assert c3.classes[0] == dc and c3.host_of(3) == 0


def test_simulated_errors_name_the_entry():
    with pytest.raises(ClusterError, match=r"class\[1\]\.name: duplicate class name 'CPU'"):
        Cluster.simulated([("CPU", 2), ("CPU", 6)])
    with pytest.raises(ClusterError, match=r"class\[0\]\.type: unknown device type 'K80'"):
        Cluster.simulated([("K80", 2)])
    with pytest.raises(ClusterError, match=r"class\[0\]\.count: must be a positive integer, got -1"):
        Cluster.simulated([("T4", -1)])
    with pytest.raises(ClusterError, match=r"class\[0\]: expected \(type, count\)"):
        Cluster.simulated(["T4"])


def test_device_class_validation_and_value_semantics():
    with pytest.raises(ClusterError, match="hosts: has 2 host ids for count = 3"):
        DeviceClass("a", "T4", 3, 1e12, GiB, 1e11, (0, 0))
    with pytest.raises(ClusterError, match="type: unknown device type 'Z9'"):
        DeviceClass("a", "Z9", 1, 1e12, GiB, 1e11, (0,))
    d = DeviceClass("a", "t4", 2, 1e12, "1GiB", "100GB/s", [0, 1])
    assert d.type == "T4" and d.memory == GiB and d.hosts == (0, 1) and d.flops == 1e12
    assert d == DeviceClass("a", "T4", 2, 1.0e12, GiB, 1e11, (0, 1))
    c = Cluster((d,), name="t")
    assert c == Cluster([d], list(DEFAULT_LINKS), "t") and hash(c) == hash(Cluster((d,), name="t"))
    assert "2×a" in repr(c)
    assert "t4" not in c.summary() and "T4" in c.summary()


# ------------------------------------------------------------------ property: any cluster round-trips

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_pos_float = st.floats(min_value=1e-3, max_value=1e16, allow_nan=False, allow_infinity=False)


@st.composite
def _clusters(draw):
    n_classes = draw(st.integers(1, 4))
    classes = []
    for k in range(n_classes):
        count = draw(st.integers(1, 6))
        hosts = draw(st.one_of(
            st.just(None),
            st.lists(st.integers(0, 5), min_size=count, max_size=count),
            st.integers(1, 3).map(lambda d, c=count, k=k: [10 * k + i // d for i in range(c)]),
        ))
        over = draw(st.fixed_dictionaries({}, optional={
            "flops": _pos_float, "memory": st.integers(1, 2**45), "mem_bandwidth": _pos_float}))
        classes.append(DeviceClass.from_catalogue(
            draw(st.sampled_from(cat.known_types() + ["a100", "h100-sxm"])), count,
            name=f"c{k}" + draw(st.sampled_from(["", ' "q"', "\\x", "é\t"])),
            hosts=hosts, **over))
    links = tuple(LinkLevel(draw(st.sampled_from([n, "lvl \"" + n + "\""])),
                            draw(st.floats(0, 1, allow_nan=False)), draw(_pos_float))
                  for n in ("intra-host", "inter-host"))
    return Cluster(tuple(classes), links, draw(st.text(min_size=1, max_size=8).filter(str.strip)))


@settings(max_examples=150, deadline=None)
@given(_clusters(), st.booleans())
def test_any_cluster_round_trips_exactly(c, explicit):
    assert Cluster.from_toml(c.to_toml(explicit=explicit)) == c
    assert Cluster.from_dict(json.loads(json.dumps(c.to_dict(explicit=explicit)))) == c


# ---- islands --------------------------------------------------------------------------

ISLANDS_TOML = """
name = "two-sites"
[[class]]
type = "A100"
hosts = 2
devices_per_host = 4
[[class]]
type = "V100"
hosts = 1
devices_per_host = 4
[[island]]
name = "site-a"
host_ids = [0, 1]
[[island]]
name = "site-b"
classes = ["V100"]
[links.inter_host]
bandwidth = "100Gbps"
latency = "10us"
[links.inter_island]
name = "WAN"
bandwidth = "1Gbps"
latency = "1ms"
"""


def test_islands_give_a_third_link_level_and_round_trip():
    c = Cluster.from_toml(ISLANDS_TOML)
    assert [i.name for i in c.islands] == ["site-a", "site-b"] and c.num_islands == 2
    assert [c.island_of(d) for d in (0, 4, 7, 8)] == [0, 0, 0, 1]
    assert c.island_devices(1) == tuple(range(8, 12))
    assert c.link_between(0, 1) is c.links[0]          # one host
    assert c.link_between(0, 4) is c.links[1]          # two hosts of one island
    assert c.link_between(0, 8).name == "WAN" and c.inter_island.beta == 1e9 / 8
    assert Cluster.from_toml(c.to_toml()) == c
    assert Cluster.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert "island site-b: hosts [2]" in c.summary()


def test_without_islands_the_inter_island_level_is_the_inter_host_one():
    c = Cluster.load("a100x8-v100x8-100g")
    assert c.islands == () and c.num_islands == 1 and c.inter_island == c.inter_host
    assert c.link_between(0, 8) == c.inter_host
    assert "inter_island" not in c.to_toml()   # nothing to say: written as before
    two = Cluster(c.classes, links=c.links[:2], name=c.name)   # two levels given in code
    assert two == c


def test_a_ring_across_islands_is_priced_on_the_inter_island_link():
    from hapsynth.synth.collectives import all_reduce
    flat = Cluster.from_toml(ISLANDS_TOML.split("[[island]]")[0]
                             + '[links.inter_host]\nbandwidth = "100Gbps"\nlatency = "10us"\n')
    sites = Cluster.from_toml(ISLANDS_TOML)
    inside = list(range(8))   # site-a only: the inter-host link, as without islands
    both = list(range(12))
    assert all_reduce(sites, 1 << 24, inside) == pytest.approx(all_reduce(flat, 1 << 24, inside))
    assert all_reduce(sites, 1 << 24, both) > 50 * all_reduce(flat, 1 << 24, both)


@pytest.mark.parametrize("island,message", [
    ('name = "x"\nhost_ids = [0, 7]', "island[0].hosts: host 7 holds no device"),
    ('name = "x"\nclasses = ["A100", "V1OO"]', "island[0].classes: no class named 'V1OO'"),
    ('name = "x"\nhost_ids = [0]\nclasses = ["V100"]', "give exactly one of"),
    ('name = "x"\nhost_ids = [0, 0, 1]', "island[0].host_ids: lists a host twice"),
    ('name = "x"\nhost_ids = [0, 1]', "hosts [2] are in no island"),
    ('name = "x"\nhosts = [0, 1, 2]', "island[0].hosts: unknown key 'hosts' (did you mean 'host_ids'?"),
])
def test_bad_islands_name_the_field(island, message):
    head = ISLANDS_TOML.split("[[island]]")[0]
    with pytest.raises(ClusterError, match=re.escape(message)):
        Cluster.from_toml(head + "[[island]]\n" + island + "\n")


def test_island_presets():
    pair = Cluster.load("a100x8-v100x8-islands-10g")
    assert [i.name for i in pair.islands] == ["a100", "v100"]
    assert pair.inter_island.beta == 10e9 / 8 and pair.classes[1].memory == 32 * 2**30
    hap = Cluster.load("hap-islands")
    assert hap.num_devices == 64 and [len(hap.island_devices(k)) for k in range(2)] == [16, 48]
    three = Cluster.load("three-islands")
    assert three.num_islands == 3 and three.link_between(0, 31) == three.inter_island
    assert three.link_between(16, 24) == three.inter_host   # the two V100 hosts
    sim = Cluster.simulated([("A100", 4), ("V100", 4)], devices_per_host=4,
                            islands={"a": ["A100"], "b": [1]})
    assert sim.island_of(0) == 0 and sim.island_of(7) == 1


def test_islands_per_class_as_the_design_writes_them():
    """`island = "a"` in a [[class]] table; a class without one is in island "0"; hosts of
    two islands are never shared; written back in the same short form."""
    text = """
[[class]]
type = "A100"
hosts = 1
devices_per_host = 8
island = "a"
[[class]]
type = "V100"
hosts = 1
devices_per_host = 8
island = "b"
[[class]]
type = "T4"
count = 4
[links.inter_island]
bandwidth = "10Gbps"
latency = "50us"
"""
    c = Cluster.from_toml(text)
    assert [(i.name, i.hosts) for i in c.islands] == [("a", (0,)), ("b", (1,)), ("0", (2,))]
    assert c.link_between(0, 8) == c.inter_island and c.inter_island.alpha == 50e-6
    assert 'island = "b"' in c.to_toml() and "[[island]]" not in c.to_toml()
    assert Cluster.from_toml(c.to_toml()) == c
    shared = text.replace('type = "V100"\nhosts = 1\ndevices_per_host = 8',
                          'type = "V100"\ncount = 8\nhost = 0')
    with pytest.raises(ClusterError, match="host 0 holds classes of different islands"):
        Cluster.from_toml(shared)
    with pytest.raises(ClusterError, match="per class .* or as \\[\\[island\\]\\] tables"):
        Cluster.from_toml(text + '[[island]]\nname = "x"\nhost_ids = [0, 1, 2]\n')
