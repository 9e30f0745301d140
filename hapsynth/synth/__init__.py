"""Stage 2: from the IR and a `hapsynth.cluster.Cluster` to a `Plan`.

strategy.py (factor classes, strategies per node) -> structure.py (what each strategy
needs; share-independent) -> pricing.py (frozen tables at given shares, via the
costmodel.py roofline and alpha-beta collectives) -> timing.py (step time of an
assignment) and memory.py -> search.py (starts, memory fit, local search) and solver.py
(CP-SAT) -> synthesize.py (the orchestration, HAP's strategy/share alternation; fsdp.py:
the FSDP baseline and start) -> assemble.py -> plan.py (`Plan`: JSON, summary, explain).

Pipelines across islands: stages.py (what a cut may split) -> pipeline.py (the search
over cuts) -> pipeprice.py (one candidate's step: stagegroups.py where stages run,
opcosts.py per-op seconds, cutscan.py what a cut costs, pipelinks.py what crosses,
pipememory.py bytes per device, pipeschedule.py and lockstep.py the schedule) ->
pipeplan.py (the `Plan` of a pipeline) -> pipechoice.py (whether it is kept over SPMD).

Which plan is kept: choose.py (`make_plan`: SPMD on every device or fewer, data
parallelism, or a pipeline, pipeline.py; `sooner`) <- recompute.py (`plan_program`: the
step as written, with activations recomputed or its own recomputation undone) <- once.py
(planned on process zero only, or read back from the plan cache). rewrites.py: the
program a plan runs (`program_of`).
"""
