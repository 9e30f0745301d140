"""Plans kept on disk between runs. Planning a cluster of islands takes a minute or two,
and rerunning a script (a restarted job, a notebook kernel) plans the same step on the
same cluster with the same options again: with a cache folder the second run reads the
plan back. Opt in with `hs.parallelize(..., plan_cache=DIR)` or the environment variable
`HAPSYNTH_PLAN_CACHE=DIR`, as with JAX's compilation cache.

A plan is filed under a hash of all it depends on: the traced program (every op with its
params and constant operands, every type, the arguments' paths), the cluster (its full
description), the planning options, the number of processes, hapsynth's own source and
JAX's version. A file that cannot be read back, or whose plan does not check against
the program, is planned again and replaced; a folder that cannot be written keeps
nothing; each with a warning."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import tempfile
import warnings
from pathlib import Path

import jax
import numpy as np

from hapsynth.cluster import Cluster
from hapsynth.ir.signature import of_program
from hapsynth.ir.trace import Const, Program
from hapsynth.synth.plan import Plan

__all__ = ["ENV", "PlanCache"]

ENV = "HAPSYNTH_PLAN_CACHE"

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _fingerprint(value) -> str:
    """A text standing for `value` (an eqn's param) that is the same in every process:
    arrays by their bytes, callables by name, no memory addresses."""
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}({','.join(map(_fingerprint, value))})"
    if isinstance(value, (set, frozenset)):  # (in no order that lasts between processes)
        return f"{type(value).__name__}({','.join(sorted(map(_fingerprint, value)))})"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k!r}:{_fingerprint(v)}" for k, v in sorted(
            value.items(), key=lambda kv: repr(kv[0]))) + "}"
    if isinstance(value, (np.ndarray, jax.Array, np.generic, int, float, complex)) \
            and not isinstance(value, bool):
        if jax.dtypes.issubdtype(getattr(value, "dtype", None) or np.float32,
                                 jax.dtypes.prng_key):  # (typed keys: their bits and impl)
            return f"key({jax.random.key_impl(value)},{_fingerprint(jax.random.key_data(value))})"
        a = np.asarray(value)
        return f"array({a.dtype},{a.shape},{hashlib.sha256(a.tobytes()).hexdigest()[:16]})"
    if callable(value) and not isinstance(value, type) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return _ADDRESS.sub("", repr(value))


def program_key(prog: Program) -> str:
    """A hash of the traced program: what `Signature` holds, every op's params and the
    values of its constant operands (rules read some: a pad by zero carries a partial
    sum, a pad by one does not)."""
    h = hashlib.sha256()
    sig = of_program(prog)
    h.update(json.dumps([sig.inputs, sig.outputs, sig.ops, sig.digest]).encode())
    for e in prog.eqns:
        consts = [_fingerprint(x.value) for x in e.inputs if isinstance(x, Const)]
        h.update(f"{e.name}{_fingerprint(dict(e.params))}{e.loop}{consts}".encode())
    for t, v in sorted(prog.consts.items()):
        h.update(f"{t}{_fingerprint(v)}".encode())
    h.update(repr([_fingerprint(o.value) for o in prog.outputs
                   if isinstance(o, Const)]).encode())
    h.update(_ADDRESS.sub("", repr((prog.out_tree, prog.loops, prog.input_views,
                                    prog.split))).encode())
    return h.hexdigest()


class PlanCache:
    """A folder of plans, one JSON file each, named by `key`."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder).expanduser()

    @classmethod
    def of(cls, given) -> "PlanCache | None":
        """`given`: a folder, None (the folder `HAPSYNTH_PLAN_CACHE` names, if set) or
        False (no cache)."""
        if given is False:
            return None
        if given is None:
            given = os.environ.get(ENV) or None
            return None if given is None else cls(given)
        if not isinstance(given, (str, os.PathLike)) or not str(given):
            raise ValueError(f"plan_cache must be a folder, None (${ENV}) or False, got "
                             f"{given!r}")
        return cls(given)

    def key(self, prog: Program, cluster: Cluster, options: dict) -> str:
        """The name a plan of `prog` on `cluster` under `options` is filed under."""
        from hapsynth import __version__
        from hapsynth._jax import moves_across_processes
        what = {"program": program_key(prog),
                "cluster": cluster.to_dict(explicit=True),
                "options": {k: _fingerprint(v) for k, v in sorted(options.items())},
                "processes": jax.process_count(),
                "moves": jax.process_count() > 1 and moves_across_processes(),
                "hapsynth": __version__, "code": _code(), "jax": jax.__version__}
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.json"

    def get(self, key: str) -> Plan | None:
        """The plan filed under `key`, or None (not there, or unreadable: warned)."""
        path = self.path(key)
        if not path.exists():
            return None
        try:
            return Plan.from_json(path.read_text())
        except Exception as err:  # noqa: BLE001 (a damaged file is planned again)
            warnings.warn(f"hapsynth plan cache: {path} cannot be read back ({err}); planning "
                          "again", stacklevel=3)
            return None

    def put(self, key: str, plan: Plan) -> Path | None:
        """File `plan` under `key`, written whole or not at all (a folder that cannot be
        written is warned of: the plan made is not lost)."""
        path, tmp = self.path(key), None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{key}.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(plan.to_json())
            os.chmod(tmp, 0o666 & ~_UMASK)  # (as a plain open would: others may read it)
            os.replace(tmp, path)
            return path
        except OSError as err:
            warnings.warn(f"hapsynth plan cache: cannot write {path} ({err}); the plan is "
                          "not kept", stacklevel=3)
            return None
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.remove(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()  # (read once, at import: setting it is not thread-safe)


@functools.lru_cache(maxsize=None)
def _code() -> str:
    """A hash of hapsynth's own source: a plan made by other code is made again."""
    h = hashlib.sha256()
    root = Path(__file__).parent
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]
