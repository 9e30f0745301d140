"""The CNN of Equinox's MNIST tutorial, trained the Equinox way.

`eqx.nn.Conv2d` / `MaxPool2d` / `Linear` on single examples (channels-first, no batch
axis), `jax.vmap` over the batch, log-softmax and a `take_along_axis` cross-entropy,
`eqx.filter_value_and_grad`, optax AdamW.  To make the step a pure function of array
pytrees the model is split once with ``eqx.partition(model, eqx.is_array)``; the step
`eqx.combine`s the arrays with the static part, and hands back the arrays of the
updated model (``eqx.filter(model, eqx.is_array)``): the same pytree structure, with
``None`` where the static leaves were.

The step is ``train_step(params, opt_state, x, y) -> (params, opt_state, loss)`` with
``x: f32[B, 1, 28, 28]`` and ``y: i32[B]``.

Sizes: ``tiny`` (MNIST shapes, batch 32) and ``paper`` (MNIST shapes, batch 2048:
the tutorial's network is small; it is the batch that makes it worth spreading;
abstract).
"""
from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

BATCH = {"tiny": 32, "paper": 2048}
LEARNING_RATE = 3e-4


class CNN(eqx.Module):
    layers: list

    def __init__(self, key):
        key1, key2, key3, key4 = jax.random.split(key, 4)
        self.layers = [
            eqx.nn.Conv2d(1, 3, kernel_size=4, key=key1),
            eqx.nn.MaxPool2d(kernel_size=2),
            jax.nn.relu,
            jnp.ravel,
            eqx.nn.Linear(1728, 512, key=key2),
            jax.nn.sigmoid,
            eqx.nn.Linear(512, 64, key=key3),
            jax.nn.relu,
            eqx.nn.Linear(64, 10, key=key4),
            jax.nn.log_softmax,
        ]

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def cross_entropy(y, pred_y):
    pred_y = jnp.take_along_axis(pred_y, jnp.expand_dims(y, 1), axis=1)
    return -jnp.mean(pred_y)


def loss(model, x, y):
    pred_y = jax.vmap(model)(x)
    return cross_entropy(y, pred_y)


def make(size: str = "tiny"):
    batch = BATCH[size]
    optim = optax.adamw(LEARNING_RATE)
    key = jax.random.PRNGKey(5678)
    if size == "tiny":
        model = CNN(key)
        params, static = eqx.partition(model, eqx.is_array)
        opt_state = optim.init(params)
        rs = np.random.default_rng(1)  # a batch from the data loader
        x = jnp.asarray(rs.standard_normal((batch, 1, 28, 28), dtype=np.float32))
        y = jnp.asarray(rs.integers(0, 10, batch, dtype=np.int32))
    else:
        model = eqx.filter_eval_shape(CNN, key)  # arrays become jax.ShapeDtypeStruct
        params, static = eqx.partition(
            model, lambda leaf: isinstance(leaf, jax.ShapeDtypeStruct))
        opt_state = jax.eval_shape(optim.init, params)
        x = jax.ShapeDtypeStruct((batch, 1, 28, 28), jnp.float32)
        y = jax.ShapeDtypeStruct((batch,), jnp.int32)

    def train_step(params, opt_state, x, y):
        model = eqx.combine(params, static)
        loss_value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return eqx.filter(model, eqx.is_array), opt_state, loss_value

    return train_step, (params, opt_state, x, y)
