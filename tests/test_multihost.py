"""Two processes on 127.0.0.1 run the same parallelized step with jax.distributed."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("multihost_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, **extra):
    port = _free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "HAPSYNTH_PLAN_CACHE")} | extra
    return [subprocess.Popen([sys.executable, str(WORKER), str(i), str(port), mode],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            for i in range(2)]


@pytest.mark.slow
def test_two_processes_match_single_device():
    procs = _launch("run")
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
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
        procs = _launch("run", HAPSYNTH_PLAN_CACHE=str(tmp_path))
        for p in procs:
            out = p.communicate(timeout=240)[0]
            assert p.returncode == 0, out[-3000:]
            line = [ln for ln in out.splitlines() if ln.startswith("MAXERR")][-1]
            assert float(line.split()[1]) < 2e-3 and line.split()[9] == cached, (run, line)
        assert len(list(tmp_path.glob("*.json"))) == 2  # (the synthesized and the DP plan)


@pytest.mark.slow
def test_a_dead_process_makes_the_other_fail_not_hang():
    procs = _launch("die")
    t0 = time.monotonic()
    out1 = procs[1].communicate(timeout=240)[0]
    assert procs[1].returncode == 3, out1[-2000:]
    try:
        out0 = procs[0].communicate(timeout=180)[0]
    except subprocess.TimeoutExpired:
        procs[0].kill()
        pytest.fail("the surviving process hung instead of failing")
    assert procs[0].returncode != 0, out0[-2000:]
    assert time.monotonic() - t0 < 200
