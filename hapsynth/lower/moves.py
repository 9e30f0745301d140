"""Moving an array onto other devices, across processes too.

`jax.device_put` moves an array to another process's devices only where both ends lie
alike: the same HLO sharding over as many devices. `move` does that where it can, and
elsewhere (two islands of unequal sizes on other hosts) sends each receiving device its
own piece, one device to one device, once per receiving process and piece (devices of
that process taking the same piece copy it there), then builds the array from them.
Every process calls `move` alike; each takes part in the transfers it holds an end of.

`broadcast` and `everywhere` bring a value to every process, whatever device counts the
processes hold (JAX's `multihost_utils` assumes equal counts); `from_process_zero` a
string (a plan synthesised once, on process zero).
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as PS

__all__ = ["broadcast", "everywhere", "from_process_zero", "move"]


def move(x, dst: NamedSharding):
    """`x` laid out as `dst`, wherever its devices are."""
    if not isinstance(x, jax.Array) or not x.committed or _direct(x.sharding, dst):
        return jax.device_put(x, dst)
    return _by_pieces(x, dst)


def _processes(sharding) -> set[int]:
    return {d.process_index for d in sharding.device_set}


def _direct(src, dst: NamedSharding) -> bool:
    """Whether `jax.device_put` moves it: one process holds both ends, or the ends lie
    alike on as many devices of other processes (JAX's cross-host transfer)."""
    a, b = _processes(src), _processes(dst)
    if len(a | b) == 1:
        return True
    return (isinstance(src, NamedSharding) and not a & b and src.spec == dst.spec
            and src.mesh.devices.shape == dst.mesh.devices.shape)


def _bounds(index, shape) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _by_pieces(x: jax.Array, dst: NamedSharding) -> jax.Array:
    """`x` laid out as `dst` by single-device transfers, a piece per receiving device (a
    value split so that no device holds a piece whole is gathered on its devices first)."""
    me, shape = jax.process_index(), x.shape
    held = {d: _bounds(i, shape) for d, i in x.sharding.devices_indices_map(shape).items()}
    boxes = {_bounds(i, shape) for i in dst.devices_indices_map(shape).values()}
    if not all(_holders(held, box) for box in boxes):  # gathered on its devices first
        x = _whole(x)
        held = {d: _bounds(i, shape) for d, i in x.sharding.devices_indices_map(shape).items()}
    mine = {sh.device: sh.data for sh in x.addressable_shards}
    got: dict = {}  # this process's receiving devices -> their pieces
    first: dict = {}  # (receiving process, piece) -> the device it went to there
    wanted = sorted(dst.devices_indices_map(shape).items(), key=lambda kv: kv[0].id)
    for k, (d, index) in enumerate(wanted):
        box = _bounds(index, shape)
        if (d.process_index, box) in first:
            if d.process_index == me:
                got[d] = jax.device_put(got[first[(d.process_index, box)]], d)
            continue
        first[(d.process_index, box)] = d
        src = _holder(held, box, d, k)
        if me not in (src.process_index, d.process_index):
            continue
        piece = jax.device_put(_piece(x, src, held[src], box, mine.get(src)),
                               SingleDeviceSharding(d))
        if d.process_index == me:
            got[d] = piece
    return jax.make_array_from_single_device_arrays(shape, dst, list(got.values()),
                                                    dtype=x.dtype)


def _holders(held: dict, box) -> list:
    """The devices holding `box` whole."""
    return sorted((d for d, b in held.items()
                   if all(lo <= blo and bhi <= hi for (lo, hi), (blo, bhi) in zip(b, box))),
                  key=lambda d: d.id)


def _holder(held: dict, box, dst, k: int):
    """A device holding `box` whole: one on `dst`'s process if any, else the k-th in
    turn (so that a stage's devices share the sending)."""
    have = _holders(held, box)
    near = [d for d in have if d.process_index == dst.process_index]
    return near[0] if near else have[k % len(have)]


def _whole(x: jax.Array) -> jax.Array:
    """`x` replicated over its own devices (a program on them)."""
    if x.sharding.is_fully_replicated:
        return x
    return jax.jit(lambda v: v, out_shardings=NamedSharding(x.sharding.mesh, PS()))(x)


def _piece(x: jax.Array, src, bounds, box, data):
    """The part `box` of `x` on device `src`: cut from its shard there, or, on a process
    not holding `src`, an array of its shape there with no data here."""
    shape = tuple(hi - lo for lo, hi in box)
    if data is None:
        return jax.make_array_from_single_device_arrays(
            shape, SingleDeviceSharding(src), [], dtype=x.dtype)
    if box == bounds:
        return data
    start = [lo - slo for (lo, _), (slo, _) in zip(box, bounds)]
    return jax.lax.slice(data, start, [s + n for s, n in zip(start, shape)])


def broadcast(value, source: int = 0) -> np.ndarray:
    """Process `source`'s `value` (an array of the same shape and dtype on every
    process; the others' are ignored), on every process: one program over every device,
    each holding its process's value (as `multihost_utils.broadcast_one_to_all`, for
    processes of any device counts). Over every device, not one a process: on XLA CPU a
    collective over some devices only could start there before the step's own work and
    stall it."""
    value = np.asarray(value)
    if jax.process_count() == 1:
        return value
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("all",))
    rows = jax.make_array_from_single_device_arrays(
        (len(devices), *value.shape), NamedSharding(mesh, PS("all")),
        [jax.device_put(value[None], d) for d in jax.local_devices()])
    first = next(i for i, d in enumerate(devices) if d.process_index == source)
    out = jax.jit(lambda v: v[first], out_shardings=NamedSharding(mesh, PS()))(rows)
    return np.asarray(out.addressable_data(0))


def from_process_zero(text: str | None) -> str:
    """Process 0's string on every process (the others pass anything, None too): with
    several `jax.distributed` processes a plan is synthesised once and shared, since
    every process must run the same program."""
    if jax.process_count() == 1:
        return text
    data = np.frombuffer(text.encode(), np.uint8) if jax.process_index() == 0 else None
    n = int(broadcast(np.int32(0 if data is None else data.size)))
    return bytes(broadcast(np.zeros(n, np.uint8) if data is None else data)).decode()


def everywhere(x: jax.Array) -> jax.Array:
    """The whole of global array `x` on this process, whichever processes hold it, as an
    uncommitted array (every process calls it alike)."""
    if jax.process_count() == 1:
        return x
    whole = _whole(x)
    held = sorted(_processes(x.sharding))
    if len(held) == jax.process_count():
        return jax.numpy.asarray(np.asarray(whole.addressable_data(0)))
    me = jax.process_index() == held[0]
    local = np.asarray(whole.addressable_data(0)) if me else np.zeros(x.shape, x.dtype)
    return jax.numpy.asarray(broadcast(local, held[0]))
