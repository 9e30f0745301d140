"""One process of a 2-process `jax.distributed` run on 127.0.0.1 (CPU, gloo collectives).

    python multihost_worker.py PROCESS_ID PORT MODE     (MODE: run | die)

`run`: three chained parallelized steps; prints MAXERR against single-device jax.jit (and
whether the plan was read from the plan cache, where `HAPSYNTH_PLAN_CACHE` names one).
`die`: process 1 exits abruptly after one step; process 0 keeps stepping and must fail.
"""
import os
import sys

from twoprocs import exit_on_error

exit_on_error()

pid, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUM_CPU_DEVICES"] = "2"
import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid, heartbeat_timeout_seconds=10,
                           initialization_timeout=60)
import numpy as np  # noqa: E402

import hapsynth as hs  # noqa: E402
from hapsynth.models import get  # noqa: E402

cluster = hs.Cluster.simulated(
    [("CPU", 1, {"name": "fast", "flops": "360GFLOP/s", "mem_bandwidth": "40GB/s"}),
     ("CPU", 3, {"name": "slow"})], name="two-hosts")
step, (params, opt, batch) = get("mlp", "tiny")
par = hs.parallelize(step, cluster=cluster, time_limit=1)
state = (params, opt)
want = (params, opt)
ref = jax.jit(step)
paths = {jax.tree_util.keystr(p): v
         for p, v in jax.tree_util.tree_flatten_with_path((params, opt, batch))[0]}
asked = []


def load(path, dim, start, stop):  # a data loader that reads only the rows asked for
    asked.append((path, stop - start))
    return np.take(np.asarray(paths[path]), np.arange(start, stop), axis=dim)


abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
for i in range(3):
    if i == 1:  # data parallel (the batch is split): each process loads only its rows
        dp = hs.parallelize(step, cluster=cluster, strategy="data-parallel")
        state = dp(*dp.load(load, *state[:2], abstract))
    else:
        state = par(*state[:2], batch)
    if mode == "die" and pid == 1:
        os._exit(3)
    want = ref(*want[:2], batch)
full = hs.gather(state)
err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(float(np.max(np.abs(np.asarray(b)))), 1.0))
          for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(want)))
units = par.plan(params, opt, batch).shard_units
loaded = sum(n for _, n in asked)
total = sum(np.shape(v)[0] for v in jax.tree.leaves(batch))
cached = bool(par.plan(params, opt, batch).solver.get("cached"))  # ($HAPSYNTH_PLAN_CACHE)
print(f"MAXERR {err:.3e} UNEVEN {any(len(set(u)) > 1 for u in units.values())} "
      f"LOADED {loaded} OF {total} CACHED {cached}", flush=True)
