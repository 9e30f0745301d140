"""Values packed into flat buffers, one per dtype: how a pipelined program keeps, sends
and stores what differs in shape from stage to stage (branches of one `lax.switch` must
return equal shapes, so each pads its buffers to the largest branch's)."""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["Packing", "Ref", "bundle", "dtype_of", "trim", "pad_to"]


def dtype_of(k: str) -> str:
    """The dtype of buffer `k` ("float32", or "float32/3" for a buffer of its own)."""
    return k.split("/")[0]


class Packing:
    """Named arrays laid end to end in one flat buffer per dtype; or, `apart`, each in a
    buffer of its own, the largest of each dtype in its first ("float32/0"), the next in
    its second, and so on (stages with layers of one shape leave a buffer no larger than
    its largest value). `apart=True` puts every array apart: what is added to every
    microbatch (gradient sums), since XLA's CPU backend concatenates far below memory
    speed (150 MB in about a second), while adding a whole buffer runs at it.
    `apart=n` puts apart the arrays of at least n bytes (a stage's state: a leaf filling
    its buffer is read and written whole, not sliced out of one shared buffer and written
    back into a copy of it); `synth.slots.packed_bytes` prices the same layout."""

    def __init__(self, items, apart: bool | int = False):
        self.slots, self.sizes = {}, {}
        least = 0 if apart is True else None if apart is False else int(apart)

        def nbytes(x):
            return int(np.prod(x[1], dtype=np.int64)) * np.dtype(x[2]).itemsize

        items = list(items)
        big = sorted((x for x in items if least is not None and nbytes(x) >= least),
                     key=lambda x: (np.dtype(x[2]).name, -nbytes(x)))
        ids = {id(x) for x in big}
        count: dict = {}
        for (key, shape, dtype), alone in [(x, False) for x in items if id(x) not in ids] + [
                (x, True) for x in big]:
            k = np.dtype(dtype).name
            if alone:
                count[k] = count.get(k, -1) + 1
                k = f"{k}/{count[k]}"
            n = int(np.prod(shape, dtype=np.int64))
            self.slots[key] = (k, self.sizes.get(k, 0), tuple(shape))
            self.sizes[k] = self.sizes.get(k, 0) + n

    def pack(self, values: dict, sizes: dict, into: tuple | None = None) -> tuple:
        """`values` in flat buffers of `sizes` (per dtype), the rest zeros; or, given
        `into` (buffers of those sizes), the slots of those in `values` written over it, the
        rest kept: in place where XLA may reuse the buffers (a concatenation padded to a
        large buffer runs far below memory speed on XLA's CPU backend, and writes all of it)."""
        if into is not None:
            out = dict(zip(sizes, into))
            for key, (k, off, _) in self.slots.items():
                if key in values:
                    out[k] = lax.dynamic_update_slice(
                        out[k], jnp.ravel(values[key]).astype(dtype_of(k)), (off,))
            return tuple(out[k] for k in sizes)
        parts = {k: [] for k in sizes}
        for key, (k, _, shape) in self.slots.items():
            parts[k].append(jnp.ravel(values[key]).astype(dtype_of(k)))
        out = []
        for k, n in sizes.items():
            flat = (parts[k][0] if len(parts[k]) == 1 else jnp.concatenate(parts[k])
                    if parts[k] else jnp.zeros((0,), dtype_of(k)))
            out.append(jnp.pad(flat, (0, n - flat.shape[0])))
        return tuple(out)

    def unpack(self, bufs: tuple, order) -> dict:
        where = dict(zip(order, bufs))
        return {key: where[k][off:off + int(np.prod(shape, dtype=np.int64))].reshape(shape)
                for key, (k, off, shape) in self.slots.items()}


def bundle(packings) -> dict:
    """Per dtype, the largest size among `packings` (sorted by dtype name)."""
    sizes: dict = {}
    for p in packings:
        for k, n in p.sizes.items():
            sizes[k] = max(sizes.get(k, 0), n)
    return dict(sorted(sizes.items()))


@dataclass
class Ref:
    """A bundle of traced buffers (`bufs`, dtype order `order`) and how one stage packed it."""
    bufs: tuple
    order: tuple
    packing: Packing
    chunked: bool = False   # gathered over "data": one chunk per sending device
    sender: int = -1



def trim(v, lay, shape):
    """A padded S value cut to `shape` (its rows on this device)."""
    if lay.kind == "S" and v.shape[lay.dim] != shape[lay.dim]:
        return lax.slice_in_dim(v, 0, shape[lay.dim], axis=lay.dim)
    return v


def pad_to(v, lay, shape):
    if lay.kind == "S" and v.shape[lay.dim] != shape[lay.dim]:
        pad = [(0, 0)] * v.ndim
        pad[lay.dim] = (0, shape[lay.dim] - v.shape[lay.dim])
        return jnp.pad(v, pad)
    return v
