"""Slower devices on equal hardware: a `BranchHook` that runs every segment r times.

`Lowered(prog, plan, devices, branch_hook=WorkRepeat(counts))` makes device i evaluate
every segment `counts[i]` times (`hapsynth.lower.hook` describes the hook). Repeating
the same ops on the same operands is CSE'd by XLA (optimization barriers do not stop it
on CPU), so the repeats run in a loop whose trip count is a runtime input; each turn
changes one element of every operand in place by `where(flag, 1, 0)` (`flag` a runtime
False) and carries the segment's results out of the loop. Values are unchanged, yet XLA
can neither merge, hoist nor drop a repeat, and no extra elementwise work is fused into
the repeated ops (their matmuls stay library calls). Counts change without recompiling
(`set`), and one `WorkRepeat` may serve several programs on the same devices. The
repeats sit in a `cond` taken only when the count exceeds one, so a device that does not
repeat runs the plain segment. Repeats find their operands warm in cache, so r repeats
cost less than r first runs: the emulated device is somewhat less than r times slower
(`hapsynth bench hetero` calibrates against this harness, not against r).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hapsynth.lower.values import AXIS

__all__ = ["WorkRepeat"]


class WorkRepeat:
    """Device i runs each segment `counts[i]` times (a `hapsynth.lower.hook.BranchHook`)."""

    def __init__(self, counts, flag: bool = False):
        self.k = len(counts)
        self.set(counts, flag)

    def set(self, counts, flag: bool = False) -> None:
        """From the next call on, device i runs each segment `counts[i]` times (`flag=True`
        perturbs the repeats' operands, which tests use to see them run)."""
        r = [int(x) for x in counts]
        if len(r) != self.k or min(r, default=0) < 1:
            raise ValueError(f"work_repeat needs {self.k} integers >= 1, got {counts!r}")
        self.counts, self.flag = tuple(r), bool(flag)
        self._placed: dict = {}

    def inputs(self, mesh) -> tuple:
        """(flag, counts), replicated on `mesh` (placed once per mesh and setting)."""
        if mesh.devices.size != self.k:
            raise ValueError(f"work_repeat needs {mesh.devices.size} integers >= 1 for this "
                             f"program's devices, got {self.counts!r}")
        if mesh not in self._placed:
            rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            self._placed[mesh] = (jax.device_put(np.asarray(self.flag), rep),
                                  jax.device_put(np.asarray(self.counts, np.int32), rep))
        return self._placed[mesh]

    def wrap(self, branch, entry, extra, index=None):
        """`branch`, then its repeats on the devices whose count exceeds one (`index`: the
        device's number in the program's devices, when the mesh is not the 1-D one)."""
        flag, counts = extra
        count = counts[lax.axis_index(AXIS) if index is None else index]

        def numeric(v):
            return v.size and jnp.issubdtype(v.dtype, jnp.number)

        def zero(v):  # a runtime zero (flag is False) XLA cannot fold away
            return jnp.where(flag, 1, 0).astype(v.dtype)

        def nudge(vals):
            # one element each, in place: the operands become loop-variant (so XLA cannot
            # hoist or merge the repeat) at O(1) cost, and no elementwise op is fused into
            # their consumers (a matmul stays a library matmul)
            out = []
            for v in vals:
                if numeric(v):
                    at = (0,) * v.ndim
                    corner = lax.dynamic_slice(v, at, (1,) * v.ndim)
                    v = lax.dynamic_update_slice(v, corner + zero(v), at)
                out.append(v)
            return tuple(out)

        def again(_, carry):
            # the results are carried out of the loop, so no repeat is dead code
            b = nudge(carry[0])
            return b, branch(*b)

        def repeated(*a):
            # the loop updates its operands in place; for the step's own (read-only)
            # inputs XLA would copy them before the branch, on every device, so this
            # branch makes its own copies of those
            b = tuple(v + zero(v) if e and numeric(v) else v for v, e in zip(a, entry))
            return lax.fori_loop(0, count - 1, again, (b, branch(*b)))[1]

        # a device that does not repeat runs the plain segment: both branches compute
        # their results in place. The cond is not free on a large model: the paper MLP's
        # one-device step runs 0.36 s plain and 0.44-0.46 s with it at one repeat
        # (0.84-0.89 s while its weight gradients left the cond transposed;
        # benchmarks/RESULTS.md, 2026-12-05)
        return lambda *a: lax.cond(count > 1, repeated, branch, *a)
