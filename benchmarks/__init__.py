"""hapsynth_bench: the measurement harness, kept out of the product (`hapsynth`).

Installed as the package `hapsynth_bench` (this folder, mapped in pyproject.toml) with
hapsynth; `hapsynth bench overhead|hetero` and `hapsynth profile --processes N` use it.

- launch.py: N local one-core `jax.distributed` processes (ctypes `prctl`, `/proc`,
  idle priority for gloo's loop threads);
- emulation.py: `WorkRepeat`, a branch hook of the lowering that emulates slower devices;
- hetero.py: `hapsynth bench hetero` (speed-ups on two emulated heterogeneous devices);
- overhead.py: `hapsynth bench overhead` (the lowered step against hand-written DP);
- plan_zoo.py: predicted plans for every zoo model (`python benchmarks/plan_zoo.py`);
- cli.py: what `hapsynth bench` runs.
"""
