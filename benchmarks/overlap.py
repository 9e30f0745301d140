"""`hapsynth bench overlap`: does this runtime run a `ppermute` beside independent work?

The pipeline lowering can send what a tick made during the next tick's work (the plan's
`delay` 1), which pays only where the runtime runs a collective beside work it does not
depend on (XLA's asynchronous collectives on GPUs). The planner assumes it does on
GPUs and does not on CPUs; this probe measures the CPU side. Two `jax.distributed`
processes (`launch.py`, one CPU device and one core each, over a link rate-limited as in
`hapsynth bench pipeline`) run a loop whose iterations each multiply a matrix and swap
a buffer by `ppermute`, four ways: the work alone, the swap alone, the swap of what
the work made (it must wait), and the swap of what the previous iteration made (it
need not). If the last runs in about the longer of work and swap, the runtime overlaps
them; in about their sum, it runs them one after another.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

MODES = ("work", "send", "after", "beside")


def measure(n: int = 1024, kb: int = 512, iters: int = 6, reps: int = 7) -> dict:
    """One process's part (runs under `hapsynth_bench.launch`): ms per iteration, per mode."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("x",))
    ring = [(i, (i + 1) % len(devices)) for i in range(len(devices))]
    size = kb * 256  # float32

    def program(mode):
        def body(a, buf):
            def it(_, carry):
                a, buf = carry
                made = jnp.tanh(a @ a) if mode != "send" else a
                if mode == "after":  # what this iteration made crosses
                    buf = lax.ppermute(buf + made[0, 0], "x", ring)
                elif mode == "beside":  # what the last iteration made crosses
                    buf = lax.ppermute(buf, "x", ring) + made[0, 0]
                elif mode == "send":
                    buf = lax.ppermute(buf, "x", ring) + 1.0
                else:
                    buf = buf + made[0, 0]
                return made, buf
            return lax.fori_loop(0, iters, it, (a, buf))
        spec = (P("x"), P("x"))
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))

    sharded = NamedSharding(mesh, P("x"))
    a = jax.make_array_from_callback((len(devices) * n, n), sharded, lambda _: (
        np.random.RandomState(0).rand(n, n).astype(np.float32) / n))
    buf = jax.make_array_from_callback((len(devices) * size,), sharded,
                                       lambda _: np.zeros(size, np.float32))
    programs = {m: program(m) for m in MODES}
    for f in programs.values():
        jax.block_until_ready(f(a, buf))
    times: dict = {m: [] for m in MODES}
    for _ in range(reps):  # the modes in turn, so drift in the machine hits all alike
        for m, f in programs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(a, buf))
            times[m].append((time.perf_counter() - t0) / iters)
    return {"ms": {m: statistics.median(t) * 1e3 for m, t in times.items()},
            "bytes": size * 4, "matmul": n}


def run(link: str | None = "100mbit", reps: int = 7) -> dict:
    """Measure in the slow-link namespace (or on the plain loopback when `link` is None)."""
    from hapsynth_bench import launch
    if link is None:
        return launch.run("hapsynth_bench.overlap:measure", {"reps": reps})
    from hapsynth_bench.pipeline_bench import behind_link
    return {**behind_link(link, "hapsynth_bench.overlap", {"reps": reps}), "link": link}


def format_row(r: dict) -> str:
    ms = r["ms"]
    both, longer = ms["work"] + ms["send"], max(ms["work"], ms["send"])
    verdict = ("runs them side by side" if ms["beside"] < longer + 0.25 * (both - longer)
               else "runs them one after another")
    return (f"{r['bytes'] / 1e6:.1f} MB swapped beside a {r['matmul']}x{r['matmul']} matmul, "
            f"link {r.get('link', 'loopback')}, ms per iteration:\n"
            f"  work {ms['work']:.1f}  send {ms['send']:.1f}  send after the work "
            f"{ms['after']:.1f}  send beside it {ms['beside']:.1f}\n"
            f"  beside / (work + send) = {ms['beside'] / both:.2f}, "
            f"beside / max(work, send) = {ms['beside'] / longer:.2f}: this runtime {verdict}")


if __name__ == "__main__":  # inside the namespace: the processes, then one JSON line
    from hapsynth_bench import launch
    print(json.dumps(launch.run("hapsynth_bench.overlap:measure", json.loads(sys.argv[1]))))
