"""Lower a Plan to one `jax.jit(shard_map(...))` over a 1-D mesh of the cluster's devices.

The flat program is interpreted eqn by eqn inside the shard_map body:
- an operand is first converted to the layout its op needs, with collectives *outside*
  any branch (divergent branches holding collectives would deadlock);
- a replicated (or partial-sum) op runs at full size on every device;
- a sharded op runs in a `lax.switch` on the device's *group* (devices with equal
  shard sizes): branch g slices its operands to group g's static sizes, binds the
  primitive with params resized for them, and pads results back to the stored size.
XLA executes only the taken branch, so a device computes only its own share.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from hapsynth import _jax
from hapsynth.ir.rules import local_params
from hapsynth.ir.trace import Const, Program
from hapsynth.lower.values import AXIS, Geometry, Layout, Sharded, shard_array, spec, unshard
from hapsynth.synth.plan import Plan


class Lowered:
    """A plan bound to a traced program and a mesh; call it with global or Sharded args."""

    def __init__(self, prog: Program, plan: Plan, devices):
        self.prog, self.plan = prog, plan
        self.mesh = Mesh(np.asarray(devices), (AXIS,))
        self.k = len(devices)
        self.units = {int(u): tuple(v) for u, v in plan.shard_units.items()}
        keys = sorted(self.units)
        sig = [tuple(self.units[u][i] for u in keys) for i in range(self.k)]
        first = {}
        self.group_of = np.array([first.setdefault(s, len(first)) for s in sig], np.int32)
        self.group_rep = [sig.index(s) for s in first]  # one device per group
        n_state = plan.state_leaves
        outs = prog.outputs
        self.in_layouts = [
            Layout.parse(plan.tensor_layouts[outs[i]]) if i < n_state and isinstance(outs[i], int)
            else Layout("R") for i in range(len(prog.inputs))]
        self.out_layouts = [
            Layout.parse(plan.tensor_layouts[o]) if i < n_state and isinstance(o, int) else Layout("R")
            for i, o in enumerate(outs)]
        in_specs = tuple(spec(l, 0) for l in self.in_layouts)
        out_specs = tuple(spec(l, 0) for l in self.out_layouts)
        self._fn = jax.jit(jax.shard_map(self._body, mesh=self.mesh, in_specs=in_specs,
                                         out_specs=out_specs, check_vma=False))

    # -- inside the shard_map ------------------------------------------------------
    def _geom(self, layout: Layout, shape) -> Geometry:
        return Geometry.of(layout, shape, self.units)

    def _convert(self, v, src: Layout, dst: Layout, shape):
        if src == dst or dst.kind == "R" and src.kind == "R":
            return v
        idx = lax.axis_index(AXIS)
        if src.kind == "S" and dst.kind != "P":  # to R first (S->S reshards through R)
            g = self._geom(src, shape)
            full = lax.all_gather(v, AXIS, axis=src.dim, tiled=True)
            v = jnp.take(full, jnp.asarray(g.compact_index()), axis=src.dim)
            src = Layout("R")
        if src.kind == "P" and dst.kind != "P":
            v, src = lax.psum(v, AXIS), Layout("R")
        if src == dst:
            return v
        if src.kind == "R" and dst.kind == "S":
            g = self._geom(dst, shape)
            pad = [(0, 0)] * v.ndim
            pad[dst.dim] = (0, g.pad)
            off = jnp.asarray(g.offsets, jnp.int32)[idx]
            return lax.dynamic_slice_in_dim(jnp.pad(v, pad), off, g.pad, axis=dst.dim)
        if src.kind == "R" and dst.kind == "P":
            return jnp.where(idx == 0, v, jnp.zeros_like(v))
        if src.kind == "S" and dst.kind == "P":  # own rows in place, zeros elsewhere
            g = self._geom(src, shape)
            rows = jnp.asarray(g.rows, jnp.int32)[idx]
            keep = lax.broadcasted_iota(jnp.int32, v.shape, src.dim) < rows
            v = jnp.where(keep, v, jnp.zeros_like(v))
            full = [*shape]
            full[src.dim] = shape[src.dim] + g.pad
            z = lax.dynamic_update_slice_in_dim(jnp.zeros(full, v.dtype), v,
                                                jnp.asarray(g.offsets, jnp.int32)[idx], src.dim)
            return lax.slice_in_dim(z, 0, shape[src.dim], axis=src.dim)
        raise NotImplementedError(f"conversion {src} -> {dst}")

    def _sharded_op(self, eqn, op_id, vals, needs):
        """Run one sharded op in a switch over device groups."""
        out_layouts = [Layout.parse(self.plan.tensor_layouts[t]) for t in eqn.outputs]

        def branch(g):
            dev = self.group_rep[g]

            def run(*xs):
                local = []
                for x, need, aval in zip(xs, needs, eqn.in_avals):
                    if need is not None and need.kind == "S":
                        rows = Geometry.of(need, aval.shape, self.units).rows[dev]
                        x = lax.slice_in_dim(x, 0, rows, axis=need.dim)
                    local.append(x)
                out_shapes = []
                for lay, aval in zip(out_layouts, eqn.out_avals):
                    shape = list(aval.shape)
                    if lay.kind == "S":
                        shape[lay.dim] = Geometry.of(lay, aval.shape, self.units).rows[dev]
                    out_shapes.append(shape)
                params = local_params(eqn, [np.shape(x) for x in local], out_shapes)
                outs = _jax.bind(eqn.primitive, local, params)
                outs = list(outs) if eqn.primitive.multiple_results else [outs]
                padded = []
                for o, lay, aval in zip(outs, out_layouts, eqn.out_avals):
                    if lay.kind == "S":
                        m = Geometry.of(lay, aval.shape, self.units).pad
                        pad = [(0, 0)] * o.ndim
                        pad[lay.dim] = (0, m - o.shape[lay.dim])
                        o = jnp.pad(o, pad)
                    padded.append(o)
                return tuple(padded)
            return run

        group = jnp.asarray(self.group_of)[lax.axis_index(AXIS)]
        branches = [branch(g) for g in range(len(self.group_rep))]
        outs = branches[0](*vals) if len(branches) == 1 else lax.switch(group, branches, *vals)
        return list(outs), out_layouts

    def _body(self, *flat):
        prog, plan = self.prog, self.plan
        env = {}
        for t, v, lay in zip(prog.inputs, flat, self.in_layouts):
            env[t] = (v[0] if lay.kind == "P" else v, lay)
        for t, v in prog.consts.items():
            env[t] = (v, Layout("R"))
        converted = {}
        for op_id, eqn in enumerate(prog.eqns):
            needs = [None if n is None else Layout.parse(n) for n in plan.op_inputs[op_id]]
            vals = []
            for x, need, aval in zip(eqn.inputs, needs, eqn.in_avals):
                if isinstance(x, Const):
                    vals.append(x.value)
                    continue
                key = (x, need)
                if key not in converted:
                    v, lay = env[x]
                    converted[key] = self._convert(v, lay, need, aval.shape)
                vals.append(converted[key])
            if plan.op_factors[op_id] >= 0:
                outs, lays = self._sharded_op(eqn, op_id, vals, needs)
            else:
                outs = _jax.bind(eqn.primitive, vals, eqn.params)
                outs = list(outs) if eqn.primitive.multiple_results else [outs]
                lays = [Layout.parse(plan.tensor_layouts[t]) for t in eqn.outputs]
            for t, o, lay in zip(eqn.outputs, outs, lays):
                env[t] = (o, lay)
        results = []
        for o, want, aval in zip(prog.outputs, self.out_layouts, self._out_avals()):
            if isinstance(o, Const):
                v, lay = jnp.asarray(o.value), Layout("R")
            else:
                v, lay = env[o]
            v = self._convert(v, lay, want, aval.shape)
            results.append(v[None] if want.kind == "P" else v)
        return tuple(results)

    def _out_avals(self):
        return [self.prog.avals[o] if isinstance(o, int) else o.aval for o in self.prog.outputs]

    # -- outside -------------------------------------------------------------------
    def __call__(self, *args):
        leaves, _ = jax.tree.flatten(args, is_leaf=lambda v: isinstance(v, Sharded))
        if len(leaves) != len(self.in_layouts):
            raise ValueError(f"expected {len(self.in_layouts)} array leaves, got {len(leaves)}")
        flat = []
        for x, lay in zip(leaves, self.in_layouts):
            if isinstance(x, Sharded):
                if Layout.parse(x.layout) == lay:
                    flat.append(x.data)
                    continue
                x = unshard(x)
            flat.append(shard_array(x, lay, self.units, self.mesh))
        outs = self._fn(*flat)
        if self.mesh.devices.flat[0].platform == "cpu":
            # XLA CPU runs collectives in-process: another program dispatched to these
            # devices while one is mid-collective can starve it (seen as a rendezvous
            # timeout), so on CPU a step finishes before the caller continues.
            jax.block_until_ready(outs)
        wrapped = []
        for o, lay, aval in zip(outs, self.out_layouts, self._out_avals()):
            if lay.kind == "R" and len(wrapped) >= self.plan.state_leaves:
                wrapped.append(o)
            else:
                text = "R" if lay.kind == "R" else ("P" if lay.kind == "P" else f"S{lay.dim}/{lay.units}")
                wrapped.append(Sharded(o, text, aval.shape,
                                       self.units.get(lay.units) if lay.kind == "S" else None))
        return jax.tree.unflatten(self.prog.out_tree, wrapped)
