"""Plans kept on disk between runs. Planning a cluster of islands takes a minute or two,
and rerunning a script (a restarted job, a notebook kernel) plans the same step on the
same cluster with the same options again: with a cache folder the second run reads the
plan back. Opt in with `hs.parallelize(..., plan_cache=DIR)` or the environment variable
`HAPSYNTH_PLAN_CACHE=DIR`, as with JAX's compilation cache.

A plan is filed under a hash of all it depends on: the traced program (every op with its
params, every type, the arguments' paths), the cluster (its full description), the
planning options, the number of processes, and the hapsynth and JAX versions. A file
that cannot be read back, or whose plan does not check against the program, is planned
again and replaced (with a warning)."""
from __future__ import annotations

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
from hapsynth.ir.trace import Program
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
    if isinstance(value, (np.ndarray, jax.Array)):
        a = np.asarray(value)
        return f"array({a.dtype},{a.shape},{hashlib.sha256(a.tobytes()).hexdigest()[:16]})"
    if callable(value) and not isinstance(value, type) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return _ADDRESS.sub("", repr(value))


def program_key(prog: Program) -> str:
    """A hash of the traced program: what `Signature` holds, and every op's params."""
    h = hashlib.sha256()
    sig = of_program(prog)
    h.update(json.dumps([sig.inputs, sig.outputs, sig.ops, sig.digest]).encode())
    for e in prog.eqns:
        h.update(f"{e.name}{_fingerprint(dict(e.params))}{e.loop}".encode())
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

    def key(self, prog: Program, cluster: Cluster, options: dict) -> str:
        from hapsynth import __version__
        from hapsynth._jax import moves_across_processes
        what = {"program": program_key(prog),
                "cluster": cluster.to_dict(explicit=True),
                "options": {k: _fingerprint(v) for k, v in sorted(options.items())},
                "processes": jax.process_count(),
                "moves": jax.process_count() > 1 and moves_across_processes(),
                "hapsynth": __version__, "jax": jax.__version__}
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

    def put(self, key: str, plan: Plan) -> Path:
        """File `plan` under `key` (written whole or not at all)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{key}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(plan.to_json())
        os.replace(tmp, path)
        return path
