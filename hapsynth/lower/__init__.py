"""Stage 3: lower a Plan to `jax.jit(shard_map(...))` with per-group branches.

values.py (how each layout is stored, `Sharded`, shard/gather), devices.py (a cluster on
`jax.devices()`) -> schedule.py (segments) -> collectives.py (conversions between them)
-> branches.py (a segment per group, `lax.switch`; cpu.py: XLA CPU kernel workarounds)
-> program.py (`Lowered`; gspmd.py: even plans as plain `jit`; hook.py: `BranchHook`).
Pipelines: wiring.py (what stages run and exchange; packing.py: uneven rows padded) ->
pipeline.py (`Pipelined`: a tick loop over a (stage, data) mesh; ticklayout.py its static
tables, tickloop.py and tickwork.py the loop and one tick's work, wires.py crossings,
finish.py the once-per-step ops, stagestate.py state in and out) or freerun.py
(`FreeRunning`: a program per stage and phase; freemoves.py values crossing stages,
freerounds.py the once-per-step rounds; moves.py: values between devices and processes).

`lower(prog, plan, devices)` is the one entry point: it picks the runtime by the plan.
"""
from __future__ import annotations

__all__ = ["lower"]


def lower(prog, plan, devices, *, donate=()):
    """The runtime that runs `plan` for the traced program `prog` on `devices` (the
    cluster's, in order): `Lowered` for an SPMD plan (no `plan.stages`), `FreeRunning`
    for a pipeline whose `plan.pipeline["runtime"]` is "free" (a program per stage and
    phase), else `Pipelined` (one tick-loop program), after checking the plan was made
    for `prog` (`PlanMismatch` names what differs). `donate`: flat input leaves whose
    buffers the step may reuse. Every runtime has `run(leaves)`, `shard(*args)` and
    `load(load, *args)`."""
    from hapsynth.ir.signature import of_program

    plan.check(of_program(prog))  # (the one place a runtime's plan is checked)
    if not plan.stages:
        from hapsynth.lower.program import Lowered
        return Lowered(prog, plan, devices, donate=donate)
    if plan.pipeline.get("runtime") == "free":
        from hapsynth.lower.freerun import FreeRunning
        return FreeRunning(prog, plan, devices, donate=donate)
    from hapsynth.lower.pipeline import Pipelined
    return Pipelined(prog, plan, devices, donate=donate)
