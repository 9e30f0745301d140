"""ResNet-18 in dm-haiku, trained the way Haiku's ImageNet example trains its ResNets.

`hk.nets.ResNet18` under `hk.transform_with_state`, BatchNorm on batch statistics
(``is_training=True``) with its moving averages carried as haiku state, label-smoothed
one-hot cross-entropy, L2 weight decay on everything but the BatchNorm parameters,
and optax SGD with Nesterov momentum on a warmup-cosine schedule.

The step is ``train_step(params, state, opt_state, batch) ->
(params, state, opt_state, loss)``, ``batch = {"images": f32[B, H, W, 3],
"labels": i32[B]}``.

Sizes: ``tiny`` (32 x 32 images, 10 classes, batch 16) and ``paper`` (ImageNet:
224 x 224 x 3, 1000 classes, batch 32 * 64 = 2048; abstract).
"""
from __future__ import annotations

from dataclasses import dataclass

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclass(frozen=True)
class Config:
    image_size: int
    num_classes: int
    batch: int
    lr: float = 0.1 * 2048 / 256
    warmup_steps: int = 5 * 625
    total_steps: int = 90 * 625
    weight_decay: float = 1e-4
    label_smoothing: float = 0.1
    bn_decay: float = 0.9


CONFIGS = {
    "tiny": Config(image_size=32, num_classes=10, batch=16, lr=0.05, warmup_steps=1,
                   total_steps=100),
    "paper": Config(image_size=224, num_classes=1000, batch=32 * 64),
}


def make(size: str = "tiny"):
    cfg = CONFIGS[size]

    def _forward(batch, is_training):
        net = hk.nets.ResNet18(cfg.num_classes, bn_config={"decay_rate": cfg.bn_decay})
        return net(batch["images"], is_training=is_training)

    forward = hk.transform_with_state(_forward)

    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.total_steps)
    optimizer = optax.sgd(schedule, momentum=0.9, nesterov=True)

    def l2_loss(params):
        return 0.5 * sum(jnp.sum(jnp.square(p)) for p in jax.tree.leaves(params))

    def loss_fn(params, state, batch):
        logits, state = forward.apply(params, state, None, batch, is_training=True)
        labels = jax.nn.one_hot(batch["labels"], cfg.num_classes)
        labels = optax.smooth_labels(labels, cfg.label_smoothing)
        loss = optax.softmax_cross_entropy(logits=logits, labels=labels).mean()
        decayed, _ = hk.data_structures.partition(
            lambda module_name, name, value: "batchnorm" not in module_name, params)
        loss = loss + cfg.weight_decay * l2_loss(decayed)
        return loss, state

    def train_step(params, state, opt_state, batch):
        (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, state, batch)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        return new_params, new_state, new_opt_state, loss

    rng = jax.random.PRNGKey(0)
    shape = (cfg.batch, cfg.image_size, cfg.image_size, 3)
    if size == "tiny":
        rs = np.random.default_rng(1)  # what the input pipeline hands over: host arrays
        batch = {"images": jnp.asarray(rs.standard_normal(shape, dtype=np.float32)),
                 "labels": jnp.asarray(rs.integers(0, cfg.num_classes, cfg.batch, dtype=np.int32))}
        params, state = jax.jit(lambda rng, b: forward.init(rng, b, is_training=True))(rng, batch)
        opt_state = optimizer.init(params)
    else:
        batch = {"images": jax.ShapeDtypeStruct(shape, jnp.float32),
                 "labels": jax.ShapeDtypeStruct((cfg.batch,), jnp.int32)}
        params, state = jax.eval_shape(lambda b: forward.init(rng, b, is_training=True), batch)
        opt_state = jax.eval_shape(optimizer.init, params)
    return train_step, (params, state, opt_state, batch)
