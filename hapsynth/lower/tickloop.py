"""The tick loop of a pipelined program: one `fori_loop` whose body is the same at every
tick, what differs per tick being data (`TickLayout.tables`). Per tick each device runs
its kind of work (a forward keeping values, one keeping none, a backward, or nothing)
in conds on the kind, adds to its sums, stores what it keeps in the pool, and what it
sends crosses to its receivers' mailboxes."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jax import lax

from hapsynth.lower.packing import dtype_of
from hapsynth.lower.place import Place
from hapsynth.lower.ticklayout import TickLayout
from hapsynth.lower.tickwork import tick_branch
from hapsynth.lower.wires import cross, cross_late
from hapsynth.lower.wiring import StageWiring

__all__ = ["tick_loop"]


def _store(bufs, values, at):
    """`bufs` (per dtype) with row `at` set to `values`, in place. Never in a `cond` that
    also passes `bufs` through or reads them by a second reference (XLA would copy them
    whole every tick); a mailbox has a spare last row, which a tick storing nothing
    writes (its table entry is the slot count)."""
    return tuple(lax.dynamic_update_index_in_dim(b, v, at, 0) for b, v in zip(bufs, values))


def tick_loop(w: StageWiring, lay: TickLayout, place: Place, state: list, data: dict,
              pool: tuple) -> tuple:
    """Every tick of the step: (per phase its sums, per dtype, summed over this device's
    microbatches; the keep pool as the last tick left it). `state`: per stage, its state
    values by tensor id; `pool`: per dtype, [slots, size]."""
    tb = lay.tables
    tick = _Tick(w, lay, place, state, data, jnp.asarray(tb.micro), jnp.asarray(tb.keep_in),
                 jnp.asarray(tb.keep_out), {c: jnp.asarray(tb.mail_in[c]) for c in lay.chans},
                 {c: jnp.asarray(tb.mail_out[c]) for c in lay.chans}, jnp.asarray(lay.kind))
    acc = {ph: tuple(jnp.zeros((n,), dtype_of(k)) for k, n in lay.acc_sizes[ph].items())
           for ph in "FB"}
    mail = {c: tuple(jnp.zeros((tb.mail_slots[c] + 1,) + ((lay.stage_devices,) if lay.chunked[
        c[0]] else ()) + (n,), k) for k, n in lay.chan_sizes[c].items()) for c in lay.chans}
    made = tick.idle_sends() if lay.delay else ()
    acc, pool, _, _ = lax.fori_loop(0, tb.ticks, tick, (acc, pool, mail, made))
    return acc, pool


@dataclass(frozen=True, eq=False)
class _Tick:
    """The loop's body: (tick, (sums, pool, mailboxes, what the last tick made, to
    cross in this one where messages cross late)) -> the same after the tick."""

    w: StageWiring
    lay: TickLayout
    place: Place
    state: list
    data: dict
    micro: Any          # the tables, [tick, stage]
    keep_in: Any
    keep_out: Any
    mail_in: dict
    mail_out: dict
    kind: Any

    def __call__(self, i, carry):
        acc, pool, mail, made = carry
        sidx = self.place.stage
        m = self.micro[i, sidx]
        # the pool and mailboxes are read whole (a branch takes its slots) and written
        # outside the switch, in place; the branches close over them (a hook repeating
        # a branch repeats its work, not copies of them)
        operands = [self.keep_in[i, sidx], *(self.mail_in[c][i, sidx] for c in self.lay.chans)]
        forward, pool, outs = self._forward(i, m, operands, mail, acc, pool)
        # the backward's sums in a cond of their own, its one buffer operand: passed
        # through the forwards' and the idle branches too, XLA copied them whole there
        back, outs_b = lax.cond(self.kind[i, sidx] == 3,
                                self._work(2, "B", m, operands, mail), self._idle,
                                {"B": acc["B"]}, pool)
        acc = {**forward, **back}
        outs = tuple(jnp.where(self.kind[i, sidx] == 3, b, f) for f, b in zip(outs, outs_b))
        if self.lay.delay:  # what the last tick made crosses, independent of this tick's work
            outs, made = made, tuple(outs)
        return acc, pool, self._deliver(i, outs, mail), made

    def idle_sends(self) -> tuple:
        """What a tick sends where no stage sends: zeros, per shift and dtype."""
        return tuple(jnp.zeros((n,), k) for d in self.lay.shifts
                     for k, n in self.lay.wire_sizes[d].items())

    def _idle(self, acc, pool):
        return acc, self.idle_sends()

    def _work(self, kind, ph, m, operands, mail):
        """Kind `kind`'s work (0: a forward keeping, 1: one keeping nothing, 2: a
        backward) as a cond branch: (sums, pool) -> (the sums with its own added, what
        else its branch returns). Its branches read the pool they are given, the cond's
        own operand: a second reference (a closure over the loop's) makes XLA copy it."""
        lay, n = self.lay, len(self.lay.acc_sizes[ph])

        def work(acc, pool):
            branches = [self.place.hooked(tick_branch(
                self.w, lay, g, ph, m, self.state, self.data, pool, mail, kind == 0),
                [False] * len(operands)) for g, _ in lay.kinds[kind]]
            outs = lax.switch(jnp.asarray(lay.within[kind])[self.place.group], branches,
                              *operands)
            return {**acc, ph: tuple(a + c for a, c in zip(acc[ph], outs[:n]))}, outs[n:]
        return work

    def _forward(self, i, m, operands, mail, acc, pool):
        """The forward's part of a tick: (its sums, the pool, what it sends)."""
        sidx, kinds = self.place.stage, self.lay.kinds

        def keeping(acc, pool):  # a forward whose keep is stored in the pool, in place
            acc, outs = self._work(0, "F", m, operands, mail)(acc, pool)
            return (acc, _store(pool, outs[:len(pool)], self.keep_out[i, sidx]),
                    tuple(outs[len(pool):]))

        def other(acc, pool):  # idle (a backward, elsewhere), a forward keeping nothing
            acc, outs = lax.cond(self.kind[i, sidx] == 2, self._work(1, "F", m, operands, mail),
                                 self._idle, acc, pool) if kinds[1] else self._idle(acc, pool)
            return acc, pool, tuple(outs)

        if kinds[0]:
            return lax.cond(self.kind[i, sidx] == 1, keeping, other, {"F": acc["F"]}, pool)
        return other({"F": acc["F"]}, pool)

    def _deliver(self, i, outs, mail) -> dict:
        """The mailboxes once what `outs` sends (per shift its buffers) has crossed."""
        lay, sidx = self.lay, self.place.stage
        mail, crossed = dict(mail), None
        by_shift = {d: outs[a:b] for d, (a, b) in lay.spans.items()}
        late = cross_late(lay, sidx, by_shift) if lay.delay else {}
        for d in lay.shifts:
            got = by_shift[d]
            if lay.delay:
                got = late[d]
            else:
                if crossed is not None:
                    # one shift's crossing after the other's on every process: XLA's CPU
                    # runtime orders the collectives of one sequence, not those inside
                    # two independent conds, and gloo pairs a permute's messages by
                    # arrival (one tag for all), so they could mix
                    crossed, got = lax.optimization_barrier((crossed, got))
                # only the stages sending this tick: a tick with none sends nothing (the
                # pattern is the same on every device, so each takes the same branch)
                crossed = lax.switch(
                    jnp.asarray(lay.senders[d][0])[i],
                    [functools.partial(cross, lay, d, pairs) for pairs in lay.senders[d][1]],
                    *got)
                got = dict(zip(lay.wire_sizes[d], crossed))
            for c in [c for c in lay.chans if c[0] == d]:
                new = tuple(got[kd][..., :n] for kd, n in lay.chan_sizes[c].items())
                mail[c] = _store(mail[c], new, self.mail_out[c][i, sidx])
        return mail
