"""Per-primitive sharding rules and costs, in one registry (see `registry.py`)."""
from hapsynth.ir.rules import contraction, elementwise, indexing, opaque, reduction, structural  # noqa: F401
from hapsynth.ir.rules.registry import REGISTRY, UNSUPPORTED, cost_for, local_params, rule_for

__all__ = ["REGISTRY", "UNSUPPORTED", "cost_for", "local_params", "rule_for"]
