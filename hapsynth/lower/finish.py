"""The once-per-step part of a pipelined program, after its tick loop: the stages' sums
(already summed over each stage's devices), then their once-per-step ops (the optimizer)
in rounds (`rounds.py`), a value made on one stage sent to the next round reading it on
another; each new state leaf written over its place in its stage's buffers as soon as
it is made (`Packing.pack(into=)`); the outputs summed over the stages, each made on one."""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from hapsynth.ir.trace import Const
from hapsynth.lower.packing import Packing, bundle
from hapsynth.lower.place import STAGE, Place
from hapsynth.lower.rounds import Rounds
from hapsynth.lower.stagestate import stage_leaves
from hapsynth.lower.ticklayout import TickLayout
from hapsynth.lower.wires import send_once
from hapsynth.lower.wiring import StageWiring

__all__ = ["Finish"]


@dataclass(frozen=True, eq=False)
class Finish:
    """The once-per-step part on one device. `copies`: per stage the parameters it
    received (`wires.send_once`); `raw`: the data as the step was given it."""

    w: StageWiring
    lay: TickLayout
    place: Place
    copies: dict
    raw: set
    rounds: Rounds

    def __call__(self, ctx: dict, acc: dict) -> tuple:
        """`ctx`: this device's state, copies and data; `acc`: per phase its sums.
        Returns the new state buffers (a leading axis of one) and the outputs."""
        w, S = self.w, self.w.S
        avail = [{t: v.astype(w.prog.avals[t].dtype) for ph in "FB"
                  for t, v in self.lay.acc_packing[ph][s].unpack(
                      acc[ph], tuple(self.lay.acc_sizes[ph])).items()} for s in range(S)]
        done: list[set] = [set() for _ in range(S)]  # per stage, the leaves stored so far
        ctx = {**ctx, "new": list(ctx["state"])}
        last = self.rounds.last
        for k in sorted(set(self.rounds.level.values()) | {last}):
            self._fetch(avail, self._wants(k, k == last))
            if k == last:
                break
            ctx["new"] = self._round(k, ctx, avail, done)
        new_state = self._switch(ctx, avail, self._stage_state(done))
        results = self._results(ctx, avail)
        return (*[b[None] for b in new_state], *results)

    def _stores(self) -> list:
        """Per stage, its state leaves -> the new values (by tensor id)."""
        w = self.w
        return [{p: o for p, o in enumerate(w.prog.outputs[:w.nstate])
                 if w.owner[p] == s and isinstance(o, int)} for s in range(w.S)]

    def _wants(self, k, last) -> dict:
        """Per (maker, reader) stage, the values round k's ops read from another stage
        (the `last` round: those a new state leaf is)."""
        w, (where, level) = self.w, (self.rounds.where, self.rounds.level)
        wants: dict = {}
        for s, store in enumerate(self._stores()):
            for i in w.post[s]:
                if level[i] != k:
                    continue
                for x in w.prog.eqns[i].inputs:
                    if isinstance(x, int) and x in where and where[x][0] != s:
                        wants.setdefault((where[x][0], s), []).append(("t", x))
            if last:
                for o in store.values():
                    if o in where and where[o][0] != s:
                        wants.setdefault((where[o][0], s), []).append(("t", o))
        return {key: list(dict.fromkeys(v)) for key, v in wants.items()}

    def _fetch(self, avail, wants):
        """`avail` (per stage, values by id) with `wants` sent to their readers."""
        if not wants:
            return
        snap = [dict(a) for a in avail]
        got = send_once(self.w.prog, self.w.S, self.place.stage, wants, lambda a, _: {
            key: snap[a][key[1]] for (src, _), ks in wants.items() if src == a for key in ks})
        for s, refs in got.items():
            for ref in refs:
                for key, v in ref.packing.unpack(ref.bufs, ref.order).items():
                    avail[s][key[1]] = v

    def _round(self, k, ctx, avail, done) -> list:
        """Round k's ops, per stage, in a switch; adds the new values read after it (by a
        later round or as outputs) to `avail`, the state leaves it stored to `done`;
        returns the new state buffers (a new state leaf read by nothing else goes
        straight into them)."""
        w, lay, level = self.w, self.lay, self.rounds.level
        prog, S, outs = w.prog, w.S, w.prog.outputs
        later = {x for j in range(S) for i in w.post[j] if level[i] > k
                 for x in prog.eqns[i].inputs if isinstance(x, int)} | {
            o for o in outs[w.nstate:] if isinstance(o, int)}
        made = {s: [t for i in w.post[s] if level[i] == k for t in prog.eqns[i].outputs]
                for s in range(S)}
        stored = {s: {p: o for p, o in store.items() if o in made[s] and o not in later}
                  for s, store in enumerate(self._stores())}
        packs = [Packing([(t, prog.avals[t].shape, prog.avals[t].dtype) for t in made[s]
                          if t in later or t in outs[:w.nstate]
                          and t not in stored[s].values()]) for s in range(S)]
        sizes = bundle(packs)

        def rnd(s, c, known, env):
            run = w._evaluator(s, None, None, env, lambda x: known[x])
            for i in w.post[s]:
                if level[i] == k:
                    run(i)
            new = lay.state_packing[s].pack({p: env[o] for p, o in stored[s].items()},
                                            lay.state_sizes, into=tuple(c["new"]))
            return (*packs[s].pack({t: env[t] for t in packs[s].slots}, sizes), *new)

        bufs = self._switch(ctx, avail, rnd)
        new, bufs = list(bufs[len(sizes):]), bufs[:len(sizes)]
        for s in range(S):
            avail[s].update(packs[s].unpack(bufs, tuple(sizes)))
            done[s].update(stored[s])
        return new

    def _stage_state(self, done):
        """A switch body: the stage's new state buffers, once every round ran."""
        w, lay = self.w, self.lay

        def body(s, c, known, env):
            run = w._evaluator(s, None, None, env, lambda x: known[x])
            vals = {}
            for p, o in enumerate(w.prog.outputs[:w.nstate]):
                if w.owner[p] != s or p in done[s]:
                    continue
                if isinstance(o, Const):
                    vals[p] = jnp.broadcast_to(jnp.asarray(o.value), o.aval.shape)
                elif o in env:
                    vals[p] = env[o]
                elif o in known:
                    vals[p] = known[o]
                else:
                    run(w.producer[o])
                    vals[p] = env[o]
            return lay.state_packing[s].pack(vals, lay.state_sizes, into=tuple(c["new"]))
        return body

    def _results(self, ctx, avail) -> list:
        """The step's outputs but state: each from the stage making it (zeros elsewhere),
        summed over the stages."""
        w, where = self.w, self.rounds.where
        outs = w.prog.outputs[w.nstate:]
        wanted = [o for o in outs if not isinstance(o, Const)]

        def results_of(s, c, known, env):
            run = w._evaluator(s, None, None, env, lambda x: known[x])
            out = []
            for o in wanted:
                if (where[o][0] if o in where else w.out_stage.get(o, 0)) != s:
                    out.append(jnp.zeros(w.prog.avals[o].shape, w.prog.avals[o].dtype))
                elif o in env or o in known:
                    out.append(env[o] if o in env else known[o])
                else:
                    run(w.producer[o])
                    out.append(env[o])
            return tuple(out)

        picked = iter(self._switch(ctx, avail, results_of))
        results = []
        for o in outs:
            if isinstance(o, Const):
                results.append(jnp.asarray(o.value))
                continue
            v = next(picked)
            if v.dtype == jnp.bool_:
                results.append(lax.psum(v.astype(jnp.int32), STAGE).astype(jnp.bool_))
            else:
                results.append(lax.psum(v, STAGE))
        return results

    def _switch(self, ctx, avail, body):
        """`lax.switch` on the stage of `body(s, c, known, env)`: `c` the values of `ctx`
        and `avail`, passed as operands (so a branch hook sees them); `known` the stage's
        state and data by id, `env` what it holds so far."""
        w, S = self.w, self.w.S
        keys = [list(a) for a in avail]
        ctx = {**ctx, "avail": [[avail[s][t] for t in keys[s]] for s in range(S)]}
        leaves, tree = jax.tree.flatten(ctx)
        flags = jax.tree.leaves({**jax.tree.map(lambda _: False, ctx),
                                 "state": [True] * len(ctx["state"]),
                                 "data": [t in self.raw for t in w.data]})

        def make(s):
            def f(*ops):
                c = jax.tree.unflatten(tree, ops)
                known = stage_leaves(w.prog, self.lay, s, c, self.copies)
                known.update(zip(w.data, c["data"]))
                return body(s, c, known, dict(zip(keys[s], c["avail"][s])))
            return self.place.hooked(f, flags)
        return lax.switch(self.place.stage, [make(s) for s in range(S)], *leaves)
