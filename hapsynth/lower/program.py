"""Lower a Plan to one `jax.jit(shard_map(...))` over a 1-D mesh of the cluster's devices.

The flat program is interpreted eqn by eqn inside the shard_map body:
- an operand is first converted to the layout its op needs, with collectives *outside*
  any branch (divergent branches holding collectives would deadlock);
- a replicated (or partial-sum) op runs at full size on every device;
- a sharded op runs in a `lax.switch` on the device's *group* (devices with equal
  shard sizes): branch g slices its operands to group g's static sizes, binds the
  primitive with params resized for them, and pads results back to the stored size.
XLA executes only the taken branch, so a device computes only its own share.
Ops are grouped into as few such *segments* as the conversions allow (see `_segments`);
partial sums converted together (a step's gradients) are summed as one flat bucket; and
two layouts XLA CPU runs slowly inside a `shard_map` body are avoided (a dot whose
result is transposed next, a convolution not in its library kernels' layout).

`work_repeat` (benchmarks only, never part of a plan) emulates slower devices on equal
hardware: device i evaluates every segment `work_repeat[i]` times. Repeating the same
ops on the same operands is CSE'd by XLA (optimization barriers do not stop it on CPU),
so the repeats run in a loop whose trip count is a runtime input; each turn changes one
element of every operand in place by `where(flag, 1, 0)` (`flag` a runtime False) and
carries the segment's results out of the loop. Values are unchanged, yet XLA can
neither merge, hoist nor drop a repeat, and no extra elementwise work is fused into
the repeated ops (their matmuls stay library calls). Counts change without recompiling.
The repeats sit in a `cond` taken only when the count exceeds one, so a device that does
not repeat runs the plain segment. Repeats find their operands warm in cache, so r
repeats cost less than r first runs: the emulated device is somewhat less than r times
slower (`hapsynth bench hetero` calibrates against this harness, not against r).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from hapsynth import _jax
from hapsynth.ir.rules import local_params
from hapsynth.ir.trace import Const, Program, evaluate, value_of
from hapsynth.lower.values import (AXIS, Geometry, Layout, Sharded, load_array, shard_array,
                                   spec, unshard)
from hapsynth.synth.plan import Plan


class Lowered:
    """A plan bound to a traced program and a mesh; call it with global or Sharded args."""

    def __init__(self, prog: Program, plan: Plan, devices, *, work_repeat=None, gspmd=True):
        self.prog, self.plan = prog, plan
        self.mesh = Mesh(np.asarray(devices), (AXIS,))
        self.k = len(devices)
        self.emulating = work_repeat is not None
        if self.emulating:
            self.set_work_repeat(work_repeat)
        self.units = {int(u): tuple(v) for u, v in plan.shard_units.items()}
        keys = sorted(self.units)
        sig = [tuple(self.units[u][i] for u in keys) for i in range(self.k)]
        first = {}
        self.group_of = np.array([first.setdefault(s, len(first)) for s in sig], np.int32)
        self.group_rep = [sig.index(s) for s in first]  # one device per group
        n_state = plan.state_leaves
        outs = prog.outputs
        needs: dict[int, set] = {}
        for op_id, eqn in enumerate(prog.eqns):
            for x, n in zip(eqn.inputs, plan.op_inputs[op_id]):
                if isinstance(x, int) and n is not None:
                    needs.setdefault(x, set()).add(n)
        # state arrives as its update left it; data in the one layout its readers need
        # (each device then receives only its rows), else whole
        self.in_layouts = [
            Layout.parse(plan.tensor_layouts[outs[i]]) if i < n_state and isinstance(outs[i], int)
            else Layout.parse(next(iter(needs[t]))) if len(needs.get(t, ())) == 1
            and next(iter(needs[t])).startswith("S") else Layout("R")
            for i, t in enumerate(prog.inputs)]
        self.out_layouts = [
            Layout.parse(plan.tensor_layouts[o]) if i < n_state and isinstance(o, int) else Layout("R")
            for i, o in enumerate(outs)]
        self.segments = self._segments()
        self.exports = self._exports()
        # a matmul whose result is transposed next (the weight gradients of a backward
        # pass): XLA would fold the transpose into the dot, and on CPU the folded dot
        # misses the fast matmul library (measured 1.6x slower); a barrier keeps it
        readers = {}
        for eqn in prog.eqns:
            for x in eqn.inputs:
                if isinstance(x, int):
                    readers.setdefault(x, set()).add(eqn.primitive.name)
        self.keep_dot = {i for i, eqn in enumerate(prog.eqns)
                         if eqn.primitive.name == "dot_general"
                         and any("transpose" in readers.get(t, ()) for t in eqn.outputs)}
        # the collective form the plan priced, per (tensor, target layout)
        self.forms = {(c.tensor, Layout.parse(c.dst)): c.form for c in plan.conversions}
        for i in range(plan.state_leaves):  # a state input is converted like its update
            out = prog.outputs[i]
            for (t, dst), form in list(self.forms.items()):
                if t == out:
                    self.forms[(prog.inputs[i], dst)] = form
        # a plan with even shards everywhere needs no branches: plain jit with the plan's
        # layouts as sharding constraints, partitioned by XLA (the cheapest program)
        used = {Layout.parse(t).units for t in (*plan.tensor_layouts,
                                                *(n for ins in plan.op_inputs for n in ins if n))
                if t.startswith("S")}
        self.mode = "gspmd" if gspmd and not self.emulating and all(
            len(set(self.units[u])) == 1 for u in used) and all(
            lay.kind != "P" for lay in (*self.in_layouts, *self.out_layouts)) else "shard_map"
        if self.mode == "gspmd":
            self._fn = jax.jit(self._global_body,
                               in_shardings=tuple(self._named(l) for l in self.in_layouts),
                               out_shardings=tuple(self._named(l) for l in self.out_layouts))
            return
        in_specs = tuple(spec(l, 0) for l in self.in_layouts)
        if self.emulating:
            in_specs += (spec(Layout("R"), 0), spec(Layout("R"), 0))
        out_specs = tuple(spec(l, 0) for l in self.out_layouts)
        self._fn = jax.jit(jax.shard_map(self._body, mesh=self.mesh, in_specs=in_specs,
                                         out_specs=out_specs, check_vma=False))

    def set_work_repeat(self, work_repeat, flag: bool = False):
        """Benchmarks only: device i runs each segment `work_repeat[i]` times from now on
        (`flag=True` perturbs the repeats' operands, which tests use to see them run)."""
        r = [int(x) for x in work_repeat]
        if not self.emulating or len(r) != self.k or min(r) < 1:
            raise ValueError(f"work_repeat needs {self.k} integers >= 1 on a Lowered built "
                             f"with work_repeat=, got {work_repeat!r}")
        rep = jax.sharding.NamedSharding(self.mesh, spec(Layout("R"), 0))
        self.repeat = tuple(r)
        self._extra = (jax.device_put(np.asarray(flag), rep),
                       jax.device_put(np.asarray(r, np.int32), rep))

    def _named(self, layout: Layout):
        return jax.sharding.NamedSharding(self.mesh, spec(layout, 0))

    def _global_body(self, *flat):
        """The program at global shapes, each R/S tensor constrained to its plan layout."""
        def place(t, v):
            lay = Layout.parse(self.plan.tensor_layouts[t])
            return v if lay.kind == "P" else lax.with_sharding_constraint(v, self._named(lay))

        env = evaluate(self.prog, flat, place)
        return tuple(jnp.asarray(value_of(env, o)) for o in self.prog.outputs)

    # -- inside the shard_map ------------------------------------------------------
    def _geom(self, layout: Layout, shape) -> Geometry:
        return Geometry.of(layout, shape, self.units)

    def _to_rows(self, v, geom: Geometry, dim: int, rows_full: int):
        """Lay the full dim out as k blocks of `geom.pad` rows (device i's rows, then zeros)."""
        idx = np.full((self.k, geom.pad), rows_full, np.int32)  # index rows_full = a zero row
        for i, (o, r) in enumerate(zip(geom.offsets, geom.rows)):
            idx[i, :r] = np.arange(o, o + r)
        pad = [(0, 0)] * v.ndim
        pad[dim] = (0, 1)
        return jnp.take(jnp.pad(v, pad), jnp.asarray(idx.reshape(-1)), axis=dim)

    def _convert(self, v, src: Layout, dst: Layout, shape, form: str | None = None):
        """Change layout outside any branch, with the collective form the plan chose."""
        if src == dst:
            return v
        idx = lax.axis_index(AXIS)
        if src.kind == "S" and dst.kind == "S" and src.dim != dst.dim:
            return self._all_to_all(v, src, dst, shape)
        if src.kind == "S" and dst.kind == "R" and form == "grouped":
            return lax.psum(self._convert(v, src, Layout("P"), shape), AXIS)  # masked psum
        if src.kind == "P" and dst.kind == "S" and form == "padded":
            g = self._geom(dst, shape)
            blocks = self._to_rows(v, g, dst.dim, shape[dst.dim])
            return lax.psum_scatter(blocks, AXIS, scatter_dimension=dst.dim, tiled=True)
        if src.kind == "S" and dst.kind != "P":  # padded all-gather, then drop the padding
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

    def _sum_together(self, keys, env) -> dict:
        """P -> R for several tensors in one psum per dtype (flattened, concatenated):
        a backend may run a combined all-reduce buffer by buffer (gloo pays its latency
        per buffer), so the gradients of a step are summed as one bucket."""
        by_dtype: dict = {}
        for key in keys:
            by_dtype.setdefault(jnp.dtype(env[key[0]][0].dtype), []).append(key)
        out = {}
        for group in by_dtype.values():
            if len(group) < 2:
                continue
            vals = [env[k[0]][0] for k in group]
            total = lax.psum(jnp.concatenate([v.reshape(-1) for v in vals]), AXIS)
            at = 0
            for k, v in zip(group, vals):
                out[k] = total[at:at + v.size].reshape(v.shape)
                at += v.size
        return out

    def _all_to_all(self, v, src: Layout, dst: Layout, shape):
        """S(a) -> S(b): padded all-to-all; each device sends block j of its rows to j."""
        gs, gd = self._geom(src, shape), self._geom(dst, shape)
        blocks = self._to_rows(v, gd, dst.dim, shape[dst.dim])       # b: k * M_dst
        moved = lax.all_to_all(blocks, AXIS, split_axis=dst.dim, concat_axis=src.dim,
                               tiled=True)                            # a: k * M_src
        return jnp.take(moved, jnp.asarray(gs.compact_index()), axis=src.dim)

    def _segments(self) -> list[list[int]]:
        """Group the ops into as few segments as the conversions allow.

        An op that needs a value made in the current segment converted must wait for a
        later segment, and so must every op reading its results; all other ops stay
        (the program is pure, so any topological order computes the same values).
        Conversions of values made earlier are hoisted before a segment, so each segment
        is one switch with every collective outside it. Few segments matter: a value
        leaving a segment is materialised (and padded), where inside one XLA fuses it
        (the loss's all-reduce no longer splits a step's forward from its backward)."""
        prog, plan = self.prog, self.plan
        segments, remaining = [], list(range(len(prog.eqns)))
        while remaining:
            current, made, waiting, later = [], set(), set(), []
            for op_id in remaining:
                eqn = prog.eqns[op_id]
                blocked = any(
                    isinstance(x, int) and (x in waiting or x in made and need is not None and
                                            Layout.parse(plan.tensor_layouts[x])
                                            != Layout.parse(need))
                    for x, need in zip(eqn.inputs, plan.op_inputs[op_id]))
                if blocked:
                    later.append(op_id)
                    waiting.update(eqn.outputs)
                else:
                    current.append(op_id)
                    made.update(eqn.outputs)
            segments.append(current)
            remaining = later
        return segments

    def _exports(self) -> list[list[int]]:
        """Per segment, the tensors it makes that a later segment or the output reads
        (only these leave its branch)."""
        prog = self.prog
        later = {o for o in prog.outputs if isinstance(o, int)}
        exports = []
        for seg in reversed(self.segments):
            made = [t for op_id in seg for t in prog.eqns[op_id].outputs]
            exports.append([t for t in made if t in later])
            later.update(x for op_id in seg for x in prog.eqns[op_id].inputs
                         if isinstance(x, int))
        return exports[::-1]

    def _run_segment(self, seg, ext, dev, exports):
        """Evaluate a segment's ops for the devices of `dev`'s group (None: full size).

        `ext` maps (tensor, layout) of operands made before the segment to stored values;
        returns the `exports`, S-layout ones padded back to their stored size."""
        prog, plan = self.prog, self.plan
        local = {}

        def fetch(x, need):
            if isinstance(x, Const):
                return x.value
            if x in local:
                return local[x]
            v = ext[(x, need)]
            if dev is not None and need.kind == "S":
                rows = Geometry.of(need, prog.avals[x].shape, self.units).rows[dev]
                v = lax.slice_in_dim(v, 0, rows, axis=need.dim)
            return v

        for op_id in seg:
            eqn = prog.eqns[op_id]
            needs = [None if n is None else Layout.parse(n) for n in plan.op_inputs[op_id]]
            vals = [fetch(x, n) for x, n in zip(eqn.inputs, needs)]
            out_lays = [Layout.parse(plan.tensor_layouts[t]) for t in eqn.outputs]
            params = eqn.params
            if plan.op_factors[op_id] >= 0 and dev is not None:
                shapes = []
                for lay, aval in zip(out_lays, eqn.out_avals):
                    shape = list(aval.shape)
                    if lay.kind == "S":
                        shape[lay.dim] = Geometry.of(lay, aval.shape, self.units).rows[dev]
                    shapes.append(shape)
                params = local_params(eqn, [np.shape(v) for v in vals], shapes)
            if eqn.primitive.name == "conv_general_dilated":
                outs = [_canonical_conv(eqn.primitive, vals, params)]
            else:
                outs = _jax.bind(eqn.primitive, vals, params)
                outs = list(outs) if eqn.primitive.multiple_results else [outs]
            if op_id in self.keep_dot:
                outs = list(lax.optimization_barrier(outs))
            local.update(zip(eqn.outputs, outs))
        result = []
        for t in exports:
            v, lay = local[t], Layout.parse(plan.tensor_layouts[t])
            if lay.kind == "S" and dev is not None:
                pad = [(0, 0)] * v.ndim
                pad[lay.dim] = (0, Geometry.of(lay, prog.avals[t].shape, self.units).pad
                                - v.shape[lay.dim])
                v = jnp.pad(v, pad)
            result.append(v)
        return result

    def _repeated(self, seg, exports, keys, dev, extra):
        """Branch function of `dev`'s group: the segment, then (emulating) its repeats."""
        def once(*a):
            return tuple(self._run_segment(seg, dict(zip(keys, a)), dev, exports))

        if extra is None:
            return once
        flag, count = extra

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
            return b, once(*b)

        inputs = {(t, lay) for t, lay in zip(self.prog.inputs, self.in_layouts)}
        entry = [k in inputs for k in keys]

        def repeated(*a):
            # the loop updates its operands in place; for the step's own (read-only)
            # inputs XLA would copy them before the branch, on every device, so this
            # branch makes its own copies of those
            b = tuple(v + zero(v) if e and numeric(v) else v for v, e in zip(a, entry))
            return lax.fori_loop(0, count - 1, again, (b, once(*b)))[1]

        # a device that does not repeat runs the plain segment: both branches compute
        # their results in place, so the fast device pays nothing for the knob
        return lambda *a: lax.cond(count > 1, repeated, once, *a)

    def _body(self, *flat):
        prog, plan = self.prog, self.plan
        extra = None
        if self.emulating:
            *flat, flag, counts = flat
            extra = (flag, counts[lax.axis_index(AXIS)])
        env = {}
        for t, v, lay in zip(prog.inputs, flat, self.in_layouts):
            env[t] = (v[0] if lay.kind == "P" else v, lay)
        for t, v in prog.consts.items():
            env[t] = (v, Layout("R"))
        converted = {}
        group = jnp.asarray(self.group_of)[lax.axis_index(AXIS)]
        for seg, exports in zip(self.segments, self.exports):
            made = {t for op_id in seg for t in prog.eqns[op_id].outputs}
            keys = []
            for op_id in seg:
                eqn = prog.eqns[op_id]
                for x, n in zip(eqn.inputs, plan.op_inputs[op_id]):
                    if isinstance(x, int) and x not in made:
                        keys.append((x, Layout.parse(n)))
            keys = list(dict.fromkeys(keys))
            converted.update(self._sum_together(
                [k for k in keys if k not in converted and k[1].kind == "R"
                 and env[k[0]][1].kind == "P"], env))
            for key in keys:
                if key not in converted:
                    v, lay = env[key[0]]
                    converted[key] = self._convert(v, lay, key[1], prog.avals[key[0]].shape,
                                                   self.forms.get((key[0], key[1])))
            args = [converted[k] for k in keys]
            sharded = any(plan.op_factors[o] >= 0 for o in seg) and len(self.group_rep) > 1
            if sharded:
                outs = lax.switch(group, [self._repeated(seg, exports, keys, d, extra)
                                          for d in self.group_rep], *args)
            else:
                outs = self._repeated(seg, exports, keys, self.group_rep[0], extra)(*args)
            for t, o in zip(exports, outs):
                env[t] = (o, Layout.parse(plan.tensor_layouts[t]))
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
    def shard(self, *args):
        """The arguments stored as this program reads them (`Sharded` leaves): feed a batch
        once per step with this and no resharding happens inside the call."""
        leaves, tree = jax.tree.flatten(args, is_leaf=lambda v: isinstance(v, Sharded))
        out = []
        for x, lay, t in zip(self._stored(leaves), self.in_layouts, self.prog.inputs):
            out.append(Sharded(x, _text(lay), self.prog.avals[t].shape,
                               self.units.get(lay.units) if lay.kind == "S" else None))
        return jax.tree.unflatten(tree, out)

    def load(self, load, *args):
        """Like `shard`, but every leaf given as a `jax.ShapeDtypeStruct` is read through
        `load(path, dim, start, stop)` (rows `start:stop` of dim `dim` of the leaf at
        pytree `path`), only for the devices of this process: with several processes each
        one loads just its own devices' rows of the batch."""
        flat, tree = jax.tree_util.tree_flatten_with_path(
            args, is_leaf=lambda v: isinstance(v, Sharded))
        if len(flat) != len(self.in_layouts):
            raise ValueError(f"expected {len(self.in_layouts)} array leaves, got {len(flat)}")
        out = []
        for (path, x), lay, t in zip(flat, self.in_layouts, self.prog.inputs):
            shape = self.prog.avals[t].shape
            if isinstance(x, jax.ShapeDtypeStruct):
                where = jax.tree_util.keystr(path)
                data = load_array(lambda d, a, b: load(where, d, a, b), lay, shape, x.dtype,
                                  self.units, self.mesh)
            else:
                data = self._store_one(x, lay)
            out.append(Sharded(data, _text(lay), shape,
                               self.units.get(lay.units) if lay.kind == "S" else None))
        return jax.tree.unflatten(tree, out)

    def _store_one(self, x, lay):
        if isinstance(x, Sharded):
            if Layout.parse(x.layout) == lay:
                return x.data
            x = unshard(x)
        return shard_array(x, lay, self.units, self.mesh)

    def _stored(self, leaves):
        if len(leaves) != len(self.in_layouts):
            raise ValueError(f"expected {len(self.in_layouts)} array leaves, got {len(leaves)}")
        return [self._store_one(x, lay) for x, lay in zip(leaves, self.in_layouts)]

    def __call__(self, *args):
        return self.run(jax.tree.flatten(args, is_leaf=lambda v: isinstance(v, Sharded))[0])

    def run(self, leaves):
        """One step on the flattened arguments (arrays or `Sharded`)."""
        stored = self._stored(leaves)
        if self.emulating:
            stored += self._extra
        outs = self._fn(*stored)
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
                wrapped.append(Sharded(o, _text(lay), aval.shape,
                                       self.units.get(lay.units) if lay.kind == "S" else None))
        return jax.tree.unflatten(self.prog.out_tree, wrapped)


def _canonical_conv(primitive, vals, params):
    """A convolution bound in the layout XLA's CPU library kernels take (batch, spatial,
    feature; spatial, in, out), with explicit transposes around it. Backward passes
    emit convolutions in other layouts; XLA's own partitioner canonicalises them, but
    inside a `shard_map` body they reach the naive loop emitter (measured 28x slower
    on vgg-small). Barriers keep XLA from folding the transposes back in."""
    dn = params["dimension_numbers"]
    lhs, rhs, out = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    n = len(lhs)
    nhwc = (0, n - 1, *range(1, n - 1))
    hwio = (n - 1, n - 2, *range(n - 2))
    if tuple(lhs) == nhwc and tuple(rhs) == hwio and tuple(out) == nhwc:
        return _jax.bind(primitive, vals, params)
    x = jnp.transpose(vals[0], (lhs[0], *lhs[2:], lhs[1]))
    w = jnp.transpose(vals[1], (*rhs[2:], rhs[1], rhs[0]))
    x, w = lax.optimization_barrier((x, w))
    y = _jax.bind(primitive, [x, w], {**params, "dimension_numbers": type(dn)(
        lhs_spec=nhwc, rhs_spec=hwio, out_spec=nhwc)})
    y = lax.optimization_barrier(y)
    axes = [0] * n
    axes[out[0]], axes[out[1]] = 0, n - 1
    for i, d in enumerate(out[2:]):
        axes[d] = 1 + i
    return jnp.transpose(y, axes)


def _text(lay: Layout) -> str:
    return f"S{lay.dim}/{lay.units}" if lay.kind == "S" else lay.kind
