"""Finding a cluster description by name or path: built-in presets are TOML package data.

The presets are the ``*.toml`` files of the package ``hapsynth.cluster.presets``
(the repository's ``clusters/`` folder), read with :mod:`importlib.resources` so
that they work from an installed wheel.  A preset name is matched
case-insensitively with ``_`` read as ``-``; ``hap_v100_p100`` is an alias of
``hap-v100x16-p100x48``.
"""
from __future__ import annotations

import os
from functools import lru_cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from .errors import ClusterError

__all__ = ["PRESET_PACKAGE", "preset_names", "preset_key", "preset_text", "locate", "read_file"]

PRESET_PACKAGE = "hapsynth.cluster.presets"
_ALIASES = {"hap-v100-p100": "hap-v100x16-p100x48"}


@lru_cache(maxsize=None)
def _preset_files() -> dict[str, Traversable]:
    files = resources.files(PRESET_PACKAGE).iterdir()
    return {f.name[:-5]: f for f in sorted(files, key=lambda f: f.name)
            if f.name.endswith(".toml") and f.is_file()}


def preset_names() -> list[str]:
    """Names of the built-in clusters (the presets' file stems), sorted."""
    return list(_preset_files())


def preset_key(s: str) -> str:
    """The preset name that ``s`` would name (normalised; aliases resolved)."""
    k = s.strip().lower().replace("_", "-")
    return _ALIASES.get(k, k)


def preset_text(key: str) -> str:
    """The TOML text of the preset ``key`` (a name from :func:`preset_names`)."""
    return _preset_files()[key].read_text(encoding="utf-8")


def locate(name_or_path: str | os.PathLike) -> str | Path:
    """The preset key (a ``str``) or the existing file (a ``Path``) that ``name_or_path`` names.

    A string without a path separator or ``.toml`` suffix is a preset name first; a
    ``*.toml`` path that does not exist but whose stem names a preset is that preset.
    """
    s = os.fspath(name_or_path)
    path = Path(s)
    presets = _preset_files()
    is_pathlike = (os.sep in s or "/" in s or path.suffix.lower() == ".toml"
                   or not isinstance(name_or_path, str))
    if not is_pathlike and preset_key(s) in presets:
        return preset_key(s)
    if path.is_file():
        return path
    if path.suffix.lower() == ".toml" and preset_key(path.stem) in presets:
        return preset_key(path.stem)
    what = "file" if is_pathlike else "preset or file"
    raise ClusterError(f"no such cluster {what}: {s!r} (presets: {', '.join(presets)})")


def read_file(path: Path, source: str) -> str:
    """The UTF-8 text of ``path``; ``source`` names it in the error for other bytes."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ClusterError(f"not UTF-8 text: {e}", source=source) from None
