"""hapsynth model zoo: Flax NNX models with pure train steps, by name and size.

    train_step, example_args = get("bert", "tiny")
    params, opt_state, loss = jax.jit(train_step)(*example_args)

Every entry's ``train_step(params, opt_state, batch) -> (params, opt_state, loss)`` is pure: the
forward, ``value_and_grad`` and the Optax update run inside it, and its output can be fed back.
"paper" sizes follow HAP's evaluation (global batch 32·devices; MoE experts 2·devices) and are
abstract (``jax.ShapeDtypeStruct`` leaves, nothing allocated) unless ``abstract=False``.
"""
from __future__ import annotations

from . import bert, gpt, mlp, moe, vgg, vit
from .common import BIG, CONFIG_NAMES, param_count

ZOO = {"mlp": mlp, "vgg": vgg, "vit": vit, "bert": bert, "gpt": gpt, "moe": moe}
"""name → module with ``CONFIGS`` (config name → frozen dataclass), ``config(name, devices)`` and
``build(name, *, devices, abstract)``."""


def names() -> list[str]:
    return list(ZOO)


def get(name: str, config: str = "tiny", *, devices: int = 8, abstract: bool | None = None,
        batch: int | None = None):
    """Return ``(train_step, (params, opt_state, batch))`` for zoo entry ``name`` at size ``config``.
    ``abstract=None`` means abstract for "paper", "medium" and the LLM sizes; ``batch`` sets the global batch
    (rows, images or sequences) in place of the size's. Deterministic: model from ``nnx.Rngs(0)``,
    batch from ``jax.random.key(1)``."""
    if name not in ZOO:
        raise ValueError(f"unknown model {name!r}; valid names: {names()}")
    if config not in CONFIG_NAMES:
        raise ValueError(f"unknown config {config!r}; valid configs: {list(CONFIG_NAMES)}")
    if abstract is None:
        abstract = config in BIG
    return ZOO[name].build(config, devices=devices, abstract=bool(abstract), batch=batch)


__all__ = ["ZOO", "get", "names", "param_count", "CONFIG_NAMES"]
