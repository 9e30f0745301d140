"""Stage 2: from the IR and a `hapsynth.cluster.Cluster` to a `Plan`.

strategy.py (factor classes, strategies per node) -> structure.py (what each strategy
needs; share-independent) -> pricing.py (frozen tables at given shares, via the
costmodel.py roofline and alpha-beta collectives) -> timing.py (step time of an
assignment) and memory.py -> search.py (starts, memory fit, local search) and solver.py
(CP-SAT) -> synthesize.py (the orchestration, HAP's strategy/share alternation)
-> assemble.py -> plan.py (`Plan`: JSON, summary, explain).
"""
