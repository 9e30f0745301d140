"""How long a user waits for a plan: `hs.parallelize(step, cluster=...).plan(*args)` from
a fresh process, per row, with what it picked.

    .venv/bin/python benchmarks/plan_time.py
    .venv/bin/python benchmarks/plan_time.py --rows gpt-medium@a100x8-v100x8-islands-10g
    .venv/bin/python -m hapsynth_bench.plan_time ...        (the same, installed)

Each row plans with `pipeline="auto"` (the default) and, for a cluster of islands, with
`pipeline=True` too; abstract arguments (nothing allocated). Wall seconds on this machine,
one row at a time, nothing else running.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROWS = ("gpt-medium@a100x8-v100x8-islands-10g", "bert-paper@three-islands",
        "gpt-paper@hap-v100x16-p100x48")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", default=list(ROWS), help="MODEL-CONFIG@CLUSTER")
    a = ap.parse_args(argv)
    import hapsynth as hs
    from hapsynth.models import get

    print("| model | cluster | pipeline | seconds to plan | picks | predicted step |")
    print("|---|---|---|---|---|---|")
    for row in a.rows:
        model, where = row.split("@")
        name, config = model.split("-")
        cluster = hs.Cluster.load(where)
        step, args = get(name, config, devices=cluster.num_devices, abstract=True)
        for pipeline in ("auto", True) if cluster.num_islands > 1 else ("auto",):
            t = time.perf_counter()
            plan = hs.parallelize(step, cluster=cluster, pipeline=pipeline,
                                  verbose=False).plan(*args)
            wall = time.perf_counter() - t
            picks = f"{len(plan.stages)} stages" if plan.stages else "SPMD"
            print(f"| {model} | {where} | {pipeline} | {wall:.1f} | {picks} | "
                  f"{plan.predicted_step_time:.3f} s |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
