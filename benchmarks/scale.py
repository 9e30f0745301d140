"""LLM-size GPTs (1.3B, 6.7B; 13B on HAP's cluster, the stretch) planned on heterogeneous
presets; writes SCALE.md.

    .venv/bin/python benchmarks/scale.py [--time-limit 10] [--configs 1.3b 6.7b]
        [--clusters a100x8-v100x8-100g hap-v100x16-p100x48 h100x4-t4x12]
        [--stretch 13b:hap-v100x16-p100x48 ...]
        [--out benchmarks/SCALE.md] [--json benchmarks/results/scale.json]

Planned from abstract shapes (nothing is allocated): the zoo's tied-embedding GPT at
batch 128 x 1024 tokens, AdamW. Figures are the cost model's predictions: the plan's
step, its fraction of the limit (the step as written: its FLOPs over the cluster's
FLOP/s, recomputation not counted as work), memory per device class as state +
activations + collectives' buffers against capacity, the FSDP and data-parallel
baselines priced by the same model, and the seconds planning took (trace, lift,
rewrites, synthesis) on this machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if not __package__:
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import jax  # noqa: E402

import hapsynth as hs  # noqa: E402
from hapsynth.ir import lift_program, trace  # noqa: E402
from hapsynth.models import get  # noqa: E402

CONFIGS = ["1.3b", "6.7b"]
CLUSTERS = ["a100x8-v100x8-100g", "hap-v100x16-p100x48", "h100x4-t4x12"]
STRETCH = ["13b:hap-v100x16-p100x48"]  # (config:cluster) rows after the grid
G = 2 ** 30


def written_flops(step, args) -> float:
    """FLOPs of the step as written (the work; recomputation is overhead)."""
    return lift_program(trace(step, *args)).flops


def row(config: str, cluster: hs.Cluster, time_limit: float) -> dict:
    step, args = get("gpt", config, devices=cluster.num_devices)
    out = {"config": config, "cluster": cluster.name}
    t0 = time.perf_counter()
    try:
        plan = hs.parallelize(step, cluster=cluster, time_limit=time_limit,
                              verbose=False).plan(*args)
    except hs.InfeasibleMemory as err:
        return {**out, "error": str(err), "seconds": time.perf_counter() - t0}
    out["seconds"] = time.perf_counter() - t0
    limit = written_flops(step, args) / cluster.total_flops
    out.update(step=plan.predicted_step_time, limit=limit,
               fraction=limit / plan.predicted_step_time,
               baselines={k: v for k, v in plan.baselines.items() if k != "ideal"},
               baseline_memory=dict(plan.baseline_memory),
               memory={k: dict(v) for k, v in plan.memory.items()},
               remat=plan.remat_text(), shares=dict(plan.ratios),
               summary=plan.summary())
    return out


def _gib(x: float) -> str:
    return f"{x / G:.1f}"


def _baseline(r: dict, name: str) -> str:
    t = r["baselines"].get(name)
    if t is None:
        return "n/a"
    if t == float("inf") or t != t:
        return "does not fit"
    cap = min(m["capacity"] for m in r["memory"].values())
    fits = r["baseline_memory"].get(name, 0) <= cap
    return f"{t:.2f} s ({t / r['step']:.2f}x)" + ("" if fits else ", does not fit")


def table(rows: list[dict]) -> str:
    head = ("| model | cluster | step | % of limit | memory per class (state + act. + buffers "
            "/ capacity, GiB) | FSDP | DP-CP | plan s |\n|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['cluster']} | no plan: {r['error']} | | | | | "
                         f"{r['seconds']:.0f} |")
            continue
        mem = "; ".join(f"{k} {_gib(m['state'])} + {_gib(m['activations'])} + "
                        f"{_gib(m['buffers'])} / {_gib(m['capacity'])}"
                        for k, m in r["memory"].items())
        lines.append(f"| {r['config']} | {r['cluster']} | {r['step']:.2f} s | "
                     f"{100 * r['fraction']:.0f}% | {mem} | {_baseline(r, 'FSDP')} | "
                     f"{_baseline(r, 'DP-CP')} | {r['seconds']:.0f} |")
    return head + "\n".join(lines) + "\n"


def _write_table(path: str, text: str) -> None:
    """Write `text` (the "Measured ..." line and the table) to `path`; where the file has
    one already, replace just that block and keep the prose around it."""
    try:
        with open(path) as f:
            old = f.read()
    except FileNotFoundError:
        old = ""
    start = old.find("Measured ")
    if start >= 0:
        end = old.find("\n\n", old.find("\n|", start))
        text = old[:start] + text.rstrip("\n") + (old[end:] if end >= 0 else "\n")
    with open(path, "w") as f:
        f.write(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--configs", nargs="+", default=CONFIGS)
    ap.add_argument("--clusters", nargs="+", default=CLUSTERS)
    ap.add_argument("--stretch", nargs="*", default=STRETCH, help="more config:cluster rows")
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument("--json", default=None, help="write the measured rows here")
    a = ap.parse_args(argv)
    rows = []
    pairs = [(c, n) for c in a.configs for n in a.clusters] + [
        tuple(x.split(":", 1)) for x in a.stretch]
    for config, name in pairs:
        r = row(config, hs.Cluster.load(name), a.time_limit)
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "summary"}, default=str),
              flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    text = (f"Measured {datetime.date.today()} at {commit} on {platform.machine()} "
            f"({os.cpu_count()} cores), JAX {jax.__version__}, "
            f"`--time-limit {a.time_limit:g}`.\n\n" + table(rows))
    print(text)
    if a.out:
        _write_table(a.out, text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
