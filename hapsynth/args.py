"""A train step's arguments as `jax.jit` takes them.

Pytrees of arrays (global, `Sharded`, or `jax.ShapeDtypeStruct` to plan without data)
and Python scalars (a learning rate, a step count, a flag). A Python scalar is traced
as `jit` traces it: a weakly typed value of its dtype, not a constant, so that a new
value runs the same plan. `Arguments` flattens a call's arguments once; its `key` (the
pytree structure and each leaf's shape and dtype) is what a plan depends on.
"""
from __future__ import annotations

import inspect

import jax
import numpy as np

from hapsynth.lower.values import Sharded

__all__ = ["Arguments", "check_arity", "donated_leaves", "signature_of", "state_arity"]

SCALARS = (bool, int, float, complex)


def _is_sharded(v) -> bool:
    return isinstance(v, Sharded)


class Arguments:
    """One call's arguments, flattened once. `leaves`: as the runtime reads them (a
    Python scalar as a 0-d numpy array of its `jit` dtype); `key`: the plan's signature.
    Cheap: made on every step."""

    __slots__ = ("args", "leaves", "tree", "key")

    def __init__(self, args: tuple):
        self.args = args
        self.leaves, self.tree = jax.tree.flatten(args, is_leaf=_is_sharded)
        types = []
        for i, x in enumerate(self.leaves):
            if type(x) in SCALARS:
                aval = jax.typeof(x)  # as jit: ~float32[] (weak), ~int32[], bool[]
                self.leaves[i] = np.asarray(x, aval.dtype)
                types.append(((), aval.dtype, aval.weak_type))
            elif hasattr(x, "shape") and hasattr(x, "dtype"):
                types.append((tuple(x.shape), x.dtype))
            else:
                raise _not_an_array(args, i)
        self.key = (self.tree, tuple(types))

    def values(self) -> tuple:
        """The arguments again, with Python scalars as arrays."""
        return jax.tree.unflatten(self.tree, self.leaves)

    def abstract(self) -> tuple:
        """The arguments as `jax.ShapeDtypeStruct`s (a Python scalar's weakly typed)."""
        return jax.tree.unflatten(self.tree, [
            jax.ShapeDtypeStruct(t[0], t[1], weak_type=len(t) > 2 and t[2])
            for t in self.key[1]])


def signature_of(args) -> tuple:
    """What a plan depends on: the pytree structure, shapes and dtypes of the arguments
    (a `Sharded` leaf counts as the array it stands for, a Python scalar as `jit` types
    it)."""
    return Arguments(args).key


def _not_an_array(args, i: int) -> TypeError:
    path, x = jax.tree_util.tree_flatten_with_path(args, is_leaf=_is_sharded)[0][i]
    return TypeError(f"argument {jax.tree_util.keystr(path)} of type {type(x).__name__} is "
                     f"not an array or a Python scalar (as jax.jit takes them)")


def check_arity(fn, args: tuple) -> None:
    """A `TypeError` naming the missing or extra argument, as Python's own call would,
    when `fn` does not take `args` (checked before tracing, so the error is the call's,
    not one from deep inside it). Nothing is checked for a callable without a signature."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*args)
    except TypeError as err:
        raise TypeError(_arity_message(fn, sig, args, err)) from None


def _arity_message(fn, sig: inspect.Signature, args: tuple, err: TypeError) -> str:
    name = f"{getattr(fn, '__name__', type(fn).__name__)}()"
    params = sig.parameters.values()
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p.name for p in params if p.name in positional and p.default is p.empty]
    missing = required[len(args):]
    if missing:
        names = [f"'{p}'" for p in missing]
        listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        s = "s" if len(missing) > 1 else ""
        return f"{name} missing {len(missing)} required positional argument{s}: {listed}"
    if len(args) > len(positional):
        extra = ", ".join(f"argument {i} ({_describe(a)})"
                          for i, a in enumerate(args) if i >= len(positional))
        return (f"{name} takes {len(positional)} positional argument"
                f"{'s' if len(positional) != 1 else ''} ({', '.join(positional)}) but "
                f"{len(args)} were given: {extra} is extra")
    return f"{name}: {err}"


def _describe(x) -> str:
    """An argument in a few words: `float 0.1`, `f32[8,16]`, `dict of 3 arrays`."""
    if type(x) in SCALARS:
        return f"{type(x).__name__} {x!r}"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{np.dtype(x.dtype).name}[{','.join(map(str, x.shape))}]"
    n = len(jax.tree.leaves(x, is_leaf=_is_sharded))
    return f"{type(x).__name__} of {n} leaves"


def state_arity(train_step, args) -> int:
    """How many leading arguments are state: the output's leading elements with the same
    pytree structure, shapes and dtypes (params, opt_state) are fed back as the next
    step's arguments. (A batch of token ids is one leaf like the loss, but not its shape.)"""
    out = jax.eval_shape(train_step, *args)
    if not isinstance(out, (tuple, list)):
        return 0

    def same(a, b) -> bool:
        la, ta = jax.tree.flatten(a, is_leaf=_is_sharded)
        lb, tb = jax.tree.flatten(b, is_leaf=_is_sharded)
        return ta == tb and all(np.shape(x) == np.shape(y) and
                                getattr(x, "dtype", None) == getattr(y, "dtype", None)
                                for x, y in zip(la, lb))

    k = 0
    while k < min(len(out), len(args)) and same(out[k], args[k]):
        k += 1
    return k


def donated_leaves(args, donate_argnums) -> list[int]:
    """Flat leaf indices of the arguments `donate_argnums` names (as in `jax.jit`)."""
    nums = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    for i in nums:
        if not -len(args) <= i < len(args):
            raise ValueError(f"donate_argnums has {i}, but the step takes {len(args)} arguments")
    counts = [len(jax.tree.leaves(a, is_leaf=_is_sharded)) for a in args]
    starts = [sum(counts[:i]) for i in range(len(args))]
    return [starts[i] + k for i in sorted({n % len(args) for n in nums}) for k in range(counts[i])]
