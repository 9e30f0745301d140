"""Plan every zoo `paper` config on heterogeneous presets; write a markdown table.

    .venv/bin/python benchmarks/plan_zoo.py [--time-limit 10] [--out benchmarks/PLANS.md]
    .venv/bin/python -m hapsynth_bench.plan_zoo ...        (the same, installed)

Figures are the cost model's predictions (no GPU runs here): predicted step time,
speed-up over DP-EV and DP-CP priced by the same model, the fraction of the ideal
(total flops / total FLOP/s) the plan reaches, synthesis wall time (trace + lift +
synthesis) and the CP-SAT gap. A baseline that does not fit in memory is marked.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import platform
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if not __package__:  # run as a script: this folder's modules are the package hapsynth_bench,
    _here = os.path.dirname(os.path.abspath(__file__))  # not top-level `cli`, `launch`, ...
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import hapsynth as hs  # noqa: E402
from hapsynth.models import ZOO, get, names  # noqa: E402

CLUSTERS = ["hap-v100x16-p100x48", "a100x8-v100x8-100g", "h100x4-t4x12"]


def plan_row(model: str, cluster: hs.Cluster, time_limit: float) -> dict:
    step, args = get(model, "paper", devices=cluster.num_devices)
    t0 = time.perf_counter()
    try:
        plan = hs.parallelize(step, cluster=cluster, time_limit=time_limit).plan(*args)
    except hs.InfeasibleMemory as err:
        return {"model": model, "cluster": cluster.name, "error": str(err),
                "seconds": time.perf_counter() - t0}
    cap = min(c.memory for c in cluster.classes)
    return {"model": model, "cluster": cluster.name, "plan": plan.predicted_step_time,
            "dp_ev": plan.baselines["DP-EV"], "dp_cp": plan.baselines["DP-CP"],
            "ideal": plan.baselines["ideal"], "seconds": time.perf_counter() - t0,
            "gap": plan.solver.get("gap"), "chosen": plan.chosen,
            "ev_fits": plan.baseline_memory["DP-EV"] <= cap,
            "cp_fits": plan.baseline_memory["DP-CP"] <= cap,
            "memory": plan.memory[cluster.classes[0].name]["need"] / 2**30}


@contextlib.contextmanager
def layers(model: str, n: int):
    """Temporarily give the zoo's paper config `n` layers."""
    mod = ZOO[model]
    original = mod.config
    mod.config = lambda *a, **kw: dataclasses.replace(original(*a, **kw), layers=n)
    try:
        yield
    finally:
        mod.config = original


def fmt(row: dict) -> str:
    if "error" in row:
        return (f"| {row['model']} | {row['cluster']} | does not fit | | | | "
                f"{row['seconds']:.1f} | | {row['error'].split(':', 1)[1].strip()} |")
    gap = "n/a" if row["gap"] is None else f"{row['gap']:.0%}"
    ev = f"{row['dp_ev'] / row['plan']:.2f}x" + ("" if row["ev_fits"] else " (DP-EV OOM)")
    cp = f"{row['dp_cp'] / row['plan']:.2f}x" + ("" if row["cp_fits"] else " (DP-CP OOM)")
    return (f"| {row['model']} | {row['cluster']} | {row['plan']:.3f} | {ev} | {cp} | "
            f"{row['ideal'] / row['plan']:.0%} | {row['seconds']:.1f} | {gap} | "
            f"{row['chosen']}, {row['memory']:.1f} GiB/device |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--models", nargs="*", default=names())
    ap.add_argument("--clusters", nargs="*", default=CLUSTERS)
    ap.add_argument("--out", default=None, help="write the markdown table here too")
    args = ap.parse_args(argv)
    lines = [f"# Plans for the zoo's paper configs ({datetime.date.today()})", "",
             f"Command: `.venv/bin/python benchmarks/plan_zoo.py --time-limit {args.time_limit:g}`"
             f" on {platform.machine()} ({os.cpu_count()} cores). Predicted by the cost model.", "",
             "| model | cluster | plan s/step | vs DP-EV | vs DP-CP | of ideal | synth s | gap | notes |",
             "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for cname in args.clusters:
        cluster = hs.Cluster.load(cname)
        for model in args.models:
            line = fmt(plan_row(model, cluster, args.time_limit))
            print(line, flush=True)
            lines.append(line)
    scale = ["", "Synthesis time against depth (BERT, paper widths, HAP cluster):", "",
             "| layers | eqns | synth s | plan s/step |", "|---|---|---|---|"]
    print("\n".join(scale), flush=True)
    cluster = hs.Cluster.load("hap-v100x16-p100x48")
    for n in (3, 6, 12, 24):
        with layers("bert", n):
            row = plan_row("bert", cluster, args.time_limit)
            step, a = get("bert", "paper", devices=64)
            eqns = hs.inspect(step, *a)["eqns"]
        line = f"| {n} | {eqns} | {row['seconds']:.1f} | {row.get('plan', float('nan')):.3f} |"
        print(line, flush=True)
        scale.append(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines + scale) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
