"""Temporary memory of lowered programs, as XLA's `memory_analysis` reports it.

Uneven data parallelism on 8 simulated CPU devices (2 fast, 6 slow: per-class
branches) for a few zoo models: what a change to segment scheduling does to the
program's temporaries, without timing noise. Run it at two commits to compare:

    .venv/bin/python benchmarks/temp_memory.py
"""
from __future__ import annotations

import os
import sys

MODELS = (("mlp", "paper"), ("gpt", "small"), ("bert", "small"))


def _cls(name: str, count: int, speed: int) -> str:
    return (f'[[class]]\ntype = "CPU"\nname = "{name}"\ncount = {count}\nhost = 0\n'
            f'flops = "{90 * speed}GFLOP/s"\nmem_bandwidth = "{10 * speed}GB/s"\n'
            f'memory = "64GiB"\n')


def main() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
    import jax

    import hapsynth as hs
    from hapsynth.models import get

    cluster = hs.Cluster.from_toml(_cls("fast", 2, 4) + _cls("slow", 6, 1))
    for model, config in MODELS:
        step, args = get(model, config, devices=8, abstract=False)
        low = hs.parallelize(step, cluster=cluster, strategy="data-parallel").lowered(*args)
        mem = low._fn.lower(*low._stored(jax.tree.leaves(args))).compile().memory_analysis()
        print(f"{model}-{config}: {low.mode}, {len(low.segments)} segments, "
              f"temporaries {mem.temp_size_in_bytes / 1e6:.1f} MB", flush=True)


if __name__ == "__main__":
    sys.exit(main())
