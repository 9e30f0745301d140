"""The memory model against XLA: a plan's predicted bytes per device beside what XLA's
`compiled.memory_analysis()` says the lowered program needs, for the zoo's tiny and small
configs, on one device and on 8 simulated CPU devices (2 fast + 6 slow) as data
parallelism and as the planner's plan. State is donated, as a training loop feeds it
back, so XLA's peak is arguments + outputs - aliased + temporaries.

    .venv/bin/python benchmarks/memory_check.py [model:config ...]
"""
from __future__ import annotations

import os
import sys

CASES = [(m, c) for m in ("mlp", "gpt", "bert", "vit", "vgg", "moe") for c in ("tiny", "small")]
SETUPS = ("one device", "2+6 data-parallel", "2+6 planned")


def measure(model: str, config: str, setup: str) -> tuple[float, float, dict]:
    """(predicted bytes per device of the class that binds, XLA's bytes, the plan's
    memory entry) for one zoo step."""
    import jax

    import hapsynth as hs
    from hapsynth.models import get

    cluster = (hs.Cluster.simulated([("A100", 1)]) if setup == "one device" else
               hs.Cluster.simulated([("A100", 2), ("V100", 6)]))
    strategy = "data-parallel" if "data-parallel" in setup else "auto"
    step, args = get(model, config, devices=8)
    par = hs.parallelize(step, cluster=cluster, strategy=strategy, time_limit=1, devices="all",
                         verbose=False, donate_argnums=(0, 1))
    plan = par.plan(*args)
    low = par.lowered(*args)
    m = low._fn.lower(*low._stored(jax.tree.leaves(args))).compile().memory_analysis()
    xla = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
           + m.temp_size_in_bytes)
    entry = plan.memory[cluster.classes[-1].name]
    return float(entry["total"]), float(xla), entry


def main(argv=None) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
    argv = sys.argv[1:] if argv is None else argv
    cases = [tuple(a.split(":")) for a in argv] or CASES
    print("| model | setup | predicted MB | state | activations | buffers | XLA MB | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for model, config in cases:
        for setup in SETUPS:
            pred, xla, e = measure(model, config, setup)
            print(f"| {model}-{config} | {setup} | {pred / 1e6:.3f} | {e['state'] / 1e6:.3f} | "
                  f"{e['activations'] / 1e6:.3f} | {e['buffers'] / 1e6:.3f} | {xla / 1e6:.3f} | "
                  f"{pred / xla:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
