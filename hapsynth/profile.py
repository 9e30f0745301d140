"""`hapsynth profile`: measure this machine's devices and links, write a cluster TOML.

Compute: a matmul sweep gives effective FLOP/s (the best size's rate; the sweep is
reported), a large elementwise op gives memory bandwidth. Links: a psum sweep over
all devices is fitted to the cost model's ring all-reduce,
``2(k-1) * (alpha + n/k / beta)``, by least squares on ``n``; with one device there is
no link to measure and the TOML keeps the default links. Each figure is the median of
timed runs after warm-up.
"""
from __future__ import annotations

import statistics
import time

MATMUL_SIZES = (128, 256, 512, 1024)
PSUM_BYTES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)


def _median_time(fn, *args, reps: int = 7) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compute(device=None, dtype: str = "float32") -> dict:
    """Effective FLOP/s per matmul size and memory bandwidth of one device."""
    import jax
    import jax.numpy as jnp

    device = device or jax.local_devices()[0]
    chain = 4  # several dependent matmuls per call, so dispatch is amortised

    def mm(x, w):
        for _ in range(chain):
            x = x @ w
        return x

    sweep = {}
    for n in MATMUL_SIZES:
        x = jax.device_put(jnp.ones((n, n), dtype), device)
        w = jax.device_put(jnp.eye(n, dtype=dtype), device)
        sweep[n] = chain * 2 * n ** 3 / _median_time(jax.jit(mm), x, w)
    n = 1 << 24
    a = jax.device_put(jnp.ones((n,), dtype), device)
    b = jax.device_put(jnp.ones((n,), dtype), device)
    t = _median_time(jax.jit(lambda a, b: a * 0.5 + b), a, b)
    itemsize = jnp.dtype(dtype).itemsize
    try:
        memory = int((device.memory_stats() or {}).get("bytes_limit", 0)) or None
    except Exception:  # backends without memory stats (CPU)
        memory = None
    return {"memory": memory, "platform": device.platform, "device_kind": device.device_kind,
            "matmul_flops": {str(k): v for k, v in sweep.items()},
            "flops": max(sweep.values()), "mem_bandwidth": 3 * n * itemsize / t}


def links(sizes=PSUM_BYTES) -> dict | None:
    """psum times over all global devices, and alpha/beta fitted to the ring model."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as PS

    devices = jax.devices()
    k = len(devices)
    if k < 2:
        return None
    mesh = Mesh(np.asarray(devices), ("d",))
    fn = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh, in_specs=PS("d"),
                               out_specs=PS("d")))
    times = {}
    for nbytes in sizes:
        n = nbytes // 4
        x = jax.make_array_from_callback((k * n,), NamedSharding(mesh, PS("d")),
                                         lambda idx: np.ones((n,), np.float32))
        times[nbytes] = _median_time(fn, x, reps=15)
    # t = 2(k-1) alpha + 2(k-1)/k * n / beta  (least squares in n)
    n = np.array(list(times), float)
    t = np.array(list(times.values()))
    slope, icpt = np.polyfit(n, t, 1)
    alpha = max(icpt / (2 * (k - 1)), 1e-7)
    beta = 2 * (k - 1) / k / max(slope, 1e-15)
    return {"devices": k, "psum_seconds": {str(b): s for b, s in times.items()},
            "latency": alpha, "bandwidth": beta}


def profile(dtype: str = "float32") -> dict:
    """Compute figures of this process's first device, and link figures across all."""
    return {"compute": compute(dtype=dtype), "links": links()}


def _catalogue_type(platform: str, kind: str) -> str:
    """The catalogue type for a JAX device kind ("NVIDIA H100 80GB HBM3" -> "H100");
    unknown kinds fall back to "CPU" (the measured numbers override it anyway)."""
    from hapsynth.synth import catalogue

    if platform == "cpu":
        return "CPU"
    words = kind.replace("NVIDIA", "").split()
    for n in range(len(words), 0, -1):
        for cand in ("-".join(words[:n]), words[n - 1]):
            try:
                return catalogue.canonical_name(cand)
            except catalogue.UnknownDeviceType:
                pass
    return "CPU"


def to_toml(result: dict, *, name: str = "profiled", count: int | None = None,
            memory: str | None = None) -> str:
    """A cluster TOML of `count` devices like the profiled one (default: all of them)."""
    import jax

    c, ln = result["compute"], result["links"]
    count = count or (ln["devices"] if ln else 1)
    typ = _catalogue_type(c["platform"], c["device_kind"])
    lines = [f"# written by `hapsynth profile` on {time.strftime('%Y-%m-%d')}: "
             f"{c['device_kind']} ({c['platform']}), jax {jax.__version__}",
             "# matmul FLOP/s by size: " + ", ".join(
                 f"{n}: {v / 1e9:.3g}G" for n, v in c["matmul_flops"].items()),
             f'name = "{name}"', "", "[[class]]", f'type = "{typ}"', 'name = "profiled"',
             f"count = {count}", "host = 0", f"flops = {c['flops']:.6g}",
             f"mem_bandwidth = {c['mem_bandwidth']:.6g}"]
    memory = memory or (f"{c['memory']}B" if c.get("memory") else None)
    if memory:
        lines.append(f'memory = "{memory}"')
    if ln:
        lines += ["", "[links.intra_host]", 'name = "measured psum"',
                  f"bandwidth = {ln['bandwidth']:.6g}", f"latency = {ln['latency']:.6g}"]
    return "\n".join(lines) + "\n"
