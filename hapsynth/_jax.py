"""The one place hapsynth touches JAX internals (`jax.extend`, jaxpr objects).

`jax.extend` carries no stability promise; everything version-sensitive about
jaxprs (names of call primitives, where sub-jaxprs live in params) is kept here,
so a JAX upgrade touches one file.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.extend import core as _core

Literal = _core.Literal
Var = _core.Var
ClosedJaxpr = _core.ClosedJaxpr
Jaxpr = _core.Jaxpr
Primitive = _core.Primitive

# Call-like primitives whose body is inlined: name -> param holding the body.
_INLINE_PARAM = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "custom_lin": None,  # never appears in a traced (not-yet-differentiated) step
}

# Control flow kept as one opaque node: name -> params holding bodies.
CONTROL_FLOW = {"scan": ("jaxpr",), "while": ("cond_jaxpr", "body_jaxpr"), "cond": ("branches",)}

# A scan's body is planned as a *loop region* of the flat program, between three kinds
# of marker ops that are never bound: each iteration's slice of a scanned-over operand,
# the carry (the initial value, then the previous iteration's), and the stacking of a
# per-iteration output. Own primitives, so they print and register like any other.
LOOP_SLICE = Primitive("loop_slice")
LOOP_CARRY = Primitive("loop_carry")
LOOP_STACK = Primitive("loop_stack")
LOOP_MARKERS = (LOOP_SLICE.name, LOOP_CARRY.name, LOOP_STACK.name)
COPY = jax.lax.copy_p  # an explicit identity, for a carry a body passes through
BARRIER = jax.lax.optimization_barrier_p  # keeps XLA from merging a recomputation (remat)


def scan_parts(eqn):
    """(body jaxpr, body consts, num_consts, num_carry, length, reverse) of a scan eqn, or
    None when it is not a scan the planner lifts (effects in its body)."""
    if eqn.primitive.name != "scan" or eqn.effects:
        return None
    p = eqn.params
    body = p["jaxpr"]
    return (body.jaxpr, tuple(body.consts), int(p["num_consts"]), int(p["num_carry"]),
            int(p["length"]), bool(p["reverse"]))


SELECT_N = jax.lax.select_n_p  # joins a cond's branches: case k where the index is k


def cond_branches(eqn):
    """A `cond`'s branches as (open jaxpr, consts) pairs, or None when it is not one the
    planner lifts (effects in a branch, or a result of an extended dtype such as a key)."""
    if eqn.primitive.name != "cond" or eqn.effects:
        return None
    if any(not isinstance(v.aval.dtype, np.dtype) for v in eqn.outvars):
        return None
    return [(b.jaxpr, tuple(b.consts)) for b in eqn.params["branches"]]


def platform_branch(eqn) -> int | None:
    """The value a `platform_index` eqn (`lax.platform_dependent`, as in `jnp.diagonal`)
    takes on the platform the step runs on, JAX's default backend, as `jit` resolves it;
    None for any other eqn, or where no branch names this platform and none is default."""
    if eqn.primitive.name != "platform_index":
        return None
    from jax._src import xla_bridge
    here = xla_bridge.canonicalize_platform(jax.default_backend())
    default = None
    for i, names in enumerate(eqn.params["platforms"]):
        if names is None:
            default = i
        elif any(here in xla_bridge.expand_platform_alias(n) for n in names):
            return i
    return default


def make_jaxpr(fn, *args):
    """Trace `fn(*args)` to a ClosedJaxpr; returns (closed_jaxpr, in_tree, out_tree)."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    in_tree = jax.tree.structure(args)
    out_tree = jax.tree.structure(out_shape)
    return closed, in_tree, out_tree


def inline_body(eqn) -> tuple[Jaxpr, tuple[Any, ...]] | None:
    """(open jaxpr, consts) of a call-like eqn to inline, or None if not call-like."""
    name = eqn.primitive.name
    if name not in _INLINE_PARAM or _INLINE_PARAM[name] is None:
        return None
    body = eqn.params.get(_INLINE_PARAM[name])
    if body is None:
        return None
    if isinstance(body, ClosedJaxpr):
        return body.jaxpr, tuple(body.consts)
    return body, ()


def linear_solve_body(eqn, args) -> tuple[Jaxpr, tuple[Any, ...], list] | None:
    """A `custom_linear_solve` (`jnp.linalg.solve`, `inv`) as what it runs, its `solve`
    jaxpr on that jaxpr's consts and the right-hand side: (open jaxpr, consts, its
    arguments among `args`), or None for another eqn."""
    if eqn.primitive.name != "custom_linear_solve":
        return None
    n, body = eqn.params["const_lengths"], eqn.params["jaxprs"].solve
    start = n.matvec + n.vecmat
    return (body.jaxpr, tuple(body.consts),
            [*args[start:start + n.solve], *args[sum(n):]])


def sub_jaxprs(eqn) -> list[tuple[Jaxpr, tuple[Any, ...]]]:
    """Bodies of a control-flow eqn, as (open jaxpr, consts) pairs."""
    out = []
    for key in CONTROL_FLOW.get(eqn.primitive.name, ()):
        val = eqn.params[key]
        for body in (val if isinstance(val, (tuple, list)) else (val,)):
            if isinstance(body, ClosedJaxpr):
                out.append((body.jaxpr, tuple(body.consts)))
            else:
                out.append((body, ()))
    return out


def is_literal(atom) -> bool:
    return isinstance(atom, Literal)


def is_dropvar(var) -> bool:
    return type(var).__name__ == "DropVar"


def aval_of(atom):
    return atom.aval


def has_effects(eqn) -> bool:
    return bool(eqn.effects)


def source_of(eqn) -> str:
    """A short user-facing location: the name stack of the eqn (e.g. 'jvp(Block_0)/mul')."""
    try:
        return str(eqn.source_info.name_stack)
    except AttributeError:  # pragma: no cover - older/newer JAX without name stacks
        return ""


def bind(primitive, args, params):
    """Apply a primitive to concrete or traced values."""
    return primitive.bind(*args, **params)


def partitionable_bits(eqn) -> bool:
    """Does this `random_bits` eqn give each element bits that depend only on the
    element's own global index (JAX's partitionable threefry), so a device can make just
    its block? A scalar threefry key, `jax_threefry_partitionable`, fewer than 2**32
    elements (the block's index is computed in 32 bits)."""
    if eqn.name != "random_bits" or not jax.config.jax_threefry_partitionable:
        return False
    key = eqn.in_avals[0]
    impl = getattr(getattr(key.dtype, "_impl", None), "name", None)
    return key.shape == () and impl == "threefry2x32" and eqn.out_avals[0].size < 2 ** 32


def random_bits_block(key, bit_width: int, shape, local_shape, starts):
    """The block of `jax.random.bits(key, shape)` (bit_width bits) of `local_shape`
    starting at `starts` (one start per dim, static or traced), made without the rest."""
    import jax.extend.random as jrandom
    import jax.numpy as jnp
    import numpy as np

    data = jax.random.key_data(key)
    flat = jnp.zeros(local_shape, jnp.uint32)
    for d in range(len(shape)):
        stride = jnp.uint32(int(np.prod(shape[d + 1:], dtype=np.int64)))
        at = jax.lax.broadcasted_iota(jnp.uint32, local_shape, d)
        flat = flat + (at + jnp.asarray(starts[d]).astype(jnp.uint32)) * stride
    b1, b2 = jrandom.threefry2x32_p.bind(data[0], data[1], jnp.zeros_like(flat), flat)
    dtype = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}[bit_width]
    if bit_width == 64:
        return (b1.astype(dtype) << dtype(32)) | b2.astype(dtype)
    return (b1 ^ b2).astype(dtype)


def eqn_like(fn, *avals):
    """(primitive, params) of the one eqn `fn(*avals)` traces to: a new eqn with this JAX
    version's own params (e.g. a `slice` or `reshape` the IR inserts)."""
    closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
    (eqn,) = closed.jaxpr.eqns
    return eqn.primitive, dict(eqn.params)


def process_barrier(name: str, timeout_s: float = 600.0) -> None:
    """Wait until every `jax.distributed` process reaches barrier `name` (unique per
    use), through the coordination service rather than a collective; nothing to wait
    for in one process."""
    from jax._src import distributed
    client = getattr(distributed.global_state, "client", None)
    if client is not None:
        client.wait_at_barrier(name, timeout_in_ms=int(timeout_s * 1000))


def moves_across_processes() -> bool:
    """Whether `jax.device_put` may move an array to devices of another process
    (multi-controller JAX's cross-host transfers): the backend does it, or
    `jax_cross_host_transfer_socket_address` is set (DCN transfers through sockets)."""
    from jax._src import xla_bridge
    if xla_bridge.CROSS_HOST_TRANSFER_SOCKET_ADDRESS.value:
        return True
    return bool(getattr(xla_bridge.get_backend(), "supports_cross_host_transfers", False))
