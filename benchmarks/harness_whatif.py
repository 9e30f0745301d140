"""Where would a pipeline pay on `hapsynth bench pipeline`'s harness? The planner's own
prices over emulated speed ratios and link bandwidths, nothing run.

    .venv/bin/python benchmarks/harness_whatif.py --model gpt --config small
    .venv/bin/python benchmarks/harness_whatif.py --model mlp --config paper --ratios 1 2
    .venv/bin/python benchmarks/harness_whatif.py --model vit --config paper --batch 32 \
        --from benchmarks/results/pipeline_vit.json
    .venv/bin/python -m hapsynth_bench.harness_whatif ...        (the same, installed)

The harness's cluster (`pipeline_bench._islands`: two islands of one CPU device each) at
the fast device's rates as a committed measurement calibrated them (the model's row in
`benchmarks/results/pipeline_*.json`, or `--from`), its slow device `ratio` times
slower, joined by a link of each bandwidth (as a step sees it; its latency and the
fixed per-step cost the measurement's). Per cell: the best
SPMD-only plan over both devices, the fast device alone, and the best pipeline
(`pipeline=True`) in the tick loop and run free, with its stages' ops per microbatch (0:
a stage holding no layers). A pipeline pays on the harness only where it prices below
both.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2").strip()
if not __package__:  # run as a script: this folder's modules are the package hapsynth_bench
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")  # the measured rows RESULTS.md's tables use


def calibration(model: str, config: str, path: str | None = None) -> dict:
    """The committed harness row of `model-config` (or the row at `path`): the one in
    `results/pipeline_<model>.json` before any other file of `results/` holding it (such
    as `pipeline_<model>_loopback.json`)."""
    if path:
        return json.load(open(path))
    rows = {}
    for f in glob.glob(os.path.join(RESULTS, "pipeline_*.json")):
        r = json.load(open(f))
        if r.get("model") == f"{model}-{config}" and "calibration" in r:
            rows[(os.path.basename(f) != f"pipeline_{model}.json", os.path.basename(f))] = r
    if not rows:
        raise SystemExit(f"no committed harness row of {model}-{config} in {RESULTS}: "
                         "pass --from ROW.json")
    return rows[min(rows)]


def sweep(model: str, config: str, ratios, bandwidths, row: dict, time_limit: float = 5.0,
          batch: int | None = None):
    import jax

    from hapsynth.synth.choose import make_plan
    from hapsynth.ir import lift
    from hapsynth.models import get
    from hapsynth_bench.pipeline_bench import _islands

    step, args = get(model, config, devices=2, abstract=False, batch=batch)
    _, graph = lift(step, *args)
    n = len(jax.tree.leaves(args[:2]))
    flops = row["calibration"]["flops"]
    latency = row["link"]["latency"]
    fixed = row["calibration"].get("overhead", 0.0)  # per step, as the harness adds it

    def plan(cluster, **kw):
        return make_plan(graph, cluster, num_state_leaves=n, data_inputs=graph.inputs[n:],
                         time_limit=time_limit, **kw)

    out = []
    for ratio in ratios:
        for bw in bandwidths:
            c = _islands(flops, flops / 10, ratio, {"bandwidth": bw, "latency": latency})
            spmd = plan(c, pipeline=False).predicted_step_time + fixed
            alone = plan(c.subset((0,)), pipeline=False).predicted_step_time + fixed
            pipe = plan(c, pipeline=True, pipeline_runtime="ticks")
            free = plan(c, pipeline=True, pipeline_runtime="free")  # may be ticks, if cheaper
            out.append({"ratio": ratio, "bandwidth": bw, "SPMD": spmd, "alone": alone,
                        "pipeline": pipe.predicted_step_time + fixed,
                        "free": free.predicted_step_time + fixed,
                        "free_ops": [s["ops"] for s in free.stages],
                        "micros": pipe.pipeline["micros"],
                        "schedule": pipe.pipeline["schedule"],
                        "ops": [s["ops"] for s in pipe.stages]})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--config", default="small")
    ap.add_argument("--ratios", type=float, nargs="+", default=[1.0, 1.5, 2.0, 3.0])
    ap.add_argument("--bandwidths", type=float, nargs="+", default=[12, 24, 60, 120, 250, 500],
                    help="the link as a step sees it, MB/s")
    ap.add_argument("--from", dest="path", help="a harness row (JSON) to take the rates from")
    ap.add_argument("--batch", type=int, help="the model's global batch, in place of its config's")
    a = ap.parse_args(argv)
    row = calibration(a.model, a.config, a.path)
    print(f"{a.model}-{a.config}, the fast device at {row['calibration']['flops'] / 1e9:.0f} "
          f"GFLOP/s (memory bandwidth a tenth of that in bytes/s, as the harness prices it)\n")
    print("| slow:fast | link | SPMD-only | fast alone | tick loop | its ops per stage | "
          "best of the two / tick loop | run free | its ops per stage | best / run free |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in sweep(a.model, a.config, a.ratios, [b * 1e6 for b in a.bandwidths], row,
                   batch=a.batch):
        best = min(r["SPMD"], r["alone"])
        print(f"| {r['ratio']:g}:1 | {r['bandwidth'] / 1e6:g} MB/s | {r['SPMD'] * 1e3:.1f} ms | "
              f"{r['alone'] * 1e3:.1f} ms | {r['pipeline'] * 1e3:.1f} ms ({r['micros']} x "
              f"{r['schedule']}) | {r['ops']} | {best / r['pipeline']:.2f}x | "
              f"{r['free'] * 1e3:.1f} ms | {r['free_ops']} | {best / r['free']:.2f}x |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
