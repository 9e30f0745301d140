"""Where the command line's train step comes from: a zoo model by name, or a user's own
`path/to/file.py:make_step` / `package.module:make_step`, a function returning
`(train_step, example_args)`."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys


class StepSourceError(ValueError):
    """A train step that cannot be loaded; the message names the problem in one line."""


def is_user_step(spec: str) -> bool:
    return ":" in spec


def load_step(spec: str, *, config: str = "tiny", devices: int = 64):
    """`(train_step, example_args)` of a zoo model name (at `config`, its paper batch for
    `devices`) or of `FILE.py:FUNC` / `package.module:FUNC` (FUNC() is called)."""
    if not is_user_step(spec):
        from hapsynth.models import get, names

        if spec not in names():
            raise StepSourceError(f"no zoo model {spec!r} (zoo: {', '.join(names())}; or give "
                                  "your own as path/to/file.py:make_step or package.module:make_step)")
        return get(spec, config, devices=devices)
    where, _, name = spec.rpartition(":")
    module = _module(where)
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        raise StepSourceError(f"{where} has no function {name!r}")
    made = fn()
    if (not isinstance(made, (tuple, list)) or len(made) != 2 or not callable(made[0])
            or not isinstance(made[1], (tuple, list))):
        raise StepSourceError(f"{spec}() must return (train_step, example_args): a function and "
                              f"a tuple of its arguments, got {_kind(made)}")
    return made[0], tuple(made[1])


def _module(where: str):
    if where.endswith(".py") or os.sep in where or "/" in where:
        if not os.path.isfile(where):
            raise StepSourceError(f"no such file: {where}")
        name = "hapsynth_user_" + os.path.splitext(os.path.basename(where))[0]
        spec = importlib.util.spec_from_file_location(name, where)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))  # its own imports
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.pop(0)
        return module
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        raise StepSourceError(f"no module {where!r} ({e})") from None


def _kind(x) -> str:
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}: ({', '.join(type(v).__name__ for v in x)})"
    return type(x).__name__
