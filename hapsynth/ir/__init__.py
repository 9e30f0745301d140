"""Stage 1: trace a train step and lift it to the sharding IR.

trace.py (jaxpr -> flat Program) -> rules/ (per-primitive factors and costs)
-> coarsen.py (nodes) -> lift.py (Graph) -> report.py (`inspect`). Programs rewritten
before planning: remat.py (cheap activations recomputed), checkpoint.py (the forward
pass recomputed by segments), unroll.py (loops written out),
cse.py (the step's own recomputation undone).
"""
from hapsynth.ir.graph import BLOCKED, PARALLEL, REDUCTION, Cost, Factor, Graph, Node, Op, Rule, Tensor
from hapsynth.ir.lift import lift, lift_program
from hapsynth.ir.report import inspect
from hapsynth.ir.trace import Program, trace

__all__ = ["BLOCKED", "PARALLEL", "REDUCTION", "Cost", "Factor", "Graph", "Node", "Op", "Program",
           "Rule", "Tensor", "inspect", "lift", "lift_program", "trace"]
