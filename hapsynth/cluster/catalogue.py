"""Built-in device catalogue: effective speed, memory and memory bandwidth per device type.

The cost model needs one number per device for compute speed: the *effective*
FLOP/s a device reaches on a whole fp32 training step (forward, backward and
optimizer update, memory-bound ops included), not the datasheet peak.  Only two of
these are measured (HAP's profiled numbers); the others are stated assumptions
derived from peak throughput by one of two rules:

* pre-Ampere GPUs (no TF32): **25 % of peak dense FP32**.  This is the ratio HAP's
  profiled numbers imply: V100 3.86e12 / 15.7e12 = 24.6 %, P100 2.15e12 /
  9.3e12 = 23.1 %.
* Ampere and later: XLA uses TF32 tensor cores for fp32 matmuls at JAX's default
  precision, so the rule is **10 % of peak dense TF32** (datasheet "with
  sparsity" numbers halved).  That gives A100 ≈ 4.0× V100, below NVIDIA's
  "up to 6×" for TF32 BERT training, i.e. deliberately conservative: the
  elementwise and memory-bound parts of a step do not speed up with TF32.

=========  ========  =======  ===========  =========================================
name       FLOP/s    memory   memory BW    basis of the effective FLOP/s
=========  ========  =======  ===========  =========================================
V100       3.86e12   16 GiB   900 GB/s     HAP profiled (V100-SXM2; peak FP32 15.7e12)
P100       2.15e12   16 GiB   732 GB/s     HAP profiled (P100-PCIe; peak FP32 9.3e12)
T4         2.025e12  16 GiB   320 GB/s     25 % of 8.1e12 peak FP32 (Turing, no TF32)
L4         6.0e12    24 GiB   300 GB/s     10 % of 60e12 dense TF32 (Ada)
A100-40GB  15.6e12   40 GiB   1555 GB/s    10 % of 156e12 dense TF32 (SXM4)
A100-80GB  15.6e12   80 GiB   2039 GB/s    10 % of 156e12 dense TF32 (SXM4)
H100       49.5e12   80 GiB   3350 GB/s    10 % of 495e12 dense TF32 (SXM5 80GB)
H200       49.5e12   141 GiB  4800 GB/s    10 % of 495e12 dense TF32 (same die as H100)
CPU        9.0e10    8 GiB    10 GB/s      measured: numpy 1024³ fp32 matmul, one core
                                           of the development machine (~90 GFLOP/s);
                                           memory is a nominal per-simulated-device
                                           budget, bandwidth a measured copy rate
=========  ========  =======  ===========  =========================================

Memory is the nominal capacity read as GiB (nvidia-smi reports roughly this much:
40960 MiB for an A100-40GB); the planner should keep its own reserve for the
runtime.  Memory bandwidth is the datasheet HBM/GDDR number in bytes/s.

Names are matched case-insensitively, with ``_`` and spaces read as ``-``.
Aliases: ``A100`` means **A100-40GB** (the most common cloud SKU and the
conservative choice for memory); ``H100`` is the SXM 80 GB part (``H100-SXM``,
``H100-80GB``); ``V100`` is the 16 GB SXM2 part of 8-GPU servers such as HAP's
(``V100-16GB``, ``V100-SXM2``).  ``lookup`` raises :class:`UnknownDeviceType`
(a ``LookupError``) naming the known types and the closest match.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

__all__ = [
    "DeviceType",
    "UnknownDeviceType",
    "CATALOGUE",
    "ALIASES",
    "lookup",
    "canonical_name",
    "known_types",
]

GiB = 1 << 30


@dataclass(frozen=True)
class DeviceType:
    """One catalogue entry.

    flops: effective FLOP/s for fp32 training (see the module docstring);
    memory: capacity in bytes; mem_bandwidth: bytes/s; notes: where the numbers
    come from.
    """

    name: str
    flops: float
    memory: int
    mem_bandwidth: float
    notes: str = ""


class UnknownDeviceType(LookupError):
    """A device type name that is neither a catalogue entry nor an alias."""

    def __init__(self, name: object):
        self.name = name
        known = ", ".join(CATALOGUE)
        hint = ""
        if isinstance(name, str):
            close = difflib.get_close_matches(
                _normalise(name), list(_INDEX), n=1, cutoff=0.5
            )
            if close:
                hint = f"; did you mean {_INDEX[close[0]]!r}?"
        super().__init__(f"unknown device type {name!r} (known: {known}){hint}")


_ENTRIES = (
    DeviceType("V100", 3.86e12, 16 * GiB, 900e9,
               "HAP profiled effective FLOP/s; V100-SXM2 16GB, peak FP32 15.7e12"),
    DeviceType("P100", 2.15e12, 16 * GiB, 732e9,
               "HAP profiled effective FLOP/s; P100-PCIe 16GB, peak FP32 9.3e12"),
    DeviceType("T4", 2.025e12, 16 * GiB, 320e9,
               "assumed 25% of 8.1e12 peak FP32 (no TF32)"),
    DeviceType("L4", 6.0e12, 24 * GiB, 300e9,
               "assumed 10% of 60e12 dense TF32"),
    DeviceType("A100-40GB", 15.6e12, 40 * GiB, 1555e9,
               "assumed 10% of 156e12 dense TF32; SXM4 40GB"),
    DeviceType("A100-80GB", 15.6e12, 80 * GiB, 2039e9,
               "assumed 10% of 156e12 dense TF32; SXM4 80GB"),
    DeviceType("H100", 49.5e12, 80 * GiB, 3.35e12,
               "assumed 10% of 495e12 dense TF32; SXM5 80GB"),
    DeviceType("H200", 49.5e12, 141 * GiB, 4.8e12,
               "assumed 10% of 495e12 dense TF32 (H100 die); 141GB HBM3e"),
    DeviceType("CPU", 9.0e10, 8 * GiB, 10e9,
               "measured numpy 1024^3 fp32 matmul on one core (~90 GFLOP/s); "
               "memory is a nominal budget per simulated device"),
)

CATALOGUE: Mapping[str, DeviceType] = MappingProxyType({d.name: d for d in _ENTRIES})

ALIASES: Mapping[str, str] = MappingProxyType({
    "A100": "A100-40GB",
    "A100-40G": "A100-40GB",
    "A100-SXM4-40GB": "A100-40GB",
    "A100-80G": "A100-80GB",
    "A100-SXM4-80GB": "A100-80GB",
    "H100-SXM": "H100",
    "H100-80GB": "H100",
    "H100-SXM-80GB": "H100",
    "H100-SXM5-80GB": "H100",
    "H200-141GB": "H200",
    "H200-SXM": "H200",
    "V100-16GB": "V100",
    "V100-SXM2": "V100",
    "V100-SXM2-16GB": "V100",
    "P100-16GB": "P100",
    "P100-PCIE": "P100",
    "T4-16GB": "T4",
    "L4-24GB": "L4",
})


def _normalise(name: str) -> str:
    return "-".join(name.strip().upper().replace("_", " ").replace("-", " ").split())


_INDEX: dict[str, str] = {_normalise(n): n for n in CATALOGUE}
_INDEX.update({_normalise(a): t for a, t in ALIASES.items()})


def canonical_name(name: str) -> str:
    """The catalogue name for ``name`` (an entry or alias, any case)."""
    if not isinstance(name, str):
        raise UnknownDeviceType(name)
    try:
        return _INDEX[_normalise(name)]
    except KeyError:
        raise UnknownDeviceType(name) from None


def lookup(name: str) -> DeviceType:
    """The catalogue entry for ``name`` (an entry or alias, case-insensitive)."""
    return CATALOGUE[canonical_name(name)]


def known_types() -> list[str]:
    """Catalogue entry names, in catalogue order (aliases not included)."""
    return list(CATALOGUE)
