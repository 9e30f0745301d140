"""`hapsynth profile`: measure this machine's devices and links, write a cluster TOML.

Compute: a matmul sweep gives effective FLOP/s (the best size's rate; the sweep is
reported), a large elementwise op gives memory bandwidth. Links: psum, all-gather and
all-to-all sweeps over all devices are fitted to the cost model's formulas for them
(e.g. ring all-reduce ``2(k-1) * (alpha + n/k / beta)``) by least squares on the
relative error; with one device there is no link to measure and the TOML keeps the
default links. Each figure is the median of
timed runs after warm-up.
"""
from __future__ import annotations

import statistics
import time

from hapsynth.cluster import DEFAULT_LINKS, Cluster, DeviceClass, LinkLevel, catalogue, schema
from hapsynth.cluster.values import Island
from hapsynth.synth import collectives

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
    """Times of psum, all-gather and all-to-all over all global devices (for each size in
    `sizes`, the whole tensor's bytes), and one latency/bandwidth pair fitted to all of
    them through the cost model's own formulas (so it prices every conversion kind, not
    just all-reduce), minimising the relative error."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as PS

    devices = jax.devices()
    k = len(devices)
    if k < 2:
        return None
    mesh = Mesh(np.asarray(devices), ("d",))

    def program(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PS("d"), out_specs=PS("d")))

    # per kind: the program on shards of n/k bytes, and its (alpha, 1/beta) coefficients
    # in the cost model at even shards: all-reduce of n, padded all-gather, all-to-all
    kinds = {
        "psum": (program(lambda x: jax.lax.psum(x, "d")),
                 lambda n: collectives.even_terms(collectives.ALL_REDUCE, k, n)),
        "all_gather": (program(lambda x: jax.lax.all_gather(x, "d", tiled=True)),
                       lambda n: collectives.even_terms(collectives.ALL_GATHER, k, n)),
        "all_to_all": (program(lambda x: jax.lax.all_to_all(x, "d", 0, 0, tiled=True)),
                       lambda n: collectives.even_terms(collectives.ALL_TO_ALL, k, n)),
    }
    times, rows = {}, []
    for name, (fn, coef) in kinds.items():
        times[name] = {}
        for nbytes in sizes:
            n = max(nbytes // 4 // k // k, 1) * k  # per-device floats, a multiple of k
            x = jax.make_array_from_callback((k * n,), NamedSharding(mesh, PS("d")),
                                             lambda idx, n=n: np.ones((n,), np.float32))
            t = _median_time(fn, x, reps=15)
            times[name][str(nbytes)] = t
            rows.append((*coef(4 * n * k), t))
    a = np.array([(ca / t, cb / t) for ca, cb, t in rows])
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)
    alpha = max(float(alpha), 1e-7)
    beta = 1.0 / max(float(inv_beta), 1e-15)
    return {"devices": k, "psum_seconds": times["psum"],
            "all_gather_seconds": times["all_gather"], "all_to_all_seconds": times["all_to_all"],
            "latency": alpha, "bandwidth": beta}


def profile(dtype: str = "float32") -> dict:
    """Compute figures of this process's first device, and link figures across all."""
    return {"compute": compute(dtype=dtype), "links": links()}


def _catalogue_type(platform: str, kind: str) -> str:
    """The catalogue type for a JAX device kind ("NVIDIA H100 80GB HBM3" -> "H100");
    unknown kinds fall back to "CPU" (the measured numbers override it anyway)."""
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


def _6g(x: float) -> float:
    """``x`` to 6 significant digits: a measurement, not more precise than that."""
    return float(f"{x:.6g}")


def to_toml(result: dict, *, name: str = "profiled", count: int | None = None,
            memory: str | None = None, islands: int = 1) -> str:
    """A cluster TOML of `count` devices like the profiled one (default: all of them).

    `islands=K`: the devices, in order, as K islands of equal size (with `--processes`,
    each process's devices together), each on its own host and joined to the others by
    the measured link: the inter-island level (and the inter-host one) is what was
    measured between the devices, the level a pipeline across them is priced on."""
    import jax

    c, ln = result["compute"], result["links"]
    count = count or (ln["devices"] if ln else 1)
    if islands < 1 or count % islands:
        raise ValueError(f"{count} devices do not split into {islands} equal islands")
    per = count // islands
    kind = _catalogue_type(c["platform"], c["device_kind"])
    classes = tuple(DeviceClass.from_catalogue(
        kind, per, name="profiled" if islands == 1 else f"profiled-{k}",
        hosts=(k,) * per, flops=_6g(c["flops"]), mem_bandwidth=_6g(c["mem_bandwidth"]),
        memory=memory or c.get("memory") or None) for k in range(islands))
    links = DEFAULT_LINKS
    if ln:
        measured = LinkLevel("measured collectives", _6g(ln["latency"]), _6g(ln["bandwidth"]))
        links = ((measured,) + DEFAULT_LINKS[1:] if islands == 1
                 else (DEFAULT_LINKS[0], measured, measured))
    found = tuple(Island(f"island-{k}", (k,)) for k in range(islands)) if islands > 1 else ()
    cluster = Cluster(classes, links, name, found)
    comments = [f"written by `hapsynth profile` on {time.strftime('%Y-%m-%d')}: "
                f"{c['device_kind']} ({c['platform']}), jax {jax.__version__}",
                "matmul FLOP/s by size: " + ", ".join(
                    f"{n}: {v / 1e9:.3g}G" for n, v in c["matmul_flops"].items())]
    return schema.to_toml(cluster.name, cluster.classes, cluster.links, comments=comments,
                          islands=cluster.islands)
