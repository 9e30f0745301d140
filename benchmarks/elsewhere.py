"""Plan the train steps "written elsewhere" (tests/elsewhere: plain JAX with a scan over
layers and its unrolled twin, Flax NNX and linen, dm-haiku, Equinox, gradient
accumulation, bf16) at paper size on the heterogeneous presets; write a markdown table.

    .venv/bin/python benchmarks/elsewhere.py [--time-limit 10] [--out benchmarks/ELSEWHERE.md]

Run from the repository (the models live in its tests/ folder). Figures are the cost
model's predictions: the plan's seconds per step and fraction of the limit (total flops
/ total FLOP/s), the honest data-parallel baselines (every data input split on its
leading dim, evenly or in proportion to FLOP/s, everything the batch reaches following
it, parameters replicated, gradients all-reduced), how many ops they shard, and the
synthesis wall time (trace + lift + synthesis).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_here = os.path.dirname(os.path.abspath(__file__))
if not __package__:  # run as a script: this folder's modules are the package hapsynth_bench
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
sys.path.insert(0, os.path.join(os.path.dirname(_here), "tests"))

import hapsynth as hs  # noqa: E402

CLUSTERS = ["hap-v100x16-p100x48", "a100x8-v100x8-100g", "h100x4-t4x12"]


def row(name: str, cluster: hs.Cluster, time_limit: float) -> str:
    from elsewhere import get

    step, args = get(name, "paper")
    t0 = time.perf_counter()
    try:
        plan = hs.parallelize(step, cluster=cluster, time_limit=time_limit).plan(*args)
    except (hs.InfeasibleMemory, hs.NoDataParallelism) as err:
        return f"| {name} | {cluster.name} | {err} | | | | | {time.perf_counter() - t0:.1f} |"
    seconds = time.perf_counter() - t0
    b, n = plan.baselines, len(plan.op_factors)
    cap = min(m["capacity"] for m in plan.memory.values())

    def dp(k):
        if k not in b:
            return "none (no op reads the batch)"
        oom = "" if plan.baseline_memory[k] <= cap else ", OOM"
        return f"{b[k]:.3f} ({b[k] / b['ideal']:.2f}x ideal{oom})"

    ops = plan.baseline_ops.get("DP-EV", 0) if plan.baseline_ops else 0
    return (f"| {name} | {cluster.name} | {plan.predicted_step_time:.3f} | "
            f"{b['ideal'] / plan.predicted_step_time:.0%} | {dp('DP-EV')} | {dp('DP-CP')} | "
            f"{ops} of {n} | {seconds:.1f} | {plan.chosen}{every(plan)}{recomputed(plan)} |")


def recomputed(plan) -> str:
    """For a plan that recomputes activations (`ir/remat.py`): how much it holds less; or
    that undoes the step's own recomputation (`ir/cse.py`): how much it holds more."""
    if not plan.remat:
        return ""
    r = plan.remat
    what = "its own recomputation undone" if r.get("undone") else "activations recomputed"
    return (f", {what} ({r['peak_before'] / 2**30:.0f} -> "
            f"{r['peak_after'] / 2**30:.0f} GiB at the peak)")


def every(plan) -> str:
    """For a plan that leaves devices idle: what the best plan on every device prices."""
    if plan.devices is None:
        return ""
    t = plan.baselines["all-devices"]
    return " (every device: " + ("none fits" if t != t else f"{t:.3f} s") + ")"


NOTES = [
    "Notes. `of limit` is the ideal (the step's FLOPs over the cluster's total FLOP/s) over the",
    "plan's step. Compute is priced with the bytes XLA's fusion leaves (`hapsynth/ir/fusion.py`)",
    "and independent inline all-reduces (a BatchNorm's two batch statistics) pay one latency,",
    "as XLA's all-reduce combiner issues them (`hapsynth/synth/pricing.py`). `equinox_cnn` is",
    "Equinox's MNIST tutorial network (about 0.9M parameters, 3.6 MB of f32 gradients) at",
    "batch 2048: microseconds of compute per device. Data parallelism over HAP's cluster must",
    "all-reduce those 3.6 MB across 10.4 Gbps (2 x 3.6 MB / 1.3 GB/s = 5.5 ms against an ideal",
    "of 0.07 ms), so no data-parallel plan gets within 2.5x of the ideal there;",
    "`equinox_vit` (ViT-B/16, batch 2048) is the realistic-size Equinox model. \"activations",
    "recomputed\" rows hold too much at the peak as written: the planner first recomputes the",
    "largest cheap activations only, as many as the devices' room needs, then all of them if",
    "nothing fits (`hapsynth/ir/remat.py`); where the light rewrite leaves devices idle and data",
    "parallelism over every device fits once everything is recomputed, it plans that too and",
    "keeps the faster (this check is most of the synthesis time of these rows). Recomputation",
    "is priced. \"on k of n devices\" is a plan that leaves the others idle (the slowest class,",
    "or all but one host: `hapsynth/synth/subsets.py`); its baselines and limit stay the whole",
    "cluster's, and \"every device\" is the best plan found that uses them all. `grad_accum` is",
    "BERT-base-sized (batch 2048 = 8 microbatches x 256).",
]


def main(argv=None) -> int:
    from elsewhere import MODELS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--clusters", nargs="*", default=CLUSTERS)
    ap.add_argument("--out", default=None, help="write the markdown table here too")
    args = ap.parse_args(argv)
    lines = [f"# Plans for train steps written elsewhere ({datetime.date.today()})", "",
             f"Command: `.venv/bin/python benchmarks/elsewhere.py --time-limit {args.time_limit:g}`"
             f" on {platform.machine()} ({os.cpu_count()} cores). Predicted by the cost model;"
             " the models are in `tests/elsewhere/` (paper sizes in each module's docstring).", "",
             "| model | cluster | plan s/step | of limit | DP-EV s | DP-CP s | DP shards | "
             "synth s | chosen |", "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for cname in args.clusters:
        cluster = hs.Cluster.load(cname)
        for name in args.models:
            line = row(name, cluster, args.time_limit)
            print(line, flush=True)
            lines.append(line)
    lines += ["", *NOTES]
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
