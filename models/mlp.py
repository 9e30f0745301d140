"""MLP classifier whose params are a plain dict pytree (no nnx): exercises the
"any pytree" path of the train-step contract. Softmax cross-entropy, Adam."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from .common import cross_entropy, init_plain, make_batch, make_train_step, pick_config


@dataclasses.dataclass(frozen=True)
class Config:
    in_dim: int
    hidden: tuple[int, ...]
    classes: int
    batch: int
    lr: float = 1e-3


CONFIGS = {
    "tiny": Config(in_dim=64, hidden=(128, 128), classes=10, batch=32),
    "small": Config(in_dim=256, hidden=(512, 512, 512), classes=100, batch=64),
    "paper": Config(in_dim=1024, hidden=(4096,) * 4, classes=1000, batch=32 * 8),
}


def config(name: str = "tiny", devices: int = 8, batch: int | None = None) -> Config:
    return pick_config(CONFIGS, name, devices, global_batch=batch, batch=32)


def init_params(key: jax.Array, cfg: Config) -> dict:
    """{"dense_i": {"w": [in, out], "b": [out]}} with LeCun-normal weights."""
    sizes = (cfg.in_dim, *cfg.hidden, cfg.classes)
    keys = jax.random.split(key, len(sizes) - 1)
    init = jax.nn.initializers.lecun_normal()
    return {f"dense_{i}": {"w": init(k, (n, m), jnp.float32), "b": jnp.zeros((m,), jnp.float32)}
            for i, (k, n, m) in enumerate(zip(keys, sizes[:-1], sizes[1:]))}


def forward(params: dict, x: jax.Array) -> jax.Array:
    n = len(params)
    for i in range(n):
        layer = params[f"dense_{i}"]
        x = x @ layer["w"] + layer["b"]
        if i < n - 1:
            x = jax.nn.relu(x)
    return x


def build(name: str = "tiny", *, devices: int = 8, abstract: bool = False,
          batch: int | None = None):
    cfg = config(name, devices, batch)
    tx = optax.adam(cfg.lr)
    params, opt_state = init_plain(lambda: init_params(jax.random.key(0), cfg), tx, abstract)

    def batch_fn(key):
        kx, ky = jax.random.split(key)
        return {"x": jax.random.normal(kx, (cfg.batch, cfg.in_dim), jnp.float32),
                "y": jax.random.randint(ky, (cfg.batch,), 0, cfg.classes, jnp.int32)}

    def loss_fn(p, batch):
        return cross_entropy(forward(p, batch["x"]), batch["y"])

    step = make_train_step(loss_fn, tx)
    return step, (params, opt_state, make_batch(batch_fn, abstract))
