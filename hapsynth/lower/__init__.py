"""Stage 3 (to come): lower a Plan to `jax.jit(shard_map(...))` with per-class branches."""
