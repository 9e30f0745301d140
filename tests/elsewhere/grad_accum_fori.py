"""`grad_accum` with its `jax.lax.fori_loop` + `dynamic_slice` accumulation (big_vision
style) instead of the scan over a reshaped microbatch axis; see `grad_accum`."""
from __future__ import annotations

from . import grad_accum


def make(size: str = "tiny"):
    return grad_accum.make(size, loop="fori")
