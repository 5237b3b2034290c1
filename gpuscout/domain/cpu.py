"""Which precisions this machine's CPU multiplies matrices in natively.

torch's CPU bf16 (and fp16) matmuls are fast only where the CPU has bf16 instructions (``avx512_bf16``, AMX, or
AVX-NE-CONVERT) and oneDNN may use them. Elsewhere (AVX2-only CPUs such as the AMD EPYCs of small cloud VMs) they run
on a reference path at about 1 % of fp32 speed: 0.8 GFLOP/s against 153 GFLOP/s in fp32, measured on a 2-core AMD
EPYC (AVX2 only) with torch 2.13. ``ONEDNN_MAX_CPU_ISA`` caps the instructions oneDNN uses (the test suite sets it to
AVX2 to run the slowest CPU's kernels on every machine), so the cap counts as much as the flags.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

# oneDNN's ISA names (ONEDNN_MAX_CPU_ISA), lowest to highest; aliases share a rank.
_ONEDNN_ISA_RANK: dict[str, int] = {
    "SSE41": 0, "AVX": 1, "AVX2": 2, "AVX2_VNNI": 3, "AVX2_VNNI_2": 4, "AVX512_CORE": 5, "AVX512_CORE_VNNI": 6,
    "AVX512_CORE_BF16": 7, "AVX10_1_512": 8, "AVX512_CORE_FP16": 8, "AVX10_1_512_AMX": 9, "AVX512_CORE_AMX": 9,
    "AVX10_1_512_AMX_FP16": 10, "AVX512_CORE_AMX_FP16": 10, "AVX10_2_512": 11, "AVX10_2_512_AMX_2": 12,
}  # fmt: skip
_UNCAPPED = {"", "ALL", "DEFAULT"}
# (cpuinfo flag, the lowest ONEDNN_MAX_CPU_ISA that lets oneDNN use it for bf16 matmuls)
_BF16_FLAGS = (("amx_bf16", "AVX512_CORE_AMX"), ("avx512_bf16", "AVX512_CORE_BF16"), ("avx_ne_convert", "AVX2_VNNI_2"))


@dataclass(frozen=True)
class CpuPrecisions:
    """Whether bf16 matmuls run natively on this CPU, and why (one sentence for messages)."""

    bf16_native: bool
    reason: str


def bf16_support(flags: Collection[str], max_isa: str | None) -> CpuPrecisions:
    """Native bf16 from the CPU's flags (``/proc/cpuinfo``) and oneDNN's cap (``ONEDNN_MAX_CPU_ISA``, None if unset)."""
    cap = (max_isa or "").strip().upper()
    present = [(flag, needs) for flag, needs in _BF16_FLAGS if flag in flags]
    if not present:
        return CpuPrecisions(False, "this CPU has no bf16 instructions (no avx512_bf16, amx_bf16 or avx_ne_convert)")
    if cap in _UNCAPPED:
        return CpuPrecisions(True, f"this CPU has {present[0][0]}")
    rank = _ONEDNN_ISA_RANK.get(cap)
    if rank is None:
        return CpuPrecisions(True, f"this CPU has {present[0][0]} (ONEDNN_MAX_CPU_ISA={max_isa} is not a known name)")
    for flag, needs in present:
        if rank >= _ONEDNN_ISA_RANK[needs]:
            return CpuPrecisions(True, f"this CPU has {flag} and ONEDNN_MAX_CPU_ISA={max_isa} allows it")
    flag = present[0][0]
    return CpuPrecisions(False, f"this CPU has {flag}, but ONEDNN_MAX_CPU_ISA={max_isa} keeps oneDNN from using it")


CPUINFO = Path("/proc/cpuinfo")


def cpuinfo_field(*names: str, cpuinfo: Path = CPUINFO) -> str | None:
    """The first processor's value of the first of ``names`` in ``cpuinfo`` (None where there is no such file or
    field, e.g. macOS)."""
    try:
        with cpuinfo.open(encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in names:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The instruction-set flags of the first processor in ``cpuinfo`` (empty where there are none)."""
    return frozenset((cpuinfo_field("flags", "features", cpuinfo=cpuinfo) or "").split())


def detect_cpu_precisions(environ: Mapping[str, str] | None = None) -> CpuPrecisions:
    """This machine's CPU, as torch will use it in this process (``ONEDNN_MAX_CPU_ISA`` read from ``environ``)."""
    env = os.environ if environ is None else environ
    return bf16_support(cpu_flags(), env.get("ONEDNN_MAX_CPU_ISA"))


_HALF_VALUES = ("bf16", "bfloat16", "fp16", "float16", "half")
_HALF = (*_HALF_VALUES, "mixed_precision", "amp")
_OFF = {"", "0", "false", "no", "off", "none", "auto", "fp32", "float32", "no_amp"}


def half_precision_argument(arguments: Mapping[str, object]) -> str | None:
    """``key=value`` of the first argument of a user's script that asks for bf16/fp16 (a flag such as ``bf16: true``
    or a value such as ``precision: bf16``), or None. ``auto`` is left to the script (it usually means: on a GPU)."""
    for key, value in arguments.items():
        text = str(value).strip().lower()
        if any(word in key.lower() for word in _HALF) and text not in _OFF:
            return f"{key}={value}"
        if text in _HALF_VALUES:
            return f"{key}={value}"
    return None
