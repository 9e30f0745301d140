"""The public API (DESIGN.md "Public API"): what users import as `hapsynth as hs`."""
from __future__ import annotations

from hapsynth.ir import inspect as _inspect


def inspect(train_step, *example_args) -> dict:
    """IR coverage and cost of `train_step(*example_args)`; see `hapsynth.ir.report.inspect`."""
    return _inspect(train_step, *example_args)
