"""Trace a train step to a flat `Program`: one list of primitive applications.

Nested `jit`, custom-derivative calls and `remat` are inlined. A `scan` is lifted into
a *loop region*: its body's eqns appear once, between marker ops for each scanned-over
operand's slice, each carry and each stacked output (see `Loop`), so the planner lays
out the body like any other ops and the lowering runs it as a `lax.scan`. A `cond`
becomes its branches' ops and a `select_n` per result (every branch runs; the index
picks). Other control flow (`while` with a dynamic trip count, a scan inside a loop
body) stays one eqn, its bodies kept for costing. Dead eqns are removed, as XLA would. Tensors are numbered; the same inner
jaxpr inlined twice gets fresh numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
from jax import lax

from hapsynth import _jax


@dataclass(frozen=True)
class Aval:
    """Shape and dtype of a tensor (a JAX-independent copy of a ShapedArray)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return int(math.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True, eq=False)
class Const:
    """An inline constant operand (a jaxpr literal or a closed-over value)."""

    value: Any
    aval: Aval


@dataclass(frozen=True, eq=False)
class Eqn:
    """One primitive application: operands are tensor ids or `Const`s."""

    primitive: Any
    params: Mapping[str, Any]
    inputs: tuple[int | Const, ...]
    outputs: tuple[int, ...]
    in_avals: tuple[Aval, ...]
    out_avals: tuple[Aval, ...]
    source: str = ""
    loop: int | None = None  # the loop region it runs in, if any

    @property
    def name(self) -> str:
        return self.primitive.name


@dataclass(frozen=True)
class Loop:
    """A loop region: eqns `start:end` of the program, run `length` times (in reverse
    order of the scanned-over axis if `reverse`). The region holds, in order:
    - `slices`: `loop_slice(X) -> x`, iteration i's slice `X[i]` of a scanned-over operand;
    - `carries`: `loop_carry(init, carry_out) -> carry_in`, the carry's value in an
      iteration: `init` in the first, the previous iteration's `carry_out` after (a read
      of a later eqn's result: the only backward edge of a program); after the region,
      `carry_out` holds the final value;
    - `body`: the scan body's eqns, once;
    - `stacks`: `loop_stack(y) -> Y`, the per-iteration results stacked on a new axis 0.
    Everything else the body reads is made before the region (loop-invariant)."""

    id: int
    length: int
    reverse: bool
    start: int
    end: int
    slices: tuple[int, ...]
    carries: tuple[int, ...]
    body: tuple[int, ...]
    stacks: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class Program:
    """A whole train step, flattened. `avals[t]` is tensor t's type."""

    eqns: tuple[Eqn, ...]
    avals: tuple[Aval, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int | Const, ...]
    in_tree: Any
    out_tree: Any
    consts: Mapping[int, Any] = field(default_factory=dict)
    traced_eqns: int = 0  # top-level eqns of the jaxpr before inlining
    loops: tuple[Loop, ...] = ()
    # per input leaf: None, or (shape, batch dim) it is fed in (`views.fold_batch_splits`)
    input_views: tuple = ()
    # per leading (state) input leaf: 0, or the rows it is fed as, one input each
    # (a layer-stacked leaf of a program whose loops are written out, `unroll.py`)
    split: tuple[int, ...] = ()


def to_aval(jax_aval) -> Aval:
    dtype = jax_aval.dtype
    try:
        dtype = np.dtype(dtype)
    except TypeError:  # extended dtypes (PRNG keys): keep the object, size by key data
        pass
    return Aval(tuple(int(d) for d in jax_aval.shape), dtype)


class _Builder:
    def __init__(self, lift_loops: bool = True):
        self.avals: list[Aval] = []
        self.eqns: list[Eqn] = []
        self.consts: dict[int, Any] = {}
        self.effectful: set[Eqn] = set()
        self.lift_loops = lift_loops
        self.loop_params: dict[int, tuple[int, bool]] = {}  # loop id -> (length, reverse)

    def new_tensor(self, aval: Aval) -> int:
        self.avals.append(aval)
        return len(self.avals) - 1

    def read(self, env, atom):
        if _jax.is_literal(atom):
            return Const(atom.val, to_aval(atom.aval))
        return env[atom]

    def emit(self, primitive, params, ins, out_avals, source="", loop=None) -> tuple[int, ...]:
        outs = tuple(self.new_tensor(a) for a in out_avals)
        in_avals = tuple(x.aval if isinstance(x, Const) else self.avals[x] for x in ins)
        self.eqns.append(Eqn(primitive, dict(params), tuple(ins), outs, in_avals,
                             tuple(out_avals), source, loop))
        return outs

    def inline(self, jaxpr, consts, args, loop=None) -> list:
        """Append jaxpr's eqns with invars bound to `args`; returns its outputs."""
        env: dict = {}
        for var, val in zip(jaxpr.constvars, consts):
            t = self.new_tensor(to_aval(var.aval))
            self.consts[t] = val
            env[var] = t
        for var, arg in zip(jaxpr.invars, args):
            env[var] = arg
        for eqn in jaxpr.eqns:
            ins = [self.read(env, a) for a in eqn.invars]
            body = _jax.inline_body(eqn)
            branch = _jax.platform_branch(eqn)
            if branch is not None:  # known here: a cond on it keeps one branch
                outs = [Const(np.int32(branch), to_aval(eqn.outvars[0].aval))]
            elif body is not None:
                outs = self.inline(body[0], body[1], ins, loop)
            elif (solve := _jax.linear_solve_body(eqn, ins)) is not None:
                outs = self.inline(*solve, loop)
            elif loop is None and self.lift_loops and _jax.scan_parts(eqn) is not None:
                outs = self.scan(eqn, ins, _jax.source_of(eqn))
            elif self.lift_loops and _jax.cond_branches(eqn) is not None:
                outs = self.cond(eqn, ins, _jax.source_of(eqn), loop)
            else:
                outs = self.emit(eqn.primitive, eqn.params, ins,
                                 [to_aval(v.aval) for v in eqn.outvars],
                                 _jax.source_of(eqn), loop)
                if _jax.has_effects(eqn):
                    self.effectful.add(self.eqns[-1])
            for var, val in zip(eqn.outvars, outs):
                env[var] = val
        return [self.read(env, a) for a in jaxpr.outvars]

    def scan(self, eqn, ins, source) -> list:
        """Lift a scan into a loop region (see `Loop`); returns its outputs' tensors."""
        body, body_consts, nc, ncar, length, reverse = _jax.scan_parts(eqn)
        lid = len(self.loop_params)
        self.loop_params[lid] = (length, reverse)
        consts, inits, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
        x_in = [self.emit(_jax.LOOP_SLICE, {"loop": lid}, [x], [to_aval(v.aval)], source, lid)[0]
                for x, v in zip(xs, body.invars[nc + ncar:])]
        carry_in = [self.new_tensor(to_aval(v.aval)) for v in body.invars[nc:nc + ncar]]
        at = len(self.eqns)  # the carries go here, once their updates are known
        outs = self.inline(body, body_consts, [*consts, *carry_in, *x_in], lid)
        made = {t for e in self.eqns[at:] for t in e.outputs}
        carry_out = [o if isinstance(o, int) and o in made else
                     self.emit(_jax.COPY, {}, [o], [self.avals[c]], source, lid)[0]
                     for o, c in zip(outs[:ncar], carry_in)]
        carries = [Eqn(_jax.LOOP_CARRY, {"loop": lid}, (i, o), (c,),
                       (i.aval if isinstance(i, Const) else self.avals[i], self.avals[o]),
                       (self.avals[c],), source, lid)
                   for i, o, c in zip(inits, carry_out, carry_in)]
        self.eqns[at:at] = carries
        ys = [self.emit(_jax.LOOP_STACK, {"loop": lid}, [y], [to_aval(v.aval)], source, lid)[0]
              for y, v in zip(outs[ncar:], eqn.outvars[ncar:])]
        return [*carry_out, *ys]


    def cond(self, eqn, ins, source, loop) -> list:
        """A `cond` as all its branches, each result chosen by `select_n` on the index:
        one program in which every branch's ops are laid out under one plan (both run;
        the one the index names is kept)."""
        index, operands = ins[0], ins[1:]
        branches = _jax.cond_branches(eqn)
        if isinstance(index, Const):  # (a platform's branch, `platform_branch`)
            k = int(np.clip(np.asarray(index.value), 0, len(branches) - 1))
            return self.inline(*branches[k], operands, loop)
        results = [self.inline(jaxpr, consts, operands, loop) for jaxpr, consts in branches]
        outs = []
        for cases, var in zip(zip(*results), eqn.outvars):
            aval = to_aval(var.aval)
            if all(c is cases[0] for c in cases):
                outs.append(cases[0])
                continue
            outs.append(self.emit(_jax.SELECT_N, {}, [index, *cases], [aval], source, loop)[0])
        return outs


def flatten(jaxpr, consts=(), lift_loops: bool = True):
    """Flatten an open jaxpr with its consts: (eqns, avals, input ids, outputs, consts,
    loops). `lift_loops=False` keeps every scan one eqn (costing control-flow bodies)."""
    b = _Builder(lift_loops)
    inputs = [b.new_tensor(to_aval(v.aval)) for v in jaxpr.invars]
    outputs = b.inline(jaxpr, consts, inputs)
    eqns = _dce(b.eqns, outputs, b.effectful)
    return eqns, b.avals, inputs, outputs, b.consts, loops_of(eqns, b.loop_params)


def _dce(eqns: list[Eqn], outputs, effectful: set[Eqn]) -> list[Eqn]:
    """Keep the eqns whose results are used. A loop region whose results are used keeps
    every carry (each iteration reads the last one's)."""
    live = {o for o in outputs if isinstance(o, int)}
    carry_outs: dict[int, list[int]] = {}
    loop_outs: dict[int, set[int]] = {}
    for e in eqns:
        if e.name == _jax.LOOP_CARRY.name:
            carry_outs.setdefault(e.loop, []).append(e.inputs[1])
        if e.loop is not None and e.name != _jax.LOOP_CARRY.name:
            loop_outs.setdefault(e.loop, set()).update(e.outputs)
    entered: set[int] = set()
    kept = []
    for i in range(len(eqns) - 1, -1, -1):
        e = eqns[i]
        if e.loop is not None and e.loop not in entered:
            entered.add(e.loop)  # the region's last eqn: is any of its results used?
            if live & loop_outs.get(e.loop, set()):
                live.update(carry_outs.get(e.loop, ()))
        if e in effectful or any(o in live for o in e.outputs) or (
                e.name == _jax.LOOP_CARRY.name and e.inputs[1] in live):
            kept.append(e)
            live.update(x for x in e.inputs if isinstance(x, int))
    kept.reverse()
    return kept


def loops_of(eqns, params: dict) -> tuple[Loop, ...]:
    """The loop regions of a flat eqn list (contiguous by construction)."""
    at: dict[int, list[int]] = {}
    for i, e in enumerate(eqns):
        if e.loop is not None:
            at.setdefault(e.loop, []).append(i)
    out = []
    for lid, ids in sorted(at.items()):
        assert ids == list(range(ids[0], ids[-1] + 1)), "a loop region is contiguous"
        kinds: dict[str, list[int]] = {}
        for i in ids:
            kinds.setdefault(eqns[i].name, []).append(i)
        body = tuple(i for i in ids if eqns[i].name not in _jax.LOOP_MARKERS)
        length, reverse = params[lid]
        out.append(Loop(lid, length, reverse, ids[0], ids[-1] + 1,
                        tuple(kinds.get(_jax.LOOP_SLICE.name, ())),
                        tuple(kinds.get(_jax.LOOP_CARRY.name, ())), body,
                        tuple(kinds.get(_jax.LOOP_STACK.name, ()))))
    return tuple(out)


def trace(fn, *args) -> Program:
    """Trace `fn(*args)` (arrays or ShapeDtypeStructs) into a flat Program."""
    closed, in_tree, out_tree = _jax.make_jaxpr(fn, *args)
    eqns, avals, inputs, outputs, consts, loops = flatten(closed.jaxpr, closed.consts)
    return Program(
        eqns=tuple(eqns), avals=tuple(avals), inputs=tuple(inputs), outputs=tuple(outputs),
        in_tree=in_tree, out_tree=out_tree, consts=consts, traced_eqns=len(closed.jaxpr.eqns),
        loops=loops)


def value_of(env, x):
    """An operand's value: a constant's own, or the tensor's from `env`."""
    return x.value if isinstance(x, Const) else env[x]


def evaluate(prog: Program, flat_args, place=None) -> dict:
    """Run the flat program eqn by eqn (eager, or traced under jit), each loop region as
    one `lax.scan`; returns {tensor id: value}. `place(tensor id, value)`, if given,
    replaces each result as it is made (the lowering uses it to pin results to their
    planned layouts)."""
    env = dict(prog.consts)
    env.update(zip(prog.inputs, flat_args))
    loops = {lp.start: lp for lp in prog.loops}
    i = 0
    while i < len(prog.eqns):
        if i in loops:
            _run_loop(prog, loops[i], env, place)
            i = loops[i].end
            continue
        _run_eqn(prog.eqns[i], env, place)
        i += 1
    return env


def _run_eqn(e: Eqn, env: dict, place) -> None:
    outs = _jax.bind(e.primitive, [value_of(env, x) for x in e.inputs], e.params)
    if not e.primitive.multiple_results:
        outs = (outs,)
    if place is not None:
        outs = [place(t, v) for t, v in zip(e.outputs, outs)]
    env.update(zip(e.outputs, outs))


def _run_loop(prog: Program, loop: Loop, env: dict, place) -> None:
    eqns = prog.eqns
    carries = [eqns[c] for c in loop.carries]
    init = [np.asarray(x.value, x.aval.dtype) if isinstance(x, Const) else env[x]
            for x in (c.inputs[0] for c in carries)]
    xs = [env[eqns[s].inputs[0]] for s in loop.slices]

    def body(carry, x):
        local = dict(env)  # what the body reads from before the loop: invariant
        local.update(zip((c.outputs[0] for c in carries), carry))
        local.update(zip((eqns[s].outputs[0] for s in loop.slices), x))
        for i in loop.body:
            _run_eqn(eqns[i], local, place)
        return ([value_of(local, c.inputs[1]) for c in carries],
                [value_of(local, eqns[s].inputs[0]) for s in loop.stacks])

    final, ys = lax.scan(body, init, xs, length=loop.length, reverse=loop.reverse)
    env.update(zip((c.inputs[1] for c in carries), final))
    for s, y in zip(loop.stacks, ys):
        t = eqns[s].outputs[0]
        env[t] = place(t, y) if place is not None else y
