"""What a pipeline plan's stages run and exchange, whatever runs them: per stage its
microbatch ops by phase and its once-per-step ops, what each phase keeps for its own
backward and sends to other stages, its partial sums, the parameters it copies from the
stages storing them; and the evaluation of a stage's ops at a microbatch's rows.
`Pipelined` (one SPMD program stepping a tick table) and `FreeRunning` (a program per
stage and phase, each stage running as soon as its inputs are there) both build on it.
"""
from __future__ import annotations

import jax
import numpy as np
from jax import lax

from hapsynth.ir import lift_program
from hapsynth.ir.rules import evaluate_block, facts, local_params
from hapsynth.ir.trace import Const, Program
from hapsynth.lower import cpu
from hapsynth.lower.values import Sharded, Staged, StagedRows
from hapsynth.synth.plan import Plan
from hapsynth.synth.stages import analyse, stage_of

__all__ = ["StageWiring"]


class StageWiring:
    """A pipeline plan's stages over a traced program (no devices, no JAX arrays)."""

    def __init__(self, prog: Program, plan: Plan):
        if prog.loops or prog.input_views:
            raise NotImplementedError("a pipelined step with loop regions or microbatch views")
        self.prog, self.plan = prog, plan
        pipe = plan.pipeline
        self.S, self.M = len(plan.stages), int(pipe["micros"])
        self.nstate = plan.state_leaves
        self.leaves = self.nstate - sum(max(n - 1, 0) for n in prog.split)  # the step's own
        graph = lift_program(prog)
        self.r = analyse(graph, plan.tensor_layouts, plan.op_inputs, self.nstate)
        cuts = pipe["cuts"]
        self.stage = [stage_of(x, cuts) if x >= 0 else -1 for x in self.r.rank]
        self.owner = [stage_of(x, cuts) for x in self.r.owner_rank]
        self.rows = [tuple(st["rows"]) for st in plan.stages]
        self.mb = self.r.batch // self.M
        self.producer = {t: i for i, e in enumerate(prog.eqns) for t in e.outputs}
        self.leaf = {t: i for i, t in enumerate(prog.inputs[:self.nstate])}
        self.data = {t: i for i, t in enumerate(prog.inputs) if i >= self.nstate}
        self.data_ops = [i for i, e in enumerate(prog.eqns) if self.r.region[i] == "data"]
        for i in self.data_ops:
            self.data.update((t, -1) for t in prog.eqns[i].outputs)
        self._wire()

    def _wire(self):
        r, prog = self.r, self.prog
        n = len(prog.eqns)
        self.core = {(s, ph): [i for i in range(n) if r.region[i] == "micro" and self.stage[i] == s
                               and r.forward[i] == (ph == "F")]
                     for s in range(self.S) for ph in "FB"}
        self.post = {s: [i for i in range(n) if r.region[i] == "post" and self.stage[i] == s]
                     for s in range(self.S)}
        # per (stage, phase): the micro values it reads that another (stage, phase) makes
        reads: dict = {}
        for (s, ph), ids in self.core.items():
            for i in ids:
                for x in prog.eqns[i].inputs:
                    j = self.producer.get(x) if isinstance(x, int) else None
                    if j is None or r.region[j] != "micro" or self.stage[j] < 0:
                        continue
                    src = (self.stage[j], "F" if r.forward[j] else "B")
                    if src != (s, ph):
                        reads.setdefault((s, ph), {}).setdefault(src, set()).add(x)
        self.reads = reads
        # what each (stage, phase) keeps for itself (F -> B) or sends, per destination
        self.keeps = {s: sorted(reads.get((s, "B"), {}).get((s, "F"), ())) for s in range(self.S)}
        self.sends = {}
        for (b, phb), srcs in reads.items():
            for (a, pha), xs in srcs.items():
                if a != b:
                    self.sends.setdefault((a, pha), {}).setdefault((b, phb), set()).update(xs)
        # a value read by both phases of a later stage (the activation entering it, read
        # again by its weight gradient) crosses once: that stage's forward keeps it
        for (a, pha), dests in self.sends.items():
            for (b, phb), xs in dests.items():
                twice = xs & dests.get((b, "B"), set()) if phb == "F" else set()
                if twice:
                    dests[(b, "B")] -= twice
                    self.keeps[b] = sorted(set(self.keeps[b]) | twice)
            for key in [k for k, xs in dests.items() if not xs]:
                del dests[key]
        # the partial sums read once per step (by post ops, or as outputs): accumulated
        later = {x for i, e in enumerate(prog.eqns) if r.region[i] == "post" for x in e.inputs
                 if isinstance(x, int)} | {o for o in prog.outputs if isinstance(o, int)}
        self.acc = {s: sorted({t for i in self.core[(s, "F")] + self.core[(s, "B")]
                               for t in prog.eqns[i].outputs
                               if self.plan.tensor_layouts[t].kind == "P" and t in later})
                    for s in range(self.S)}
        # the phase each value is made in ("F" or "B"): a phase adds to its own sums
        self.made_in = {t: "F" if r.forward[i] else "B" for i, e in enumerate(prog.eqns)
                        for t in e.outputs}
        # parameters a stage reads but another stores
        needs = [set() for _ in range(self.S)]
        for i, e in enumerate(prog.eqns):
            s = self.stage[i]
            if s < 0 or r.region[i] == "pre":
                continue
            needs[s] |= r.reads[i]
        for s, outs in enumerate(self._output_needs()):
            needs[s] |= outs
        self.copies = [sorted(p for p in needs[s] if self.owner[p] != s) for s in range(self.S)]

    def sums_of(self, s, ph) -> list:
        """Stage s's sums that phase `ph` ("F" or "B") adds to."""
        return [t for t in self.acc[s] if self.made_in[t] == ph]

    def _output_needs(self):
        """Outputs made from state alone (a state input, or by pre ops): a state output on
        its owner, another output on the stage storing the first parameter it reads
        (`self.out_stage`); the parameters each stage needs for them."""
        needs = [set() for _ in range(self.S)]
        self.out_stage = {}
        for i, o in enumerate(self.prog.outputs):
            if not isinstance(o, int) or not (o in self.leaf or o in self.producer and
                                              self.r.region[self.producer[o]] == "pre"):
                continue
            leaves = {self.leaf[o]} if o in self.leaf else set(self.r.reads[self.producer[o]])
            s = self.owner[i] if i < self.nstate else self.owner[min(leaves)] if leaves else 0
            self.out_stage.setdefault(o, s)
            needs[s] |= leaves
        return needs

    # -- local shapes -------------------------------------------------------------------
    def _local(self, t, rows: int | None):
        """Tensor t's shape on a device holding `rows` rows of a microbatch (None: whole)."""
        aval = self.prog.avals[t]
        lay = self.plan.tensor_layouts[t]
        shape = list(aval.shape)
        if lay.kind == "S" and rows is not None:
            shape[lay.dim] = shape[lay.dim] * rows // self.r.batch
        return tuple(shape)

    def _padded(self, t, s):
        return self._local(t, max(self.rows[s]))

    def _split_rows(self, s, v, dim):
        """A microbatch's rows of held data `v` (batch on `dim`) as stage s's program reads
        them (here: as they are)."""
        return v

    def _row_start(self, s, micro):
        """The first row of the batch this device holds of microbatch `micro` on stage s."""
        raise NotImplementedError

    # -- evaluation -----------------------------------------------------------------------
    def _evaluator(self, s, rows, micro, env, resolve):
        """A function evaluating op ids into `env`, at `rows` rows of microbatch `micro`
        (None: once per step, whole); `resolve(x)` gives values made elsewhere."""
        prog, plan, r = self.prog, self.plan, self.r
        start = None if micro is None else self._row_start(s, micro)

        def whole(x):
            """Its value, made or held whole on this device (data, state, state-only ops)."""
            if x in env:
                return env[x]
            j = self.producer.get(x)
            if j is not None and (r.region[j] == "pre" or r.rank[j] < 0 and r.region[j] == "micro"):
                run(j)
            else:
                env[x] = resolve(x)
            return env[x]

        def value(x, need):
            if isinstance(x, Const):
                return x.value
            v = whole(x)
            j = self.producer.get(x)
            held = x in self.data or x in self.leaf or j is not None and r.region[j] == "pre"
            if held and micro is not None and need is not None and need.kind == "S":
                # the plan reads it sharded: this device's rows of this microbatch
                scale = prog.avals[x].shape[need.dim] // r.batch
                v = self._split_rows(s, lax.dynamic_slice_in_dim(
                    v, start * scale, rows * scale, axis=need.dim), need.dim)
            return v

        def run(i):
            eqn = prog.eqns[i]
            vals = [value(x, n) for x, n in zip(eqn.inputs, plan.op_inputs[i])]
            if r.region[i] == "micro" and micro is not None and plan.op_factors[i] >= 0:
                shapes = [list(self._local(t, rows)) for t in eqn.outputs]
                if facts(eqn.name).block:
                    outs = evaluate_block(eqn, vals, shapes, lambda: self._starts(eqn, start))
                else:
                    outs = cpu.bind(eqn.primitive, vals, local_params(
                        eqn, [np.shape(v) for v in vals], shapes))
            else:
                outs = cpu.bind(eqn.primitive, vals, eqn.params)
            env.update(zip(eqn.outputs, outs))

        return run

    def _starts(self, eqn, start):
        out = []
        for t, aval in zip(eqn.outputs, eqn.out_avals):
            lay, at = self.plan.tensor_layouts[t], [0] * len(aval.shape)
            if lay.kind == "S":
                at[lay.dim] = start * (aval.shape[lay.dim] // self.r.batch)
            out.append(at)
        return out

    def _offsets(self, s) -> np.ndarray:
        """Per device of stage s, the first of its rows in a microbatch."""
        return np.concatenate([[0], np.cumsum(self.rows[s])[:-1]]).astype(np.int32)

    # -- arguments -------------------------------------------------------------------------
    def _rows_in(self, k) -> int:
        """How many rows the program reads step leaf k as (`Program.split`; 0: whole)."""
        return self.prog.split[k] if k < len(self.prog.split) else 0

    def _inputs(self, leaves, plain=lambda x: x) -> list:
        """The step's argument leaves as the program's inputs: a leaf the program reads
        as rows (`Program.split`) gives one input per row (this runtime's own
        `StagedRows` as they are held; any other leaf made `plain` first and sliced)."""
        n_leaves = len(self.prog.inputs) - self.nstate + self.leaves
        if len(leaves) != n_leaves:
            raise ValueError(f"expected {n_leaves} array leaves, got {len(leaves)}")
        out = []
        for k, x in enumerate(leaves):
            n = self._rows_in(k)
            if not n:
                out.append(x)
            elif isinstance(x, StagedRows) and x.owner is self:
                out += x.rows
            else:
                x = plain(x)
                out += [x[i] for i in range(n)]
        return out

    def _program_inputs(self, leaves) -> set[int]:
        """The program's state inputs that flat step leaves `leaves` are fed as (a leaf
        read as rows, `Program.split`, is several)."""
        wanted, out, at = set(leaves), set(), 0
        for k in range(self.leaves):
            n = max(self._rows_in(k), 1)
            if k in wanted:
                out |= set(range(at, at + n))
            at += n
        return out

    def _state(self, rows, stages=None) -> list:
        """The program's state leaves back as the step's: the rows of a stacked leaf
        regrouped as `StagedRows` (`stages`: each row's stage, where rows are arrays)."""
        out, it, p = [], iter(rows), 0
        for k in range(self.leaves):
            n = self._rows_in(k)
            if n:
                out.append(StagedRows([next(it) for _ in range(n)], owner=self, stages=None
                                      if stages is None else stages[p:p + n]))
            else:
                out.append(next(it))
            p += max(n, 1)
        return out

    def load(self, load, *args):
        """Like `shard`, every leaf given as a `jax.ShapeDtypeStruct` read through
        `load(path, dim, start, stop)`: whole (`load(path, 0, 0, n)`), since every device
        of a pipeline reads its microbatches' rows from the whole batch and a stage's
        state is packed from whole leaves. The shapes and dtypes returned are checked."""
        flat, tree = jax.tree_util.tree_flatten_with_path(
            args, is_leaf=lambda v: isinstance(v, (Sharded, Staged)))

        def read(path, x):
            if not isinstance(x, jax.ShapeDtypeStruct):
                return x
            where = jax.tree_util.keystr(path)
            v = np.asarray(load(where, 0, 0, x.shape[0] if x.shape else 1), x.dtype)
            if v.shape != tuple(x.shape):
                raise ValueError(f"load({where!r}, 0, 0, {x.shape[0] if x.shape else 1}) "
                                 f"returned shape {v.shape}, expected {tuple(x.shape)}")
            return v
        return self.shard(*jax.tree.unflatten(tree, [read(p, x) for p, x in flat]))
