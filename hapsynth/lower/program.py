"""`Lowered`: a plan bound to a traced program and a 1-D mesh of the cluster's devices.

The plan becomes one `jax.jit(shard_map(...))` program, interpreted eqn by eqn:
- an operand is first converted to the layout its op needs, with collectives *outside*
  any branch (divergent branches holding collectives would deadlock; collectives.py);
- ops are grouped into as few *segments* as the conversions allow (schedule.py);
- a segment with a sharded op runs in a `lax.switch` on the device's group (devices
  with equal shard sizes), each branch at its group's static sizes (branches.py), with
  two XLA CPU slow paths avoided (cpu.py);
- partial sums converted together (a step's gradients) are summed as one flat bucket.
An even plan is plain `jax.jit` with `NamedSharding`s instead (gspmd.py). A `BranchHook`
(hook.py) lets a measurement harness wrap every branch; it is never part of a plan.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from hapsynth.ir.layout import R, Layout
from hapsynth.ir.trace import Const, Program
from hapsynth.lower import branches, collectives, cpu, schedule
from hapsynth.lower import gspmd as _gspmd
from hapsynth.lower.devices import plan_devices
from hapsynth.lower.hook import BranchHook
from hapsynth.lower.values import AXIS, Sharded, load_array, shard_array, spec, unshard
from hapsynth.synth.plan import Plan

__all__ = ["Lowered"]


class Lowered:
    """A plan bound to a traced program and a mesh; call it with global or Sharded args."""

    def __init__(self, prog: Program, plan: Plan, devices, *, gspmd: bool = True,
                 donate=(), branch_hook: BranchHook | None = None, loop_form: str = "body"):
        """`donate`: flat input leaves whose stored buffers the step may reuse (as
        `jax.jit`'s donate_argnums, per leaf); a donated `Sharded` input is deleted.
        `gspmd=False` forces the `shard_map` program on an even plan. `branch_hook`:
        measurement harnesses only (hook.py); the program is then always `shard_map`.
        `loop_form`: "body" runs every loop as a scan whose body switches per segment;
        "branch" runs a loop whose body needs no collective as one switch whose branches
        scan (benchmarks/loops.py measures both; `branch_loops`: the loops that took it)."""
        if loop_form not in ("branch", "body"):
            raise ValueError(f"loop_form must be 'branch' or 'body', got {loop_form!r}")
        self.loop_form, self.branch_loops = loop_form, set()
        self.prog, self.plan = prog, plan
        donate = tuple(sorted(set(donate)))
        devices = plan_devices(plan, devices)
        self.mesh = Mesh(np.asarray(devices), (AXIS,))
        self.k = len(devices)
        self.hook = branch_hook
        self.units = {int(u): tuple(v) for u, v in plan.shard_units.items()}
        self.group_of, self.group_rep = branches.groups(self.units, self.k)
        self.in_layouts, self.out_layouts = self._boundary_layouts()
        self.items, self.exports = schedule.schedule(prog.eqns, plan.op_inputs,
                                                     plan.tensor_layouts, prog.loops, prog.outputs)
        self._eval = branches.Segments(prog, plan, self.units, frozenset(cpu.keep_dot(prog.eqns)))
        self.forms = self._forms()
        self.ahead = self._gathered_state()
        self.stored_ids = {t for t, _ in self.ahead}
        self.issued_ahead: list = []  # (tensor, layout) converted ahead, as traced
        self.mode = "gspmd" if gspmd and branch_hook is None and _gspmd.is_even(
            plan, self.units, (*self.in_layouts, *self.out_layouts)) else "shard_map"
        if self.mode == "gspmd":
            self._fn = jax.jit(
                _gspmd.body(prog, plan, self.mesh),
                in_shardings=tuple(_gspmd.named(self.mesh, l) for l in self.in_layouts),
                out_shardings=tuple(_gspmd.named(self.mesh, l) for l in self.out_layouts),
                donate_argnums=donate)
            return
        in_specs = tuple(spec(l, 0) for l in self.in_layouts)
        if branch_hook is not None:
            in_specs += tuple(spec(R, 0) for _ in branch_hook.inputs(self.mesh))
        out_specs = tuple(spec(l, 0) for l in self.out_layouts)
        self._fn = jax.jit(jax.shard_map(self._body, mesh=self.mesh, in_specs=in_specs,
                                         out_specs=out_specs, check_vma=False),
                           donate_argnums=donate)

    # -- interpreting the plan -------------------------------------------------------
    def _boundary_layouts(self) -> tuple[list[Layout], list[Layout]]:
        """Layouts of the step's inputs and outputs: state arrives as its update left it
        (and leaves that way); data in the one layout its readers need (each device then
        receives only its rows), else whole; other outputs whole."""
        prog, plan = self.prog, self.plan
        n_state, outs = plan.state_leaves, prog.outputs
        needs: dict[int, set] = {}
        for op_id, eqn in enumerate(prog.eqns):
            for x, n in zip(eqn.inputs, plan.op_inputs[op_id]):
                if isinstance(x, int) and n is not None:
                    needs.setdefault(x, set()).add(n)
        ins = [plan.tensor_layouts[outs[i]] if i < n_state and isinstance(outs[i], int)
               else next(iter(needs[t])) if len(needs.get(t, ())) == 1
               and next(iter(needs[t])).sharded else R
               for i, t in enumerate(prog.inputs)]
        out = [plan.tensor_layouts[o] if i < n_state and isinstance(o, int) else R
               for i, o in enumerate(outs)]
        return ins, out

    def _gathered_state(self) -> list:
        """The stored state (or checkpointing's copy of it) converted by a collective for
        its readers outside loops, as (tensor, layout), in the order segments first read
        them: each is gathered one ahead, while the previous one's reader runs (as
        `timing.py` prices it)."""
        stored = {t: lay for t, lay in zip(self.prog.inputs[:self.plan.state_leaves],
                                           self.in_layouts) if lay.kind == "S"}
        for e in self.prog.eqns:  # checkpointing's copies of it (`ir/checkpoint.py`)
            if getattr(e.primitive, "name", e.primitive) == "optimization_barrier":
                for x, y in zip(e.inputs, e.outputs):
                    if x in stored and self.plan.tensor_layouts[y].kind == "S":
                        stored[y] = self.plan.tensor_layouts[y]
        keys = [key for item in self.items if not isinstance(item, schedule.LoopSchedule)
                for key in schedule.operands(self.prog.eqns, self.plan.op_inputs, item)
                if key[0] in stored and key[1] != stored[key[0]]]
        return list(dict.fromkeys(keys))

    def _forms(self) -> dict:
        """The collective form the plan priced, per (tensor, target layout); a state
        input is converted like its update."""
        forms = {(c.tensor, c.dst): c.form for c in self.plan.conversions}
        for i in range(self.plan.state_leaves):
            out = self.prog.outputs[i]
            for (t, dst), form in list(forms.items()):
                if t == out:
                    forms[(self.prog.inputs[i], dst)] = form
        return forms

    # -- the shard_map body ----------------------------------------------------------
    @property
    def segments(self) -> list[list[int]]:
        """Every segment, a loop body's included (each one `lax.switch`)."""
        out = []
        for item in self.items:
            out += item.segments if isinstance(item, schedule.LoopSchedule) else [item]
        return out

    def _body(self, *flat):
        prog = self.prog
        n = len(prog.inputs)
        flat, extra = flat[:n], tuple(flat[n:])  # extra: the branch hook's inputs
        env = {}
        for t, v, lay in zip(prog.inputs, flat, self.in_layouts):
            env[t] = (v[0] if lay.kind == "P" else v, lay)
        for t, v in prog.consts.items():
            env[t] = (v, R)
        run = _Run(self, env, {}, jnp.asarray(self.group_of)[lax.axis_index(AXIS)], extra,
                   set(zip(prog.inputs, self.in_layouts)), self.ahead)
        if self.ahead and self.ahead[0][0] in env:
            run.convert(self.ahead[:1])  # the first gather of stored state, at once
        for item, exports in zip(self.items, self.exports):
            if isinstance(item, schedule.LoopSchedule):
                run.loop(item)
            else:
                run.segment(item, exports)
        results = []
        for o, want, aval in zip(prog.outputs, self.out_layouts, self._out_avals()):
            if isinstance(o, Const):
                v, lay = jnp.asarray(o.value), R
            else:
                v, lay = env[o]
            v = collectives.convert(v, lay, want, aval.shape, self.units)
            results.append(v[None] if want.kind == "P" else v)
        return tuple(results)

    def _out_avals(self):
        return [self.prog.avals[o] if isinstance(o, int) else o.aval for o in self.prog.outputs]

    # -- running it ------------------------------------------------------------------
    def shard(self, *args):
        """The arguments stored as this program reads them (`Sharded` leaves): feed a batch
        once per step with this and no resharding happens inside the call."""
        leaves, tree = jax.tree.flatten(args, is_leaf=lambda v: isinstance(v, Sharded))
        out = []
        for x, lay, t in zip(self._stored(leaves), self.in_layouts, self.prog.inputs):
            out.append(Sharded(x, lay, self.prog.avals[t].shape, self._units_of(lay)))
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
        views = self.prog.input_views or [None] * len(flat)
        for (path, x), lay, t, view in zip(flat, self.in_layouts, self.prog.inputs, views):
            shape = self.prog.avals[t].shape
            if isinstance(x, jax.ShapeDtypeStruct) and view is not None:
                # fed split into microbatches: each device's rows are strided in the
                # leaf as given, so the leaf is read whole, then split and spread
                whole = np.asarray(load(jax.tree_util.keystr(path), 0, 0, x.shape[0]), x.dtype)
                data = self._store_one(whole, lay, view)
            elif isinstance(x, jax.ShapeDtypeStruct):
                where = jax.tree_util.keystr(path)
                data = load_array(lambda d, a, b: load(where, d, a, b), lay, shape, x.dtype,
                                  self.units, self.mesh)
            else:
                data = self._store_one(x, lay, view)
            out.append(Sharded(data, lay, shape, self._units_of(lay)))
        return jax.tree.unflatten(tree, out)

    def _units_of(self, lay: Layout):
        return self.units.get(lay.units) if lay.kind == "S" else None

    def _store_one(self, x, lay, view=None):
        """A leaf as the program reads it; `view`: the (shape, batch dim) a data argument
        is fed in (`ir.views`), for a global array given in its own shape."""
        if isinstance(x, Sharded):
            if x.layout == lay:
                return x.data
            x = unshard(x)
        if view is not None and tuple(x.shape) != view[0]:
            x = jnp.reshape(x, view[0])
        return shard_array(x, lay, self.units, self.mesh)

    def _stored(self, leaves):
        if len(leaves) != len(self.in_layouts):
            raise ValueError(f"expected {len(self.in_layouts)} array leaves, got {len(leaves)}")
        views = self.prog.input_views or [None] * len(leaves)
        return [self._store_one(x, lay, v) for x, lay, v in zip(leaves, self.in_layouts, views)]

    def __call__(self, *args):
        return self.run(jax.tree.flatten(args, is_leaf=lambda v: isinstance(v, Sharded))[0])

    def run(self, leaves):
        """One step on the flattened arguments (arrays or `Sharded`)."""
        stored = self._stored(leaves)
        if self.hook is not None:
            stored += self.hook.inputs(self.mesh)
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
                wrapped.append(Sharded(o, lay, aval.shape, self._units_of(lay)))
        return jax.tree.unflatten(self.prog.out_tree, wrapped)


class _Run:
    """One trace of the shard_map body: `env` holds every value made so far with its
    layout, `converted` every value converted for a reader, by (tensor, layout)."""

    def __init__(self, low: Lowered, env: dict, converted: dict, group, extra, entry_keys,
                 ahead=()):
        self.low, self.env, self.converted = low, env, converted
        self.group, self.extra, self.entry_keys = group, extra, entry_keys
        self.ahead = list(ahead)  # stored state to gather one ahead (`Lowered._gathered_state`)

    def convert(self, keys) -> None:
        """Convert what `keys` ((tensor, layout) pairs) name, outside any branch; partial
        sums going whole are summed as one flat bucket."""
        low, env, converted = self.low, self.env, self.converted
        converted.update(collectives.sum_together(
            [k for k in keys if k not in converted and k[1].kind == "R"
             and env[k[0]][1].kind == "P"], env))
        for key in keys:
            if key not in converted:
                v, lay = env[key[0]]
                converted[key] = collectives.convert(
                    v, lay, key[1], low.prog.avals[key[0]].shape, low.units,
                    low.forms.get((key[0], key[1])))

    def segment(self, seg, exports) -> None:
        low, plan = self.low, self.low.plan
        keys = schedule.operands(low.prog.eqns, plan.op_inputs, seg)
        self.convert(keys)
        while self.ahead and self.ahead[0] in self.converted:
            self.ahead.pop(0)
        if self.ahead and self.ahead[0][0] in self.env and any(
                k[0] in low.stored_ids for k in keys):
            self.convert(self.ahead[:1])  # the next one, while this segment runs
            low.issued_ahead.append(self.ahead[0])
        sharded = any(plan.op_factors[o] >= 0 for o in seg) and len(low.group_rep) > 1
        fns = [low._eval.branch(seg, keys, exports, d)
               for d in (low.group_rep if sharded else low.group_rep[:1])]
        if low.hook is not None:
            entry = tuple(k in self.entry_keys for k in keys)
            fns = [low.hook.wrap(f, entry, self.extra) for f in fns]
        outs = branches.switch(self.group, fns, [self.converted[k] for k in keys])
        for t, o in zip(exports, outs):
            self.env[t] = (o, plan.tensor_layouts[t])

    def loop(self, item: schedule.LoopSchedule) -> None:
        """A loop region as one `lax.scan`: what it reads from before is converted first
        (loop-invariant); each iteration runs the body's segments, converting between
        them, and returns its carries in their planned layouts and its stacked values."""
        low, plan, eqns = self.low, self.low.plan, self.low.prog.eqns
        lp = item.loop
        self.convert(schedule.operands(eqns, plan.op_inputs, range(lp.start, lp.end)))
        carries, slices, stacks = ([eqns[i] for i in ids] for ids in (lp.carries, lp.slices, lp.stacks))
        keep = [plan.op_inputs[c] for c in lp.carries]  # (init, carry_out) layouts: equal
        init = [self.value(c.inputs[0], need[0]) for c, need in zip(carries, keep)]
        xs = [self.value(e.inputs[0], plan.op_inputs[i][0]) for e, i in zip(slices, lp.slices)]
        outer_env, outer_converted = self.env, self.converted
        # a stacked partial sum the plan all-reduces after the loop is all-reduced slice by
        # slice in it instead, as soon as each is made (priced so: overlapping the loop)
        summed = [i for i, s in enumerate(lp.stacks)
                  if plan.tensor_layouts[eqns[s].outputs[0]].kind == "P"
                  and (eqns[s].outputs[0], R) in low.forms]
        if low.loop_form == "branch" and not summed and self.scan_in_branches(item, init, xs):
            return

        def body(carry, x):
            env = dict(outer_env)
            env.update((c.outputs[0], (v, plan.tensor_layouts[c.outputs[0]]))
                       for c, v in zip(carries, carry))
            env.update((e.outputs[0], (v, plan.tensor_layouts[e.outputs[0]]))
                       for e, v in zip(slices, x))
            inner = _Run(low, env, dict(outer_converted), self.group, self.extra, self.entry_keys)
            for seg, exports in zip(item.segments, item.exports):
                inner.segment(seg, exports)
            new = [inner.value(c.inputs[1], need[1]) for c, need in zip(carries, keep)]
            ys = [inner.value(e.inputs[0], plan.op_inputs[i][0]) for e, i in zip(stacks, lp.stacks)]
            inner.convert([(stacks[i].inputs[0], R) for i in summed])
            for i in summed:
                ys[i] = inner.converted[(stacks[i].inputs[0], R)]
            return new, ys

        final, ys = lax.scan(body, init, xs, length=lp.length, reverse=lp.reverse)
        for c, v, need in zip(carries, final, keep):
            self.env[c.inputs[1]] = (v, need[1])
        for i, (e, v) in enumerate(zip(stacks, ys)):
            self.env[e.outputs[0]] = (v, R if i in summed else plan.tensor_layouts[e.outputs[0]])

    def scan_in_branches(self, item: schedule.LoopSchedule, init, xs) -> bool:
        """A loop whose body is one segment with no conversion in it, run as one switch
        whose branches each scan at their group's sizes: carries stay cut to the group's
        rows through the loop and a device picks its branch once, not once per iteration.
        False (nothing done) when the body needs a collective or its layouts change."""
        low, plan, eqns, avals = self.low, self.low.plan, self.low.prog.eqns, self.low.prog.avals
        lp, lays = item.loop, plan.tensor_layouts
        if len(item.segments) != 1:
            return False
        seg = item.segments[0]
        carries, slices, stacks = ([eqns[i] for i in ids] for ids in (lp.carries, lp.slices, lp.stacks))
        ends = [c.inputs[1] for c in carries] + [e.inputs[0] for e in stacks]
        needs = [plan.op_inputs[c][1] for c in lp.carries] + [plan.op_inputs[s][0] for s in lp.stacks]
        made = {t for o in seg for t in eqns[o].outputs}
        inner = {c.outputs[0] for c in carries} | {e.outputs[0] for e in slices}
        keys = schedule.operands(eqns, plan.op_inputs, seg)
        if (any(t in made | inner and lays[t] != n for t, n in zip(ends, needs))
                or any(t in inner and lays[t] != n for t, n in keys)
                or any(lays[c.outputs[0]] != plan.op_inputs[i][0] for c, i in zip(carries, lp.carries))
                or not all(_stacked(lays[e.outputs[0]], plan.op_inputs[i][0])
                           for e, i in zip(slices, lp.slices))
                or not all(_stacked(n, lays[e.outputs[0]]) for e, n in zip(stacks, needs[len(carries):]))):
            return False
        # an end the segment does not make passes through: a carry or slice read as it
        # came in, or a value from before the loop (taken in its needed layout)
        outer = [k for k in keys if k[0] not in inner]
        outer += [k for k in zip(ends, needs) if k[0] not in made | inner and k not in outer]
        made_ends = [t for t in ends if t in made]
        arg_keys = ([(c.inputs[0], plan.op_inputs[i][0]) for c, i in zip(carries, lp.carries)]
                    + [(e.inputs[0], plan.op_inputs[i][0]) for e, i in zip(slices, lp.slices)] + outer)
        n_c, n_x, ev = len(carries), len(slices), low._eval

        def branch(dev):
            # carries and loop-invariant operands are cut to the group's rows once; each
            # iteration's slice is cut, and its stacked values padded, in the body (a
            # stacked value cut or padded whole would be copied whole)
            def run(*args):
                cut = [v if i in range(n_c, n_c + n_x) else ev.cut(v, k[1], avals[k[0]].shape, dev)
                       for i, (v, k) in enumerate(zip(args, arg_keys))]
                base = dict(zip(outer, cut[n_c + n_x:]))

                def body(carry, x):
                    ext = dict(base)
                    ext.update(((c.outputs[0], lays[c.outputs[0]]), v) for c, v in zip(carries, carry))
                    ext.update(((t, lays[t]), ev.cut(v, lays[t], avals[t].shape, dev))
                               for t, v in zip((e.outputs[0] for e in slices), x))
                    ext.update(zip(((t, lays[t]) for t in made_ends),
                                   ev.run(seg, ext, dev, made_ends, pad=False)))
                    res = [ext[(t, n)] for t, n in zip(ends, needs)]
                    return res[:n_c], [ev.pad(v, n, avals[t].shape)
                                       for v, t, n in zip(res[n_c:], ends[n_c:], needs[n_c:])]

                final, ys = lax.scan(body, cut[:n_c], cut[n_c:n_c + n_x], length=lp.length,
                                     reverse=lp.reverse)
                final = [ev.pad(v, n, avals[c.inputs[1]].shape) for v, n, c in zip(final, needs, carries)]
                return (*final, *ys)
            return run

        sharded = any(plan.op_factors[o] >= 0 for o in seg) and len(low.group_rep) > 1
        fns = [branch(d) for d in (low.group_rep if sharded else low.group_rep[:1])]
        if low.hook is not None:
            entry = tuple(k in self.entry_keys for k in arg_keys)
            fns = [low.hook.wrap(f, entry, self.extra) for f in fns]
        args = [*init, *xs, *(self.value(*k) for k in outer)]
        outs = branches.switch(self.group, fns, args)
        low.branch_loops.add(lp.start)
        for c, v, n in zip(carries, outs[:n_c], needs):
            self.env[c.inputs[1]] = (v, n)
        for e, v in zip(stacks, outs[n_c:]):
            self.env[e.outputs[0]] = (v, lays[e.outputs[0]])
        return True

    def value(self, x, need):
        """Operand `x` in layout `need` (converting it here if it is not yet)."""
        if isinstance(x, Const):
            return jnp.asarray(x.value, x.aval.dtype)
        if (x, need) not in self.converted:
            self.convert([(x, need)])
        return self.converted[(x, need)]


def _stacked(one: Layout, stacked: Layout) -> bool:
    """Whether `stacked` (a loop's stacked value) splits like `one` (an iteration's)."""
    if one.kind != stacked.kind:
        return False
    return one.kind != "S" or (stacked.dim == one.dim + 1 and stacked.units == one.units)
