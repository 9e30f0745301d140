"""Per-primitive sharding rules, costs and facts, in one registry (see `registry.py`)."""
from hapsynth.ir.rules import (contraction, elementwise, indexing, linalg, loops,  # noqa: F401
                                opaque, reduction, structural)
from hapsynth.ir.rules.registry import (REGISTRY, UNSUPPORTED, Entry, cost_for, evaluate_block,
                                       facts, local_params, partial_of, rule_for)

__all__ = ["REGISTRY", "UNSUPPORTED", "Entry", "cost_for", "evaluate_block", "facts", "local_params",
           "partial_of", "rule_for"]
