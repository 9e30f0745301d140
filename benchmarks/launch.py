"""Run one function in N local processes joined by `jax.distributed` (CPU, gloo).

The process launcher of `hapsynth bench hetero` and `hapsynth profile --processes`:
each process owns one CPU device and one core, so N processes are N devices that
really run side by side. `run("pkg.module:function", {...})` starts the processes
(`python -m hapsynth_bench.launch`), each calls `function(**kwargs)` after
`jax.distributed.initialize`, and the value process 0 returns (JSON) comes back. A process that fails or hangs fails the run
with its output, within `timeout` seconds.

Found when building it (2 cores, XLA CPU, gloo): an unpinned XLA process uses every core
even with one Eigen thread, so two of them contend, and a process pinned before JAX
starts also gets a one-thread XLA pool. Pinned, each gloo collective then cost ~4 ms
whatever its size: gloo's TCP loop thread spins in `epoll_wait` (it cannot take the
connection lock the caller holds) until the scheduler tick preempts it. Giving that
thread idle priority (`SCHED_IDLE`) brings a 1 KB psum to ~0.2 ms. Measurements are only
meaningful on otherwise idle cores: `busy_cores()` tells how loaded the machine is.
"""
from __future__ import annotations

import importlib
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

MODULE = "hapsynth_bench.launch"  # what a worker process runs (`python -m`)
MARK = "HAPSYNTH-RESULT "
PROGRESS = "HAPSYNTH-PROGRESS "

#: Per-process XLA CPU settings: one compute thread, so a process stays on its core.
XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"

#: glibc malloc keeping what it frees: one arena grown by `brk`, never `mmap`, never
#: trimmed. By default every buffer over 32 MB is mapped at its allocation and unmapped
#: at its free, so each step faulted its large temporaries in again, page by page (the
#: paper MLP's step: 0.17-0.31 M page faults, about half its time). A GPU's allocator
#: keeps its pool across steps; so does this.
MALLOC_TUNABLES = ("glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:"
                   "glibc.malloc.trim_threshold=68719476736")


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free now on 127.0.0.1, outside the kernel's ephemeral range.

    A port asked of the kernel (`bind(0)`) comes from the range it also hands out to
    outgoing connections, and gloo opens many: a port picked there and bound later by a
    worker (a coordinator, a transfer server at its first `device_put`) can be taken in
    between, and the run then fails at that bind."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = map(int, f.read().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999
    pool = range(10000, lo) if lo > 12000 else range(hi + 1, 65536)
    pick, got = random.SystemRandom(), []
    for _ in range(200 * n):
        port = pick.choice(pool)
        if port in got:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        got.append(port)
        if len(got) == n:
            return got
    raise RuntimeError(f"no {n} free ports found in {pool.start}-{pool.stop - 1}")


def cores() -> list[int]:
    """The cores this process may run on (its affinity set)."""
    return sorted(os.sched_getaffinity(0))


def busy_cores(seconds: float = 0.5) -> float:
    """Cores kept busy on this machine over `seconds` (from /proc/stat)."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait
    (t0, i0), _ = sample(), time.sleep(seconds)
    t1, i1 = sample()
    return max(0.0, ((t1 - t0) - (i1 - i0)) / max(t1 - t0, 1) * os.cpu_count())


def quiet_gloo_loops() -> int:
    """Idle priority for this process's gloo TCP loop threads (see the module docstring):
    threads still named like the process that sit in epoll_wait. Returns how many."""
    me = os.getpid()
    with open("/proc/self/comm") as f:
        name = f.read().strip()
    found = 0
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if tid == me or f.read().strip() != name:
                    continue
            with open(f"/proc/self/task/{tid}/syscall") as f:
                call = f.read().split()[0]
            if call in ("232", "281", "441"):  # epoll_wait, epoll_pwait, epoll_pwait2
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                found += 1
        except (OSError, IndexError):
            continue
    return found


def progress(message: str) -> None:
    """From a task: a line shown by `run(..., echo=True)` as the run goes (process 0)."""
    print(PROGRESS + message, flush=True)


def agreed(value):
    """Process 0's `value` (JSON-able) on every process. What a plan is made from
    (measurements, calibration) differs a little between processes, and CP-SAT under a
    time limit may answer differently: plans made apart may differ, and processes running
    different programs abort inside gloo on mismatched messages."""
    import jax

    from hapsynth.lower.moves import from_process_zero

    if jax.process_count() == 1:
        return value
    return json.loads(from_process_zero(json.dumps(value) if jax.process_index() == 0 else None))


def largest(value: float) -> float:
    """The largest of every process's `value`."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return float(np.max(multihost_utils.process_allgather(np.float64(value))))


def resident_memory() -> int:
    """This process's resident memory now, in bytes (its peak so far where /proc is not
    there). With `MALLOC_TUNABLES` the heap is never given back, so it only grows."""
    import resource

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def agreed_plan(make):
    """The plan (a `Plan`) `make()` makes on process 0, on every process (see `agreed`);
    the others do not plan."""
    import jax

    from hapsynth.lower.moves import from_process_zero
    from hapsynth.synth.plan import Plan

    if jax.process_count() == 1:
        return make()
    mine = make().to_json() if jax.process_index() == 0 else None
    return Plan.from_json(from_process_zero(mine))


def _die_with_parent(parent: int) -> None:
    """In a worker: be killed when the launching process dies (Linux prctl), so no
    orphan keeps a core busy. Done by the worker itself: `preexec_fn` would fork a
    multithreaded parent."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def run(task: str, kwargs: dict | None = None, *, processes: int = 2, timeout: float = 900,
        pin: bool = True, echo: bool = False, transfers: bool = False) -> object:
    """`task(**kwargs)` in `processes` local jax.distributed processes; process 0's result.

    With `pin`, process i is bound to core i of this process's affinity set (there must
    be at least `processes` cores). With `transfers`, `jax.device_put` moves arrays
    between the processes (through sockets: a pipeline run free)."""
    avail = cores()
    if pin and len(avail) < processes:
        raise RuntimeError(f"{processes} pinned processes need {processes} cores; "
                           f"this process may use {len(avail)} ({avail})")
    port, *transfer = free_ports(1 + processes)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1",
           "XLA_FLAGS": " ".join([*flags, XLA_FLAGS]),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "GLIBC_TUNABLES": ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"),
                                                    MALLOC_TUNABLES]))}
    spec = json.dumps({"task": task, "kwargs": kwargs or {}, "processes": processes,
                       "port": port, "cores": avail[:processes] if pin else None,
                       "transfer": transfer if transfers else None,
                       "path": sys.path, "parent": os.getpid()})
    procs = [subprocess.Popen([sys.executable, "-m", MODULE, spec, str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) for i in range(processes)]
    outs = [[] for _ in procs]

    def read(i, p):
        for line in p.stdout:
            outs[i].append(line)
            if echo and i == 0 and line.startswith(PROGRESS):
                print(line[len(PROGRESS):].rstrip(), file=sys.stderr, flush=True)

    readers = [threading.Thread(target=read, args=(i, p), daemon=True)
               for i, p in enumerate(procs)]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout
    try:
        for i, p in enumerate(procs):
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{task}: process {i} of {processes} did not finish within "
                           f"{timeout:.0f} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for t in readers:
        t.join(timeout=5)
    outs = ["".join(o) for o in outs]
    failed = [(i, p.returncode, out) for i, (p, out) in enumerate(zip(procs, outs))
              if p.returncode != 0]
    if failed:  # every one: the first to fail is often not process 0
        raise RuntimeError("\n".join(
            f"{task}: process {i} exited with {rc}:\n" + "\n".join(out.strip().splitlines()[-60:])
            for i, rc, out in failed))
    for line in outs[0].splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"{task}: process 0 printed no result:\n{outs[0][-3000:]}")


def _worker(spec: dict, rank: int) -> None:
    _die_with_parent(spec["parent"])
    sys.path[:0] = [p for p in spec["path"] if p not in sys.path]
    if spec["cores"] is not None:
        os.sched_setaffinity(0, {spec["cores"][rank]})
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if spec["transfer"]:
        jax.config.update("jax_cross_host_transfer_socket_address",
                          f"127.0.0.1:{spec['transfer'][rank]}")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{spec['port']}",
                               num_processes=spec["processes"], process_id=rank,
                               heartbeat_timeout_seconds=30, initialization_timeout=120)
    if spec["cores"] is not None:
        import numpy as np
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("connect")  # opens the gloo connections
        for _ in range(3):
            multihost_utils.process_allgather(np.zeros(1))
        quiet_gloo_loops()
    module, name = spec["task"].split(":")
    result = getattr(importlib.import_module(module), name)(**spec["kwargs"])
    if rank == 0:
        print(MARK + json.dumps(result), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]), int(sys.argv[2]))
