"""`Layout`: how one tensor lies on the 1-D device axis; the one spelling every stage uses.

- `R`: replicated, every device holds the whole tensor;
- `P`: partial sum, the true value is the sum over devices of what each holds;
- `S(dim, units)`: sharded on `dim`, split in `units` factor units (a dim of size n moves
  in blocks of n / units rows); how many units each device holds is the plan's
  `shard_units[units]`, uneven in general.

Printed and parsed as "R", "P" and "S<dim>/<units>" (e.g. "S0/2048").
"""
from __future__ import annotations


class Layout:
    """An immutable, interned value: equal layouts are one object, so comparing and
    hashing them (millions of times while pricing) costs what it costs for any object."""

    __slots__ = ("kind", "dim", "units")
    _interned: dict = {}

    def __new__(cls, kind: str, dim: int = -1, units: int = 0) -> "Layout":
        key = (kind, int(dim), int(units))
        obj = cls._interned.get(key)
        if obj is None:
            if kind not in ("R", "P", "S"):
                raise ValueError(f"layout kind must be 'R', 'P' or 'S', got {kind!r}")
            if kind == "S" and (key[1] < 0 or key[2] < 1):
                raise ValueError(f"a sharded layout needs dim >= 0 and units >= 1, got "
                                 f"dim={dim}, units={units}")
            if kind != "S" and key[1:] != (-1, 0):
                raise ValueError(f"layout {kind} takes no dim or units")
            obj = object.__new__(cls)
            for name, value in zip(cls.__slots__, key):
                object.__setattr__(obj, name, value)
            obj = cls._interned.setdefault(key, obj)
        return obj

    def __setattr__(self, name, value):
        raise AttributeError("Layout is immutable")

    def __reduce__(self):  # copies and pickles come back as the interned object
        return Layout, (self.kind, self.dim, self.units)

    @property
    def sharded(self) -> bool:
        return self.kind == "S"

    @property
    def partial(self) -> bool:
        return self.kind == "P"

    @property
    def replicated(self) -> bool:
        return self.kind == "R"

    def __str__(self) -> str:
        return f"S{self.dim}/{self.units}" if self.kind == "S" else self.kind

    def __repr__(self) -> str:
        return f"Layout({self})"

    @staticmethod
    def parse(text: str) -> "Layout":
        """The layout `str(layout)` printed: "R", "P" or "S<dim>/<units>"."""
        if text in ("R", "P"):
            return Layout(text)
        try:
            dim, units = text[1:].split("/") if text[:1] == "S" else ("", "")
            return Layout("S", int(dim), int(units))
        except ValueError:
            raise ValueError(f"not a layout: {text!r} (expected 'R', 'P' or 'S<dim>/<units>', "
                             "e.g. 'S0/2048')") from None


R = Layout("R")
P = Layout("P")


def S(dim: int, units: int) -> Layout:
    """Sharded on `dim` in `units` factor units."""
    return Layout("S", dim, units)
