"""`hapsynth bench hetero`: measured speed-ups on two emulated heterogeneous devices.

Two `jax.distributed` processes on 127.0.0.1 (one CPU device and one core each, see
`hapsynth.launch`) form a 2-device cluster; the slow device is emulated with the
lowering's benchmark-only `work_repeat` knob (its branches run r times). In one run,
per model and speed ratio r:

1. the links are measured (psum sweep) and the compute rate by one even data-parallel
   run at 1:1; the cluster is that rate for the fast class and rate / r for the slow
   one (the calibration);
2. DP-EV, DP-CP, the synthesized plan and a grid of data-parallel splits (the fast
   device's share of the batch) are lowered and timed alternately, median of `reps`
   after warm-up; `measured_best` is the best grid point;
3. the cost model's prediction is printed beside each measured time.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

MODELS = ("gpt-small", "bert-small")  # compute-bound enough on one core to show a split
GRID = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)


def _cluster(flops: float, bandwidth: float, ratio: float, link: dict | None):
    from hapsynth.synth.cluster import Cluster

    links = None
    if link:
        lvl = {"bandwidth": link["bandwidth"], "latency": link["latency"]}
        links = {"intra_host": lvl, "inter_host": lvl}
    return Cluster.simulated(
        [("CPU", 1, {"name": "fast", "flops": flops, "mem_bandwidth": bandwidth}),
         ("CPU", 1, {"name": "slow", "flops": flops / ratio, "mem_bandwidth": bandwidth / ratio})],
        links=links, name=f"emulated-{ratio:g}to1")


def _time_steps(runs: dict, reps: int, warmup: int = 2) -> dict:
    """Alternate the programs step by step; median seconds per step of each."""
    import jax

    state, batch = {}, {}
    for name, (lowered, args) in runs.items():
        batch[name] = lowered.shard(*args)[2:]  # fed once, as the program reads it
        out = lowered(*args)
        for _ in range(warmup):
            out = lowered(out[0], out[1], *batch[name])
        state[name] = jax.block_until_ready(out)
    if jax.process_count() > 1:
        from hapsynth.launch import quiet_gloo_loops

        quiet_gloo_loops()  # loop threads opened by the new programs' collectives
    times = {name: [] for name in runs}
    for _ in range(reps):
        for name, (lowered, args) in runs.items():
            t0 = time.perf_counter()
            out = jax.block_until_ready(lowered(state[name][0], state[name][1], *batch[name]))
            times[name].append(time.perf_counter() - t0)
            state[name] = out
    return {name: statistics.median(ts) for name, ts in times.items()}


def measure(model: str, config: str, ratios, reps: int, time_limit: float,
            grid=GRID) -> list[dict]:
    """One process's part of the benchmark (runs under `hapsynth.launch`)."""
    import jax

    from hapsynth import profile
    from hapsynth.launch import progress
    from hapsynth.api import synthesize_once
    from hapsynth.ir import lift
    from hapsynth.lower.program import Lowered
    from hapsynth.models import get
    from hapsynth.synth.plan import Plan

    devices = jax.devices()
    link = profile.links()
    step, args = get(model, config, devices=len(devices))
    prog, graph = lift(step, *args)
    nstate = len(jax.tree.leaves(args[:2]))

    def plan(cluster, **kw) -> Plan:
        return synthesize_once(graph, cluster, num_state_leaves=nstate,
                               data_inputs=graph.inputs[nstate:], time_limit=time_limit, **kw)

    programs = {}

    def lower(p):
        """One compiled program per distinct layout choice (a plan's times do not matter)."""
        text = json.dumps([p.tensor_layouts, p.op_inputs, p.op_factors, p.shard_units,
                           [c.form for c in p.conversions]], default=str)
        if text not in programs:
            programs[text] = Lowered(prog, p, devices, work_repeat=(1, 1))
        return programs[text]

    # calibration: the rate at which this machine runs this step, from one measured
    # data-parallel run at 1:1, as one scale on the cost model's roofline rates
    probe = plan(_cluster(1e11, 1e10, 1.0, link), strategy="data-parallel", shares=(0.5, 0.5))
    busy = probe.breakdown["compute_per_class"]["fast"]
    comm = probe.breakdown["inline_comm"] + probe.breakdown["exposed_comm"]
    t = _time_steps({"probe": (lower(probe), args)}, reps)["probe"]
    scale = busy / max(t - comm, 1e-6)  # model seconds per measured second
    progress(f"{model}-{config}: calibrated, 1:1 data parallel {t * 1e3:.1f} ms/step")
    flops, bandwidth = 1e11 * scale, 1e10 * scale

    # one program per data-parallel split and per distinct plan, each compiled once:
    # the emulated speed ratio is a runtime input of the program (`set_work_repeat`)
    splits = sorted({*grid, 0.5, *(r / (r + 1) for r in ratios)})
    clusters = {r: _cluster(flops, bandwidth, r, link) for r in ratios}
    dp = {r: {s: plan(clusters[r], strategy="data-parallel", shares=(s, 1 - s)) for s in splits}
          for r in ratios}
    synthesized = {r: plan(clusters[r]) for r in ratios}
    progress(f"{model}-{config}: planned {len(ratios) * (len(splits) + 1)} programs")
    lowered = {}
    for r in ratios:
        for key, p in [*((("DP", s), q) for s, q in dp[r].items()), (("plan", r), synthesized[r])]:
            lowered[key] = lower(p)

    rows = []
    for r in ratios:
        for low in programs.values():
            low.set_work_repeat((1, int(round(r))))
        fast = r / (r + 1)
        runs = {"DP-EV": ("DP", 0.5), "DP-CP": ("DP", fast), "plan": ("plan", r),
                **{f"grid {s:.2f}": ("DP", s) for s in grid}}
        measured = _time_steps({k: (lowered[v], args) for k, v in runs.items()}, reps)
        progress(f"{model}-{config} {r:g}:1: measured {len(runs)} programs")
        grid_times = {k.split()[1]: v for k, v in measured.items() if k.startswith("grid")}
        best = min(grid_times, key=grid_times.get)
        rows.append({
            "model": f"{model}-{config}", "ratio": f"{r:g}:1",
            "measured": {k: measured[k] for k in ("DP-EV", "DP-CP", "plan")},
            "predicted": {"DP-EV": dp[r][0.5].predicted_step_time,
                          "DP-CP": dp[r][fast].predicted_step_time,
                          "plan": synthesized[r].predicted_step_time},
            "measured_best": grid_times[best],
            "measured_best_share": float(best),
            "grid": grid_times,
            "grid_predicted": {f"{s:.2f}": dp[r][s].predicted_step_time for s in grid},
            "plan_chosen": synthesized[r].chosen,
            "plan_ratios": synthesized[r].ratios,
            "calibration": {"flops": flops, "mem_bandwidth": bandwidth, "link": link}})
    return rows


def run(models, ratios=(2, 3), reps: int = 8, time_limit: float = 5.0) -> list[dict]:
    from hapsynth import launch

    rows = []
    for spec in models:
        model, config = spec.split("-") if "-" in spec else (spec, "tiny")
        rows += launch.run("hapsynth.bench.hetero:measure", echo=True, kwargs=
                           {"model": model, "config": config, "ratios": list(ratios),
                            "reps": reps, "time_limit": time_limit})
        print(format_rows(rows[-len(ratios):]), file=sys.stderr, flush=True)
    return rows


def format_rows(rows) -> str:
    """Measured and predicted ms per step; speed-ups over DP-EV beside the arithmetic
    limit (r+1)/2 of two devices at r:1."""
    lines = [f"{'model':<10} {'ratio':>5} {'':>8} {'DP-EV':>8} {'DP-CP':>8} {'plan':>8} "
             f"{'best':>8}  plan/best  speed-up (limit)"]
    for r in rows:
        m, p = r["measured"], r["predicted"]
        ratio = float(r["ratio"].split(":")[0])
        lines.append(f"{r['model']:<10} {r['ratio']:>5} {'measured':>8} "
                     + " ".join(f"{m[k] * 1e3:8.1f}" for k in ("DP-EV", "DP-CP", "plan"))
                     + f" {r['measured_best'] * 1e3:8.1f}  {m['plan'] / r['measured_best']:9.3f}"
                     f"  {m['DP-EV'] / m['plan']:.2f}x ({(ratio + 1) / 2:.2f}x)")
        err = " ".join(f"{100 * (p[k] - m[k]) / m[k]:+7.0f}%" for k in ("DP-EV", "DP-CP", "plan"))
        lines.append(f"{'':<10} {'':>5} {'predict':>8} "
                     + " ".join(f"{p[k] * 1e3:8.1f}" for k in ("DP-EV", "DP-CP", "plan"))
                     + f"   (plan: {r['plan_chosen']})")
        lines.append(f"{'':<10} {'':>5} {'error':>8} {err}")
    return "\n".join(lines)
