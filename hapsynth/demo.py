"""`make demo`: the most complete job hapsynth runs today.

1. Lift every zoo model's train step (HAP's paper sizes, abstract shapes, 64 devices)
   to the sharding IR and report coverage, size and flops.
2. Price that work on HAP's V100 + P100 cluster: the even data-parallel split and the
   physical limit, compute only (the synthesizer adds communication and memory).
3. Synthesise a plan for BERT-base on that cluster (CP-SAT + search, uneven shares)
   and compare it with data parallelism (even and FLOP/s-proportional batches).
4. Cross-check the IR's flops against XLA's own `cost_analysis()` on a compiled step.
"""
from __future__ import annotations

import os
import time


def main(fast: bool = False) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    import hapsynth as hs
    from hapsynth.models import get, names

    cluster = hs.Cluster.load("hap-v100x16-p100x48")
    n = cluster.num_devices
    slowest = min(c.flops for c in cluster.classes)
    print(f"cluster {cluster.name}: " + ", ".join(
        f"{c.count} x {c.type} ({c.flops / 1e12:.2f} TFLOP/s)" for c in cluster.classes))
    print(f"\n{'model':6s} {'eqns':>7s} {'nodes':>6s} {'TFLOP/step':>11s} {'unsupported':>12s} "
          f"{'trace':>6s} {'even split':>11s} {'limit':>7s}")
    for name in names():
        step, args = get(name, "paper", devices=n)
        r = hs.inspect(step, *args)
        even = r["flops"] / n / slowest
        ideal = r["flops"] / cluster.total_flops
        uns = sum(r["unsupported"].values())
        print(f"{name:6s} {r['eqns']:7,d} {r['nodes']:6,d} {r['flops'] / 1e12:11.1f} {uns:12d} "
              f"{r['seconds']:5.2f}s {even:10.3f}s {ideal:6.3f}s")
    print("\neven split = every device gets 1/64 of the batch, so the P100s set the pace;"
          "\nlimit = total flops / total FLOP/s (perfect balance, no communication).")
    step, args = get("bert", "paper", devices=n)
    t = time.perf_counter()
    plan = hs.parallelize(step, cluster=cluster).plan(*args)
    print(f"\nbert (paper) planned in {time.perf_counter() - t:.1f}s:")
    print(plan.summary())
    if fast:
        return 0
    step, args = get("gpt", "tiny")
    t = time.perf_counter()
    ours = hs.inspect(step, *args)["flops"]
    cost = jax.jit(step).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    xla = cost["flops"]
    ok = abs(ours / xla - 1) <= 0.05
    print(f"\ngpt (tiny): IR flops {ours:.4g} vs XLA cost_analysis {xla:.4g} "
          f"(ratio {ours / xla:.4f}, {time.perf_counter() - t:.1f}s) -> "
          f"{'match within 5%' if ok else 'MISMATCH'}")
    return 0 if ok else 1
