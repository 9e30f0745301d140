"""The unrolled twin of `scan_gpt`: the same plain-JAX GPT and the same parameter
layout (per-layer weights stacked on a leading layer axis), but the blocks run in a
Python ``for`` loop that slices layer ``i`` out of the stack -- what a
``scan_layers=False`` configuration does -- with no scan, each block under the same
`jax.checkpoint` policy (so the two do the same work).

On the same params and batch it computes the same loss and update as `scan_gpt`.
Sizes as in `scan_gpt` (``paper``: BERT-base size, batch 2048 x 128 tokens).
"""
from __future__ import annotations

import functools

import jax

from .scan_gpt import (
    CONFIGS,
    Config,
    block,
    embed,
    example_args,
    make_optimizer,
    make_train_step,
    unembed,
)


def forward(params, ids, cfg: Config):
    x = embed(params, ids)
    remat_block = jax.checkpoint(functools.partial(block, n_heads=cfg.n_heads),
                                 prevent_cse=False,
                                 policy=jax.checkpoint_policies.nothing_saveable)
    for i in range(cfg.n_layers):
        layer = jax.tree.map(lambda w: w[i], params["layers"])  # noqa: B023 (used at once)
        x = remat_block(x, layer)
    return unembed(params, x)


def make(size: str = "tiny"):
    cfg = CONFIGS[size]
    tx = make_optimizer(cfg)
    return make_train_step(forward, cfg, tx), example_args(cfg, tx, abstract=size != "tiny")
