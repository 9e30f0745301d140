"""The sharding IR: plain frozen values that cross from `ir/` to `synth/` and `lower/`.

A `Rule` describes one op by *factors* (the idea of Shardy's OpShardingRule):
each factor has a size and the (operand, dim) / (result, dim) positions it
occupies. A dim may hold a factor as its *major part*: then the dim's size is a
multiple of the factor's size and a shard of k factor units is k*(dim/size) rows.
Dims that hold no factor must stay whole on every device.

`str(rule)` is einsum-like, one letter per factor in factor order (`a` is
`factors[0]`, `b` is `factors[1]`, ...; after `z`: `z1`, `z2`, ...). A dim shows
the letters of the factors it holds (a merged reshape dim holds its major factor),
`1` if it holds none and has size 1, `_` if it holds none and is kept whole.
Reductions follow as `sum={..}` (by monoid), blocked factors as `blocked={..}`:

    dot_general [8,6,5]x[5,7]:  ([a,b,d],[d,c])->([a,b,c]) sum={d}
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

PARALLEL = "parallel"    # in a result: sharding it shards every mapped dim alike
REDUCTION = "reduction"  # operands only: sharding it makes the result partial (see `reduce`)
BLOCKED = "blocked"      # must not be sharded (sorted dim, gathered dim, conv window, ...)

Pos = tuple[int, int]  # (operand or result index, dim)


@dataclass(frozen=True)
class Factor:
    size: int
    kind: str
    operands: tuple[Pos, ...] = ()
    results: tuple[Pos, ...] = ()
    # For REDUCTION: how per-device partial results combine ("sum", "max", "min", ...).
    # Under "sum", operands that do not hold the factor must be partial sums too.
    reduce: str | None = None

    @property
    def shardable(self) -> bool:
        """May the planner shard it: a parallel factor or a sum (size > 1)."""
        return self.size > 1 and (self.kind == PARALLEL
                                  or (self.kind == REDUCTION and self.reduce == "sum"))

    @property
    def tag(self) -> str:
        """"par", "blocked", or a reduction's monoid ("sum", "max", ...)."""
        if self.kind == REDUCTION:
            return self.reduce or "reduce"
        return "par" if self.kind == PARALLEL else self.kind

    def __repr__(self) -> str:  # e.g. `sum:768 (0,2),(1,0) -> -`
        def pos(ps):
            return ",".join(f"({i},{d})" for i, d in ps) or "-"
        return f"{self.tag}:{self.size} {pos(self.operands)} -> {pos(self.results)}"


def factor_letter(i: int) -> str:
    """The name of factor i when a rule is printed: a..z, then z1, z2, ..."""
    return chr(ord("a") + i) if i < 26 else f"z{i - 25}"


@dataclass(frozen=True)
class Rule:
    """How an op may be sharded. `supported=False` means replicated-only fallback.

    `operand_shapes` / `result_shapes` are the op's shapes (filled in by `rule_for`;
    a literal scalar operand has shape `()`), so the rule prints dims holding no factor.
    """

    factors: tuple[Factor, ...] = ()
    supported: bool = True
    note: str = ""  # why an op is replicated-only by design
    operand_shapes: tuple[tuple[int, ...], ...] = ()
    result_shapes: tuple[tuple[int, ...], ...] = ()

    def shardable(self) -> tuple[int, ...]:
        """Indices of factors that may be sharded."""
        return tuple(i for i, f in enumerate(self.factors) if f.kind != BLOCKED and f.size > 1)

    def __str__(self) -> str:
        if not self.supported:
            return "unsupported"
        if self.note and not self.factors:
            return f"replicated ({self.note})"
        letters: dict[tuple[int, int, int], str] = {}  # (0 operand | 1 result, index, dim) -> letters
        groups: dict[str, list[str]] = {}  # "sum", "max", ..., "blocked" -> letters
        for k, f in enumerate(self.factors):
            x = factor_letter(k)
            for side, positions in ((0, f.operands), (1, f.results)):
                for i, d in positions:
                    letters[side, i, d] = letters.get((side, i, d), "") + x
            if f.kind != PARALLEL:
                groups.setdefault(f.tag, []).append(x)
        text = _arrays(letters, 0, self.operand_shapes) + "->" + _arrays(letters, 1, self.result_shapes)
        for g in sorted(groups, key=lambda g: g == "blocked"):  # monoids first, then blocked
            text += f" {g}={{{','.join(groups[g])}}}"
        return text + (f" ({self.note})" if self.note else "")


def _arrays(letters, side: int, shapes) -> str:
    """`([a,_],[])`: each operand's (side 0) or result's (side 1) dims, printed."""
    ranks = [len(sh) for sh in shapes]
    for (s, i, d) in letters:  # a hand-built rule has no shapes: ranks come from positions
        if s == side and i >= len(shapes):
            ranks += [0] * (i + 1 - len(ranks))
            ranks[i] = max(ranks[i], d + 1)

    def dim(i, d):
        if (side, i, d) in letters:
            return letters[side, i, d]
        return "?" if i >= len(shapes) else "1" if shapes[i][d] == 1 else "_"

    return "(" + ",".join("[" + ",".join(dim(i, d) for d in range(r)) + "]"
                          for i, r in enumerate(ranks)) + ")"


@dataclass(frozen=True)
class Cost:
    """XLA-convention cost: flops (multiply-add = 2), transcendentals, bytes touched."""

    flops: float = 0.0
    transcendentals: float = 0.0
    bytes: float = 0.0


@dataclass(frozen=True)
class Tensor:
    id: int
    shape: tuple[int, ...]
    dtype: str
    producer: int | None  # op index; None for step inputs and constants
    kind: str = "intermediate"  # "input" | "const" | "intermediate"
    itemsize: int = 4  # bytes per element (PRNG key dtypes have no numpy name)
    fused: bool = False  # fused into its one reader by XLA: never held in memory

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def __str__(self) -> str:  # e.g. `t5 f32[8,128,768]`
        return f"t{self.id} {short_dtype(self.dtype)}[{','.join(map(str, self.shape))}]"


def short_dtype(name: str) -> str:
    """JAX's short dtype names: float32 -> f32, bfloat16 -> bf16, uint8 -> u8, ..."""
    for long, short in (("bfloat", "bf"), ("float", "f"), ("uint", "u"), ("int", "i"), ("complex", "c")):
        if name.startswith(long):
            return short + name[len(long):]
    return name


@dataclass(frozen=True)
class Op:
    """One primitive application (an eqn of the flattened step)."""

    id: int
    primitive: str
    inputs: tuple[int | None, ...]  # tensor ids; None for an inline literal
    outputs: tuple[int, ...]
    rule: Rule
    cost: Cost  # of all its runs: a loop body's op runs `repeat` times
    node: int  # the coarsened node this op belongs to
    loop: int | None = None  # the loop region it runs in (see `trace.Loop`)
    repeat: int = 1
    carries: str | None = None  # a partial sum passes through: "unary", "sum" (registry)

    def __str__(self) -> str:  # `op 12 dot_general(t3, t4) -> t5  ([a,b,d],[d,c])->([a,b,c]) sum={d}`
        ins = ", ".join("lit" if t is None else f"t{t}" for t in self.inputs)
        outs = ", ".join(f"t{t}" for t in self.outputs)
        return f"op {self.id} {self.primitive}({ins}) -> {outs}  {self.rule}"


@dataclass(frozen=True)
class Node:
    """A coarsened group of ops that share one sharding decision."""

    id: int
    ops: tuple[int, ...]
    kind: str  # "compute" (a dot/conv/reduce... leader), "elementwise", "optimizer", "opaque"


@dataclass(frozen=True)
class Graph:
    tensors: tuple[Tensor, ...]
    ops: tuple[Op, ...]
    nodes: tuple[Node, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int | None, ...]
    unsupported: Mapping[str, int] = field(default_factory=dict)
    input_paths: tuple[str, ...] = ()  # pytree path of each input leaf, e.g. "[2]['x']"
    batch_dims: Mapping[int, int] = field(default_factory=dict)  # data input -> its batch dim

    @property
    def flops(self) -> float:
        return sum(op.cost.flops for op in self.ops)

    def describe(self, op_ids=None) -> str:
        """One line per op (all ops if `op_ids` is None), then the tensors they touch."""
        ops = [self.ops[i] for i in (range(len(self.ops)) if op_ids is None else op_ids)]
        ts = sorted({t for op in ops for t in (*op.inputs, *op.outputs) if t is not None})
        return "\n".join([str(op) for op in ops] + [f"  {self.tensors[t]}" for t in ts])

    def consumers(self) -> dict[int, list[int]]:
        """tensor id -> ops reading it."""
        out: dict[int, list[int]] = {}
        for op in self.ops:
            for t in op.inputs:
                if t is not None:
                    out.setdefault(t, []).append(op.id)
        return out
