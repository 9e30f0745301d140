"""Pipelines across islands, priced: SPMD-only against pipelines with GPipe, plain 1F1B and
the heterogeneity-aware 1F1B; what `pipeline="auto"` picks; the ideal. A markdown table.

    .venv/bin/python benchmarks/pipelines.py [--time-limit 10] [--out benchmarks/PIPELINES.md]
    .venv/bin/python benchmarks/pipelines.py --only gpt-medium@a100x8-v100x8-islands-10g
    .venv/bin/python -m hapsynth_bench.pipelines ...        (the same, installed)

Every figure is the cost model's prediction (no GPU runs here). "SPMD-only" is the best
plan `hs.parallelize(..., pipeline=False)` finds (it must fit memory; it may recompute
activations so that the faster devices hold the step alone); each pipeline
column is the best pipeline found under that schedule (stage cuts, stage order and
microbatch count searched for it); "balanced cuts" prices plain 1F1B and hetero-1F1B
with cuts shortlisted by balance alone (stages of comparable work, where the schedule
matters most; the columns before may find a cut where little crosses the slow link
better still); "free-running" prices hetero-1F1B with every stage running its next
work as soon as it is ready and every transfer and parameter copy under later work,
instead of in the lowering's ticks (a tick lasts its longest work and then its longest
transfer), as `pipeline_runtime="free"` runs a plan (`lower/freerun.py`: a program per
stage and phase); "accumulation over all" is one stage over every device, data
parallel in microbatches (gradient accumulation across the islands, a candidate of
`pipeline="auto"` too); "V-shaped" (`synth.pipeline.plan_vshape`): the first and last
stages on one island, the middle on another (a tied embedding's ends on one island),
priced in lock step and free-running (run free only); "auto" is what `pipeline="auto"`
returns with the default `pipeline_runtime="auto"` (one process drives every device
here, so plans run free are candidates), "auto, tick loop only" with
`pipeline_runtime="ticks"` (what runs across processes without cross-host transfers).
Where auto cuts a step with its own recomputation (`jax.checkpoint`) undone
(`ir/cse.py`), the pipeline columns price that program too, and the ideal is its limit
(the step without the recomputation). Rows
include where pipelines pay (large gradients, slow inter-island links) and where they
do not (fast links; activations crossing a cut outweighing the gradients).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if not __package__:  # run as a script: this folder's modules are the package hapsynth_bench
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
# train steps written elsewhere (tests/elsewhere): the scan-over-layers GPT
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))

import jax  # noqa: E402

import hapsynth as hs  # noqa: E402
from hapsynth.args import state_arity  # noqa: E402
from hapsynth.ir import lift_program, trace  # noqa: E402
from hapsynth.ir.cse import merge_recomputed  # noqa: E402
from hapsynth.ir.unroll import written_out  # noqa: E402
from hapsynth.models import ZOO, get  # noqa: E402
from hapsynth.synth.pipeline import SCHEDULES, plan_pipeline, plan_vshape  # noqa: E402
from hapsynth.synth.stagegroups import islands_differ  # noqa: E402
from hapsynth.synth.stages import NotPipelineable, analyse  # noqa: E402
from hapsynth.synth.choose import make_plan  # noqa: E402
from hapsynth.synth.synthesize import InfeasibleMemory, data_parallel_plan  # noqa: E402


def with_link(name: str, bandwidth: str) -> hs.Cluster:
    """Preset `name` with its inter-island link at `bandwidth`."""
    c = hs.Cluster.load(name)
    d = c.to_dict()
    d["links"]["inter_island"] = {**d["links"]["inter_island"], "bandwidth": bandwidth,
                                  "name": f"{bandwidth} link"}
    d["name"] = f"{name}@{bandwidth}"
    return hs.Cluster.from_dict(d)


ROWS = [  # (model, config, cluster): where pipelines pay, then where they do not
    ("gpt", "medium", "a100x8-v100x8-islands-10g"),
    ("gpt", "medium", "three-islands"),
    ("gpt", "paper", "a100x8-v100x8-islands-10g"),
    ("gpt", "paper", "three-islands"),
    ("gpt", "medium", ("a100x8-v100x8-islands-10g", "100Gbps")),
    ("gpt", "medium", ("a100x8-v100x8-islands-10g", "400Gbps")),
    ("gpt", "paper", ("a100x8-v100x8-islands-10g", "100Gbps")),
    ("bert", "paper", "hap-islands"),
    ("gpt", "paper", "hap-islands"),
    ("vit", "paper", "hap-islands"),
    ("bert", "paper", "three-islands"),
    # a scan over layers (tests/elsewhere/scan_gpt.py, remat in its body), written out
    ("scan_gpt", "medium", "a100x8-v100x8-islands-10g"),
    ("scan_gpt", "medium", "three-islands"),
]


def model(name: str, config: str, devices: int):
    """A zoo model, or a train step written elsewhere (`tests/elsewhere`)."""
    if name in ZOO:
        return get(name, config, devices=devices)
    from elsewhere import get as outside
    return outside(name, config)


def row(name: str, config: str, where, time_limit: float) -> dict:
    cluster = with_link(*where) if isinstance(where, tuple) else hs.Cluster.load(where)
    step, args = model(name, config, cluster.num_devices)
    t0 = time.perf_counter()
    auto = hs.parallelize(step, cluster=cluster, time_limit=time_limit, verbose=False).plan(*args)
    ticked = hs.parallelize(step, cluster=cluster, time_limit=time_limit, verbose=False,
                            pipeline_runtime="ticks").plan(*args)
    k = state_arity(step, args)
    n = len(jax.tree.leaves(args[:k]))
    prog = trace(step, *args)
    prog, n = written_out(prog, n) or (prog, n)  # as `pipeline="auto"` cuts it
    merged = (auto.pipeline or {}).get("merged")
    if merged:  # its own recomputation undone (`ir/cse.py`)
        prog = merge_recomputed(prog)
    graph = lift_program(prog)
    dp = data_parallel_plan(graph, cluster, num_state_leaves=n, data_inputs=graph.inputs[n:])
    spmd_merged = None
    if merged:  # what SPMD alone prices on that program
        try:
            spmd_merged = make_plan(graph, cluster, num_state_leaves=n,
                                    data_inputs=graph.inputs[n:],
                                    time_limit=time_limit).predicted_step_time
        except InfeasibleMemory:
            spmd_merged = float("inf")
    out = {"model": f"{name}-{config}", "cluster": cluster.name, "auto": auto.predicted_step_time,
           "chosen": auto.chosen, "spmd": auto.baselines["SPMD"], "ideal": auto.baselines["ideal"],
           "stages": len(auto.stages), "why": auto.solver.get("pipeline", ""),
           "ticks only": ticked.predicted_step_time,
           "idle": [st["island"] for st in auto.stages if st["ops"] == 0],
           "runtime": (auto.pipeline or {}).get("runtime", ""),
           "merged": bool(merged),
           "auto vee": len({tuple(st["devices"]) for st in auto.stages}) < len(auto.stages)}
    try:
        regions = analyse(graph, dp.tensor_layouts, dp.op_inputs, n)
    except NotPipelineable as e:
        out["error"] = str(e)
        return out
    def found(p):
        return (p.step, p.micros, len(p.order), p.fits) if p else None

    for kind in SCHEDULES:  # pipelines proper: two stages or more
        out[kind] = found(plan_pipeline(graph, cluster, regions, dp.tensor_layouts, n,
                                        kinds=(kind,), whole=False))
    out["whole"] = found(plan_pipeline(graph, cluster, regions, dp.tensor_layouts, n,
                                       kinds=("1f1b",), whole="only"))
    out["free"] = found(plan_pipeline(graph, cluster, regions, dp.tensor_layouts, n,
                                      kinds=("hetero-1f1b",), free_running=True, whole=False))
    if islands_differ(cluster):  # a stage per island, run free
        out["islands free"] = found(min(
            [p for p in (f(graph, cluster, regions, dp.tensor_layouts, n, kinds=("hetero-1f1b",),
                           free_running=True, whole_islands=True, **kw)
                         for f, kw in ((plan_pipeline, {"whole": False}), (plan_vshape, {})))
             if p is not None], key=lambda p: (not p.fits, p.step), default=None))
    out["vee"] = found(plan_vshape(graph, cluster, regions, dp.tensor_layouts, n))
    out["vee free"] = found(plan_vshape(graph, cluster, regions, dp.tensor_layouts, n,
                                        kinds=("hetero-1f1b",), free_running=True))
    for kind in ("1f1b", "hetero-1f1b"):  # the schedules where stages balance
        p = plan_pipeline(graph, cluster, regions, dp.tensor_layouts, n, kinds=(kind,),
                          by_links=False)
        out["balanced " + kind] = (p.step, p.fits) if p else None
    if spmd_merged is not None:
        out["why"] += ("; SPMD-only on the program the pipeline cuts (its recomputation "
                       "undone): " + (
                           f"{spmd_merged:.4g} s" if spmd_merged < float("inf")
                           else "does not fit"))
    out["seconds"] = time.perf_counter() - t0
    return out


def table(rows) -> str:
    head = ("| model | cluster | SPMD-only | GPipe | 1F1B | hetero-1F1B | hetero vs 1F1B | "
            "the same, balanced cuts | free-running (vs SPMD) | accumulation over all | "
            "V-shaped: lock step / free-running (vs SPMD) | "
            "free-running, a stage per island of unequal sizes (vs SPMD) | auto picks | auto vs SPMD | "
            "auto, tick loop only, vs SPMD | ideal | auto at limit |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        def cell(kind):
            v = r.get(kind)
            if not v:
                return "n/a"
            step, m, s, fits = v
            return f"{step:.3f} s ({s}x{m}{'' if fits else ', does not fit'})"
        # compared only where both fit: under a memory cap hetero-1F1B keeps fewer
        # microbatches in flight than plain 1F1B, which exceeds it
        one, het = r.get("1f1b"), r.get("hetero-1f1b")
        ratio = (f"{one[0] / het[0]:.2f}x" if one and het and one[3] and het[3]
                 else "n/a (does not fit)" if one and het else "")
        pick = ("SPMD" if r["chosen"] != "pipeline" else "gradient accumulation over all"
                if r["stages"] == 1 else f"pipeline, {r['stages']} stages")
        if r.get("auto vee"):  # a group of devices runs two of its stages
            pick += ", V-shaped"
        if r.get("runtime") == "free":
            pick += ", run free"
        if r.get("merged"):
            pick += ", its recomputation undone"
        if r.get("idle"):  # microbatches on the other islands alone: gradient accumulation
            pick += f" ({', '.join(r['idle'])} idle)"
        a, b = r.get("balanced 1f1b"), r.get("balanced hetero-1f1b")
        balanced = "" if not (a and b) else f"{a[0]:.3f} / {b[0]:.3f} s = " + (
            f"{a[0] / b[0]:.2f}x" if a[1] and b[1] else "does not fit")
        free = f"{cell('free')} = {r['spmd'] / r['free'][0]:.2f}x" if r.get("free") else "n/a"
        vee = f"{cell('vee')} / {cell('vee free')}" + (
            f" = {r['spmd'] / r['vee free'][0]:.2f}x" if r.get("vee free") else "")
        whole = (f"{cell('islands free')} = {r['spmd'] / r['islands free'][0]:.2f}x"
                 if r.get("islands free") else "n/a (equal islands)")
        lines.append(f"| {r['model']} | {r['cluster']} | {r['spmd']:.3f} s | {cell('gpipe')} | "
                     f"{cell('1f1b')} | {cell('hetero-1f1b')} | {ratio} | {balanced} | {free} | "
                     f"{cell('whole')} | {vee} | {whole} | {pick} | "
                     f"{r['spmd'] / r['auto']:.2f}x | {r['spmd'] / r['ticks only']:.2f}x | "
                     f"{r['ideal']:.3f} s | "
                     f"{r['ideal'] / r['auto']:.0%} |")
    notes = [f"- {r['model']} on {r['cluster']}: {r.get('error') or r['why']}" for r in rows]
    return "\n".join(lines) + "\n\nWhat `pipeline=\"auto\"` said:\n\n" + "\n".join(notes) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--out", help="write the markdown here (default: print)")
    ap.add_argument("--only", help="print one row, named MODEL-CONFIG@CLUSTER")
    a = ap.parse_args(argv)
    if a.only and a.out:
        ap.error("--only prints one row; --out writes the whole table")
    labels = [f"{n}-{c}@{w if isinstance(w, str) else '@'.join(w)}" for n, c, w in ROWS]
    if a.only and a.only not in labels:
        ap.error(f"--only: no row {a.only!r}; rows: {', '.join(labels)}")
    rows = []
    for label, (name, config, where) in zip(labels, ROWS):
        if a.only and label != a.only:
            continue
        try:
            rows.append(row(name, config, where, a.time_limit))
        except ImportError as err:  # installed without the repository's tests/
            print(f"skipped {name}: {err}", file=sys.stderr)
            continue
        print(table(rows[-1:]).splitlines()[2], file=sys.stderr, flush=True)
    text = (f"# Pipelines across islands (predicted)\n\n"
            f"Generated {datetime.date.today()} by `.venv/bin/python benchmarks/pipelines.py "
            f"--time-limit {a.time_limit:g} --out benchmarks/PIPELINES.md` (Python "
            f"{platform.python_version()}, jax {jax.__version__}). Step times per training step; "
            "a pipeline cell reads `seconds (stages x microbatches)`.\n\n" + table(rows))
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
