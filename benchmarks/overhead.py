"""`hapsynth bench overhead`: the lowered step against hand-written data parallelism.

On the even `cpu8-even` cluster the synthesized program should cost no more than
`jax.jit` with a data-parallel `NamedSharding` (batch split on dim 0, state
replicated). Runs alternate (reference, lowered, reference, ...) after warm-up and
the median of the per-pair ratios is printed, so drift on the machine cancels out.
"""
from __future__ import annotations

import statistics
import time


def overhead(model: str = "gpt", config: str = "tiny", reps: int = 20) -> dict:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as PS
    import numpy as np

    import hapsynth as hs
    from hapsynth.lower.devices import local_devices
    from hapsynth.progress import track
    from hapsynth.models import get

    cluster = hs.Cluster.load("cpu8-even")
    step, (params, opt, batch) = get(model, config)
    mesh = Mesh(np.asarray(local_devices(cluster)), ("d",))
    rep, dp = NamedSharding(mesh, PS()), NamedSharding(mesh, PS("d"))
    ref = jax.jit(step, in_shardings=(rep, rep, dp), out_shardings=(rep, rep, rep))
    par = hs.parallelize(step, cluster=cluster, strategy="data-parallel")  # like for like
    plan = par.plan(params, opt, batch)
    batch_dp = jax.device_put(batch, dp)
    batch_hs = par.shard(params, opt, batch)[2]  # each device holds only its rows
    a = ref(jax.device_put(params, rep), jax.device_put(opt, rep), batch_dp)
    b = par(params, opt, batch_hs)
    for _ in range(3):  # warm-up (compilation, first transfers)
        a = jax.block_until_ready(ref(a[0], a[1], batch_dp))
        b = par(b[0], b[1], batch_hs)
    ratios, t_ref, t_par = [], [], []
    for _ in track(range(reps), f"overhead: {reps} timed pairs"):
        t0 = time.perf_counter()
        a = jax.block_until_ready(ref(a[0], a[1], batch_dp))
        t1 = time.perf_counter()
        b = jax.block_until_ready(par(b[0], b[1], batch_hs))
        t2 = time.perf_counter()
        t_ref.append(t1 - t0)
        t_par.append(t2 - t1)
        ratios.append((t2 - t1) / (t1 - t0))
    return {"model": f"{model} ({config})", "reference_s": statistics.median(t_ref),
            "lowered_s": statistics.median(t_par), "median_ratio": statistics.median(ratios),
            "reps": reps, "plan": plan.chosen, "switch_groups": len(set(
                tuple(u[i] for u in plan.shard_units.values()) for i in range(8)))}


def main(model: str, config: str, reps: int) -> int:
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", 8)
    except RuntimeError:
        pass
    r = overhead(model, config, reps)
    print(f"{r['model']} on 8 CPU devices, even cluster, {r['reps']} alternating pairs:")
    print(f"  jit + NamedSharding (data parallel): {r['reference_s'] * 1e3:8.2f} ms/step (median)")
    print(f"  hapsynth lowered plan:               {r['lowered_s'] * 1e3:8.2f} ms/step (median)")
    print(f"  median ratio lowered/reference:      {r['median_ratio']:8.3f}  (target <= 1.10)")
    return 0
