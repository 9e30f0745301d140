"""Test session setup: 8 simulated CPU devices, set before JAX initialises."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_NUM_CPU_DEVICES"] = "8"
# (the second: pipelined programs on several CPU devices need it, see
# `hapsynth.lower.pipeline.CPU_FLAG`)
for _flag in ("--xla_force_host_platform_device_count=8",
              "--xla_cpu_enable_concurrency_optimized_scheduler=false"):
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
