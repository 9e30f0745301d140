"""One process of a 2-process `jax.distributed` run on 127.0.0.1 (CPU): an island of two
devices each, a pipeline between them run free (`pipeline_runtime="free"`), values moved
between the processes by `jax.device_put` (cross-host transfers through sockets).

    python freerun_worker.py PROCESS_ID PORT TRANSFER_PORT MODEL [DEVICES]
    (TRANSFER_PORT: its own; DEVICES per process, 2 unless given, or "N0,N1" for
    islands of unequal sizes)

Three chained steps; prints MAXERR against single-device jax.jit (the state gathered on
every process) and the stages' islands.
"""
import os
import sys

from twoprocs import exit_on_error

exit_on_error()

pid, port, transfer, model = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
counts = [int(c) for c in (sys.argv[5] if len(sys.argv) > 5 else "2").split(",")] * 2
counts = counts[:2]
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUM_CPU_DEVICES"] = str(counts[pid])
import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_cross_host_transfer_socket_address", f"127.0.0.1:{transfer}")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid, heartbeat_timeout_seconds=10,
                           initialization_timeout=60)
import numpy as np  # noqa: E402

import hapsynth as hs  # noqa: E402
from hapsynth.models import get  # noqa: E402

cluster = hs.Cluster.simulated([("A100", counts[0], {"host": 0}),
                                ("V100", counts[1], {"host": 1})],
                               islands={"a": ["A100"], "b": ["V100"]},
                               links={"inter_island": {"bandwidth": "10Gbps", "latency": "50us"}})
step, args = get(model, "tiny")
k = 2
par = hs.parallelize(step, cluster=cluster, pipeline=True, pipeline_runtime="free", time_limit=1)
plan = par.plan(*args)
print(f"PLAN {plan.pipeline['runtime']} {[st['island'] for st in plan.stages]} "
      f"{plan.pipeline['cuts']} {plan.pipeline['micros']} ROWS "
      f"{[st['rows'] for st in plan.stages]}", flush=True)
ref = jax.jit(step)
got = want = args
for i in range(3):
    got = par(*got[:k], *args[k:])
    print(f"STEP {i}", flush=True)
    want = ref(*want[:k], *args[k:])
full = hs.gather(got)
err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(float(np.max(np.abs(np.asarray(b)))), 1.0))
          for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(want)))
print(f"MAXERR {err:.3e} RUNTIME {plan.pipeline['runtime']} "
      f"STAGES {'/'.join(st['island'] for st in plan.stages)} "
      f"LOWERED {type(par.lowered(*args)).__name__}", flush=True)
