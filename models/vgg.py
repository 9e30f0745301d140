"""VGG-style CNN: 3×3 SAME convs + ReLU, 2×2 max pooling, flatten, dense head (no BatchNorm);
SGD with momentum 0.9. "paper" is VGG19 on 224×224×3 with 1000 classes (143.7M params)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from .common import cross_entropy, init_state, make_batch, make_train_step, pick_config

M = "M"  # max-pool marker in the conv layout
VGG19 = (64, 64, M, 128, 128, M, 256, 256, 256, 256, M, 512, 512, 512, 512, M, 512, 512, 512, 512, M)


@dataclasses.dataclass(frozen=True)
class Config:
    layout: tuple  # conv widths, with "M" for a 2×2/2 max pool
    fc: tuple[int, ...]  # hidden dense widths of the head
    image: int  # square input side
    classes: int
    batch: int
    lr: float = 0.01


CONFIGS = {
    "tiny": Config(layout=(16, 16, M, 32, 32, M), fc=(128,), image=16, classes=10, batch=16),
    "small": Config(layout=(32, 32, M, 64, 64, M, 128, 128, M), fc=(256,), image=32, classes=10, batch=32),
    "paper": Config(layout=VGG19, fc=(4096, 4096), image=224, classes=1000, batch=32 * 8),
}


def config(name: str = "tiny", devices: int = 8, batch: int | None = None) -> Config:
    return pick_config(CONFIGS, name, devices, global_batch=batch, batch=32)


class VGG(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.layout = cfg.layout
        convs, c = [], 3
        for item in cfg.layout:
            if item != M:
                convs.append(nnx.Conv(c, item, kernel_size=(3, 3), padding="SAME", rngs=rngs))
                c = item
        self.convs = nnx.List(convs)
        side = cfg.image // 2 ** cfg.layout.count(M)
        widths = (side * side * c, *cfg.fc, cfg.classes)
        self.fcs = nnx.List([nnx.Linear(n, m, rngs=rngs) for n, m in zip(widths[:-1], widths[1:])])

    def __call__(self, x: jax.Array) -> jax.Array:
        convs = iter(self.convs)
        for item in self.layout:
            if item == M:
                x = nnx.max_pool(x, window_shape=(2, 2), strides=(2, 2))
            else:
                x = jax.nn.relu(next(convs)(x))
        x = x.reshape(x.shape[0], -1)
        for i, fc in enumerate(self.fcs):
            x = fc(x)
            if i < len(self.fcs) - 1:
                x = jax.nn.relu(x)
        return x


def build(name: str = "tiny", *, devices: int = 8, abstract: bool = False,
          batch: int | None = None):
    cfg = config(name, devices, batch)
    tx = optax.sgd(cfg.lr, momentum=0.9)
    graphdef, params, opt_state = init_state(lambda: VGG(cfg, rngs=nnx.Rngs(0)), tx, abstract)

    def batch_fn(key):
        kx, ky = jax.random.split(key)
        return {"image": jax.random.normal(kx, (cfg.batch, cfg.image, cfg.image, 3), jnp.float32),
                "label": jax.random.randint(ky, (cfg.batch,), 0, cfg.classes, jnp.int32)}

    def loss_fn(model, batch):
        return cross_entropy(model(batch["image"]), batch["label"])

    step = make_train_step(loss_fn, tx, graphdef)
    return step, (params, opt_state, make_batch(batch_fn, abstract))
