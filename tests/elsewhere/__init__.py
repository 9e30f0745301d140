"""A second model zoo: train steps written the way other people write them.

The project's own zoo (`models/`) is Flax NNX in one house style.  These are written
the way each library's docs, tutorials and the big training codebases (MaxText,
levanter, big_vision, the Flax / Haiku / Equinox examples, Hugging Face's Flax scripts)
write them, with nothing shaped to suit a planner.

Every module exposes ``make(size="tiny") -> (train_step, example_args)``:
``train_step(*example_args)`` returns a tuple whose leading elements are the updated
state, with the pytree structure, shapes and dtypes of the leading arguments, and
whose last element is the loss.  ``"tiny"`` gives concrete, deterministic arrays small
enough for a few CPU steps; ``"paper"`` gives `jax.ShapeDtypeStruct` leaves at a
realistic size (stated in each module's docstring).
"""
from __future__ import annotations

from . import (
    bf16_mixed,
    equinox_cnn,
    equinox_vit,
    grad_accum,
    grad_accum_fori,
    haiku_resnet,
    linen_transformer,
    nnx_gpt,
    scan_gpt,
    unrolled_gpt,
)

MODELS = {
    "scan_gpt": scan_gpt,                    # plain JAX, stacked layers, lax.scan + checkpoint
    "unrolled_gpt": unrolled_gpt,            # the same, Python for-loop over the stack
    "nnx_gpt": nnx_gpt,                      # Flax NNX, nnx.split / nnx.merge pure step
    "linen_transformer": linen_transformer,  # Flax linen BERT MLM, dropout rng, clipped AdamW
    "haiku_resnet": haiku_resnet,            # dm-haiku ResNet-18, BatchNorm state, SGD momentum
    "equinox_cnn": equinox_cnn,              # Equinox MNIST CNN, partition / combine
    "equinox_vit": equinox_vit,              # Equinox ViT-B/16, eqx.nn attention, clipped AdamW
    "grad_accum": grad_accum,                # microbatches in lax.scan
    "grad_accum_fori": grad_accum_fori,      # microbatches in lax.fori_loop + dynamic_slice
    "bf16_mixed": bf16_mixed,                # linen ViT, bf16 compute, f32 master weights
}


def get(name: str, size: str = "tiny"):
    """``(train_step, example_args)`` of model `name` at `size` ("tiny" or "paper")."""
    return MODELS[name].make(size)
