"""Per-group evaluation of a segment, and the `lax.switch` that picks a device's group.

Devices with equal shard sizes form a *group*. A group's branch slices its operands to
the group's static sizes, binds each primitive with params resized for them
(`local_params`), and pads S results back to the stored (largest) size, so every
branch returns the same shapes. XLA executes only the taken branch: a device computes
only its own share.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from hapsynth.ir.rules import evaluate_block, facts, local_params
from hapsynth.ir.trace import Const, Program
from hapsynth.lower import cpu
from hapsynth.lower.values import AXIS, Geometry
from hapsynth.synth.plan import Plan

__all__ = ["groups", "Segments", "switch"]


def groups(units: dict, k: int) -> tuple[np.ndarray, list[int]]:
    """(group of each device, one device of each group): devices with equal units in
    every split of `units` share a group, numbered in order of first device."""
    keys = sorted(units)
    sig = [tuple(units[u][i] for u in keys) for i in range(k)]
    first: dict = {}
    group_of = np.array([first.setdefault(s, len(first)) for s in sig], np.int32)
    return group_of, [sig.index(s) for s in first]


@dataclass(frozen=True)
class Segments:
    """Evaluates segments of `prog` under `plan` (`units`: its shard_units; `keep`: dots
    made with their operands swapped, `cpu.keep_dot`)."""

    prog: Program
    plan: Plan
    units: dict
    keep: frozenset

    def run(self, seg: Sequence[int], ext: dict, dev: int | None, exports,
            pad: bool = True) -> list:
        """Evaluate a segment's ops for the devices of `dev`'s group (None: full size).

        `ext` maps (tensor, layout) of operands made before the segment to stored values
        (S ones may already be cut to the group's rows); returns the `exports`, S-layout
        ones padded back to their stored size unless `pad` is False."""
        prog, plan = self.prog, self.plan
        local = {}

        def fetch(x, need):
            if isinstance(x, Const):
                return x.value
            if x in local:
                return local[x]
            v = ext[(x, need)]
            return v if dev is None else self.cut(v, need, prog.avals[x].shape, dev)

        for op_id in seg:
            eqn = prog.eqns[op_id]
            vals = [fetch(x, n) for x, n in zip(eqn.inputs, plan.op_inputs[op_id])]
            if plan.op_factors[op_id] >= 0 and dev is not None and facts(eqn.name).block:
                outs = evaluate_block(eqn, vals, self._local_shapes(eqn, dev),
                                      lambda eqn=eqn: self._starts(eqn))
            else:
                params = eqn.params
                if plan.op_factors[op_id] >= 0 and dev is not None:
                    params = local_params(eqn, [np.shape(v) for v in vals],
                                          self._local_shapes(eqn, dev))
                outs = cpu.bind(eqn.primitive, vals, params, swap=op_id in self.keep)
            local.update(zip(eqn.outputs, outs))
        result = []
        for t in exports:
            v, lay = local[t], plan.tensor_layouts[t]
            if pad and dev is not None:
                v = self.pad(v, lay, prog.avals[t].shape)
            result.append(v)
        return result

    def cut(self, v, lay, shape, dev: int):
        """Stored value `v` of an S `lay` (global `shape`) cut to `dev`'s group's rows."""
        if lay.kind != "S":
            return v
        return lax.slice_in_dim(v, 0, Geometry.of(lay, shape, self.units).rows[dev], axis=lay.dim)

    def pad(self, v, lay, shape, dim: int | None = None):
        """A group's value of an S `lay` padded back to its stored rows (on `dim`, when
        the value has gained leading axes, as a loop's stacked results have)."""
        if lay.kind != "S":
            return v
        dim = lay.dim if dim is None else dim
        widths = [(0, 0)] * v.ndim
        widths[dim] = (0, Geometry.of(lay, shape, self.units).pad - v.shape[dim])
        return jnp.pad(v, widths)

    def _local_shapes(self, eqn, dev: int) -> list[list[int]]:
        """The results' shapes on `dev`'s group: S dims cut to the group's rows."""
        shapes = []
        for t, aval in zip(eqn.outputs, eqn.out_avals):
            lay, shape = self.plan.tensor_layouts[t], list(aval.shape)
            if lay.kind == "S":
                shape[lay.dim] = Geometry.of(lay, aval.shape, self.units).rows[dev]
            shapes.append(shape)
        return shapes

    def _starts(self, eqn) -> list[list]:
        """Per result, where this device's block starts along each dim (traced: devices
        of one group hold different rows)."""
        out = []
        for t, aval in zip(eqn.outputs, eqn.out_avals):
            lay, at = self.plan.tensor_layouts[t], [0] * len(aval.shape)
            if lay.kind == "S":
                offsets = Geometry.of(lay, aval.shape, self.units).offsets
                at[lay.dim] = jnp.asarray(offsets, jnp.int32)[lax.axis_index(AXIS)]
            out.append(at)
        return out

    def branch(self, seg: Sequence[int], keys: Sequence, exports, dev: int | None) -> Callable:
        """The branch function of `dev`'s group: operands in the order of `keys`
        (`schedule.operands`) -> tuple of the exports."""
        def once(*a):
            return tuple(self.run(seg, dict(zip(keys, a)), dev, exports))
        return once


def switch(group, branches: Sequence[Callable], args):
    """Run the branch of this device's `group` (a traced index); one branch: no switch."""
    if len(branches) == 1:
        return branches[0](*args)
    return lax.switch(group, list(branches), *args)
