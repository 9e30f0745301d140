"""`hapsynth` command line: inspect a zoo model's IR, run the demo."""
from __future__ import annotations

import argparse
import json
import sys


def _zoo(name: str, config: str, devices: int):
    from hapsynth.models import get

    return get(name, config, devices=devices)


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

    step, example = _zoo(args.model, args.config, args.devices)
    report = hs.inspect(step, *example)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(args.model, args.config, report))
    return 0


def cmd_demo(args) -> int:
    from hapsynth import demo

    return demo.main(fast=args.fast)


def build_parser() -> argparse.ArgumentParser:
    from hapsynth.models import CONFIG_NAMES, names

    p = argparse.ArgumentParser(prog="hapsynth", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="IR coverage and cost of a zoo model's train step")
    ins.add_argument("model", choices=names())
    ins.add_argument("--config", default="tiny", choices=list(CONFIG_NAMES))
    ins.add_argument("--devices", type=int, default=64,
                     help="sets the paper batch (32 x devices) and MoE experts (2 x devices)")
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    ins.set_defaults(func=cmd_inspect)
    demo = sub.add_parser("demo", help="the main job: what hapsynth can do today, end to end")
    demo.add_argument("--fast", action="store_true", help="skip the XLA cross-check")
    demo.set_defaults(func=cmd_demo)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
