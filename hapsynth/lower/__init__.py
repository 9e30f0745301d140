"""Stage 3: lower a Plan to `jax.jit(shard_map(...))` with per-group branches.

values.py (how each layout is stored, `Sharded`, shard/gather), devices.py (a cluster on
`jax.devices()`) -> schedule.py (segments) -> collectives.py (conversions between them)
-> branches.py (a segment per group, `lax.switch`; cpu.py: XLA CPU kernel workarounds)
-> program.py (`Lowered`; gspmd.py: even plans as plain `jit`; hook.py: `BranchHook`).
Pipelines: wiring.py (what stages run and exchange; packing.py: uneven rows padded) ->
pipeline.py (`Pipelined`: a tick loop over a (stage, data) mesh) or freerun.py
(`FreeRunning`: a program per stage and phase; moves.py: values between devices and
processes).
"""
