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
order and each receiving device takes its own. A stage's partial sums (gradients, the
loss) add up over the microbatches, in float32 where narrower; then the once-per-step
ops run per stage in rounds, a value made on one stage crossing to the next round of
another. A step written out of a scan over layers (`Program.split`) runs too, its
stacked leaves as `hs.StagedRows` whose rows stay on their stages.

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
from hapsynth.ir.signature import of_program
from hapsynth.ir.trace import Const, Program
from hapsynth.lower import cpu
from hapsynth.lower.moves import move
from hapsynth.lower.packing import pad_to, trim
from hapsynth.lower.rounds import post_rounds
from hapsynth.lower.values import Sharded, Staged, plain
from hapsynth.lower.wiring import StageWiring
from hapsynth.synth.plan import Plan
from hapsynth.synth.slots import sum_dtype

__all__ = ["FreeRunning"]

DATA = "data"


class FreeRunning(StageWiring):
    """A pipeline plan bound to a traced program and the devices of one process."""

    def __init__(self, prog: Program, plan: Plan, devices, *, donate=(), branch_hook=None):
        """`donate`: flat indices of the step's argument leaves whose buffers the step may
        reuse (as `jax.jit`'s `donate_argnums`): a state leaf's is given up to the round
        of once-per-step ops reading it last. `branch_hook`: measurement harnesses only
        (`hook.py`): every stage's work and round of once-per-step ops runs
        `hook.wrap`ped on each of its devices."""
        plan.check(of_program(prog))
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
        value on the sender's devices, the microbatch's rows in order (`_crossing`), so a
        stage of other devices takes its own rows of it; what a forward keeps for its
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
            return new, kept, {t: self._leave(s, t, v) for t, v in out.items()}

        own, whole = PS(DATA), PS()
        into = {t: self._crossing(t) for t in self.crossing_in[(s, ph)]}
        return self._program(s, fn, (whole, whole, whole, into, own, own),
                             (own, own, {t: self._crossing(t, s) for t in sent}), donate=(5,),
                             entry=lambda m, state, data, *_: [False] + [True] * (
                                 len(state) + len(data)))

    def _leave(self, s, t, v):
        """Value t as stage s's devices hold it (padded to the most rows) as it leaves:
        sharded over devices of uneven rows, gathered whole (the devices' rows in order).
        No partial sum crosses (`synth.stages.analyse` keeps its readers with it)."""
        lay = self.plan.tensor_layouts[t]
        if lay.kind != "S" or self.even[s]:
            return v
        chunks = jax.lax.all_gather(v, DATA)
        return jnp.concatenate([trim(chunks[j], lay, self._local(t, r))
                                for j, r in enumerate(self.rows[s])], axis=lay.dim)

    def _crossing(self, t, sender=None) -> PS:
        """How value t lies as it crosses: split on its batch dimension over a stage's
        devices where sharded (each device its own rows, so that a stage of other devices
        takes its rows from it), else whole. Leaving a
        `sender` of uneven rows, sharded values are whole (`_leave`)."""
        lay = self.plan.tensor_layouts[t]
        if lay.kind == "S" and (sender is None or self.even[sender]):
            return PS(*([None] * lay.dim), DATA)
        return PS()

    def _arriving(self, t, v, a, b):
        """Value t, sent by stage a, on stage b's devices as its programs read it."""
        if (t, a, b) not in self._rechunks:
            self._rechunks[(t, a, b)] = self._relayout(t, a, b)
        fn, where = self._rechunks[(t, a, b)]
        return move(v if fn is None else fn(v), where)

    def _relayout(self, t, a, b):
        """(a program on a's devices or None, b's sharding) for value t from stage a to b.
        A sharded value whose layouts differ (uneven rows on either side, or unequal
        device counts) is first re-laid on a's devices as b's devices take it, their rows
        each padded to the most (each trims its own): split over a's devices where the
        counts match, so that it crosses as it lies (what a transfer across processes
        needs), else whole."""
        lay = self.plan.tensor_layouts[t]
        where = NamedSharding(self.meshes[b], self._crossing(t))
        na, nb = self.meshes[a].devices.size, self.meshes[b].devices.size
        if lay.kind != "S" or self.even[a] and self.even[b] and na == nb:
            return None, where
        scale = self.prog.avals[t].shape[lay.dim] // self.r.batch
        most = max(self.rows[b]) * scale

        def rechunk(x):
            return jnp.concatenate([pad_to(jax.lax.slice_in_dim(
                x, o * scale, (o + r) * scale, axis=lay.dim), lay, (
                *x.shape[:lay.dim], most, *x.shape[lay.dim + 1:]))
                for o, r in zip(self._offsets(b), self.rows[b])], axis=lay.dim)
        on_a = NamedSharding(self.meshes[a], self._crossing(t)) if na == nb else self._whole[a]
        return jax.jit(rechunk, out_shardings=on_a), where

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
        """The once-per-step ops in rounds: an op runs in the round after the last one
        making a value it reads on another stage (sums count as made in round 0)."""
        prog = self.prog
        ranked = post_rounds(self)
        self.where, self.level = where, level = ranked.where, ranked.level
        # per value, the rounds (level, stage) reading it: a round returns only what
        # another round or the step's outputs read (the rest stays inside its program)
        readers: dict = {}
        for ids in self.post.values():
            for i in ids:
                for x in prog.eqns[i].inputs:
                    if isinstance(x, int):
                        readers.setdefault(x, set()).add((level[i], self.stage[i]))
        outputs = {o for o in prog.outputs if isinstance(o, int)}
        rounds = {}
        for k in sorted(set(level.values())):
            for s in range(self.S):
                ops = [i for i in self.post[s] if level[i] == k]
                if ops:
                    rounds[(k, s)] = (ops, [t for i in ops for t in prog.eqns[i].outputs
                                            if t in outputs or readers.get(t, set()) - {(k, s)}])
        # per stage, the state leaves it stores and the outputs it makes (once the rounds ran)
        outs = prog.outputs
        self.stores = {s: [p for p in range(self.nstate) if self.owner[p] == s]
                       for s in range(self.S)}
        self.results = [o for o in outs[self.nstate:] if not isinstance(o, Const)]
        self.made_on = {o: where[o][0] if o in where else self.out_stage.get(o, 0)
                        for o in self.results}
        # per round and stage, the values it reads that another stage made: (value, maker)
        self._wants = {(k, s): list(dict.fromkeys(
            (x, where[x][0]) for i in self.post[s] if level[i] == k for x in prog.eqns[i].inputs
            if isinstance(x, int) and x in where and where[x][0] != s)) for k, s in rounds}
        # per stage, what its state leaves and outputs read from elsewhere once the rounds
        # ran: (value, the stage making it, or None for a state leaf passed through)
        self._fetch = {s: [(o, where[o][0] if o in where else None) for o in dict.fromkeys(
            [outs[p] for p in self.stores[s]] + [o for o in self.results if self.made_on[o] == s])
            if isinstance(o, int) and (o in where and where[o][0] != s or o in self.leaf)]
            for s in range(self.S)}
        self._final = {s: list(dict.fromkeys([
            *[outs[p] for p in self.stores[s] if isinstance(outs[p], int)],
            *[o for o in self.results if self.made_on[o] == s]])) for s in range(self.S)}
        self._made_last: dict = {}  # (stage, values no round made) -> a program making them
        self._gone = self._donated(rounds)
        self._post = {key: self._program(key[1], self._evaluate(key[1], ops, made, apart=True),
                                         (PS(), PS()), PS(), donate=(0,))
                      for key, (ops, made) in rounds.items()}

    def _donated(self, rounds) -> dict:
        """Per round, the donated state leaves it gives up (`donate`): those its stage
        alone holds, read last by that round (through the state-only ops it runs), and
        neither stored nor output as they are."""
        prog, r = self.prog, self.r

        def leaves_read(i, seen):
            out = set()
            for x in prog.eqns[i].inputs:
                if not isinstance(x, int):
                    continue
                if x in self.leaf:
                    out.add(x)
                j = self.producer.get(x)
                if j is not None and j not in seen and (
                        r.region[j] == "pre" or r.rank[j] < 0 and r.region[j] == "micro"):
                    seen.add(j)
                    out |= leaves_read(j, seen)
            return out
        kept = set()  # stored or output as they are, or read by what no round makes
        for o in (o for fin in self._final.values() for o in fin):
            if o in self.leaf:
                kept.add(o)
            elif o not in self.where and o in self.producer:
                kept |= leaves_read(self.producer[o], set())
        last: dict = {}
        for (k, s), (ops, _) in sorted(rounds.items()):
            for t in set().union(*[leaves_read(i, set()) for i in ops]):
                last[t] = (k, s)
        gone = {key: [] for key in rounds}
        for t, (k, s) in last.items():
            p = self.leaf[t]
            if p in self.donate and self.owner[p] == s and self._holders[p] == [s] \
                    and t not in kept:
                gone[(k, s)].append(t)
        return gone

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
        whole = self._whole
        state = [{} for _ in range(S)]  # per stage, the state leaves it reads, by id
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
        acc = [{ph: self._zeros[(s, ph)]() for ph in "FB"} for s in range(S)]
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
        # once per step: the sums, then the rounds
        avail = [{**state[s], **data[s]} for s in range(S)]
        for s in range(S):
            for ph in "FB":
                avail[s].update(self._summed(s, acc[s][ph]))
        for (k, s), fn in self._post.items():
            for x, src in self._wants[(k, s)]:
                if x not in avail[s]:
                    avail[s][x] = self._put(avail[src][x], s)
            gone = {t: avail[s].pop(t) for t in self._gone[(k, s)]}
            avail[s].update(fn(gone, avail[s], *self._extra(s)))
        outs = prog.outputs
        for s in range(S):  # what the last round made elsewhere, for a state leaf or output
            for o, src in self._fetch[s]:
                if o in avail[s]:
                    continue
                if src is not None and o in avail[src]:
                    avail[s][o] = self._put(avail[src][o], s)
                elif o in self.leaf:
                    avail[s][o] = move(leaves[self.leaf[o]], whole[s])
        final = [self._last(s, avail[s]) for s in range(S)]
        new = []
        for p in range(self.nstate):
            o, s = outs[p], self.owner[p]
            new.append(jax.device_put(jnp.broadcast_to(jnp.asarray(o.value), o.aval.shape),
                                      whole[s]) if isinstance(o, Const) else final[s][o])
        results = [jnp.asarray(o.value) if isinstance(o, Const) else final[self.made_on[o]][o]
                   for o in outs[self.nstate:]]
        return jax.tree.unflatten(prog.out_tree, self._state(new, self.owner) + results)

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
