"""`hapsynth` command line: inspect a train step's IR (a zoo model's or your own), plan it on
a cluster, run the demo and the benchmarks."""
from __future__ import annotations

import argparse
import json
import sys


def _step(args, devices: int):
    """The command's train step, or None after a one-line error (`hapsynth.steps`)."""
    from hapsynth.steps import StepSourceError, load_step

    try:
        return load_step(args.model, config=args.config, devices=devices)
    except StepSourceError as err:
        print(f"hapsynth {args.command}: {err}", file=sys.stderr)
        return None


def _label(args) -> str:
    from hapsynth.steps import is_user_step

    return "your step" if is_user_step(args.model) else f"zoo, {args.config}"


def format_report(name: str, config: str, report: dict) -> str:
    """A readable table of an `inspect` report."""
    lines = [
        f"{name} ({config})",
        f"  eqns (inlined, live)  {report['eqns']:>10,}   traced top-level {report['traced_eqns']:,}",
        f"  nodes (coarsened)     {report['nodes']:>10,}   " + ", ".join(
            f"{k} {v}" for k, v in report["node_kinds"].items()),
        f"  flops / step          {report['flops']:>10.4g}   transcendentals {report['transcendentals']:.4g}",
        f"  bytes touched         {report['bytes']:>10.4g}",
        f"  trace + lift          {report['seconds']:>9.2f}s",
    ]
    uns = report["unsupported"]
    lines.append("  unsupported           " + (", ".join(f"{k} x{v}" for k, v in uns.items())
                                              + "  (planned replicated)" if uns else "none"))
    for prim, why in report["replicated"].items():
        lines.append(f"  replicated by design  {prim}: {why}")
    prims = sorted(report["primitives"].items(), key=lambda kv: -kv[1])
    lines.append("  primitives            " + ", ".join(f"{k} {v}" for k, v in prims[:12])
                 + (f", ... ({len(prims)} kinds)" if len(prims) > 12 else ""))
    return "\n".join(lines)


def cmd_inspect(args) -> int:
    import hapsynth as hs

    loaded = _step(args, args.devices)
    if loaded is None:
        return 2
    step, example = loaded
    report = hs.inspect(step, *example)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(args.model, _label(args), report))
    return 0


def cmd_plan(args) -> int:
    import hapsynth as hs

    cluster = hs.Cluster.load(args.cluster)
    loaded = _step(args, cluster.num_devices)
    if loaded is None:
        return 2
    step, example = loaded
    try:
        plan = hs.parallelize(step, cluster=cluster, time_limit=args.time_limit, seed=args.seed,
                              devices="all" if args.all_devices else "auto",
                              remat=False if args.no_remat else "auto",
                              plan_cache=args.plan_cache).plan(*example)
    except hs.InfeasibleMemory as err:
        print(f"hapsynth plan: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(plan.to_json())
    else:
        print(f"{args.model} ({_label(args)}, on {cluster.num_devices} devices)")
        print(plan.summary())
        if args.explain:
            print(plan.explain())
    if args.out:
        with open(args.out, "w") as f:
            f.write(plan.to_json())
    return _pictures(args, plan)


def _pictures(args, plan) -> int:
    """`--png`: the plan's timeline and balance; `--html`: its table, as a page."""
    if args.png:
        from hapsynth.view.plots import overview

        try:
            fig = overview(plan)
        except ImportError as err:
            print(f"hapsynth plan --png: {err}", file=sys.stderr)
            return 2
        fig.savefig(args.png, dpi=110)
    if args.html:
        from hapsynth.view.html import page

        with open(args.html, "w") as f:
            f.write(page(f"hapsynth plan: {args.model} on {plan.cluster}", plan._repr_html_()))
    return 0


def _harness(module: str, command: str):
    """A module of the measurement harness `hapsynth_bench` (installed with hapsynth);
    None, with a one-line error, where it is missing."""
    import importlib

    try:
        return importlib.import_module(f"hapsynth_bench.{module}")
    except ModuleNotFoundError as err:
        if err.name not in ("hapsynth_bench", f"hapsynth_bench.{module}"):
            raise
        print(f"hapsynth {command}: needs the measurement harness (package hapsynth_bench), "
              "which is not installed", file=sys.stderr)
        return None


def cmd_bench(args) -> int:
    cli = _harness("cli", "bench")
    if cli is None:
        return 2
    return cli.bench(args.kind, model=args.model, config=args.config, reps=args.reps,
                     ratios=args.ratios, as_json=args.json, link=args.link, batch=args.batch)


def cmd_profile(args) -> int:
    from hapsynth import profile

    if args.processes > 1:
        launch = _harness("launch", "profile --processes")
        if launch is None:
            return 2
        result = launch.run("hapsynth.profile:profile", {}, processes=args.processes)
    else:
        result = profile.profile()
    text = profile.to_toml(result, name=args.name, islands=args.islands)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(json.dumps(result, indent=1) if args.json else text)
    return 0


def cmd_demo(args) -> int:
    from hapsynth import demo

    return demo.main(fast=args.fast)


def build_parser() -> argparse.ArgumentParser:
    from hapsynth.models import CONFIG_NAMES, names

    p = argparse.ArgumentParser(prog="hapsynth", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    step_help = (f"a zoo model ({', '.join(names())}) or your own train step: "
                 "path/to/file.py:make_step or package.module:make_step, a function "
                 "returning (train_step, example_args)")
    ins = sub.add_parser("inspect", help="IR coverage and cost of a train step")
    ins.add_argument("model", metavar="STEP", help=step_help)
    ins.add_argument("--config", default="tiny", choices=list(CONFIG_NAMES))
    ins.add_argument("--devices", type=int, default=64,
                     help="sets the paper batch (32 x devices) and MoE experts (2 x devices)")
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    ins.set_defaults(func=cmd_inspect)
    pl = sub.add_parser("plan", help="synthesise a plan for a train step on a cluster")
    pl.add_argument("model", metavar="STEP", help=step_help)
    pl.add_argument("--config", default="paper", choices=list(CONFIG_NAMES))
    pl.add_argument("--cluster", default="hap-v100x16-p100x48",
                    help="preset name or TOML path (see Cluster.presets())")
    pl.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT seconds in all")
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("--all-devices", action="store_true",
                    help="every device works (by default a plan may leave slow or far ones idle)")
    pl.add_argument("--no-remat", action="store_true",
                    help="plan the step as written even when its activations do not fit "
                         "(by default cheap ones are then recomputed in the backward pass)")
    pl.add_argument("--plan-cache", metavar="DIR",
                    help="keep plans in this folder and read one back when the same step, "
                         "cluster and options are planned again (default: $HAPSYNTH_PLAN_CACHE)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("--out", help="also write the plan's JSON to this file")
    pl.add_argument("--explain", action="store_true",
                    help="also print, per node, its ops, strategy, layouts and conversions")
    pl.add_argument("--png", metavar="FILE",
                    help="write the plan's timeline and balance as a PNG (needs hapsynth[plot])")
    pl.add_argument("--html", metavar="FILE", help="write the plan's tables as an HTML page")
    pl.set_defaults(func=cmd_plan)
    be = sub.add_parser("bench", help="benchmarks measured side by side (package hapsynth_bench)")
    be.add_argument("kind", choices=["overhead", "hetero", "pipeline", "overlap"])
    be.add_argument("--model", choices=names(), help="default: gpt (overhead), a set (hetero)")
    be.add_argument("--config", choices=list(CONFIG_NAMES), help="default: tiny")
    be.add_argument("--reps", type=int, help="timed steps per program (default 20 / 8)")
    be.add_argument("--batch", type=int,
                    help="pipeline: the model's global batch, in place of its config's")
    be.add_argument("--ratios", type=float, nargs="+", default=[2.0, 3.0],
                    help="hetero: fast/slow speed ratios to emulate")
    be.add_argument("--json", action="store_true", help="hetero, pipeline, overlap: print JSON")
    be.add_argument("--link", default="100mbit",
                    help="pipeline, overlap: the emulated link between the two processes, a tc rate "
                         "(default 100mbit; 'none' for the plain loopback; needs root)")
    be.set_defaults(func=cmd_bench)
    pr = sub.add_parser("profile", help="measure local devices and links, write a cluster TOML")
    pr.add_argument("--processes", type=int, default=1,
                    help="CPU: measure links between this many one-core jax.distributed processes")
    pr.add_argument("--name", default="profiled", help="the cluster's name in the TOML")
    pr.add_argument("--islands", type=int, default=1,
                    help="write the devices as this many equal islands joined by the measured "
                         "link (e.g. --processes 2 --islands 2: one island per process)")
    pr.add_argument("--out", help="write the TOML to this file")
    pr.add_argument("--json", action="store_true", help="print the measurements as JSON")
    pr.set_defaults(func=cmd_profile)
    demo = sub.add_parser("demo", help="the main job: what hapsynth can do today, end to end")
    demo.add_argument("--fast", action="store_true", help="skip the XLA cross-check")
    demo.set_defaults(func=cmd_demo)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
