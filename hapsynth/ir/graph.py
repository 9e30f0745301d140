"""The sharding IR: plain frozen values that cross from `ir/` to `synth/` and `lower/`.

A `Rule` describes one op by *factors* (the idea of Shardy's OpShardingRule):
each factor has a size and the (operand, dim) / (result, dim) positions it
occupies. A dim may hold a factor as its *major part*: then the dim's size is a
multiple of the factor's size and a shard of k factor units is k*(dim/size) rows.
Dims that hold no factor must stay whole on every device.
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


@dataclass(frozen=True)
class Rule:
    """How an op may be sharded. `supported=False` means replicated-only fallback."""

    factors: tuple[Factor, ...] = ()
    supported: bool = True
    note: str = ""  # why an op is replicated-only by design

    def shardable(self) -> tuple[int, ...]:
        """Indices of factors that may be sharded."""
        return tuple(i for i, f in enumerate(self.factors) if f.kind != BLOCKED and f.size > 1)


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

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class Op:
    """One primitive application (an eqn of the flattened step)."""

    id: int
    primitive: str
    inputs: tuple[int | None, ...]  # tensor ids; None for an inline literal
    outputs: tuple[int, ...]
    rule: Rule
    cost: Cost
    node: int  # the coarsened node this op belongs to


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

    @property
    def flops(self) -> float:
        return sum(op.cost.flops for op in self.ops)

    def consumers(self) -> dict[int, list[int]]:
        """tensor id -> ops reading it."""
        out: dict[int, list[int]] = {}
        for op in self.ops:
            for t in op.inputs:
                if t is not None:
                    out.setdefault(t, []).append(op.id)
        return out
