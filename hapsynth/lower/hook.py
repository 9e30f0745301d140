"""`BranchHook`: how a measurement harness wraps every segment's branch of a program.

Never part of a plan: it lets a benchmark change what each device runs (e.g. run every
segment r times to emulate a slower device, `hapsynth_bench.emulation`) without the
lowering knowing about benchmarks. `Lowered(prog, plan, devices, branch_hook=hook)`:

- the program is always the `shard_map` one (never plain `jit`, which has no branches);
- every call appends `hook.inputs(mesh)` to the step's stored inputs, replicated on all
  devices: their values may change between calls without recompiling, as long as their
  number, shapes and dtypes do not (it is also called once when the program is built);
- inside the body, each segment's branch function (one per group of devices with equal
  shard sizes, and the one of a segment with no sharded op) is replaced by
  `hook.wrap(branch, entry, extra)`, where
  - `branch(*operands)` returns the tuple of values the segment exports;
  - `entry[i]` is True when operand i is one of the step's own inputs, passed unchanged
    (a read-only buffer: updating it in place makes XLA copy it first, on every device);
  - `extra` is the tuple of traced extra inputs (whole values, the same on every device;
    the hook may index them with `lax.axis_index(hapsynth.lower.values.AXIS)`);
  - a pipelined program (`lower/pipeline.py`, a (stage, data) mesh) also passes
    `index=`, the device's number in the program's `devices` (traced; the mesh orders
    devices by stage, in the plan's order of the islands).
  `wrap` runs while tracing, outside the `lax.switch`; what it returns is called with the
  same operands and must return the same structure as `branch`.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

__all__ = ["BranchHook"]


class BranchHook(Protocol):
    def inputs(self, mesh) -> tuple:
        """The extra inputs of the next call, as arrays replicated on `mesh`."""

    def wrap(self, branch: Callable, entry: Sequence[bool], extra: tuple,
             index=None) -> Callable:
        """The function to run in place of `branch` (see the module docstring)."""
