"""`hapsynth bench pipeline`: a pipeline measured against the best SPMD-only plan, on two
emulated islands joined by a slow link.

Two `jax.distributed` processes (one CPU device and one core each, `launch.py`) are two
islands of one device. The slow device is emulated as in `hapsynth bench hetero` (every
branch it runs is run r times, `emulation.WorkRepeat`). The slow link is a real one: the
processes run in their own network namespace whose loopback is rate-limited by a token
bucket (`tc qdisc tbf`, jumbo frames so that the bucket sees every packet); every byte
between the processes crosses it, the gradient all-reduce of SPMD as much as a
pipeline's activations. This needs root and iproute2 (`ip`, `tc`).

In one run: the link is measured (`hapsynth.profile.links`, inside the namespace); the
cost of a repeat from even data parallelism with every branch run once and three times,
timed alternately (`calibrate_work`); the fixed per-step cost and the fast device's rate
from the step on the fast device alone by plain `jax.jit` (no link in it); the slow
device's rate from the fast one's plus r - 1 repeats (so each class is priced at what
it runs at, as `hapsynth profile` measures real devices; a repeat can cost more than a
first run, and the slow device then runs at more than r:1); and the link's bandwidth
inside a step from the same 1:1 probe (its time less work and fixed cost is its
all-reduce). The cluster is two islands of those rates joined by the measured link. Planned on it: the best
SPMD-only plan over both devices (`pipeline=False`), the fast device alone (what a user
could run instead; two processes do not run a plan on part of their devices, so it is
run as plain `jax.jit` on process 0's device), the best pipeline in the tick loop
(`pipeline=True, pipeline_runtime="ticks"`), and the best run free (`"free"`: the
processes move arrays by `jax.device_put`, unless `HAPSYNTH_BENCH_TRANSFERS=0`).
They are timed alternately (median of `reps`, once untimed rounds no longer grow
the heap, a step that grew it again timed again: `hetero._time_steps`); each prediction is
printed beside its measurement with the same fixed per-step overhead added, and the
pipeline's speed-up is over the better of the two SPMD-only ones. Every plan, and every
measurement it is made from, is process 0's (`launch.agreed`): plans made apart on two
processes differed and their programs aborted inside gloo.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import uuid

NAMESPACE = "hapsynth-bench"
#: Seconds a run may take: the paper MLP's takes 13-15 min behind 400 Mbit/s, most of it
#: the calibration's data-parallel steps (10 s each, some timed again); the paper ViT's
#: about an hour (25-45 s each). `HAPSYNTH_BENCH_TIMEOUT` sets another.
TIMEOUT = float(os.environ.get("HAPSYNTH_BENCH_TIMEOUT", 2400))


def _islands(flops: float, bandwidth: float, ratio: float, link: dict | None):
    from hapsynth.cluster import Cluster

    links = None
    if link:
        lvl = {"bandwidth": link["bandwidth"], "latency": link["latency"]}
        links = {"intra_host": lvl, "inter_host": lvl, "inter_island": lvl}
    return Cluster.simulated(
        [("CPU", 1, {"name": "fast", "flops": flops, "mem_bandwidth": bandwidth, "host": 0}),
         ("CPU", 1, {"name": "slow", "flops": flops / ratio, "mem_bandwidth": bandwidth / ratio,
                     "host": 1})],
        links=links, islands={"fast": ["fast"], "slow": ["slow"]},
        name=f"emulated-islands-{ratio:g}to1")


def calibrate_work(prog, probe, devices, args, reps: int) -> tuple[float, float]:
    """The probe plan's step at 1:1 and the compute in it (measured seconds): the step
    with every branch run once and three times on every device, timed alternately (so
    that the machine's drift over the run falls on both), the difference halved (it steadied this
    benchmark's calibration; `hetero.measure` keeps once and twice, see there)."""
    from hapsynth.lower.program import Lowered
    from hapsynth_bench.emulation import WorkRepeat
    from hapsynth_bench.hetero import _time_steps

    runs = {k: (Lowered(prog, probe, devices, branch_hook=WorkRepeat((k, k))), args)
            for k in ("1", "3")}
    t = _time_steps(runs, reps)
    return t["1"], max((t["3"] - t["1"]) / 2, 1e-6)


def class_rates(alone_priced: float, alone_seconds: float, probe_priced: float,
                repeat_seconds: float, r: float) -> tuple[float, float]:
    """Each class's rate as it runs (what `hapsynth profile` measures of real devices), as
    multiples of the rates the `*_priced` seconds were priced at: the fast device's from
    its step alone, the slow one's from that plus r - 1 repeats at the rate the probe's
    repeat shows (a repeat can cost more than a first run, where its copies dominate)."""
    fast = alone_priced / max(alone_seconds, 1e-9)
    return fast, 1.0 / (1.0 / fast + (r - 1.0) * repeat_seconds / probe_priced)


class _Alone:
    """The step by plain `jax.jit` on this process's one device, no slow device, no link:
    on process 0 the fast device alone, what a user could run instead of any plan (the
    SPMD-only planner's plans on part of a cluster are not run across processes)."""

    def __init__(self, step, device):
        import jax

        self.device, self.fn = device, jax.jit(step)

    def shard(self, *args):
        import jax

        return jax.device_put(args, self.device)

    def __call__(self, *args):
        return self.fn(*self.shard(*args))


def measure(model: str, config: str, ratio: float, reps: int, time_limit: float,
            batch: int | None = None) -> dict:
    """One process's part (runs under `hapsynth_bench.launch`). Every plan, and all it is
    made from, is process 0's (`launch.agreed`)."""
    import jax

    from hapsynth import profile
    from hapsynth._jax import moves_across_processes
    from hapsynth.synth.choose import make_plan
    from hapsynth.ir import lift
    from hapsynth.lower.freerun import FreeRunning
    from hapsynth.lower.pipeline import Pipelined
    from hapsynth.lower.program import Lowered
    from hapsynth.models import get
    from hapsynth_bench.emulation import WorkRepeat
    from hapsynth_bench.hetero import _time_steps
    from hapsynth_bench.launch import agreed, agreed_plan, progress

    devices = jax.devices()
    link = agreed(profile.links())
    progress(f"link: {link['bandwidth'] / 1e6:.1f} MB/s, latency {link['latency'] * 1e6:.0f} us")
    step, args = get(model, config, devices=len(devices), abstract=False, batch=batch)
    prog, graph = lift(step, *args)
    nstate = len(jax.tree.leaves(args[:2]))

    def plan(cluster, **kw):
        return agreed_plan(lambda: make_plan(
            graph, cluster, num_state_leaves=nstate, data_inputs=graph.inputs[nstate:],
            time_limit=time_limit, **kw))

    base = _islands(1e11, 1e10, 1.0, link)
    probe = plan(base, strategy="data-parallel", shares=(0.5, 0.5))
    t1, rep = calibrate_work(prog, probe, devices, args, reps)
    gc.collect()  # the probe's two programs, before the timed ones are built
    busy = probe.breakdown["compute_per_class"]["fast"]
    # the fixed cost of a step (dispatch, not split, not slowed), from the step on the
    # fast device alone: no link in it, whose price would otherwise land here
    alone_runs = {"alone": (_Alone(step, jax.local_devices()[0]), args)}
    alone_1to1 = _time_steps(alone_runs, reps)["alone"]
    overhead = max(alone_1to1 - 2 * rep, 0.0)
    fast, slow = class_rates(plan(base.subset((0,)), pipeline=False).predicted_step_time,
                             alone_1to1 - overhead, busy, rep, ratio)
    work = busy / fast  # the probe's compute, run once
    # the link as a step sees it: the probe's time less its work and the fixed cost is
    # its gradient all-reduce; the bandwidth is scaled to make the model say so (an
    # isolated psum sweep is faster than the same bytes inside a step)
    comm = probe.breakdown["inline_comm"] + probe.breakdown["exposed_comm"]
    seen = t1 - work - overhead
    slower = seen / comm if comm > 0 and seen > comm else 1.0
    link = {**link, "bandwidth": link["bandwidth"] / slower, "swept_bandwidth": link["bandwidth"]}
    cluster = _islands(1e11 * fast, 1e10 * fast, fast / slow, link)
    progress(f"calibrated: fast {1e11 * fast / 1e9:.1f} GFLOP/s, slow {1e11 * slow / 1e9:.1f} "
             f"(emulated {fast / slow:.2f}:1), overhead {overhead * 1e3:.1f} ms, "
             f"link in a step {link['bandwidth'] / 1e6:.1f} MB/s")
    spmd = plan(cluster, pipeline=False)
    alone = plan(cluster.subset((0,)), pipeline=False)
    pipe = plan(cluster, pipeline=True, pipeline_runtime="ticks")
    # run free too, when arrays move between the processes (`transfers`)
    free = plan(cluster, pipeline=True, pipeline_runtime="free") if moves_across_processes() \
        else pipe
    progress(f"planned: SPMD-only {spmd.predicted_step_time * 1e3:.1f} ms ({spmd.chosen}), "
             f"fast device alone {alone.predicted_step_time * 1e3:.1f} ms, "
             f"pipeline {pipe.predicted_step_time * 1e3:.1f} ms")
    emulate = WorkRepeat((1, int(round(ratio))))
    runs_free = free.pipeline.get("runtime") == "free"
    makers = {"SPMD": lambda: Lowered(prog, spmd, devices, branch_hook=emulate),
              "pipeline": lambda: Pipelined(prog, pipe, devices, branch_hook=emulate),
              "alone": lambda: alone_runs["alone"][0]}
    if runs_free:
        makers["free"] = lambda: FreeRunning(prog, free, devices, branch_hook=emulate)
    timed = timed_programs()
    runs = {k: (make(), args) for k, make in makers.items() if k in timed}
    measured = _time_steps(runs, reps)
    if os.environ.get("HAPSYNTH_BENCH_TRACE"):  # a profile of two pipelined steps, per process
        _trace(*runs["pipeline"], f"{os.environ['HAPSYNTH_BENCH_TRACE']}/p{jax.process_index()}")
    predicted = {"SPMD": spmd.predicted_step_time + overhead,
                 "pipeline": pipe.predicted_step_time + overhead,
                 "alone": alone.predicted_step_time + overhead}
    if runs_free:
        predicted["free"] = free.predicted_step_time + overhead
    return {"model": f"{model}-{config}", "batch": batch, "ratio": f"{ratio:g}:1", "link": link,
            "measured": measured, "predicted": predicted, "spmd_chosen": spmd.chosen,
            "pipeline": {"micros": pipe.pipeline["micros"], "schedule": pipe.pipeline["schedule"],
                         "stages": [s["island"] for s in pipe.stages],
                         "work": [(s["forward"] + s["backward"]) * pipe.pipeline["micros"]
                                  for s in pipe.stages],
                         "ops": [s["ops"] for s in pipe.stages],
                         "by_kind": pipe.pipeline["by_kind"]},
            "free": {"runtime": free.pipeline.get("runtime"), "micros": free.pipeline["micros"],
                     "schedule": free.pipeline["schedule"],
                     "stages": [s["island"] for s in free.stages],
                     "ops": [s["ops"] for s in free.stages]} if free.stages else None,
            "calibration": {"flops": 1e11 * fast, "slow_flops": 1e11 * slow,
                            "emulated": fast / slow, "overhead": overhead, "probe_1to1": t1,
                            "probe_thrice": t1 + 2 * rep, "alone_1to1": alone_1to1,
                            "link_in_step": link["bandwidth"]}}


def _trace(lowered, args, where: str) -> None:
    """Two steps of `lowered` under `jax.profiler`, after two untimed ones."""
    import jax

    batch = lowered.shard(*args)[2:]
    out = jax.block_until_ready(lowered(*args))
    for traced in (False, True):
        if traced:
            jax.profiler.start_trace(where)
        for _ in range(2):
            out = jax.block_until_ready(lowered(out[0], out[1], *batch))
    jax.profiler.stop_trace()


@contextlib.contextmanager
def slow_loopback(rate: str):
    """A network namespace whose loopback carries at most `rate` (e.g. "100mbit"); yields
    the command prefix that runs a program inside it."""
    name = f"{NAMESPACE}-{uuid.uuid4().hex[:6]}"
    steps = [["ip", "netns", "add", name],
             ["ip", "netns", "exec", name, "ip", "link", "set", "dev", "lo", "mtu", "9000"],
             ["ip", "netns", "exec", name, "ip", "link", "set", "dev", "lo", "gso_max_size", "9000"],
             ["ip", "netns", "exec", name, "ip", "link", "set", "dev", "lo", "gro_max_size", "9000"],
             ["ip", "netns", "exec", name, "ip", "link", "set", "dev", "lo", "up"],
             ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
              "rate", rate, "burst", "20kb", "latency", "100ms"]]
    try:
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"a slow link needs root and iproute2: `{' '.join(cmd)}` "
                                   f"said: {done.stderr.strip()}")
        yield ["ip", "netns", "exec", name]
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def run(model: str = "gpt", config: str = "small", ratio: float = 2.0, reps: int = 8,
        time_limit: float = 5.0, link: str | None = "100mbit", batch: int | None = None) -> dict:
    """Measure in the slow-link namespace (or on the plain loopback when `link` is None);
    `batch`: the model's global batch in place of its config's."""
    kwargs = {"model": model, "config": config, "ratio": ratio, "reps": reps,
              "time_limit": time_limit, "batch": batch}
    if link is None:
        from hapsynth_bench import launch
        return launch.run("hapsynth_bench.pipeline_bench:measure", kwargs, echo=True,
                          transfers=transfers(), timeout=TIMEOUT)
    row = behind_link(link, "hapsynth_bench.pipeline_bench", kwargs)
    row["link_limit"] = link
    return row


def timed_programs() -> set[str]:
    """The programs timed (all are planned and priced): `HAPSYNTH_BENCH_TIMED`, a comma list of
    SPMD, alone, pipeline (the tick loop) and free; all by default. Each process holds every
    timed program's state and heap at once: the paper ViT's four do not fit two processes
    in 24 GB."""
    names = {"SPMD", "alone", "pipeline", "free"}
    asked = os.environ.get("HAPSYNTH_BENCH_TIMED")
    if not asked:
        return names
    chosen = {n.strip() for n in asked.split(",") if n.strip()}
    if not chosen or chosen - names:
        raise ValueError(f"HAPSYNTH_BENCH_TIMED={asked!r}: name some of {sorted(names)}")
    return chosen


def transfers() -> bool:
    """Whether the processes move arrays by `jax.device_put`, so that a pipeline run free
    is timed beside the tick loop: yes unless `HAPSYNTH_BENCH_TRANSFERS=0`."""
    return os.environ.get("HAPSYNTH_BENCH_TRANSFERS", "1") != "0"


def behind_link(link: str, module: str, kwargs: dict) -> dict:
    """`python -m module '<kwargs as JSON>'` run in a namespace whose loopback carries at
    most `link`; the JSON of its last line."""
    with slow_loopback(link) as prefix:
        out = subprocess.run([*prefix, sys.executable, "-m", module, json.dumps(kwargs)],
                             stdout=subprocess.PIPE, text=True, env={**os.environ})
    if out.returncode:
        raise RuntimeError(f"the measurement failed ({out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def best_spmd(times: dict) -> float:
    """The best SPMD-only time of a row's: over both devices, or the fast device alone
    (rows from before 2026-12-05 have only the first)."""
    return min(times.get("SPMD", float("inf")), times.get("alone", float("inf")))


def format_row(r: dict) -> str:
    """A row's step times (measured, predicted, error), then each pipeline's speed-ups:
    over SPMD-only across both devices (the planner's `baselines["SPMD"]`) and over the
    better of that and the fast device alone (what a user could run instead)."""
    m, p = r["measured"], r["predicted"]
    ln = r["link"]
    pipe = r["pipeline"]
    idle = [s for s, n in zip(pipe["stages"], pipe.get("ops", pipe.get(
        "work", [1] * len(pipe["stages"])))) if n <= 0]  # (before "ops": its work was 0)
    emulated = r.get("calibration", {}).get("emulated")
    free = r.get("free") if "free" in p else None
    lines = [f"{r['model']}" + (f" (batch {r['batch']})" if r.get("batch") else "")
             + f" at {r['ratio']}" + (f" (runs as {emulated:.2f}:1)" if emulated else "")
             + f", link {r.get('link_limit', 'loopback')} (psum sweep "
             f"{ln.get('swept_bandwidth', ln['bandwidth']) / 1e6:.1f} MB/s, in a step "
             f"{ln['bandwidth'] / 1e6:.1f} MB/s, {ln['latency'] * 1e6:.0f} us); "
             f"pipeline {len(pipe['stages'])} stages x {pipe['micros']} microbatches, "
             f"{pipe['schedule']}" + (f" ({', '.join(idle)} idle: the fast device alone, "
                                      f"in microbatches)" if idle else "")
             + (f"; run free {len(free['stages'])} stages x {free['micros']} microbatches, "
                f"{free['schedule']}" if free else "") + f"; SPMD-only: {r['spmd_chosen']}"]
    cols = [k for k in ("SPMD", "alone", "pipeline", "free") if k in p]
    names = {"SPMD": "SPMD-only", "alone": "fast alone", "pipeline": "tick loop",
             "free": "run free"}
    lines.append(f"{'':>10} " + " ".join(f"{names[k]:>10}" for k in cols))
    def cell(v, fmt: str, unit: str) -> str:  # 10 wide, a dash for what was not timed
        return f"{'-':>10}" if v is None else format(v, fmt) + unit

    for label, d in (("measured", m), ("predicted", p)):
        lines.append(f"{label:>10} " + " ".join(
            cell(d[k] * 1e3 if k in d else None, "8.1f", "ms") for k in cols))
    lines.append(f"{'error':>10} " + " ".join(
        cell(100 * (p[k] - m[k]) / m[k] if k in m else None, "+9.0f", "%") for k in cols))
    pipes = [k for k in ("pipeline", "free") if k in p]
    ups = {"over SPMD-only": lambda d, k: d["SPMD"] / d[k] if "SPMD" in d and k in d else None,
           "over the better": lambda d, k: best_spmd(d) / d[k] if k in d else None}
    pairs = [(o, k) for o in ups for k in pipes]
    span = 11 * len(pipes) - 1
    lines.append(f"{'speed-up':>10} " + " ".join(f"{o:^{span}}" for o in ups))
    lines.append(f"{'':>10} " + " ".join(f"{names[k]:>10}" for _, k in pairs))
    for label, d in (("measured", m), ("predicted", p)):
        lines.append(f"{label:>10} " + " ".join(cell(ups[o](d, k), "9.2f", "x") for o, k in pairs))
    lines.append(f"{'error':>10} " + " ".join(
        cell(100 * (ups[o](p, k) / ups[o](m, k) - 1) if ups[o](m, k) else None, "+9.0f", "%")
        for o, k in pairs))
    if "SPMD" not in m:
        lines.append("(SPMD-only across both devices not timed: measured, the better is the "
                     "fast device alone)")
    return "\n".join(lines)


if __name__ == "__main__":  # inside the namespace: run the processes, print the row
    from hapsynth_bench import launch

    print(json.dumps(launch.run("hapsynth_bench.pipeline_bench:measure", json.loads(sys.argv[1]),
                                echo=True, transfers=transfers(), timeout=TIMEOUT)))
