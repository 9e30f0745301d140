"""Two processes on 127.0.0.1 run the same parallelized step with jax.distributed."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

import twoprocs
from hapsynth_bench.launch import free_ports

WORKER = Path(__file__).with_name("multihost_worker.py")


def _argv(mode: str):
    return lambda ports: [[str(WORKER), str(i), str(ports[0]), mode] for i in range(2)]


@pytest.mark.slow
def test_two_processes_match_single_device():
    for rc, out in twoprocs.run(_argv("run"), n=1):
        assert rc == 0, out[-3000:]
        line = [ln for ln in out.splitlines() if ln.startswith("MAXERR")][-1]
        err, uneven = float(line.split()[1]), line.split()[3] == "True"
        assert err < 2e-3, line
        assert uneven, "the two-class cluster should give uneven shards"
        loaded, total = int(line.split()[5]), int(line.split()[7])
        assert 0 < loaded < total, f"a process should load only its own rows: {line}"


@pytest.mark.slow
def test_two_processes_read_a_cached_plan_back(tmp_path):
    """With a plan cache, process 0 files the plan the first run makes; a second run
    reads it back, shares it with process 1, and both still match one-device `jit`."""
    for run, cached in enumerate(("False", "True")):
        for rc, out in twoprocs.run(_argv("run"), n=1, HAPSYNTH_PLAN_CACHE=str(tmp_path)):
            assert rc == 0, out[-3000:]
            line = [ln for ln in out.splitlines() if ln.startswith("MAXERR")][-1]
            assert float(line.split()[1]) < 2e-3 and line.split()[9] == cached, (run, line)
        assert len(list(tmp_path.glob("*.json"))) == 2  # (the synthesized and the DP plan)


@pytest.mark.slow
def test_a_dead_process_makes_the_other_fail_not_hang():
    procs = twoprocs.start(_argv("die")(free_ports(1)))
    t0 = time.monotonic()
    procs[1].wait(timeout=240)
    assert procs[1].returncode == 3, twoprocs.output(procs[1])[-2000:]
    try:
        procs[0].wait(timeout=180)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        pytest.fail("the surviving process hung instead of failing")
    assert procs[0].returncode != 0, twoprocs.output(procs[0])[-2000:]
    assert time.monotonic() - t0 < 200


def test_free_ports_lie_outside_the_ephemeral_range():
    """The workers' ports are picked where the kernel never hands out a connection's own
    port (gloo opens many between the pick and a worker's bind)."""
    lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = free_ports(50)
    assert len(set(ports)) == 50
    assert not any(lo <= p <= hi for p in ports), (lo, hi, ports)
