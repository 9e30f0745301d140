"""Cost model: every expected value is worked out by hand from the formulas in the
brief (ring / bottleneck link / masked psum / pairwise exchange), not by calling
the implementation's helpers."""
import math
import random

import pytest

from hapsynth.ir.graph import Cost
from hapsynth.ir.layout import P, R, S
from hapsynth.synth import collectives as coll
from hapsynth.synth import costmodel as cm
from hapsynth.cluster import Cluster, DeviceClass, LinkLevel

# Distinct, easy-to-spot link numbers: intra 3 us / 7 GB/s, inter 1 ms / 100 MB/s.
A_IN, B_IN = 3e-6, 7e9
A_X, B_X = 1e-3, 1e8
LINKS = (LinkLevel("intra", A_IN, B_IN), LinkLevel("inter", A_X, B_X))


def one_host(k=8):
    return Cluster.simulated([("CPU", k)], links=LINKS)


def two_hosts():
    return Cluster.simulated([("CPU", 8)], devices_per_host=4, links=LINKS)


def close(a, b, rel=1e-12):
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-18)


# --------------------------------------------------------------------------- all-reduce


def test_all_reduce_single_device_is_free():
    c = Cluster.simulated([("CPU", 1)], links=LINKS)
    assert coll.all_reduce(c, 1e9) == 0.0
    assert coll.all_gather(c, [1e9]) == 0.0
    assert coll.reduce_scatter(c, [1e9]) == 0.0
    assert coll.all_to_all(c, [[5.0]]) == 0.0


def test_all_reduce_one_host_uses_intra_link():
    n = 8e6
    expected = 2 * 7 * (3e-6 + 8e6 / 8 / 7e9)
    assert close(coll.all_reduce(one_host(), n), expected)
    assert coll.all_reduce(one_host(), 0) == 0.0


def test_all_reduce_two_hosts_bottleneck_is_inter_host():
    n = 8e6
    expected = 2 * 7 * (1e-3 + 8e6 / 8 / 1e8)
    assert close(coll.all_reduce(two_hosts(), n), expected)
    # A subset of the devices on one host only uses the intra-host level.
    assert close(coll.all_reduce(two_hosts(), n, devices=[4, 5, 6, 7]),
                 2 * 3 * (3e-6 + 8e6 / 4 / 7e9))


def test_hap_worked_example_bert_base_gradients():
    c = Cluster.load("hap-v100x16-p100x48")
    n = 110e6 * 4
    # 64 devices on 8 hosts, inter-host 10.4 Gbps = 1.3e9 B/s, 20 us latency.
    expected = 2 * 63 * (20e-6 + 440e6 / 64 / 1.3e9)  # = 0.66887 s
    t = coll.all_reduce(c, n)
    assert 0.6 <= t <= 0.7
    assert t == pytest.approx(0.66887, rel=1e-4)
    assert close(t, expected)
    # The intra-host level (10 GB/s) alone would be ~7x cheaper: the bound is inter-host.
    assert t > 5 * 2 * 63 * (5e-6 + 440e6 / 64 / 10e9)


def test_slowest_link_is_by_time_not_bandwidth():
    # intra: huge latency, huge bandwidth; inter: tiny latency, low bandwidth.
    links = (LinkLevel("intra", 1e-3, 1e11), LinkLevel("inter", 1e-6, 1e9))
    c = Cluster.simulated([("CPU", 4)], devices_per_host=2, links=links)
    small, big = 400.0, 4e9
    # small message: intra step (1 ms + ...) is slower than inter (1 us + ...); the tree
    # (2 log2 4 = 4 steps of the whole message) beats the ring (6 steps of a quarter)
    assert close(coll.all_reduce(c, small), 2 * 2 * (1e-3 + 400 / 1e11))
    # big message: inter (1e9 B/s) dominates, by ring
    assert close(coll.all_reduce(c, big), 2 * 3 * (1e-6 + 1e9 / 1e9))


def test_small_all_reduces_take_the_tree_large_ones_the_ring():
    c = Cluster.load("hap-v100x16-p100x48")  # 64 devices: ring 126 steps, tree 12
    assert coll.all_reduce_form(c, 4.0) == ("tree", pytest.approx(12 * (20e-6 + 4 / 1.3e9)))
    assert coll.all_reduce_form(c, 440e6)[0] == "ring"
    assert coll.latency_steps("all_reduce", "tree", 64) == 12


# --------------------------------------------------------------------------- all-gather


def test_all_gather_even_sizes_padded_is_cheaper():
    sizes = [1e6] * 8
    padded = 7 * (3e-6 + 1e6 / 7e9)
    grouped = 2 * 7 * (3e-6 + 8e6 / 8 / 7e9)
    c = one_host()
    assert close(coll.all_gather(c, sizes, "padded"), padded)
    assert close(coll.all_gather(c, sizes, "grouped"), grouped)
    assert padded <= grouped
    assert coll.gather_form(c, sizes) == ("padded", pytest.approx(padded, rel=1e-12))
    assert close(coll.all_gather(c, sizes, "best"), padded)


def test_all_gather_skewed_sizes_grouped_is_cheaper():
    c = one_host()
    sizes = [1e8, 0, 0, 0, 0, 0, 0, 0]
    padded = 7 * (3e-6 + 1e8 / 7e9)           # ~0.100 s: 7 copies of the big shard
    grouped = 2 * 7 * (3e-6 + 1e8 / 8 / 7e9)  # ~0.025 s: masked psum of 1e8 bytes
    assert close(coll.all_gather(c, sizes, "padded"), padded)
    assert close(coll.all_gather(c, sizes, "grouped"), grouped)
    assert grouped < padded
    form, t = coll.gather_form(c, sizes)
    assert form == "grouped" and close(t, grouped)
    assert close(coll.all_gather(c, sizes), grouped)  # default form is "best"


def test_all_gather_skewed_but_tiny_is_latency_bound():
    # [1000, 0, ...]: latency decides. The grouped form is a masked all-reduce, which for
    # so small a message takes the tree: 2 log2 8 = 6 latencies against padded's 7.
    c = one_host()
    sizes = [1000, 0, 0, 0, 0, 0, 0, 0]
    padded = 7 * (3e-6 + 1000 / 7e9)
    ring = 2 * 7 * (3e-6 + 1000 / 8 / 7e9)
    tree = 2 * 3 * (3e-6 + 1000 / 7e9)
    assert tree < padded < ring
    assert coll.gather_form(c, sizes) == ("grouped", pytest.approx(tree, rel=1e-12))
    assert coll.gather_form(c, sizes, "padded") == ("padded", pytest.approx(padded, rel=1e-12))
    # with zero latency the skew decides: grouped moves 2/8 of what padded moves
    c0 = Cluster.simulated([("CPU", 8)], links=(LinkLevel("i", 0, 7e9), LinkLevel("x", 0, 1e8)))
    assert coll.gather_form(c0, sizes) == ("grouped", pytest.approx(14 * 125 / 7e9, rel=1e-12))


def test_zero_size_shards_are_legal():
    c = one_host()
    assert coll.all_gather(c, [0] * 8, "padded") == 0.0
    assert coll.all_gather(c, [0] * 8, "grouped") == 0.0
    assert coll.gather_form(c, [0] * 8) == ("padded", 0.0)
    sizes = [0, 0, 3e6, 1e6, 0, 0, 0, 0]
    assert close(coll.all_gather(c, sizes, "padded"), 7 * (3e-6 + 3e6 / 7e9))
    assert close(coll.all_gather(c, sizes, "grouped"), 14 * (3e-6 + 4e6 / 8 / 7e9))


@pytest.mark.parametrize("seed", range(6))
def test_best_is_the_minimum(seed):
    rng = random.Random(seed)
    c = two_hosts() if seed % 2 else one_host()
    sizes = [rng.choice([0, rng.uniform(0, 1e7), rng.uniform(0, 1e3)]) for _ in range(8)]
    for fn, form_fn in ((coll.all_gather, coll.gather_form),
                        (coll.reduce_scatter, coll.reduce_scatter_form)):
        p, g = fn(c, sizes, "padded"), fn(c, sizes, "grouped")
        assert fn(c, sizes, "best") == min(p, g)
        form, t = form_fn(c, sizes)
        assert t == min(p, g)
        assert form == ("padded" if p <= g else "grouped")


# --------------------------------------------------------------------------- reduce-scatter


def test_reduce_scatter_formulas():
    c = two_hosts()
    sizes = [3e6, 1e6, 1e6, 1e6, 2e6, 0, 0, 0]  # total 8e6, M = 3e6
    padded = 7 * (1e-3 + 3e6 / 1e8)
    grouped = 2 * 7 * (1e-3 + 8e6 / 8 / 1e8)
    assert close(coll.reduce_scatter(c, sizes, "padded"), padded)
    assert close(coll.reduce_scatter(c, sizes, "grouped"), grouped)
    assert coll.reduce_scatter_form(c, sizes) == ("grouped", pytest.approx(grouped, rel=1e-12))


# --------------------------------------------------------------------------- all-to-all


def test_all_to_all_matrix_padded_to_largest_off_diagonal_block():
    c = one_host(4)
    send = [[9e9, 1e5, 2e5, 0],      # the diagonal stays local: 9e9 is ignored
            [1e5, 0, 0, 4e5],
            [0, 0, 0, 3e5],
            [1e5, 1e5, 1e5, 0]]
    expected = 3 * (3e-6 + 4e5 / 7e9)
    assert close(coll.all_to_all(c, send), expected)
    # 1-D: device i sends send[i] to each other device
    assert close(coll.all_to_all(c, [1e5, 4e5, 0, 2e5]), expected)
    assert coll.all_to_all(c, [[7.0, 0, 0, 0], [0] * 4, [0] * 4, [0] * 4]) == 0.0


def test_all_to_all_two_hosts_uses_inter_host_every_step():
    expected = 7 * (1e-3 + 5e5 / 1e8)
    assert close(coll.all_to_all(two_hosts(), [5e5] * 8), expected)


def test_all_to_all_steps_priced_by_the_links_they_use():
    # hosts 0,1,0,1: shift 2 pairs 0<->2 and 1<->3 (same host); shifts 1, 3 cross.
    c = Cluster.simulated([("CPU", 4, {"host_ids": [0, 1, 0, 1]})], links=LINKS)
    b = 1e6
    expected = 2 * (1e-3 + 1e6 / 1e8) + 1 * (3e-6 + 1e6 / 7e9)
    assert close(coll.all_to_all(c, [b] * 4), expected)
    # the ring 0-1-2-3-0 crosses hosts at every hop
    assert close(coll.all_reduce(c, 4e6), 2 * 3 * (1e-3 + 1e6 / 1e8))


def test_all_to_all_blocks_by_hand():
    # different dims: outer product / T
    m = coll.all_to_all_blocks(100, [50, 30, 20], [10, 10, 80], same_dim=False)
    assert m == [[5, 5, 40], [3, 3, 24], [2, 2, 16]]
    # same dim: old ranges [0,50) [50,80) [80,100); new [0,10) [10,20) [20,100)
    m = coll.all_to_all_blocks(100, [50, 30, 20], [10, 10, 80], same_dim=True)
    assert m == [[10, 10, 30], [0, 0, 30], [0, 0, 20]]


# --------------------------------------------------------------------------- conversions

T = 8e6
EVEN = [1e6] * 8
SKEW = [4e6, 2e6, 1e6, 1e6, 0, 0, 0, 0]


def test_conversion_table_names_and_costs():
    c = one_host()
    ring_ar = 14 * (3e-6 + T / 8 / 7e9)       # all-reduce of the whole tensor
    cases = {
        (R, R): ("none", None, 0.0),
        (P, P): ("none", None, 0.0),
        (R, S(0, 8)): ("slice", None, 0.0),
        (R, P): ("mask", None, 0.0),
        (S(1, 8), P): ("zero_pad", None, 0.0),
        (P, R): ("all_reduce", "ring", ring_ar),
        # S->R even: padded 7(a + 1e6/b) beats grouped (= ring_ar)
        (S(0, 8), R): ("all_gather", "padded", 7 * (3e-6 + 1e6 / 7e9)),
        (P, S(0, 8)): ("reduce_scatter", "padded", 7 * (3e-6 + 1e6 / 7e9)),
        # S(0)->S(1): block a->b = 1e6 * 1e6 / 8e6 = 125000
        (S(0, 8), S(1, 8)): ("all_to_all", "padded", 7 * (3e-6 + 125000 / 7e9)),
    }
    for (src, dst), (name, form, secs) in cases.items():
        got = cm.conversion_time(c, src, dst, T, EVEN, EVEN)
        assert got[0] == name, (src, dst, got)
        assert got[1] == form, (src, dst, got)
        assert close(got[2], secs), (src, dst, got, secs)
        if name in ("none", "slice", "mask", "zero_pad"):
            assert got[2] == 0.0


def test_conversion_same_dim_resharding_and_identity():
    c = one_host()
    assert cm.conversion_time(c, S(0, 8), S(0, 8), T, EVEN, EVEN) == ("none", None, 0.0)
    # EVEN ranges [i*1e6, (i+1)*1e6); SKEW ranges [0,4e6) [4e6,6e6) [6e6,7e6) [7e6,8e6):
    # largest off-diagonal overlap: device 1's old [1e6,2e6) lies in device 0's new range.
    name, form, secs = cm.conversion_time(c, S(0, 8), S(0, 8), T, EVEN, SKEW)
    assert (name, form) == ("all_to_all", "padded")
    assert close(secs, 7 * (3e-6 + 1e6 / 7e9))


def test_conversion_skewed_sizes_choose_grouped_and_forced_form():
    c = one_host()
    big = [8e8, 0, 0, 0, 0, 0, 0, 0]
    name, form, secs = cm.conversion_time(c, S(0, 8), R, 8e8, big)
    assert (name, form) == ("all_gather", "grouped")
    assert close(secs, 14 * (3e-6 + 1e8 / 7e9))
    name, form, secs = cm.conversion_time(c, S(0, 8), R, 8e8, big, form="padded")
    assert (name, form) == ("all_gather", "padded")
    assert close(secs, 7 * (3e-6 + 8e8 / 7e9))
    name, form, _ = cm.conversion_time(c, P, S(2, 8), 8e8, None, big)
    assert (name, form) == ("reduce_scatter", "grouped")


def test_conversion_validation():
    c = one_host()
    with pytest.raises(ValueError):
        cm.conversion_time(c, "X", R, T)
    with pytest.raises(ValueError):
        cm.conversion_time(c, S(0, 8), R, T)            # sizes missing
    with pytest.raises(ValueError):
        cm.conversion_time(c, S(0, 8), R, T, [1e6] * 7)  # wrong length
    with pytest.raises(ValueError):
        cm.conversion_time(c, S(0, 8), R, T, [2e6] * 8)  # does not sum to T
    with pytest.raises(ValueError):
        coll.all_gather(c, [-1] + [0] * 7)
    with pytest.raises(ValueError):
        coll.all_gather(c, EVEN, "fastest")


# --------------------------------------------------------------------------- compute


def test_compute_time_roofline_both_regimes():
    dc = DeviceClass.from_catalogue("V100", 1, flops=4e12, mem_bandwidth=1e12)
    # compute-bound: 8e12 flops / 4e12 = 2 s vs 1e9 B / 1e12 = 1 ms
    assert close(cm.compute_time(Cost(flops=8e12, bytes=1e9), dc), 2.0)
    # memory-bound: 4e9 flops -> 1 ms vs 3e12 B -> 3 s
    assert close(cm.compute_time(Cost(flops=4e9, bytes=3e12), dc), 3.0)
    # transcendentals at 4 flops each: (4e12 + 4 * 1e12) / 4e12 = 2 s
    assert cm.TRANSCENDENTAL_FLOPS == 4
    assert close(cm.compute_time(Cost(flops=4e12, transcendentals=1e12), dc), 2.0)
    assert cm.compute_time(Cost(), dc) == 0.0
    # XLA's CPU runtime does one after the other: the sum
    cpu = DeviceClass.from_catalogue("CPU", 1, flops=4e12, mem_bandwidth=1e12)
    assert "CPU" in cm.SERIAL_TYPES
    assert close(cm.compute_time(Cost(flops=8e12, bytes=1e12), cpu), 3.0)
    assert close(cm.compute_time(Cost(flops=8e12, bytes=1e12), dc), 2.0)


def test_class_compute_times():
    c = Cluster.simulated([("V100", 2, {"flops": 4e12, "mem_bandwidth": 1e12}),
                           ("P100", 2, {"flops": 2e12, "mem_bandwidth": 5e11})], links=LINKS)
    assert cm.class_compute_times(c, Cost(flops=8e12)) == (2.0, 4.0)
    assert cm.class_compute_times(c, [Cost(flops=8e12), Cost(bytes=1e12)]) == (2.0, 2.0)


# --------------------------------------------------------------------------- memory


def test_bytes_per_device():
    assert cm.bytes_per_device(100, R, num_devices=3) == (100, 100, 100)
    assert cm.bytes_per_device(100, P, [1, 2, 3]) == (100, 100, 100)
    assert cm.bytes_per_device(100, S(0, 8), [50, 30, 20, 0]) == (50, 30, 20, 0)
    assert cm.bytes_per_device(100, S(0, 8), [0.5, 0.3, 0.2, 0]) == pytest.approx((50, 30, 20, 0))
    assert cm.bytes_per_device(100, S(0, 8), [50, 30, 20, 0], padded=True) == (50,) * 4
