"""`make demo`: plan a heterogeneous cluster, train on it, and check against one device.

1. Plan GPT (tiny) for a cluster of 2 fast + 6 slow devices (4x apart in FLOP/s and
   memory bandwidth), simulated on the 8 local CPU devices: uneven shares per class,
   collectives, predicted time against DP-EV / DP-CP / ideal.
2. Train a few steps with the lowered program and print the distributed loss beside
   the single-device `jax.jit` loss each step; end with whether they match.
3. Plan BERT-base for HAP's 16 V100 + 48 P100 cluster (abstract shapes, no devices).
"""
from __future__ import annotations

import os
import time

STEPS = 5


def main(fast: bool = False) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
    import jax

    try:  # the CLI imports JAX before this runs; the backend itself starts lazily
        jax.config.update("jax_num_cpu_devices", 8)
    except RuntimeError:
        pass
    import numpy as np

    import hapsynth as hs
    from hapsynth.models import get

    cluster = hs.Cluster.simulated(
        [("CPU", 2, {"name": "fast", "flops": "360GFLOP/s", "mem_bandwidth": "40GB/s"}),
         ("CPU", 6, {"name": "slow", "flops": "90GFLOP/s", "mem_bandwidth": "10GB/s"})],
        name="fast2-slow6")
    step, (params, opt, batch) = get("gpt", "tiny")
    # every device takes part, to show uneven shards: for a step this small the default
    # (devices="auto") runs faster on the 2 fast devices alone and leaves the slow ones idle
    par = hs.parallelize(step, cluster=cluster, devices="all")
    t = time.perf_counter()
    plan = par.plan(params, opt, batch)
    print(f"gpt (tiny) on {cluster.num_devices} simulated devices "
          f"({', '.join(f'{c.count} x {c.name}' for c in cluster.classes)}), "
          f"planned in {time.perf_counter() - t:.1f}s")
    print(plan.summary())
    units = sorted(plan.shard_units.items(), key=lambda kv: -kv[0])[:3]
    for total, per in units:
        print(f"  a dim of {total} units is split {list(per)} over the devices")

    ref = jax.jit(step)
    want = got = (params, opt)
    worst = 0.0
    print(f"\n{'step':>4s} {'distributed loss':>17s} {'single-device loss':>19s}")
    for i in range(STEPS):
        t = time.perf_counter()
        got = par(*got[:2], batch)
        want = ref(*want[:2], batch)
        full = hs.gather(got)
        for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(want)):
            a, b = np.asarray(a), np.asarray(b)
            worst = max(worst, float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1.0)))
        print(f"{i + 1:4d} {float(full[2]):17.6f} {float(want[2]):19.6f}"
              + (f"   ({time.perf_counter() - t:.1f}s incl. compile)" if i == 0 else ""))
    ok = worst < 2e-3
    print(f"\nall parameters, optimizer state and losses "
          f"{'match' if ok else 'DO NOT MATCH'} single-device jax.jit "
          f"(largest relative difference {worst:.2e})")
    if not fast:
        hap = hs.Cluster.load("hap-v100x16-p100x48")
        step, args = get("bert", "paper", devices=hap.num_devices)
        t = time.perf_counter()
        plan = hs.parallelize(step, cluster=hap).plan(*args)
        print(f"\nbert (paper, batch 2048 x 128) on {hap.name}, planned in "
              f"{time.perf_counter() - t:.1f}s:")
        print(plan.summary())
    return 0 if ok else 1
