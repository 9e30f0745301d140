"""Stage 3: lower a Plan to `jax.jit(shard_map(...))` with per-group branches.

values.py (how each layout is stored, `Sharded`, shard/gather) -> program.py (`Lowered`).
"""
