"""A device's place on a pipelined program's (stage, data) mesh, as its traced body sees
it, and the branch hook every branch it runs goes through (`hook.py`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["STAGE", "DATA", "Place"]

STAGE, DATA = "stage", "data"


@dataclass(frozen=True, eq=False)
class Place:
    """Traced: this device's stage, its group (stage and row count), and its number in
    the program's `devices` (the mesh puts stages in the plan's order, which need not be
    the devices' order); `hook` and its inputs `extra` (none without a hook)."""

    stage: Any
    group: Any
    index: Any
    hook: Any = None
    extra: tuple = ()

    def hooked(self, f, entry):
        """Branch `f` as the hook wraps it (`entry`: per operand, whether it is one of
        the step's own inputs)."""
        return f if self.hook is None else self.hook.wrap(f, entry, self.extra,
                                                          index=self.index)
