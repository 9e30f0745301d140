"""`Pipelined`: a pipeline plan as one `jax.jit(shard_map(...))` over a (stage, data) mesh.

The technique the design validated: each stage's state sits in one flat buffer per
dtype and device (global `[stages, pad]`, spec `P("stage", None)`), so a device stores
only its stage (`stagestate.py`). The step is a static table of ticks
(`synth.lockstep.ticks`), run as one `fori_loop` whose body is the same at every tick, so
the program does not grow with the microbatches; what differs per tick is data
(`synth/slots.py`, laid out with the buffers in `ticklayout.py`). At each tick every
device runs its stage's work in a `lax.switch` on its group (stage and row count: a
stage mixing classes holds uneven rows) and phase (forward, backward, idle)
(`tickloop.py`, `tickwork.py`); values cross stages by `ppermute` outside the switch, one
wire per shift between stages (`wires.py`), either after the work that made them or (the
plan's `delay` 1) during the next tick's work, which they do not depend on (there a shift
and its opposite cross in one `ppermute` where no stage sends on both,
`synth.slots.wire_rounds`: two stages' forwards and backwards use both directions of their
link at once), and wait in the receiver's mailbox (a slot per message in flight) until
read.
What a forward keeps for its backward goes into a pool of slots that every step
receives and returns (donated), a slot reused once the backward reading it has run.
The pool is updated in place by the forward that keeps (inside the `cond` only that
kind of work takes, the pool its one operand: a second reference, a closure reading it,
made XLA copy it whole every tick); mailboxes are written outside the switch, one slot
a tick; XLA copies neither per tick. Per microbatch a stage runs its forward ops (or
its backward ops) at its rows and adds its partial sums (gradients, loss) into
accumulators (float32 for narrower floats, cast back once summed: `slots.sum_dtype`);
after the last tick these are summed over the stage's devices (`psum` on "data") and
the stages run their remaining ops once (the optimizer), in rounds where a value made
on one stage is read on another (a global norm, a tied embedding's gradient;
`finish.py`); each new state leaf is written over its place in the stage's buffer as
soon as it is made (`Packing.pack(into=)`: a concatenation padded to the largest stage
ran far below memory speed on XLA CPU). The backward's sums are the operands of a cond
of their own (passed through the other kinds of work, XLA copied them whole every tick),
one buffer per value (`Packing(apart=True)`: each stage's largest gradient of a dtype
in the first, and so on), so a backward adds each gradient where it lies (packed by a
concatenation, the MLP's 58.6M floats took XLA's CPU backend seconds per backward).
A stage's large state leaves have buffers of their own too
(`Packing(apart=synth.slots.APART_BYTES)`), read and written whole.
Ops of no stage (reading only data and constants, or only state) are computed where
they are read.
"""
from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from hapsynth.ir.trace import Const, Program
from hapsynth.lower import cpu
from hapsynth.lower.finish import Finish
from hapsynth.lower.place import DATA, STAGE, Place
from hapsynth.lower.rounds import post_rounds
from hapsynth.lower.stagestate import pack_state, stage_leaves, staged
from hapsynth.lower.ticklayout import tick_layout
from hapsynth.lower.tickloop import tick_loop
from hapsynth.lower.values import Sharded, Staged, plain
from hapsynth.lower.wires import send_once
from hapsynth.lower.wiring import StageWiring
from hapsynth.synth.plan import Plan
from hapsynth.synth.slots import APART_BYTES

__all__ = ["Pipelined", "Staged"]


#: XLA's CPU scheduler that runs independent ops side by side gives every permute one
#: rendezvous key; in a pipelined program over several CPU devices of one process it let
#: devices meet at different permutes (a failed check in the rendezvous, a hang, or wrong
#: values: the bf16 step of `tests/elsewhere` over two stages, at most runs). Passed to
#: `jax.jit` as a compiler option it did not help; set in XLA_FLAGS it did (4 of 4 runs).
CPU_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


class Pipelined(StageWiring):
    """A pipeline plan bound to a traced program and the cluster's devices. Where its
    values lie is `self.layout` (`TickLayout`), whose fields read as its own too
    (`low.keep_sizes`, `low.tables`)."""

    def __init__(self, prog: Program, plan: Plan, devices, *, donate=(), branch_hook=None):
        """`branch_hook`: measurement harnesses only (`hook.py`): every branch a device
        runs (each tick's work, each round of once-per-step ops) is `hook.wrap`ped."""
        self.hook = branch_hook
        super().__init__(prog, plan)
        sizes = {len(st["devices"]) for st in plan.stages}
        if len(sizes) != 1:
            raise NotImplementedError(
                f"pipeline stages of unequal device counts ({[len(s['devices']) for s in plan.stages]}): "
                "the (stage, data) mesh needs equal stages")
        self.D = sizes.pop()
        local = [d for st in plan.stages for d in st["devices"]
                 if devices[d].process_index == jax.process_index()]
        if devices[0].platform == "cpu" and len(local) > 1 and \
                CPU_FLAG not in os.environ.get("XLA_FLAGS", ""):
            warnings.warn(f"a pipelined program on {len(local)} CPU devices of one process: "
                          f"XLA's CPU runtime may run its permutes out of order (a failed "
                          f"check in its rendezvous, a hang, wrong values); set XLA_FLAGS="
                          f"{CPU_FLAG} before JAX starts", RuntimeWarning, stacklevel=3)
        self.mesh = Mesh(np.array([[devices[d] for d in st["devices"]] for st in plan.stages]),
                         (STAGE, DATA))
        self.layout = tick_layout(self, self.D, APART_BYTES)
        ns, nk = len(self.layout.state_order), len(self.layout.keep_sizes)
        own = PS((STAGE, DATA), None)  # each device's own pool of keep buffers
        state = tuple(PS(STAGE, None) for _ in range(ns)) + (own,) * nk
        in_specs = state + tuple(PS() for _ in prog.inputs[self.nstate:])
        if branch_hook is not None:
            in_specs += tuple(PS() for _ in branch_hook.inputs(self.mesh))
        out_specs = state + tuple(PS() for _ in prog.outputs[self.nstate:])
        self._scratch = None
        self._fn = jax.jit(jax.shard_map(self._body, mesh=self.mesh, in_specs=in_specs,
                                         out_specs=out_specs, check_vma=False),
                           # the state's buffers hold every leaf: given up only when all are
                           donate_argnums=tuple(range(0 if self.nstate and set(
                               range(self.leaves)) <= set(donate) else ns, ns + nk)))

    def __getattr__(self, name):
        """A field of `self.layout` (only reached where no attribute of that name is)."""
        layout = self.__dict__.get("layout")
        if layout is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(layout, name)

    def _row_start(self, s, micro):
        return micro * self.mb + jnp.asarray(self._offsets(s))[lax.axis_index(DATA)]

    def _senders(self, d) -> tuple:
        """Per tick, which pattern of stages sends on shift `d` (`TickLayout.senders`)."""
        return self.layout.senders[d]

    # -- the shard_map body ------------------------------------------------------------------
    def _body(self, *flat):
        """One device's step: (its stage's state buffers, its keep pool, the data, the
        hook's inputs) -> (the new state buffers, the pool, the outputs)."""
        prog, lay, S = self.prog, self.layout, self.S
        ns, nk = len(lay.state_order), len(lay.keep_sizes)
        n_data = len(prog.inputs) - self.nstate
        state = tuple(b[0] for b in flat[:ns])
        pool = tuple(flat[ns:ns + nk])  # per dtype: [slots, size]
        data = dict(zip(prog.inputs[self.nstate:], flat[ns + nk:ns + nk + n_data]))
        raw = set(data)
        for i in self.data_ops:  # made from the whole batch, on every device
            eqn = prog.eqns[i]
            vals = [x.value if isinstance(x, Const) else data[x] for x in eqn.inputs]
            data.update(zip(eqn.outputs, cpu.bind(eqn.primitive, vals, eqn.params)))
        place = self._place(tuple(flat[ns + nk + n_data:]))
        copies = self._copies(place.stage, state)
        ctx = {"state": list(state), "copies": [[list(r.bufs) for r in copies.get(s, [])]
                                                for s in range(S)]}
        acc, pool = tick_loop(self, lay, place, [stage_leaves(prog, lay, s, ctx, copies)
                                                 for s in range(S)], data, pool)
        if self.D > 1:  # (over one device XLA still runs it, copying every sum)
            acc = {ph: tuple(lax.psum(a, DATA) for a in bufs) for ph, bufs in acc.items()}
        ctx = {**ctx, "data": [data[t] for t in self.data]}
        out = Finish(self, lay, place, copies, raw, post_rounds(self))(ctx, acc)
        # the keep buffers as the last tick left them, for the next step
        return (*out[:ns], *pool, *out[ns:])

    def _place(self, extra) -> Place:
        sidx, didx = lax.axis_index(STAGE), lax.axis_index(DATA)
        group = jnp.asarray(self.layout.group_of)[sidx, didx]
        index = jnp.asarray([st["devices"] for st in self.plan.stages])[sidx, didx]
        return Place(sidx, group, index, self.hook, extra)

    def _copies(self, sidx, state) -> dict:
        """The parameters a stage reads but another stores, sent once: stage -> [Ref]."""
        lay, wants = self.layout, {}
        for s in range(self.S):
            for p in self.copies[s]:
                wants.setdefault((self.owner[p], s), []).append(("leaf", p))
        return send_once(self.prog, self.S, sidx, wants, lambda s, _: {
            ("leaf", p): v for p, v in lay.state_packing[s].unpack(state, lay.state_order).items()})

    # -- running it ----------------------------------------------------------------------
    def _staged(self, bufs) -> list:
        return self._state(staged(self.layout, bufs, self.owner[:self.nstate], self))

    def shard(self, *args):
        """The arguments stored as this program reads them: state as `Staged` leaves of
        the per-stage buffers, data on every device."""
        leaves, tree = jax.tree.flatten(args, is_leaf=lambda v: isinstance(v, (Sharded, Staged)))
        leaves = self._inputs(leaves, plain)
        state = pack_state(self.layout, self.mesh, self, leaves, self.nstate)
        rep = NamedSharding(self.mesh, PS())
        data = [jax.device_put(jnp.asarray(x), rep) for x in leaves[self.nstate:]]
        return jax.tree.unflatten(tree, self._staged(dict(zip(self.layout.state_order, state)))
                                  + data)

    def _arguments(self, leaves) -> list:
        """The program's arguments for one step on the flattened arguments."""
        leaves = self._inputs(leaves, plain)
        state = pack_state(self.layout, self.mesh, self, leaves, self.nstate)
        rep = NamedSharding(self.mesh, PS())
        data = [jax.device_put(jnp.asarray(x), rep) for x in leaves[self.nstate:]]
        extra = self.hook.inputs(self.mesh) if self.hook is not None else ()
        if self._scratch is None:
            own = NamedSharding(self.mesh, PS((STAGE, DATA), None))
            slots = self.layout.keep_buffers
            self._scratch = [jax.device_put(np.zeros((self.mesh.devices.size * slots, n), k), own)
                             for k, n in self.layout.keep_sizes.items()]
        return [*state, *self._scratch, *data, *extra]

    def compile(self, *args):
        """The step compiled for these arguments (`jax.stages.Compiled`: its
        `memory_analysis()` gives each device's bytes, the same on every device)."""
        return self._fn.lower(*self._arguments(jax.tree.flatten(
            args, is_leaf=lambda v: isinstance(v, (Sharded, Staged)))[0])).compile()

    def run(self, leaves):
        """One step on the flattened arguments; state comes back as `Staged` leaves."""
        outs = self._fn(*self._arguments(leaves))
        if self.mesh.devices.flat[0].platform == "cpu":
            jax.block_until_ready(outs)
        ns, nk = len(self.layout.state_order), len(self._scratch)
        self._scratch = list(outs[ns:ns + nk])
        outs = outs[:ns] + outs[ns + nk:]
        bufs = dict(zip(self.layout.state_order, outs[:ns]))
        return jax.tree.unflatten(self.prog.out_tree, self._staged(bufs) + list(outs[ns:]))

    def __call__(self, *args):
        return self.run(jax.tree.flatten(args, is_leaf=lambda v: isinstance(v, (Sharded, Staged)))[0])
