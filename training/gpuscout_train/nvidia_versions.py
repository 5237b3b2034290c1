"""The GPU host's NVIDIA driver and CUDA versions, for benchmark.json's ``software`` (train.py and the gpuscout_report
helper of the user's own jobs): a figure names the driver and CUDA it was measured with."""

from __future__ import annotations

import re
import sys
from pathlib import Path


def nvidia_versions() -> dict[str, str | None]:
    """The host's NVIDIA driver version and the newest CUDA version it supports, from NVML (nvidia-ml-py, which the
    image has) or, without it, /proc/driver/nvidia/version; the CUDA runtime torch was built with. Each None where it
    cannot be read (a CPU host has no driver)."""
    driver: str | None = None
    cuda_driver: str | None = None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            raw = pynvml.nvmlSystemGetDriverVersion()
            driver = raw.decode() if isinstance(raw, bytes) else str(raw)
            version = int(pynvml.nvmlSystemGetCudaDriverVersion_v2())
            cuda_driver = f"{version // 1000}.{version % 1000 // 10}"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library, no driver, no GPU: fall back to the kernel module's own line
        driver = _driver_from_proc()
    return {
        "nvidia_driver": driver,
        "cuda_driver": cuda_driver,
        "cuda_runtime": _cuda_runtime(),
    }


def _driver_from_proc(path: str = "/proc/driver/nvidia/version") -> str | None:
    """``NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  ...`` -> ``580.95.05``."""
    try:
        first = Path(path).read_text(encoding="utf-8").splitlines()[0]
    except (OSError, IndexError):
        return None
    match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", first)
    return match.group(1) if match else None


def _cuda_runtime() -> str | None:
    """The CUDA version torch was built with, when the job imported torch (never imported here for that)."""
    torch = sys.modules.get("torch")
    version = getattr(getattr(torch, "version", None), "cuda", None) if torch is not None else None
    return str(version) if version else None
