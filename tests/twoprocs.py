"""Two worker processes joined by `jax.distributed` on 127.0.0.1, for the tests."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import traceback

#: What the workers must not inherit: the test session's 8 simulated devices and its cache.
_DROPPED = ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "HAPSYNTH_PLAN_CACHE")


def exit_on_error() -> None:
    """In a worker: an uncaught error prints and ends the process at once. Left to the
    interpreter, `jax.distributed`'s shutdown waits for the other process at a barrier,
    and a failed run reads as a hang."""
    def hook(kind, value, tb):
        traceback.print_exception(kind, value, tb)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.excepthook = hook


def start(argv: list[list[str]], **env) -> list[subprocess.Popen]:
    """Starts a process per command line, its output (with errors) in a file of its own."""
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED} | env
    procs = []
    for args in argv:
        out = tempfile.TemporaryFile(mode="w+")
        procs.append(subprocess.Popen([sys.executable, *args], stdout=out,
                                      stderr=subprocess.STDOUT, text=True, env=env))
        procs[-1].out = out
    return procs


def output(p: subprocess.Popen) -> str:
    p.out.seek(0)
    return p.out.read()


def run(argv_of, n: int = 2, timeout: float = 240, **env) -> list[tuple[int, str]]:
    """Runs `argv_of(ports)`'s command lines together with fresh free ports, `n` of them
    (outside the ephemeral range); their (exit status, output). Once a worker lost a
    port to another process between its pick and its bind, the run is tried once more;
    a run past `timeout` seconds fails the test with every output."""
    import pytest

    from hapsynth_bench.launch import free_ports

    for attempt in range(2):
        procs = start(argv_of(free_ports(n)), **env)
        end = time.monotonic() + timeout
        try:
            for p in procs:
                p.wait(timeout=max(end - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"no end within {timeout} s:\n" + "\n".join(
                f"--- process {i}:\n{output(p)[-3000:]}" for i, p in enumerate(procs)))
        got = [(p.returncode, output(p)) for p in procs]
        if attempt == 0 and any(rc and "Address already in use" in out for rc, out in got):
            continue
        return got
