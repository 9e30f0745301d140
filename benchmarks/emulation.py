"""Slower devices on equal hardware: a `BranchHook` that runs every segment r times.

`Lowered(prog, plan, devices, branch_hook=WorkRepeat(counts))` makes device i evaluate
every segment `counts[i]` times (`hapsynth.lower.hook` describes the hook). Repeating
the same ops on the same operands is CSE'd by XLA (optimization barriers do not stop it
on CPU), so the repeats run first, on copies of the operands, in a loop whose trip count
is a runtime input; each turn changes one element of every copy in place by
`where(flag, 1, 0)` (`flag` a runtime False) and carries the segment's results out of
the loop. Values are unchanged, yet XLA can neither merge, hoist nor drop a repeat, and
no extra elementwise work is fused into the repeated ops (their matmuls stay library
calls). The segment itself then runs on the operands, as on a device that does not
repeat, and one element of the last repeat's results, times the flag, is added to one of
its results in place, so the loop is not dead code. Counts change without recompiling
(`set`), and one `WorkRepeat` may serve several programs on the same devices. The
repeats sit in a `cond` taken only when the count exceeds one; both of its sides leave
the segment's results where the plain segment does, so a device that does not repeat
runs at (nearly) its plain speed. Repeats find their operands warm in cache and pay for
their copies, so r repeats cost about, not exactly, r first runs (`hapsynth bench
pipeline` measures the slow device's rate as it runs; `hapsynth bench hetero`
calibrates against this harness, not against r).
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

        def corner(vals):
            # one element of every numeric result, summed (read out of the loop's results,
            # which XLA cannot narrow to one element)
            return sum((v.reshape(-1)[0].astype(jnp.float32) for v in vals if numeric(v)),
                       jnp.float32(0))

        def repeated(*a):
            # the repeats on copies (the loop updates them in place), then the segment on
            # the operands, as a device that does not repeat runs it: both sides of the
            # cond then leave their results where the plain segment does. (Returning the
            # loop's results made XLA copy every result out of the cond, on every device:
            # the paper MLP's pipelined step on 2 CPU devices of one process, 0.57 s
            # without the hook, took 0.76 s with it at one repeat, 0.60 s now.)
            b = tuple(v + zero(v) if numeric(v) else v for v in a)
            _, last = lax.fori_loop(0, count - 2, again, (b, branch(*b)))
            out = list(branch(*a))
            for i, v in enumerate(out):
                if numeric(v):  # O(1), in place; adds 0 unless the flag is set
                    at = (0,) * v.ndim
                    tie = jnp.where(flag, corner(last), 0).astype(v.dtype).reshape((1,) * v.ndim)
                    out[i] = lax.dynamic_update_slice(v, lax.dynamic_slice(v, at, (1,) * v.ndim)
                                                      + tie, at)
                    break
            return tuple(out)

        # a device that does not repeat runs the plain segment
        return lambda *a: lax.cond(count > 1, repeated, branch, *a)
