"""Quantities with units (bandwidth, latency, memory, FLOP/s): one unit table per kind, one parser.

A quantity is a number in base units or a string ``"<number><unit>"`` whose unit
is a prefix (matched case-insensitively) followed by one of its kind's suffixes:

=============  ==============  =============================================
kind           base unit       string units
=============  ==============  =============================================
bandwidth      bytes/s         ``bps kbps Mbps Gbps Tbps`` or ``Gb/s`` (bits);
                               ``B/s kB/s MB/s GB/s TB/s KiB/s MiB/s GiB/s``
latency        seconds         ``s ms us µs ns``
memory         bytes (int)     ``B kB MB GB TB KiB MiB GiB TiB``
flops          FLOP/s          ``FLOP/s kFLOP/s … PFLOP/s`` or ``TFLOPS`` etc.
=============  ==============  =============================================

``b`` (bits) and ``B`` (bytes) differ; only FLOP/s units ignore case throughout.
Errors are :class:`ClusterError` naming the field and the value.
"""
from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import fail

__all__ = [
    "parse_bandwidth",
    "parse_latency",
    "parse_memory",
    "parse_flops",
    "human_bandwidth",
    "human_latency",
    "human_memory",
    "human_flops",
]

_NUM_RE = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*(\S.*?)?\s*$")
_DEC = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_BIN = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40, "pi": 2.0**50}


@dataclass(frozen=True)
class _Kind:
    """How one kind of quantity is written: ``value = number * prefix * mul / div``.

    Suffix scales are ``(mul, div)`` so that e.g. ``"5us"`` is ``5 / 1e6``, the
    double nearest 5e-06 (``5 * 1e-6`` is not).
    """

    expected: str                            # what a valid value looks like, for errors
    units: Mapping[str, tuple[float, float]]  # unit suffix -> (mul, div)
    prefixes: Mapping[str, float]            # lower-case prefix -> multiplier
    fold_case: bool = False                  # match the suffix case-insensitively too


_BANDWIDTH = _Kind("bytes/s or a string such as '10.4Gbps', '12GB/s', '11GiB/s'",
                   {"bps": (1.0, 8.0), "b/s": (1.0, 8.0), "B/s": (1.0, 1.0)}, {**_DEC, **_BIN})
_LATENCY = _Kind("seconds or a string such as '20us', '1.5ms'",
                 {"s": (1.0, 1.0), "ms": (1.0, 1e3), "us": (1.0, 1e6), "µs": (1.0, 1e6),
                  "μs": (1.0, 1e6), "ns": (1.0, 1e9)}, {"": 1.0})
_MEMORY = _Kind("bytes (an integer) or a string such as '32GiB', '16GB'",
                {"B": (1.0, 1.0)}, {**_DEC, **_BIN})
_FLOPS = _Kind("FLOP/s or a string such as '15.6TFLOP/s', '90 GFLOPS'",
               {"flop/s": (1.0, 1.0), "flops": (1.0, 1.0)}, _DEC, fold_case=True)


def _parse(kind: _Kind, value: Any, field: str | None) -> tuple[float, bool]:
    """(value in base units, whether it had a unit); rejects bools and other types."""
    if isinstance(value, bool):
        raise fail(field, f"expected {kind.expected}, got {value!r}")
    if isinstance(value, numbers.Real):
        return float(value), False
    if not isinstance(value, str):
        raise fail(field, f"expected {kind.expected}, got {type(value).__name__} {value!r}")
    m = _NUM_RE.match(value)
    if not m:
        raise fail(field, f"cannot parse {value!r} (expected {kind.expected})")
    x, unit = float(m.group(1)), m.group(2)
    if unit is None:
        return x, False
    key = unit.lower() if kind.fold_case else unit
    for suffix, (mul, div) in kind.units.items():
        prefix = key[:-len(suffix)].lower()
        if key.endswith(suffix) and prefix in kind.prefixes:
            return x * kind.prefixes[prefix] * mul / div, True
    raise fail(field, f"cannot parse {value!r} (expected {kind.expected})")


def _check_range(x: float, value: Any, field: str | None, *, allow_zero: bool = False) -> float:
    if not math.isfinite(x) or x < 0 or (x == 0 and not allow_zero):
        need = "non-negative" if allow_zero else "positive"
        raise fail(field, f"must be finite and {need}, got {value!r}")
    return x


def parse_bandwidth(value: Any, field: str | None = "bandwidth") -> float:
    """Bandwidth in bytes/s from a number (bytes/s) or a string such as ``"10.4Gbps"``."""
    return _check_range(_parse(_BANDWIDTH, value, field)[0], value, field)


def parse_latency(value: Any, field: str | None = "latency") -> float:
    """Latency in seconds from a number (s) or a string such as ``"20us"``."""
    return _check_range(_parse(_LATENCY, value, field)[0], value, field, allow_zero=True)


def parse_memory(value: Any, field: str | None = "memory") -> int:
    """Memory in bytes (int) from an int or a string such as ``"32GiB"``."""
    x, has_unit = _parse(_MEMORY, value, field)
    if not has_unit and not isinstance(value, str) and not float(x).is_integer():
        raise fail(field, f"expected {_MEMORY.expected}, got {value!r}")
    _check_range(x, value, field)
    n = int(round(x))
    if n <= 0:
        raise fail(field, f"must be at least 1 byte, got {value!r}")
    return n


def parse_flops(value: Any, field: str | None = "flops") -> float:
    """Effective FLOP/s from a number or a string such as ``"15.6TFLOP/s"`` / ``"15.6 TFLOPS"``."""
    return _check_range(_parse(_FLOPS, value, field)[0], value, field)


# ---- readable forms, for comments and summaries


def human_bandwidth(b: float) -> str:
    return f"{b / 1e9:.4g} GB/s = {b * 8 / 1e9:.4g} Gbps"


def human_latency(s: float) -> str:
    return f"{s * 1e6:.4g} us"


def human_memory(m: int) -> str:
    return f"{m / 2**30:.4g} GiB"


def human_flops(f: float) -> str:
    return f"{f / 1e12:.4g} TFLOP/s" if f >= 1e12 else f"{f / 1e9:.4g} GFLOP/s"
