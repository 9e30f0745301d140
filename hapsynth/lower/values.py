"""Distributed values: how a layout is stored across devices, and `shard` / `gather`.

Storage on the 1-D mesh axis "d" of k devices (docs/design.md, stage 3):
- `R`: the whole array on every device;
- `P`: a partial sum per device, stored stacked as a global `[k, *shape]` array;
- `S<dim>/<units>`: device i holds `rows[i]` rows of `dim`, padded to `M = max(rows)`;
  globally a `[.., k*M, ..]` array sharded evenly on `dim`, which JAX accepts.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from hapsynth.ir.layout import Layout
from hapsynth.lower.moves import everywhere

AXIS = "d"


@dataclass(frozen=True)
class Geometry:
    """Per-device rows of an S layout on a tensor of `shape`."""

    rows: tuple[int, ...]
    offsets: tuple[int, ...]
    pad: int                  # M: rows every device stores

    @staticmethod
    def of(layout: Layout, shape, shard_units) -> "Geometry":
        scale = shape[layout.dim] // layout.units
        rows = tuple(u * scale for u in shard_units[layout.units])
        offsets = tuple(int(x) for x in np.concatenate([[0], np.cumsum(rows)[:-1]]))
        return Geometry(rows, offsets, max(rows))

    def compact_index(self) -> np.ndarray:
        """Positions of the valid rows in the gathered `k*M` buffer, in global order."""
        return np.concatenate([np.arange(i * self.pad, i * self.pad + r)
                               for i, r in enumerate(self.rows)]).astype(np.int32)


@jax.tree_util.register_pytree_node_class
class Sharded:
    """A global array stored in a plan's layout (what a parallelized step returns)."""

    def __init__(self, data, layout: Layout, shape, units: tuple | None):
        self.data, self.layout, self.shape, self.units = data, layout, tuple(shape), units

    def tree_flatten(self):
        return (self.data,), (self.layout, self.shape, self.units)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    @property
    def dtype(self):
        return self.data.dtype

    def __repr__(self):
        return f"Sharded({self.layout}, shape={self.shape})"


class Staged:
    """A state leaf stored in a pipeline's per-stage buffers (what a pipelined step
    returns); `hs.gather` gives the array."""

    def __init__(self, buffers, stage: int, dtype_key: str, offset: int, shape, dtype, owner):
        self.buffers, self.stage, self.key, self.offset = buffers, stage, dtype_key, offset
        self.shape, self.dtype, self.owner = tuple(shape), np.dtype(dtype), owner

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def value(self):
        row = np.asarray(_addressable(self.buffers[self.key]))[self.stage]
        size = int(np.prod(self.shape, dtype=np.int64))
        return jnp.asarray(row[self.offset:self.offset + size].reshape(self.shape))

    def __repr__(self):
        return f"Staged(stage {self.stage}, shape={self.shape})"


class StagedRows(Staged):
    """A layer-stacked state leaf stored as its rows, each on the stage of its layer: rows
    of a tick loop's buffers (`Staged`), or arrays whole on their stages' devices (a
    pipeline run free: `stages` names them). The next step reads the rows where they are."""

    def __init__(self, rows, owner=None, stages=None):
        self.rows = tuple(rows)
        first = self.rows[0]
        staged = isinstance(first, Staged)
        self.owner = first.owner if staged else owner
        self.buffers, self.key = (first.buffers, first.key) if staged else (None, None)
        self.stage, self.offset = None, None
        self.shape, self.dtype = (len(self.rows), *first.shape), np.dtype(first.dtype)
        self._stages = tuple(stages) if stages is not None else tuple(r.stage for r in self.rows)

    @property
    def stages(self) -> tuple[int, ...]:
        return self._stages

    def value(self):
        return jnp.stack([r.value() if isinstance(r, Staged) else jnp.asarray(
            np.asarray(_addressable(r))) for r in self.rows])

    def __repr__(self):
        return f"StagedRows(stages {self.stages}, shape={self.shape})"


def spec(layout: Layout, ndim: int) -> PS:
    if layout.kind == "R":
        return PS()
    if layout.kind == "P":
        return PS(AXIS)
    return PS(*([None] * layout.dim + [AXIS]))


def shard_array(x, layout: Layout, shard_units, mesh) -> jax.Array:
    """Global array `x` -> the stored form of `layout` on `mesh`."""
    x = jnp.asarray(x)
    k = mesh.devices.size
    if layout.kind == "R":
        return jax.device_put(x, NamedSharding(mesh, PS()))
    if layout.kind == "P":
        stacked = jnp.concatenate([x[None], jnp.zeros((k - 1, *x.shape), x.dtype)])
        return jax.device_put(stacked, NamedSharding(mesh, PS(AXIS)))
    g = Geometry.of(layout, x.shape, shard_units)
    blocks = []
    for i in range(k):
        part = jax.lax.slice_in_dim(x, g.offsets[i], g.offsets[i] + g.rows[i], axis=layout.dim)
        pad = [(0, 0)] * x.ndim
        pad[layout.dim] = (0, g.pad - g.rows[i])
        blocks.append(jnp.pad(part, pad))
    return jax.device_put(jnp.concatenate(blocks, axis=layout.dim),
                          NamedSharding(mesh, spec(layout, x.ndim)))


def load_array(load, layout: Layout, shape, dtype, shard_units, mesh) -> jax.Array:
    """The stored form of `layout`, built from `load(dim, start, stop)` calls for this
    process's devices only: each process reads just the rows its devices hold."""
    if layout.kind == "P":
        raise ValueError("a partial-sum input cannot be loaded by rows")
    sharding = NamedSharding(mesh, spec(layout, len(shape)))
    if layout.kind == "S":
        g, dim = Geometry.of(layout, shape, shard_units), layout.dim
    else:
        g, dim = Geometry((shape[0],) * mesh.devices.size, (0,) * mesh.devices.size, shape[0]), 0
    stored = list(shape)
    if layout.kind == "S":
        stored[dim] = g.pad * mesh.devices.size
    pieces, cache = [], {}
    for i, d in enumerate(mesh.devices.flat):
        if d.process_index != jax.process_index():
            continue
        key = (g.offsets[i], g.rows[i])
        if key not in cache:
            part = np.asarray(load(dim, g.offsets[i], g.offsets[i] + g.rows[i]), dtype)
            want = tuple(g.rows[i] if a == dim else n for a, n in enumerate(shape))
            if part.shape != want:
                raise ValueError(f"load(dim={dim}, start={g.offsets[i]}, stop="
                                 f"{g.offsets[i] + g.rows[i]}) returned shape {part.shape}, "
                                 f"expected {want}")
            pad = [(0, 0)] * len(shape)
            pad[dim] = (0, g.pad - g.rows[i]) if layout.kind == "S" else (0, 0)
            cache[key] = np.pad(part, pad)
        pieces.append(jax.device_put(cache[key], d))
    return jax.make_array_from_single_device_arrays(tuple(stored), sharding, pieces)


def _addressable(data):
    """The whole global array in this process (across hosts: replicated over the devices
    holding it, then sent from the first process holding it to the others)."""
    if isinstance(data, jax.Array) and jax.process_count() > 1:
        return everywhere(data)
    return data


def unshard(value: Sharded):
    """The plain global array a `Sharded` value stands for.

    Assembled on the host from the device shards: no multi-device program is launched
    (on XLA CPU, many small collective programs in flight can stall its rendezvous)."""
    layout = value.layout
    if layout.kind == "R":
        return _addressable(value.data)
    data = np.asarray(_addressable(value.data))
    if layout.kind == "P":
        return jnp.asarray(data.sum(axis=0, dtype=data.dtype))
    g = Geometry.of(layout, value.shape, dict([(layout.units, value.units)]))
    return jnp.asarray(np.take(data, g.compact_index(), axis=layout.dim))


def plain(v):
    """The array a leaf stands for, `Sharded` or `Staged` (on every process)."""
    return unshard(v) if isinstance(v, Sharded) else v.value() if isinstance(v, Staged) else v


def gather(tree):
    """Replace every `Sharded` or `Staged` leaf by the plain array it stands for (on every
    process)."""
    def one(v):
        if isinstance(v, Sharded):
            return unshard(v)
        return v.value() if isinstance(v, Staged) else _addressable(v)
    return jax.tree.map(one, tree, is_leaf=lambda v: isinstance(v, (Sharded, Staged)))
