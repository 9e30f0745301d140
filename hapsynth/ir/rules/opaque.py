"""Primitives kept whole on every device, by design (not fallbacks).

Control flow (`scan`, `while`, `cond`) is one opaque node with replicated operands;
its cost is that of its bodies (a scan's body times its length). Random-bit
generators are replicated because their bits depend on the *global* shape: a
device must generate the whole tensor and slice its rows (DESIGN.md).
"""
from __future__ import annotations

from hapsynth.ir.rules.registry import register, replicated

CONTROL_FLOW_NOTE = "control flow: planned as one opaque node with replicated operands"
RANDOM_NOTE = "random bits depend on the global shape: generated whole, then sliced"


def _body_cost(eqn):
    from hapsynth.ir.cost import control_flow_cost  # late: cost walks bodies via the registry

    return control_flow_cost(eqn)


@register("scan", "while", "cond", cost=_body_cost)
def control_flow(eqn):
    return replicated(CONTROL_FLOW_NOTE)


def _hash_cost(per_element):
    # XLA expands threefry hashing into ~50 integer ops per output element.
    return lambda e: (per_element * e.out_avals[0].size, 0.0)


@register("random_bits", cost=_hash_cost(47.0))
@register("random_fold_in", "random_split", cost=_hash_cost(55.0))
@register("random_seed", "random_wrap", "random_unwrap", "rng_bit_generator", "rng_uniform")
def random(eqn):
    return replicated(RANDOM_NOTE)
