"""`hapsynth bench hetero`: measured speed-ups on two emulated heterogeneous devices.

Two `jax.distributed` processes on 127.0.0.1 (one CPU device and one core each, see
`hapsynth_bench.launch`) form a 2-device cluster; the slow device is emulated by
`hapsynth_bench.emulation.WorkRepeat`, a branch hook of the lowering (its branches run
r times). In one run, per model and speed ratio r:

1. calibration, from runs at 1:1 speeds only: the links (psum, all-gather and
   all-to-all sweeps, `hapsynth.profile.links`); the compute rate from even data
   parallelism with every segment run once and twice; then a fixed per-step overhead
   and the latency a collective really costs inside a step, from that run and the
   synthesized plans' runs at 1:1. The cluster is the rate for the fast class and
   rate / r for the slow one;
2. DP-EV, DP-CP, the synthesized plan and a grid of data-parallel splits (the fast
   device's share of the batch) are lowered and timed alternately, median of `reps`
   after warm-up (untimed rounds until the heap stops growing; a step that grew it again
   is timed again); `measured_best` is the best grid point;
3. the cost model's prediction (plus the fixed overhead) is printed beside each
   measured time.
"""
from __future__ import annotations

import itertools
import json
import statistics
import sys
import time

MODELS = ("gpt-small", "bert-small")  # compute-bound enough on one core to show a split
GRID = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)


def _cluster(flops: float, bandwidth: float, ratio: float, link: dict | None):
    from hapsynth.cluster import Cluster

    links = None
    if link:
        lvl = {"bandwidth": link["bandwidth"], "latency": link["latency"]}
        links = {"intra_host": lvl, "inter_host": lvl}
    return Cluster.simulated(
        [("CPU", 1, {"name": "fast", "flops": flops, "mem_bandwidth": bandwidth}),
         ("CPU", 1, {"name": "slow", "flops": flops / ratio, "mem_bandwidth": bandwidth / ratio})],
        links=links, name=f"emulated-{ratio:g}to1")


_BARRIERS = itertools.count()  # each barrier's name is used once


#: Untimed rounds of the rotation, at most, until the heap stops growing (`_time_steps`).
STEADY_ROUNDS = 12
#: A step (or round) grew the heap when a process's resident memory rose by more.
STEADY_BYTES = 8 << 20
#: Timed rounds, at most, per step asked for: a step that grew the heap is timed again.
RETIME = 3


def _time_steps(runs: dict, reps: int, warmup: int = 2) -> dict:
    """Alternate the programs step by step; median seconds per step of each (process
    0's, on every process: `launch.agreed`). Across processes, every step starts
    together, after all have finished the step before, so that no process starts a
    program while another still runs the last one (behind the slow link gloo aborted
    runs on messages of mismatched sizes, "Received data size doesn't match expected
    size"; this closes one way that could happen, see RESULTS.md).

    Timed once the heap has stopped growing: untimed rounds of the rotation run until in
    one no process's resident memory rose (`STEADY_BYTES`; a GPU's caching allocator
    has its pool after its first steps). Alternating programs of different buffers
    fragments glibc's heap, which grew for several rounds before it sufficed: the paper
    MLP's pipelined step took 1.5-5.4 s in those, faulting 0.17-0.38 M pages, and 0.53 s
    after them, its heap 9.2 GB (one round of warm-up, as before, timed 1.1 s against
    0.60 s alone). It still grows now and then after a steady round (the MLP's pipelined
    step, 50-140 MB in 5 of 12 later rounds, 0.86-1.28 s against 0.59-0.70 s), so a
    timed step during which any process's memory rose is not counted but timed again
    (at most `RETIME` * `reps` timed rounds): a program run alone, as a user runs it,
    does not grow its heap after its first steps."""
    import jax

    from hapsynth._jax import process_barrier
    from hapsynth_bench.launch import agreed, largest, progress, quiet_gloo_loops, resident_memory

    def together():
        if jax.process_count() > 1:
            process_barrier(f"hapsynth-time-steps-{next(_BARRIERS)}")

    state, batch = {}, {}
    for name, (lowered, args) in runs.items():
        together()
        batch[name] = lowered.shard(*args)[2:]  # fed once, as the program reads it
        out = lowered(*args)
        for _ in range(warmup):
            out = lowered(out[0], out[1], *batch[name])
        state[name] = jax.block_until_ready(out)
    times = {name: [] for name in runs}
    grown = {name: [] for name in runs}  # the timed steps that grew the heap

    def rotation(timed: bool) -> int:
        """One step of every program; the most any process's memory rose in one."""
        most = 0
        for name, (lowered, args) in runs.items():
            together()
            before = resident_memory()
            t0 = time.perf_counter()
            out = jax.block_until_ready(lowered(state[name][0], state[name][1], *batch[name]))
            seconds = time.perf_counter() - t0
            state[name] = out
            rose = largest(resident_memory() - before)
            if timed:
                (times if rose <= STEADY_BYTES else grown)[name].append(seconds)
            most = max(most, rose)
        return most

    if jax.process_count() > 1:
        quiet_gloo_loops()  # loop threads opened by the new programs' collectives
    for _ in range(STEADY_ROUNDS):
        if rotation(False) <= STEADY_BYTES:
            break
    else:
        progress(f"the heap still grew after {STEADY_ROUNDS} untimed rounds")
    if jax.process_count() > 1:
        quiet_gloo_loops()
    for _ in range(RETIME * reps):
        if all(len(ts) >= reps for ts in times.values()):
            break
        rotation(True)
    for name, ts in times.items():
        if grown[name]:
            progress(f"{name}: {len(grown[name])} timed steps grew the heap and were timed "
                     f"again ({statistics.median(grown[name]) * 1e3:.1f} ms against "
                     + (f"{statistics.median(ts) * 1e3:.1f} ms)" if ts else "none steady)"))
        if not ts:  # every step grew it: the grown ones are all there is
            times[name] = grown[name]
    return agreed({name: statistics.median(ts) for name, ts in times.items()})


def measure(model: str, config: str, ratios, reps: int, time_limit: float,
            grid=GRID) -> list[dict]:
    """One process's part of the benchmark (runs under `hapsynth_bench.launch`)."""
    import jax
    import numpy as np

    from hapsynth import profile
    from hapsynth.synth.once import synthesize_once
    from hapsynth.ir import lift
    from hapsynth.lower.program import Lowered
    from hapsynth.models import get
    from hapsynth.synth.plan import Plan
    from hapsynth_bench.emulation import WorkRepeat
    from hapsynth_bench.launch import agreed, progress

    devices = jax.devices()
    link = agreed(profile.links())
    step, args = get(model, config, devices=len(devices))
    prog, graph = lift(step, *args)
    nstate = len(jax.tree.leaves(args[:2]))

    def plan(cluster, **kw) -> Plan:  # over both devices: the uneven split is what is measured
        # (process 0's, shared: `synthesize_once`; a second sharing around it would hang)
        return synthesize_once(prog, cluster, num_state_leaves=nstate, devices="all",
                               time_limit=time_limit, **kw)[0]

    programs = {}
    emulate = WorkRepeat((1, 1))  # one knob for every program: the speed ratio of the devices

    def lower(p):
        """One compiled program per distinct layout choice (a plan's times do not matter)."""
        text = json.dumps([p.tensor_layouts, p.op_inputs, p.op_factors, p.shard_units,
                           [c.form for c in p.conversions]], default=str)
        if text not in programs:
            programs[text] = Lowered(prog, p, devices, branch_hook=emulate)
        return programs[text]

    # calibration, from runs at 1:1 only (no row's own measurement):
    # - compute rate: even data parallelism with every segment run once and twice on
    #   both devices; the difference is the step's compute, one scale on the roofline;
    # - per-step overhead O (dispatch, segment boundaries; not split, not slowed) and
    #   the per-collective latency seen inside a step (collective + local pads and
    #   gathers + waiting): from the data-parallel probe and, at 1:1, the synthesized
    #   plans (many conversions), two equations in two unknowns.
    probe = plan(_cluster(1e11, 1e10, 1.0, link), strategy="data-parallel", shares=(0.5, 0.5))
    # (`pipeline_bench.calibrate_work`, once and three times alternately, put this
    # benchmark's predictions 10-34% off in a run on 2026-12-04; once and twice: within
    # 5% on 11-30)
    low = lower(probe)
    t1 = _time_steps({"probe": (low, args)}, reps)["probe"]
    emulate.set((2, 2))
    t2 = _time_steps({"probe": (low, args)}, reps)["probe"]
    emulate.set((1, 1))
    busy = probe.breakdown["compute_per_class"]["fast"]
    work = max(t2 - t1, 1e-6)
    scale = busy / work  # model seconds per measured second
    flops, bandwidth = 1e11 * scale, 1e10 * scale
    progress(f"{model}-{config}: 1:1 data parallel {t1 * 1e3:.1f} ms/step, "
             f"{t2 * 1e3:.1f} with every segment twice")
    splits = sorted({*grid, 0.5, *(r / (r + 1) for r in ratios)})

    def synthesized_at(lnk):
        return {r: plan(_cluster(flops, bandwidth, r, lnk)) for r in ratios}

    base = plan(_cluster(flops, bandwidth, 1.0, link), strategy="data-parallel",
                shares=(0.5, 0.5))
    rhs = [(_latency_steps(base, 2), t1 - work - _comm(base))]
    for r, p in synthesized_at(link).items():
        if p.chosen == "synthesized":  # its time at 1:1 speeds: the fast class's compute
            low = lower(p)
            t = _time_steps({"plan": (low, args)}, reps)["plan"]
            busy_p = p.breakdown["compute_per_class"]["fast"]
            rhs.append((_latency_steps(p, 2), t - busy_p - _comm(p)))
            progress(f"{model}-{config}: the {r:g}:1 plan at 1:1 speeds {t * 1e3:.1f} ms/step")
    gamma = 0.0
    if len(rhs) > 1:  # O + L * gamma = excess, least squares over the probes
        a = np.array([[1.0, L] for L, _ in rhs])
        (_, gamma), *_ = np.linalg.lstsq(a, np.array([e for _, e in rhs]), rcond=None)
        gamma = max(float(gamma), 0.0)
    overhead = max(float(np.mean([e - L * gamma for L, e in rhs])), 0.0)
    if link and gamma:
        link = {**link, "latency": link["latency"] + gamma}
    progress(f"{model}-{config}: calibrated: {flops / 1e9:.0f} GFLOP/s, overhead "
             f"{overhead * 1e3:.1f} ms/step, latency in a step "
             f"{(link or {}).get('latency', 0) * 1e6:.0f} us")

    # one program per data-parallel split and per distinct plan, each compiled once:
    # the emulated speed ratio is a runtime input of the programs (`emulate.set`)
    clusters = {r: _cluster(flops, bandwidth, r, link) for r in ratios}
    dp = {r: {s: plan(clusters[r], strategy="data-parallel", shares=(s, 1 - s)) for s in splits}
          for r in ratios}
    synthesized = synthesized_at(link)
    progress(f"{model}-{config}: planned {len(ratios) * (len(splits) + 1)} programs")
    lowered = {}
    for r in ratios:
        for key, p in [*((("DP", s), q) for s, q in dp[r].items()), (("plan", r), synthesized[r])]:
            lowered[key] = lower(p)

    rows = []
    for r in ratios:
        emulate.set((1, int(round(r))))
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
            "predicted": {"DP-EV": dp[r][0.5].predicted_step_time + overhead,
                          "DP-CP": dp[r][fast].predicted_step_time + overhead,
                          "plan": synthesized[r].predicted_step_time + overhead},
            "measured_best": grid_times[best],
            "measured_best_share": float(best),
            "grid": grid_times,
            "grid_predicted": {f"{s:.2f}": dp[r][s].predicted_step_time + overhead
                               for s in grid},
            "plan_chosen": synthesized[r].chosen,
            "plan_ratios": synthesized[r].ratios,
            "calibration": {"flops": flops, "mem_bandwidth": bandwidth, "link": link,
                            "overhead": overhead, "latency_in_step": gamma,
                            "probe_1to1": t1, "probe_twice": t2}})
    return rows


def _latency_steps(plan, k: int) -> int:
    """Latency terms (alpha) the cost model charges `plan` on k devices: each inline
    collective's steps, and one all-reduce's for the combined gradient collectives."""
    from hapsynth.synth.collectives import ALL_REDUCE, latency_steps, steps

    inline = sum(latency_steps(c.collective, c.form, k) for c in plan.conversions
                 if c.seconds and not c.deferred)
    grouped = any(c.deferred for c in plan.conversions)
    return inline + (steps(ALL_REDUCE, k) if grouped else 0)


def _comm(plan) -> float:
    return plan.breakdown["inline_comm"] + plan.breakdown["exposed_comm"]


def run(models, ratios=(2, 3), reps: int = 8, time_limit: float = 5.0,
        grid=GRID) -> list[dict]:
    from hapsynth_bench import launch

    from hapsynth.progress import track

    rows = []
    for spec in track(models, f"hetero: {len(models)} models x {len(ratios)} ratios"):
        model, config = spec.split("-") if "-" in spec else (spec, "tiny")
        rows += launch.run("hapsynth_bench.hetero:measure", echo=True, kwargs=
                           {"model": model, "config": config, "ratios": list(ratios),
                            "reps": reps, "time_limit": time_limit, "grid": list(grid)})
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
