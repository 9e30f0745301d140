"""`Pipelined`: a pipeline plan as one `jax.jit(shard_map(...))` over a (stage, data) mesh.

The technique the design validated: each stage's state sits in one flat buffer per
dtype and device (global `[stages, pad]`, spec `P("stage", None)`), so a device stores
only its stage. The step is a static table of ticks (`synth.pipeline.ticks`), run as
one `fori_loop` whose body is the same at every tick, so the program does not grow with
the microbatches; what differs per tick is data (`synth/slots.py`). At each tick every
device runs its stage's work in a `lax.switch` on its group (stage and row count: a
stage mixing classes holds uneven rows) and phase (forward, backward, idle); values
cross stages by `ppermute` outside the switch, one wire per shift between stages,
either after the work that made them or (the plan's `delay` 1) during the next tick's
work, which they do not depend on (there a shift and its opposite cross in one
`ppermute` where no stage sends on both, `synth.slots.wire_rounds`: two stages' forwards
and backwards use both directions of their link at once), and wait in the receiver's
mailbox (a slot per message in flight) until read.
What a forward keeps for its backward goes into a pool of slots that every step
receives and returns (donated), a slot reused once the backward reading it has run.
The pool is updated in place by the forward that keeps (inside the `cond` only that
kind of work takes, the pool its one operand: a second reference, a closure reading it,
made XLA copy it whole every tick); mailboxes are written outside the switch, one slot
a tick (`_store`); XLA copies neither per tick. Per microbatch a stage runs its forward ops (or
its backward ops) at its rows and adds its partial sums (gradients, loss) into
accumulators (float32 for narrower floats, cast back once summed: `slots.sum_dtype`);
after the last tick these are summed over the stage's devices (`psum` on "data") and
the stages run their remaining ops once (the optimizer), in rounds where a value made
on one stage is read on another (a global norm, a tied embedding's
gradient); each new state leaf is written over its place in the stage's buffer as soon
as it is made (`Packing.pack(into=)`: a concatenation padded to the largest stage ran far
below memory speed on XLA CPU). The backward's sums are the operands of a cond of
their own (passed through the other kinds of work, XLA copied them whole every tick),
one buffer per value (`Packing(apart=True)`: each stage's largest gradient of a dtype
in the first, and so on), so a backward adds each gradient where it lies (packed by a
concatenation, the MLP's 58.6M floats took XLA's CPU backend seconds per backward).
A stage's large state leaves have buffers of their own too
(`Packing(apart=synth.slots.APART_BYTES)`), read and written whole.
Ops of no stage (reading only data and constants, or only state) are computed where
they are read.
"""
from __future__ import annotations

import functools
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from hapsynth.ir.signature import of_program
from hapsynth.ir.trace import Const, Program
from hapsynth.lower import cpu
from hapsynth.lower.packing import Packing, Ref, bundle, dtype_of, pad_to, trim
from hapsynth.synth.slots import APART_BYTES, B, F, sum_dtype, tick_tables, wire_rounds
from hapsynth.lower.values import Sharded, Staged, plain, unshard
from hapsynth.lower.wiring import StageWiring
from hapsynth.synth.plan import Plan

__all__ = ["Pipelined", "Staged"]

STAGE, DATA = "stage", "data"


#: XLA's CPU scheduler that runs independent ops side by side gives every permute one
#: rendezvous key; in a pipelined program over several CPU devices of one process it let
#: devices meet at different permutes (a failed check in the rendezvous, a hang, or wrong
#: values: the bf16 step of `tests/elsewhere` over two stages, at most runs). Passed to
#: `jax.jit` as a compiler option it did not help; set in XLA_FLAGS it did (4 of 4 runs).
CPU_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def _store(bufs, values, at):
    """`bufs` (per dtype) with row `at` set to `values`, in place. Never in a `cond` that
    also passes `bufs` through or reads them by a second reference (XLA would copy them
    whole every tick); a mailbox has a spare last row, which a tick storing nothing
    writes (its table entry is the slot count)."""
    return tuple(lax.dynamic_update_index_in_dim(b, v, at, 0) for b, v in zip(bufs, values))


class Pipelined(StageWiring):
    """A pipeline plan bound to a traced program and the cluster's devices."""

    def __init__(self, prog: Program, plan: Plan, devices, *, donate=(), branch_hook=None):
        """`branch_hook`: measurement harnesses only (`hook.py`): every branch a device
        runs (each tick's work, each round of once-per-step ops) is `hook.wrap`ped."""
        plan.check(of_program(prog))
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
        self.groups = sorted({(s, r) for s in range(self.S) for r in self.rows[s]})
        self.group_of = np.array([[self.groups.index((s, r)) for r in self.rows[s]]
                                  for s in range(self.S)], np.int32)
        self._static()
        self.state_packing = [Packing([(p, prog.avals[prog.inputs[p]].shape,
                                        prog.avals[prog.inputs[p]].dtype)
                                       for p in range(self.nstate) if self.owner[p] == s],
                                      apart=APART_BYTES)
                              for s in range(self.S)]
        self.state_sizes = bundle(self.state_packing)
        self.state_order = tuple(self.state_sizes)
        n_data = len(prog.inputs) - self.nstate
        ns, nk = len(self.state_order), len(self.keep_sizes)
        own = PS((STAGE, DATA), None)  # each device's own pool of keep buffers
        in_specs = (tuple(PS(STAGE, None) for _ in self.state_order) + (own,) * nk
                    + tuple(PS() for _ in range(n_data)))
        if branch_hook is not None:
            in_specs += tuple(PS() for _ in branch_hook.inputs(self.mesh))
        out_specs = (tuple(PS(STAGE, None) for _ in self.state_order) + (own,) * nk
                     + tuple(PS() for _ in prog.outputs[self.nstate:]))
        self._scratch = None
        self._fn = jax.jit(jax.shard_map(self._body, mesh=self.mesh, in_specs=in_specs,
                                         out_specs=out_specs, check_vma=False),
                           # the state's buffers hold every leaf: given up only when all are
                           donate_argnums=tuple(range(0 if self.nstate and set(
                               range(self.leaves)) <= set(donate) else ns, ns + nk)))

    # -- the static plan of the program ------------------------------------------------
    def _static(self):
        prog = self.prog
        # what a stage's forward keeps, in buffers of one size for every stage: a tick
        # writes into a buffer whose last reader has run (a pool, `_body`), so a device
        # whose stage keeps nothing that tick passes it through untouched
        self.keep_packing = {s: Packing([(t, self._padded(t, s), prog.avals[t].dtype)
                                         for t in self.keeps[s]]) for s in range(self.S)}
        self.keep_sizes = bundle(self.keep_packing.values())
        # what a stage's phase sends per channel (shift to the reader, phase), one packing
        # per sender; a channel's messages wait in mailboxes until read
        items: dict = {}
        for (a, pha), dests in sorted(self.sends.items()):
            for (b, phb), xs in sorted(dests.items()):
                items.setdefault((b - a, pha), {}).setdefault(a, []).extend(
                    ((b, phb, x), self._padded(x, a), prog.avals[x].dtype) for x in sorted(xs))
        self.chan_pack = {c: {a: Packing(v) for a, v in per.items()} for c, per in items.items()}
        self.chan_sizes = {c: bundle(ps.values()) for c, ps in self.chan_pack.items()}
        shifts = sorted({d for d, _ in self.chan_pack})
        self.wire_sizes = {d: bundle(p for (e, _), ps in self.chan_pack.items() if e == d
                                     for p in ps.values()) for d in shifts}
        # a receiver holding other rows than its sender gathers every sender's chunk
        self.chunked = {d: any(self.rows[a] != self.rows[a + d] for (e, _), ps in
                               self.chan_pack.items() if e == d for a in ps) for d in shifts}
        # a message crosses in the tick that made it, or (delay 1) during the next tick's
        # work, on every pair its shift may use, so the two can run side by side
        self.delay = int(self.plan.pipeline.get("delay", 0))
        if self.delay not in (0, 1):
            raise ValueError(f"a pipeline plan's messages cross in the tick that made them "
                             f"(delay 0) or during the next one (delay 1), not {self.delay} "
                             f"ticks later")
        self.tables = tick_tables(
            self.plan.pipeline["table"], self.S, [bool(self.keeps[s]) for s in range(self.S)],
            {c: {a: sorted({key[1] for key in p.slots}) for a, p in ps.items()}
             for c, ps in self.chan_pack.items()}, self.delay)
        self.keep_buffers = self.tables.keep_slots
        # accumulated per phase: a forward adds to its sums only (a loss), a backward to
        # its own (gradients), so neither moves the other's buffer
        # (in float32 where the sums are narrower: `sum_dtype`; cast back once summed)
        self.acc_packing = {ph: [Packing([(t, prog.avals[t].shape, sum_dtype(prog.avals[t].dtype))
                                          for t in self.sums_of(s, ph)], apart=True)
                                 for s in range(self.S)] for ph in "FB"}
        self.acc_sizes = {ph: bundle(ps) for ph, ps in self.acc_packing.items()}

    def _row_start(self, s, micro):
        return micro * self.mb + jnp.asarray(self._offsets(s))[lax.axis_index(DATA)]

    # -- the shard_map body ------------------------------------------------------------------
    def _body(self, *flat):
        prog, S = self.prog, self.S
        ns = len(self.state_order)
        state = tuple(b[0] for b in flat[:ns])
        pool = tuple(flat[ns:ns + len(self.keep_sizes)])  # per dtype: [slots, size]
        ns += len(pool)
        n_data = len(prog.inputs) - self.nstate
        data = dict(zip(prog.inputs[self.nstate:], flat[ns:ns + n_data]))
        self._extra = tuple(flat[ns + n_data:])
        raw = set(data)
        for i in self.data_ops:  # made from the whole batch, on every device
            eqn = prog.eqns[i]
            vals = [x.value if isinstance(x, Const) else data[x] for x in eqn.inputs]
            data.update(zip(eqn.outputs, cpu.bind(eqn.primitive, vals, eqn.params)))
        sidx = lax.axis_index(STAGE)
        didx = lax.axis_index(DATA)
        group = jnp.asarray(self.group_of)[sidx, didx]
        # the device's number in `devices` (as the cluster counts it), for a hook: the
        # mesh puts stages in the plan's order, which need not be the devices' order
        self._index = jnp.asarray([st["devices"] for st in self.plan.stages])[sidx, didx]

        # 1. copies of parameters a stage reads but another stores
        wants: dict = {}
        for s in range(S):
            for p in self.copies[s]:
                wants.setdefault((self.owner[p], s), []).append(("leaf", p))
        copies = self._send_once(
            sidx, wants,
            lambda s, _: {("leaf", p): v for p, v in self.state_packing[s].unpack(
                state, self.state_order).items()})


        # 2. the ticks, in a loop: what differs from tick to tick is data (`self.tables`)
        unpacked = [self._leaves(s, {"state": list(state), "copies": [
            [list(r.bufs) for r in copies.get(k, [])] for k in range(S)]}, copies)
            for s in range(S)]
        tb = self.tables
        micro = jnp.asarray(tb.micro)
        keep_in, keep_out = jnp.asarray(tb.keep_in), jnp.asarray(tb.keep_out)
        chans = sorted(self.chan_pack)
        mail_in = {c: jnp.asarray(tb.mail_in[c]) for c in chans}
        mail_out = {c: jnp.asarray(tb.mail_out[c]) for c in chans}
        shifts = sorted(self.wire_sizes)
        # per tick and device one kind of work, each its own switch over the groups
        # (idle; a forward keeping values, which it stores in the pool; a forward keeping
        # nothing; a backward), so no device makes or moves a buffer it does not fill
        fkeep = np.asarray([bool(self.keeps[s]) for s in range(S)])
        kind = jnp.asarray(np.where(tb.phase == F, np.where(fkeep, 1, 2), np.where(
            tb.phase == B, 3, 0)).astype(np.int32))
        kinds = [[(g, "F") for g, (s, _) in enumerate(self.groups) if fkeep[s]],
                 [(g, "F") for g, (s, _) in enumerate(self.groups) if not fkeep[s]],
                 [(g, "B") for g in range(len(self.groups))]]
        within = np.zeros((3, len(self.groups)), np.int32)  # the group's branch in its kind
        for k, pairs in enumerate(kinds):
            for j, (g, _) in enumerate(pairs):
                within[k, g] = j
        senders = {d: self._senders(d) for d in shifts}
        rounds = wire_rounds({d: senders[d][2] for d in shifts},
                             {d for d in shifts if self.chunked[d]})
        ends = np.cumsum([len(self.wire_sizes[d]) for d in shifts]).tolist()
        spans = {d: (e - len(self.wire_sizes[d]), e) for d, e in zip(shifts, ends)}  # in outs
        na = {ph: len(self.acc_sizes[ph]) for ph in "FB"}

        def tick(i, carry):
            acc, pool, mail, made = carry
            m = micro[i, sidx]
            # the pool and mailboxes are read whole (a branch takes its slots) and written
            # outside the switch, in place; the branches close over them (a hook repeating
            # a branch repeats its work, not copies of them)
            operands = [keep_in[i, sidx], *(mail_in[c][i, sidx] for c in chans)]

            def work(k, ph, acc, pool):
                # the branches read the pool they are given, the cond's own operand: a
                # second reference (a closure over the loop's) would make XLA copy it
                branches = [self._hooked(self._tick_branch(g, ph, m, unpacked, data, pool,
                                                           mail, k == 0),
                                         [False] * len(operands)) for g, _ in kinds[k]]
                outs = lax.switch(jnp.asarray(within[k])[group], branches, *operands)
                n = na[ph]
                return {**acc, ph: tuple(a + c for a, c in zip(acc[ph], outs[:n]))}, outs[n:]

            def keeping(acc, pool):  # a forward whose keep is stored in the pool, in place
                acc, outs = work(0, "F", acc, pool)
                return (acc, _store(pool, outs[:len(pool)], keep_out[i, sidx]),
                        tuple(outs[len(pool):]))

            def idle(acc, pool):
                return acc, tuple(jnp.zeros((n,), k) for d in shifts
                                  for k, n in self.wire_sizes[d].items())

            def other(acc, pool):  # idle (a backward, below), a forward keeping nothing
                acc, outs = lax.cond(kind[i, sidx] == 2, functools.partial(work, 1, "F"),
                                     idle, acc, pool) if kinds[1] else idle(acc, pool)
                return acc, pool, tuple(outs)

            # the backward's sums in a cond of their own, its one buffer operand: passed
            # through the forwards' and the idle branches too, XLA copied them whole there
            forward = {"F": acc["F"]}
            if kinds[0]:
                forward, pool, outs = lax.cond(kind[i, sidx] == 1, keeping, other, forward, pool)
            else:
                forward, pool, outs = other(forward, pool)
            back, outs_b = lax.cond(kind[i, sidx] == 3, functools.partial(work, 2, "B"), idle,
                                    {"B": acc["B"]}, pool)
            acc = {**forward, **back}
            outs = tuple(jnp.where(kind[i, sidx] == 3, b, f) for f, b in zip(outs, outs_b))
            if self.delay:  # what the last tick made crosses, independent of this tick's work
                outs, made = made, tuple(outs)
            mail, crossed = dict(mail), None
            by_shift = {d: outs[a:b] for d, (a, b) in spans.items()}
            late = self._cross_late(sidx, senders, rounds, by_shift) if self.delay else {}
            for d in shifts:
                got = by_shift[d]
                if self.delay:
                    got = late[d]
                else:
                    if crossed is not None:
                        # one shift's crossing after the other's on every process: XLA's
                        # CPU runtime orders the collectives of one sequence, not those
                        # inside two independent conds, and gloo pairs a permute's
                        # messages by arrival (one tag for all), so they could mix
                        crossed, got = lax.optimization_barrier((crossed, got))
                    # only the stages sending this tick: a tick with none sends nothing (the
                    # pattern is the same on every device, so each takes the same branch)
                    crossed = lax.switch(
                        jnp.asarray(senders[d][0])[i],
                        [functools.partial(self._cross, d, pairs) for pairs in senders[d][1]],
                        *got)
                    got = dict(zip(self.wire_sizes[d], crossed))
                for c in [c for c in chans if c[0] == d]:
                    new = tuple(got[kd][..., :n] for kd, n in self.chan_sizes[c].items())
                    mail[c] = _store(mail[c], new, mail_out[c][i, sidx])
            return acc, pool, mail, made

        acc = {ph: tuple(jnp.zeros((n,), dtype_of(k)) for k, n in self.acc_sizes[ph].items())
               for ph in "FB"}
        mail = {c: tuple(jnp.zeros((tb.mail_slots[c] + 1,) + ((self.D,) if self.chunked[c[0]]
                                                         else ()) + (n,), k)
                         for k, n in self.chan_sizes[c].items()) for c in chans}
        made = tuple(jnp.zeros((n,), k) for d in shifts for k, n in self.wire_sizes[d].items()) \
            if self.delay else ()
        acc, pool, _, _ = lax.fori_loop(0, tb.ticks, tick, (acc, pool, mail, made))

        # 3. once per step: sums over the stage's devices, then the stages' remaining ops
        if self.D > 1:  # (over one device XLA still runs it, copying every sum)
            acc = {ph: tuple(lax.psum(a, DATA) for a in bufs) for ph, bufs in acc.items()}
        ctx = {"state": list(state), "copies": [[list(r.bufs) for r in copies.get(s, [])]
                                                for s in range(S)],
               "data": [data[t] for t in self.data]}
        out = self._finish(sidx, ctx, copies, acc, raw)
        # the keep buffers as the last tick left them, for the next step
        return (*out[:len(self.state_order)], *pool, *out[len(self.state_order):])

    def _hooked(self, f, entry):
        return f if self.hook is None else self.hook.wrap(f, entry, self._extra,
                                                          index=self._index)

    def _leaves(self, s, ctx, copies) -> dict:
        """Stage s's state (what it stores and the copies it received) by tensor id."""
        prog = self.prog
        out = {prog.inputs[p]: v for p, v in self.state_packing[s].unpack(
            tuple(ctx["state"]), self.state_order).items()}
        for ref, bufs in zip(copies.get(s, []), ctx["copies"][s]):
            out.update({prog.inputs[k[1]]: v for k, v in ref.packing.unpack(
                tuple(bufs), ref.order).items()})
        return out

    def _stage_switch(self, sidx, ctx, raw, body):
        """`lax.switch` on the stage of `body(s, ctx)`, the values of `ctx` (state,
        copies, data, values made so far) passed as operands: a branch hook sees them."""
        leaves, tree = jax.tree.flatten(ctx)
        flags = jax.tree.leaves({**jax.tree.map(lambda _: False, ctx),
                                 "state": [True] * len(ctx["state"]),
                                 "data": [t in raw for t in self.data]})

        def make(s):
            def f(*ops):
                return body(s, jax.tree.unflatten(tree, ops))
            return self._hooked(f, flags)
        return lax.switch(sidx, [make(s) for s in range(self.S)], *leaves)

    def _senders(self, d) -> tuple:
        """Per tick, which pattern of stages sends on shift `d` (an index into the
        patterns), the patterns as (sender, receiver) pairs, and every pair sending on it
        at some tick."""
        tb, pats = self.tables, {}
        index = np.zeros(tb.ticks, np.int32)
        for i in range(tb.ticks):
            pairs = tuple((a, a + d) for a in range(self.S) if tb.phase[i, a]
                          and a in self.chan_pack.get((d, "FB"[tb.phase[i, a] - 1]), {}))
            index[i] = pats.setdefault(pairs, len(pats))
        every = tuple(sorted({p for pairs in pats for p in pairs}))
        return index, list(pats), every

    def _cross(self, d, pairs, *bufs):
        """What stages `pairs` send on shift d, as their receivers get it (gathered over
        "data" first where the two split their rows differently)."""
        if not pairs:  # read by no one
            return tuple(jnp.broadcast_to(b, (self.D, *b.shape)) for b in bufs) \
                if self.chunked[d] else bufs
        if self.chunked[d]:
            bufs = tuple(lax.all_gather(b, DATA) for b in bufs)
        return tuple(lax.ppermute(b, STAGE, list(pairs)) for b in bufs)

    def _cross_late(self, sidx, senders, rounds, made) -> dict:
        """What the last tick made (per shift, its buffers per dtype), as its receivers get
        it: per shift a dict by dtype. A round of two opposite shifts crosses in one
        `ppermute`, each stage sending its own shift's buffers, padded to the wider."""
        out = {}
        for rnd in rounds:
            if len(rnd) == 1:
                d, = rnd
                out[d] = dict(zip(self.wire_sizes[d], self._cross(d, senders[d][2], *made[d])))
                continue
            sizes: dict = {}
            for d in rnd:
                for k, n in self.wire_sizes[d].items():
                    sizes[k] = max(sizes.get(k, 0), n)
            mine = [dict(zip(self.wire_sizes[d], made[d])) for d in rnd]

            def fill(x, k, n):
                return jnp.zeros((n,), dtype_of(k)) if x is None else \
                    jnp.pad(x, (0, n - x.shape[0]))
            first = jnp.asarray([any(a == s for a, _ in senders[rnd[0]][2])
                                 for s in range(self.S)])[sidx]
            both = tuple(jnp.where(first, fill(mine[0].get(k), k, n), fill(mine[1].get(k), k, n))
                         for k, n in sizes.items())
            got = dict(zip(sizes, lax.ppermute(
                both, STAGE, [*senders[rnd[0]][2], *senders[rnd[1]][2]])))
            for d in rnd:
                out[d] = {k: got[k][:n] for k, n in self.wire_sizes[d].items()}
        return out

    def _tick_branch(self, g, ph, m, state, data, pool, mail, keeping):
        """The work of group g's devices in phase `ph` ("F" or "B") on microbatch `m`.
        Operands: the keep slot a backward reads (of `pool`) and per channel the mailbox
        slot to read (of `mail`); results: what it adds to its phase's sums, what the
        forward keeps (if `keeping`), what each shift's wire sends (zeros where
        nothing is)."""
        s, rows = self.groups[g]
        chans, shifts = sorted(self.chan_pack), sorted(self.wire_sizes)
        keep_order = tuple(self.keep_sizes)

        def slot(bufs, k):
            return tuple(lax.dynamic_index_in_dim(b, k, 0, keepdims=False) for b in bufs)

        def branch(*ops):
            mails = {c: (mail[c], ops[1 + j]) for j, c in enumerate(chans)}
            known, env = dict(state[s]), {}
            if ph == "B" and self.keeps[s]:
                for t, v in self.keep_packing[s].unpack(slot(pool, ops[0]), keep_order).items():
                    known[t] = trim(v, self.plan.tensor_layouts[t], self._local(t, rows))
            for (a, pha), dests in self.sends.items():
                if (s, ph) in dests:
                    c = (s - a, pha)
                    bufs = slot(*mails[c])
                    ref = Ref(bufs, tuple(self.chan_sizes[c]), self.chan_pack[c][a],
                              self.chunked[c[0]], a)
                    known.update(self._received(ref, bufs, s, rows))
            known.update({t: data[t] for t in self.data})
            run = self._evaluator(s, rows, m, env, lambda x: known[x])
            for i in self.core[(s, ph)]:
                run(i)
            sums = self.acc_packing[ph][s]
            out = sums.pack({t: env[t] for t in sums.slots}, self.acc_sizes[ph])
            if keeping:
                out += self.keep_packing[s].pack({
                    t: pad_to(env[t] if t in env else known[t], self.plan.tensor_layouts[t],
                              self._padded(t, s)) for t in self.keeps[s]}, self.keep_sizes)
            for d in shifts:
                p = self.chan_pack.get((d, ph), {}).get(s)
                out += p.pack({key: pad_to(env[key[2]], self.plan.tensor_layouts[key[2]],
                                           self._padded(key[2], s)) for key in p.slots},
                              self.wire_sizes[d]) if p is not None else tuple(
                    jnp.zeros((n,), k) for k, n in self.wire_sizes[d].items())
            return out

        return branch

    def _received(self, ref, bufs, s, rows) -> dict:
        """Values of `ref` (sent by stage `ref.sender`) as this device of stage `s` reads them."""
        prog, plan = self.prog, self.plan
        out = {}
        if not ref.chunked:
            for key, v in ref.packing.unpack(bufs, ref.order).items():
                t = key[2]
                out[t] = trim(v, plan.tensor_layouts[t], self._local(t, rows))
            return out
        didx = lax.axis_index(DATA)
        chunks = [ref.packing.unpack(tuple(b[j] for b in bufs), ref.order) for j in range(self.D)]
        a = ref.sender
        off = jnp.asarray(self._offsets(s))[didx]
        for key in ref.packing.slots:
            t = key[2]
            lay = plan.tensor_layouts[t]
            if lay.kind != "S":
                out[t] = jnp.stack([c[key] for c in chunks])[didx]
                continue
            whole = jnp.concatenate([trim(c[key], lay, self._local(t, self.rows[a][j]))
                                     for j, c in enumerate(chunks)], axis=lay.dim)
            scale = prog.avals[t].shape[lay.dim] // self.r.batch
            out[t] = lax.dynamic_slice_in_dim(whole, off * scale, rows * scale, axis=lay.dim)
        return out

    def _send_once(self, sidx, wants, values_of) -> dict:
        """Whole values sent between stages once: `wants[(src, dst)]` lists keys; the
        sender's `values_of(src, env)` gives them. Returns dst -> [Ref]."""
        by_shift: dict = {}
        for (a, b), keys in wants.items():
            if keys:
                by_shift.setdefault(b - a, {})[a] = (b, keys)
        got: dict = {}
        for d, senders in sorted(by_shift.items()):
            packs = {a: Packing([(k, self._whole_shape(k), self._whole_dtype(k)) for k in keys])
                     for a, (b, keys) in senders.items()}
            sizes = bundle(packs.values())

            def branch(a, packs=packs, sizes=sizes):
                def f():
                    if a not in packs:
                        return tuple(jnp.zeros((n,), k) for k, n in sizes.items())
                    vals = values_of(a, {})
                    return packs[a].pack(vals, sizes)
                return f

            fns = [branch(a) for a in range(self.S)]
            bufs = lax.switch(sidx, fns)
            bufs = tuple(lax.ppermute(b, STAGE, [(a, a + d) for a in senders]) for b in bufs)
            for a, (b, _) in senders.items():
                got.setdefault(b, []).append(Ref(bufs, tuple(sizes), packs[a], sender=a))
        return got

    def _whole_shape(self, key):
        return self.prog.avals[self.prog.inputs[key[1]] if key[0] == "leaf" else key[1]].shape

    def _whole_dtype(self, key):
        return self.prog.avals[self.prog.inputs[key[1]] if key[0] == "leaf" else key[1]].dtype

    def _finish(self, sidx, ctx, copies, acc, raw):
        """Rounds of once-per-step ops; returns the new state buffers and the outputs."""
        prog, S = self.prog, self.S
        where: dict = {}   # tensor -> (stage, round) it is made in
        for s in range(S):
            for t in self.acc[s]:
                where[t] = (s, 0)
        level = {}
        for i in sorted(i for ids in self.post.values() for i in ids):
            s = self.stage[i]
            lv = 0
            for x in prog.eqns[i].inputs:
                if isinstance(x, int) and x in where:
                    a, k = where[x]
                    lv = max(lv, k + (a != s))
            level[i] = lv
            for t in prog.eqns[i].outputs:
                where[t] = (s, lv)
        outs = prog.outputs
        final = max([0] + list(level.values())) + 1
        avail = [{t: v.astype(prog.avals[t].dtype) for ph in "FB"
                  for t, v in self.acc_packing[ph][s].unpack(
                      acc[ph], tuple(self.acc_sizes[ph])).items()} for s in range(S)]
        keys = [list(a) for a in avail]

        # per stage, its state leaves -> the new values; written into "new" as they are made
        stores = [{p: o for p, o in enumerate(outs[:self.nstate])
                   if self.owner[p] == s and isinstance(o, int)} for s in range(S)]
        done: list[set] = [set() for _ in range(S)]
        ctx = {**ctx, "new": list(ctx["state"])}

        def context():
            return {**ctx, "avail": [[avail[s][t] for t in keys[s]] for s in range(S)]}

        def view(s, c):
            """Stage s's values inside a branch: state, data, what it holds so far."""
            known = self._leaves(s, c, copies)
            known.update(zip(self.data, c["data"]))
            return known, dict(zip(keys[s], c["avail"][s]))

        for k in sorted(set(level.values()) | {final}):
            # values made at an earlier round on another stage, read now
            wants: dict = {}
            for s in range(S):
                for i in self.post[s]:
                    if level[i] != k:
                        continue
                    for x in prog.eqns[i].inputs:
                        if isinstance(x, int) and x in where and where[x][0] != s:
                            wants.setdefault((where[x][0], s), []).append(("t", x))
                if k == final:
                    for p, o in enumerate(outs[:self.nstate]):
                        if self.owner[p] == s and isinstance(o, int) and o in where \
                                and where[o][0] != s:
                            wants.setdefault((where[o][0], s), []).append(("t", o))
            wants = {key: list(dict.fromkeys(v)) for key, v in wants.items()}
            if wants:
                snap = [dict(a) for a in avail]
                got = self._send_once(sidx, wants, lambda a, _, snap=snap: {
                    key: snap[a][key[1]] for (src, _), ks in wants.items() if src == a
                    for key in ks})
                for s, refs in got.items():
                    for ref in refs:
                        for key, v in ref.packing.unpack(ref.bufs, ref.order).items():
                            avail[s][key[1]] = v
                keys = [list(a) for a in avail]
            if k == final:
                break
            # this round's ops, per stage, in a switch: the new values read after it (by a
            # later round or as outputs) packed per stage
            # (a new state leaf read by nothing else goes straight into its stage's buffers)
            later = {x for j in range(S) for i in self.post[j] if level[i] > k
                     for x in prog.eqns[i].inputs if isinstance(x, int)} | {
                o for o in outs[self.nstate:] if isinstance(o, int)}
            made = {s: [t for i in self.post[s] if level[i] == k for t in prog.eqns[i].outputs]
                    for s in range(S)}
            stored = {s: {p: o for p, o in store.items() if o in made[s] and o not in later}
                      for s, store in enumerate(stores)}
            packs = [Packing([(t, prog.avals[t].shape, prog.avals[t].dtype) for t in made[s]
                              if t in later or t in outs[:self.nstate]
                              and t not in stored[s].values()]) for s in range(S)]
            sizes = bundle(packs)

            def rnd(s, c, k=k, packs=packs, sizes=sizes, stored=stored):
                known, env = view(s, c)
                run = self._evaluator(s, None, None, env, lambda x: known[x])
                for i in self.post[s]:
                    if level[i] == k:
                        run(i)
                new = self.state_packing[s].pack({p: env[o] for p, o in stored[s].items()},
                                                 self.state_sizes, into=tuple(c["new"]))
                return (*packs[s].pack({t: env[t] for t in packs[s].slots}, sizes), *new)

            bufs = self._stage_switch(sidx, context(), raw, rnd)
            ctx["new"], bufs = list(bufs[len(sizes):]), bufs[:len(sizes)]
            for s in range(S):
                avail[s].update(packs[s].unpack(bufs, tuple(sizes)))
                for p in stored[s]:
                    done[s].add(p)
            keys = [list(a) for a in avail]

        def stage_state(s, c):
            known, env = view(s, c)
            run = self._evaluator(s, None, None, env, lambda x: known[x])
            vals = {}
            for p, o in enumerate(outs[:self.nstate]):
                if self.owner[p] != s or p in done[s]:
                    continue
                if isinstance(o, Const):
                    vals[p] = jnp.broadcast_to(jnp.asarray(o.value), o.aval.shape)
                elif o in env:
                    vals[p] = env[o]
                elif o in known:
                    vals[p] = known[o]
                else:
                    run(self.producer[o])
                    vals[p] = env[o]
            return self.state_packing[s].pack(vals, self.state_sizes, into=tuple(c["new"]))

        new_state = self._stage_switch(sidx, context(), raw, stage_state)
        wanted = [o for o in outs[self.nstate:] if not isinstance(o, Const)]

        def made_on(o) -> int:
            return where[o][0] if o in where else self.out_stage.get(o, 0)

        def results_of(s, c):  # each output from the stage making it, zeros elsewhere
            known, env = view(s, c)
            run = self._evaluator(s, None, None, env, lambda x: known[x])
            out = []
            for o in wanted:
                if made_on(o) != s:
                    out.append(jnp.zeros(prog.avals[o].shape, prog.avals[o].dtype))
                elif o in env or o in known:
                    out.append(env[o] if o in env else known[o])
                else:
                    run(self.producer[o])
                    out.append(env[o])
            return tuple(out)

        picked = iter(self._stage_switch(sidx, context(), raw, results_of))
        results = []
        for o in outs[self.nstate:]:
            if isinstance(o, Const):
                results.append(jnp.asarray(o.value))
                continue
            v = next(picked)
            if v.dtype == jnp.bool_:
                results.append(lax.psum(v.astype(jnp.int32), STAGE).astype(jnp.bool_))
            else:
                results.append(lax.psum(v, STAGE))
        return (*[b[None] for b in new_state], *results)

    # -- running it ----------------------------------------------------------------------
    def _pack_state(self, leaves):
        """State leaves (arrays or `Staged` of this program) as the per-stage buffers."""
        state = leaves[:self.nstate]
        if state and all(isinstance(x, Staged) and x.owner is self and x.buffers is state[0].buffers
                         and self.state_packing[x.stage].slots.get(p) == (x.key, x.offset, x.shape)
                         for p, x in enumerate(state)):  # this program's last state, in place
            return tuple(state[0].buffers[k] for k in self.state_order)
        rows = {k: np.zeros((self.S, n), dtype_of(k)) for k, n in self.state_sizes.items()}
        for s, p in enumerate(self.state_packing):
            for key, (k, off, shape) in p.slots.items():
                x = leaves[key]
                x = x.value() if isinstance(x, Staged) else x
                if isinstance(x, Sharded):
                    x = unshard(x)
                rows[k][s, off:off + int(np.prod(shape, dtype=np.int64))] = np.ravel(np.asarray(x))
        sharding = NamedSharding(self.mesh, PS(STAGE, None))
        return tuple(jax.device_put(rows[k], sharding) for k in self.state_order)

    def _wrap(self, bufs) -> list:
        out = []
        for p in range(self.nstate):
            k, off, shape = self.state_packing[self.owner[p]].slots[p]
            out.append(Staged(bufs, self.owner[p], k, off, shape, dtype_of(k), self))
        return out

    def shard(self, *args):
        """The arguments stored as this program reads them: state as `Staged` leaves of
        the per-stage buffers, data on every device."""
        leaves, tree = jax.tree.flatten(args, is_leaf=lambda v: isinstance(v, (Sharded, Staged)))
        leaves = self._inputs(leaves, plain)
        bufs = dict(zip(self.state_order, self._pack_state(leaves)))
        rep = NamedSharding(self.mesh, PS())
        data = [jax.device_put(jnp.asarray(x), rep) for x in leaves[self.nstate:]]
        return jax.tree.unflatten(tree, self._state(self._wrap(bufs)) + data)

    def _arguments(self, leaves) -> list:
        """The program's arguments for one step on the flattened arguments."""
        leaves = self._inputs(leaves, plain)
        state = self._pack_state(leaves)
        rep = NamedSharding(self.mesh, PS())
        data = [jax.device_put(jnp.asarray(x), rep) for x in leaves[self.nstate:]]
        extra = self.hook.inputs(self.mesh) if self.hook is not None else ()
        if self._scratch is None:
            own = NamedSharding(self.mesh, PS((STAGE, DATA), None))
            slots = self.keep_buffers
            self._scratch = [jax.device_put(np.zeros((self.mesh.devices.size * slots, n), k), own)
                             for k, n in self.keep_sizes.items()]
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
        ns, nk = len(self.state_order), len(self._scratch)
        self._scratch = list(outs[ns:ns + nk])
        outs = outs[:ns] + outs[ns + nk:]
        bufs = dict(zip(self.state_order, outs[:ns]))
        wrapped = self._state(self._wrap(bufs)) + list(outs[ns:])
        return jax.tree.unflatten(self.prog.out_tree, wrapped)

    def __call__(self, *args):
        return self.run(jax.tree.flatten(args, is_leaf=lambda v: isinstance(v, (Sharded, Staged)))[0])


