"""`FreeRunning`: a pipeline plan run free, a program per stage and phase.

`Pipelined` runs a plan as one SPMD program whose tick loop meets every stage at each
tick's crossing (lock step). Here each stage's forward, and its backward, of one
microbatch is a `jax.jit` program of its own on the stage's devices; values move between
stages by `jax.device_put`, and every program is dispatched in the schedule's order
without waiting: the runtime starts each as soon as its inputs are there, so an island
runs its next work while the last one's values cross, as the free-running price assumes
(`synth.pipeline`, `free_running=True`). One group of devices may run several stages (a
V shape: both ends on one island, nothing of them crossing). Stages may differ in device
counts, and a stage's devices may hold uneven rows of a microbatch (each then runs its
own in a `lax.switch` branch): a sharded value crosses as the microbatch's rows in
order and each receiving device takes its own (`freemoves.py`). A stage's partial sums
(gradients, the loss) add up over the microbatches, in float32 where narrower; then the
once-per-step ops run per stage in rounds, a value made on one stage crossing to the
next round of another (`freerounds.py`). A step written out of a scan over layers
(`Program.split`) runs too, its stacked leaves as `hs.StagedRows` whose rows stay on
their stages.

Across processes (islands on other hosts; `jax.distributed`) every process runs this
same dispatch: each program runs on the devices a process has of it and nothing
elsewhere, and `jax.device_put` between two stages' devices moves the values from the
processes holding them to those receiving them (multi-controller JAX's cross-host
transfers: the backend's own, or through sockets where
`jax_cross_host_transfer_socket_address` is set). Such a transfer keeps its layout, so
between stages of unequal device counts a value goes a piece per receiving device
(`lower/moves.py`). The step's results lie on the devices of the stage making them;
`hs.gather` brings them to every process.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from hapsynth._jax import moves_across_processes
from hapsynth.ir.trace import Const, Program
from hapsynth.lower import cpu
from hapsynth.lower.freemoves import DATA, crossing, leave, relayout
from hapsynth.lower.freerounds import free_rounds
from hapsynth.lower.moves import move
from hapsynth.lower.packing import pad_to, trim
from hapsynth.lower.values import Sharded, Staged, plain
from hapsynth.lower.wiring import StageWiring
from hapsynth.synth.plan import Plan
from hapsynth.synth.slots import sum_dtype

__all__ = ["FreeRunning"]


class FreeRunning(StageWiring):
    """A pipeline plan bound to a traced program and the devices of one process."""

    def __init__(self, prog: Program, plan: Plan, devices, *, donate=(), branch_hook=None):
        """`donate`: flat indices of the step's argument leaves whose buffers the step may
        reuse (as `jax.jit`'s `donate_argnums`): a state leaf's is given up to the round
        of once-per-step ops reading it last. `branch_hook`: measurement harnesses only
        (`hook.py`): every stage's work and round of once-per-step ops runs
        `hook.wrap`ped on each of its devices."""
        super().__init__(prog, plan)
        self.donate = self._program_inputs(donate)
        self.hook = branch_hook
        owners = {devices[d].process_index for st in plan.stages for d in st["devices"]}
        if len(owners) > 1 and not moves_across_processes():
            raise RuntimeError(
                "a free-running pipeline over several processes moves values between them "
                "with jax.device_put: set jax.config.update('jax_cross_host_transfer_socket_"
                "address', 'HOST:PORT') (this process's address) before JAX starts, or use "
                "pipeline_runtime='ticks'")
        self.meshes = [Mesh(np.array([devices[d] for d in st["devices"]]), (DATA,))
                       for st in plan.stages]
        # per (stage, phase): the phases whose values it reads (they run first)
        self.sources = {(s, ph): sorted({(a, pha) for (a, pha), dests in self.sends.items()
                                         if (s, ph) in dests} | ({(s, "F")} if ph == "B" else set()))
                        for s in range(self.S) for ph in "FB"}
        self.order = self._order(plan.pipeline["slots"])
        # per stage: whether its devices hold as many rows each (else each runs its own
        # rows in a `lax.switch` branch, what it keeps and sends padded to the most)
        self.even = [len(set(r)) == 1 for r in self.rows]
        self._rechunks: dict = {}
        # per (stage, phase): the values crossing into it from other stages
        self.crossing_in = {(s, ph): sorted({x for dests in self.sends.values()
                                             for x in dests.get((s, ph), ())})
                            for s in range(self.S) for ph in "FB"}
        self._works = {key: self._work(*key) for key in self.sources}
        self._sums: dict = {}
        self._data_fns: dict = {}
        self._whole = [NamedSharding(m, PS()) for m in self.meshes]
        self._own = [NamedSharding(m, PS(DATA)) for m in self.meshes]
        self._zeros = {(s, ph): self._zeros_of(s, ph) for s in range(self.S) for ph in "FB"}
        # per state leaf, the stages reading it (its owner, and those copying it)
        self._holders = [sorted({self.owner[p], *[s for s in range(self.S) if p in self.copies[s]]})
                         for p in range(self.nstate)]
        self._rounds()

    # -- what runs when -------------------------------------------------------------------
    def _order(self, slots) -> list[tuple[int, int, str]]:
        """The works in the schedule's order (by simulated start), each after what it reads."""
        want = {(s, m, ph) for s in range(self.S) for m in range(self.M) for ph in "FB"}
        listed = [(int(s), int(m), str(ph)) for s, m, ph, *_ in
                  sorted(slots, key=lambda x: (float(x[3]), float(x[4]), int(x[0])))]
        if set(listed) != want or len(listed) != len(want):
            raise ValueError("the plan's schedule does not run every stage's forward and "
                             "backward of every microbatch once")
        done, out, waiting = set(), [], list(listed)
        while waiting:
            for k, (s, m, ph) in enumerate(waiting):
                if all((a, m, pha) in done for a, pha in self.sources[(s, ph)]):
                    break
            else:
                raise ValueError("the plan's schedule waits on itself")
            done.add(waiting.pop(k))
            out.append((s, m, ph))
        return out

    def _row_start(self, s, micro):
        return micro * self.mb + jnp.asarray(self._offsets(s))[jax.lax.axis_index(DATA)]

    # -- the programs ---------------------------------------------------------------------
    def _work(self, s, ph):
        """Stage s's phase `ph` of one microbatch, each device at its rows: (microbatch,
        state, data, received, kept, sums) -> (sums with its own added, what it keeps for
        its backward, what it sends). What crosses to another stage crosses as a global
        value on the sender's devices, the microbatch's rows in order (`freemoves.py`),
        so a stage of other devices takes its own rows of it; what a forward keeps for its
        backward, and the sums, stay each device's own (a leading axis of its devices)."""
        sums = self.sums_of(s, ph)
        keep = self.keeps[s] if ph == "F" else []
        sent = sorted({x for xs in self.sends.get((s, ph), {}).values() for x in xs})
        ops, lay = self.core[(s, ph)], self.plan.tensor_layouts
        sizes = sorted(set(self.rows[s]))
        group = np.array([sizes.index(r) for r in self.rows[s]], np.int32)

        def at(rows):
            """The work on a device holding `rows` rows; what it keeps and sends padded to
            the stage's most rows."""
            def branch(m, state, data, received, kept, acc):
                arrived = {t: trim(v, lay[t], self._local(t, rows)) for t, v in received.items()}
                known = {**state, **data, **arrived,
                         **{t: trim(v[0], lay[t], self._local(t, rows)) for t, v in kept.items()}}
                env: dict = {}
                run = self._evaluator(s, rows, m, env, lambda x: known[x])
                for i in ops:
                    run(i)
                new = {t: acc[t] + env[t].astype(acc[t].dtype)[None] for t in sums}
                kept = {t: pad_to(env[t] if t in env else known[t], lay[t],
                                  self._padded(t, s))[None] for t in keep}
                return new, kept, {t: pad_to(env[t], lay[t], self._padded(t, s)) for t in sent}
            return branch

        def fn(*args):
            if len(sizes) == 1:
                new, kept, out = at(sizes[0])(*args)
            else:
                new, kept, out = jax.lax.switch(jnp.asarray(group)[jax.lax.axis_index(DATA)],
                                                [at(r) for r in sizes], *args)
            return new, kept, {t: leave(self, s, t, v) for t, v in out.items()}

        own, whole = PS(DATA), PS()
        into = {t: crossing(self, t) for t in self.crossing_in[(s, ph)]}
        return self._program(s, fn, (whole, whole, whole, into, own, own),
                             (own, own, {t: crossing(self, t, s) for t in sent}), donate=(5,),
                             entry=lambda m, state, data, *_: [False] + [True] * (
                                 len(state) + len(data)))

    def _arriving(self, t, v, a, b):
        """Value t, sent by stage a, on stage b's devices as its programs read it."""
        if (t, a, b) not in self._rechunks:
            self._rechunks[(t, a, b)] = relayout(self, t, a, b)
        fn, where = self._rechunks[(t, a, b)]
        return move(v if fn is None else fn(v), where)

    def _program(self, s, fn, in_specs, out_specs, donate=(), entry=None):
        """`fn` as one `jit(shard_map)` program on stage s's devices. Under a branch hook
        its body is `hook.wrap`ped (`entry(*args)`: per leaf of the arguments, whether it
        is the step's own input), and the hook's inputs are passed last (`_extra`)."""
        mesh = self.meshes[s]
        if self.hook is None:
            return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                         check_vma=False), donate_argnums=donate)
        number = np.asarray(self.plan.stages[s]["devices"], np.int32)

        def body(*args):
            *args, extra = args
            leaves, tree = jax.tree.flatten(args)
            made: list = []

            def branch(*flat):
                out, shape = jax.tree.flatten(fn(*jax.tree.unflatten(tree, flat)))
                made.append(shape)
                return tuple(out)
            flags = list(entry(*args)) if entry else []
            flags += [False] * (len(leaves) - len(flags))
            index = jnp.asarray(number)[jax.lax.axis_index(DATA)]
            got = self.hook.wrap(branch, flags, tuple(extra), index=index)(*leaves)
            return jax.tree.unflatten(made[-1], got)
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(*in_specs, PS()),
                                     out_specs=out_specs, check_vma=False), donate_argnums=donate)

    def _extra(self, s) -> tuple:
        """The hook's inputs for a program on stage s (none without a hook)."""
        return () if self.hook is None else (tuple(self.hook.inputs(self.meshes[s])),)

    def _rounds(self):
        """The once-per-step ops in rounds (`freerounds.py`), a program per round and stage
        taking the donated state leaves it gives up apart."""
        once = free_rounds(self, self.donate, self._holders)
        self.where, self.level, self.stores = once.where, once.level, once.stores
        self.results, self.made_on, self._gone = once.results, once.made_on, once.gone
        self._wants, self._fetch, self._final = once.wants, once.fetch, once.final
        self._made_last: dict = {}  # (stage, values no round made) -> a program making them
        self._post = {key: self._program(key[1], self._evaluate(key[1], ops, made, apart=True),
                                         (PS(), PS()), PS(), donate=(0,))
                      for key, (ops, made) in once.rounds.items()}

    def _last(self, s, avail: dict) -> dict:
        """What stage s stores and outputs: those made already as they are (no copies),
        the rest (ops of no stage, on what it holds) by one program."""
        missing = tuple(t for t in self._final[s] if t not in avail)
        if missing:
            if (s, missing) not in self._made_last:
                self._made_last[(s, missing)] = jax.jit(self._evaluate(s, [], list(missing)))
            avail = {**avail, **self._made_last[(s, missing)](avail)}
        return {t: avail[t] for t in self._final[s]}

    def _evaluate(self, s, ops, wanted, apart: bool = False):
        """Ops once per step, whole, on stage s: (its values by id) -> `wanted` by id
        (made by `ops`, or by ops of no stage from what it holds). `apart`: (the values
        it may reuse the buffers of, the rest) -> `wanted`, to donate the first."""
        if apart:
            inner = self._evaluate(s, ops, wanted)
            return lambda gone, known: inner({**known, **gone})

        def fn(known):
            env: dict = {}
            run = self._evaluator(s, None, None, env, lambda x: known[x])
            for i in ops:
                run(i)
            out = {}
            for t in wanted:
                if t not in env and t not in known:
                    run(self.producer[t])
                out[t] = env[t] if t in env else known[t]
            return out
        return fn

    # -- running it -----------------------------------------------------------------------
    def _put(self, x, s):
        return move(x, self._whole[s])

    def _zeros_of(self, s, ph):
        """A program making stage s's sums of phase `ph` zero, one row per device, on the
        devices (not moved there from the host at every step)."""
        n, avals = self.meshes[s].devices.size, self.prog.avals
        sums = self.sums_of(s, ph)
        return jax.jit(lambda: {t: jnp.zeros((n, *avals[t].shape), sum_dtype(avals[t].dtype))
                                for t in sums}, out_shardings=self._own[s])

    def _summed(self, s, acc) -> dict:
        """The sums of a stage's devices, each whole on every one, in their own dtypes."""
        key = (s, tuple(acc))
        if key not in self._sums:
            avals = self.prog.avals
            self._sums[key] = jax.jit(lambda a: {t: v.sum(0).astype(avals[t].dtype)
                                                 for t, v in a.items()},
                                      out_shardings=NamedSharding(self.meshes[s], PS()),
                                      donate_argnums=0)
        return self._sums[key](acc)

    def run(self, leaves):
        """One step on the flattened arguments (arrays; `hs.Sharded` or `hs.Staged` leaves
        are gathered first); the new state comes back on each leaf's stage."""
        prog, S = self.prog, self.S
        leaves = [plain(x) for x in self._inputs(leaves, plain)]
        state, data = self._placed(leaves)
        acc = self._microbatches(state, data)
        # once per step: the sums, then the rounds
        avail = [{**state[s], **data[s]} for s in range(S)]
        for s in range(S):
            for ph in "FB":
                avail[s].update(self._summed(s, acc[s][ph]))
        self._once(avail, leaves)
        final = [self._last(s, avail[s]) for s in range(S)]
        outs, new = prog.outputs, []
        for p in range(self.nstate):
            o, s = outs[p], self.owner[p]
            new.append(jax.device_put(jnp.broadcast_to(jnp.asarray(o.value), o.aval.shape),
                                      self._whole[s]) if isinstance(o, Const) else final[s][o])
        results = [jnp.asarray(o.value) if isinstance(o, Const) else final[self.made_on[o]][o]
                   for o in outs[self.nstate:]]
        return jax.tree.unflatten(prog.out_tree, self._state(new, self.owner) + results)

    def _placed(self, leaves) -> tuple[list, list]:
        """Per stage, the state leaves it reads and the data (with what the step makes of
        it alone), by id, on its devices."""
        prog, S, whole = self.prog, self.S, self._whole
        state = [{} for _ in range(S)]
        for p in range(self.nstate):
            for s in self._holders[p]:
                state[s][prog.inputs[p]] = move(leaves[p], whole[s])
        data = [{} for _ in range(S)]
        for s in range(S):
            got = {t: jax.device_put(jnp.asarray(leaves[i]), whole[s])
                   for t, i in self.data.items() if i >= 0}
            if self.data_ops:
                got = self._data_values(s, got)
            data[s] = got
        return state, data

    def _microbatches(self, state, data) -> list:
        """Every stage's works in `order`, each dispatched without waiting, what it sends
        moved to its receivers' devices; per stage and phase, its devices' sums."""
        acc = [{ph: self._zeros[(s, ph)]() for ph in "FB"} for s in range(self.S)]
        inbox: dict = {}
        kept: dict = {}
        for s, m, ph in self.order:
            received = inbox.pop((s, ph, m), {})
            mine = kept.pop((s, m)) if ph == "B" else {}
            acc[s][ph], keep, sent = self._works[(s, ph)](np.int32(m), state[s], data[s],
                                                          received, mine, acc[s][ph],
                                                          *self._extra(s))
            if ph == "F":
                kept[(s, m)] = keep
            for (b, phb), xs in self.sends.get((s, ph), {}).items():
                box = inbox.setdefault((b, phb, m), {})
                for x in xs:
                    box[x] = self._arriving(x, sent[x], s, b)
        return acc

    def _once(self, avail, leaves):
        """The rounds of once-per-step ops, on each stage's values by id (`avail`, the
        sums in): each round's values added to its stage's; then what a stage stores
        or outputs that the last round made elsewhere (or a state leaf passed through)."""
        for (k, s), fn in self._post.items():
            for x, src in self._wants[(k, s)]:
                if x not in avail[s]:
                    avail[s][x] = self._put(avail[src][x], s)
            gone = {t: avail[s].pop(t) for t in self._gone[(k, s)]}
            avail[s].update(fn(gone, avail[s], *self._extra(s)))
        for s in range(self.S):
            for o, src in self._fetch[s]:
                if o in avail[s]:
                    continue
                if src is not None and o in avail[src]:
                    avail[s][o] = self._put(avail[src][o], s)
                elif o in self.leaf:
                    avail[s][o] = move(leaves[self.leaf[o]], self._whole[s])

    def _data_values(self, s, inputs):
        """The data and what the step makes of it alone (`data_ops`), on stage s."""
        if s not in self._data_fns:
            prog = self.prog

            def fn(vals):
                vals = dict(vals)
                for i in self.data_ops:
                    eqn = prog.eqns[i]
                    ins = [x.value if isinstance(x, Const) else vals[x] for x in eqn.inputs]
                    vals.update(zip(eqn.outputs, cpu.bind(eqn.primitive, ins, eqn.params)))
                return vals
            self._data_fns[s] = jax.jit(fn)
        return self._data_fns[s](inputs)

    def shard(self, *args):
        """The arguments as this program reads them: each state leaf whole on its stage's
        devices, a copy of its own (a step donating it leaves `args` alone); the data
        goes to every stage's devices at each step."""
        leaves, tree = jax.tree.flatten(args, is_leaf=lambda v: isinstance(v, (Sharded, Staged)))
        leaves = [plain(x) for x in self._inputs(leaves, plain)]
        state = [jax.device_put(jnp.array(x, copy=True), self._whole[self.owner[p]])
                 for p, x in enumerate(leaves[:self.nstate])]
        return jax.tree.unflatten(tree, self._state(state, self.owner)
                                  + [jnp.asarray(x) for x in leaves[self.nstate:]])

    def __call__(self, *args):
        return self.run(jax.tree.flatten(args, is_leaf=lambda v: isinstance(v, (Sharded, Staged)))[0])
