"""Slower devices on equal hardware: a `BranchHook` that runs every segment r times.

`Lowered(prog, plan, devices, branch_hook=WorkRepeat(counts))` makes device i evaluate
every segment `counts[i]` times (`hapsynth.lower.hook` describes the hook). Repeating
the same ops on the same operands is CSE'd by XLA (optimization barriers do not stop it
on CPU), and ops whose operands do not change in a loop are hoisted out of it. So the
segment runs once on its operands, as on a device that does not repeat, and then
`count - 1` times in a loop whose trip count is a runtime input, each turn in a `cond`
on `i < count` (true, but XLA cannot fold it): a conditional is neither hoisted nor
merged, its operands are read where they lie (no copies: the stage-sized state buffers
of a pipeline's once-per-step rounds made copying them cost more than the repeats), and
the repeated matmuls stay library calls. The loop carries the last repeat's results out,
and one element of them (less the segment's own), where `flag` (a runtime False), is
added to one of the segment's results in place, so no repeat is dead code (with `flag`
set the repeats run on operands one element of which is raised by one, so the results
change exactly where a repeat ran). Counts change without
recompiling (`set`), and one `WorkRepeat` may serve several programs on the same
devices. The repeats sit in a `cond` taken only when the count exceeds one, so a device
that does not repeat runs its plain segment. Repeats find their operands warm in cache,
so r repeats cost about, not exactly, r first runs (`hapsynth bench pipeline` measures
the slow device's rate as it runs; `hapsynth bench hetero` calibrates against this
harness, not against r).
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
        runs the repeats on operands with one element each raised by one, and adds the
        difference their results make to the segment's: tests use it to see them run)."""
        r = [int(x) for x in counts]
        if len(r) != self.k or min(r, default=0) < 1:
            raise ValueError(f"work_repeat needs {self.k} integers >= 1, got {counts!r}")
        self.counts, self.flag = tuple(r), bool(flag)
        self._placed: dict = {}

    def inputs(self, mesh) -> tuple:
        """(flag, counts), replicated on `mesh` (placed once per mesh and setting)."""
        if mesh.devices.size > self.k:  # (fewer: one stage's of a pipeline run free)
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

        def corner(vals):
            # one element of every numeric result, summed (read out of the loop's results,
            # which XLA cannot narrow to one element)
            return sum((v.reshape(-1)[0].astype(jnp.float32) for v in vals if numeric(v)),
                       jnp.float32(0))

        def bumped(vals):
            # (tests only, `flag` set) one element of every numeric operand plus one, so
            # that a repeat's results differ from the segment's where it really ran
            return tuple(lax.dynamic_update_slice(v, lax.dynamic_slice(
                v, (0,) * v.ndim, (1,) * v.ndim) + 1, (0,) * v.ndim) if numeric(v) else v
                for v in vals)

        def repeated(*a):
            # the segment on its operands, as a device that does not repeat runs it, then
            # count - 1 repeats on the same operands, each in a cond whose predicate XLA
            # cannot fold (`count` is a runtime input): neither hoisted out of the loop
            # nor merged with the first run, and no operand is copied (copies of the
            # stage-sized state buffers a pipeline's once-per-step rounds read cost the
            # slow process of the paper MLP's pipeline about 170 ms a step)
            out = list(branch(*a))

            def again(i, last):
                return lax.cond(i < count, lambda: lax.cond(
                    flag, lambda: tuple(branch(*bumped(a))), lambda: tuple(branch(*a))),
                    lambda: last)

            last = lax.fori_loop(0, count - 1, again, tuple(out))
            for i, v in enumerate(out):
                if numeric(v):  # O(1), in place; adds 0 unless the flag is set and a
                    at = (0,) * v.ndim  # repeat ran (on bumped operands)
                    tie = jnp.where(flag, corner(last) - corner(out), 0).astype(v.dtype)
                    out[i] = lax.dynamic_update_slice(v, lax.dynamic_slice(v, at, (1,) * v.ndim)
                                                      + tie.reshape((1,) * v.ndim), at)
                    break
            return tuple(out)

        # a device that does not repeat runs the plain segment
        return lambda *a: lax.cond(count > 1, repeated, branch, *a)
