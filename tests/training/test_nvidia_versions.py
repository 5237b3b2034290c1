"""The GPU host's driver and CUDA versions recorded in benchmark.json (training/gpuscout_train/nvidia_versions.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from gpuscout_train.nvidia_versions import _driver_from_proc, nvidia_versions

# /proc/driver/nvidia/version's first line, as the open and the proprietary kernel modules write it
PROC_LINES = [
    (
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@U16-I3-B03)",
        "580.95.05",
    ),
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024", "535.183.01"),
    ("something else entirely", None),
]


@pytest.mark.parametrize(("line", "driver"), PROC_LINES)
def test_the_driver_is_read_from_the_kernel_modules_line(tmp_path: Path, line: str, driver: str | None) -> None:
    path = tmp_path / "version"
    path.write_text(line + "\nGCC version:  gcc version 12.3.0\n")
    assert _driver_from_proc(str(path)) == driver
    assert _driver_from_proc(str(tmp_path / "missing")) is None


def test_nvml_gives_the_driver_and_the_newest_cuda_it_supports(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given NVML answering as a 580 driver with CUDA 13.0 does (nvmlSystemGetCudaDriverVersion_v2: 1000 x major + 10 x
    # minor), and torch built with CUDA 12.8
    calls: list[str] = []
    fake = SimpleNamespace(
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlSystemGetDriverVersion=lambda: b"580.95.05",
        nvmlSystemGetCudaDriverVersion_v2=lambda: 13000,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(version=SimpleNamespace(cuda="12.8")))
    assert nvidia_versions() == {"nvidia_driver": "580.95.05", "cuda_driver": "13.0", "cuda_runtime": "12.8"}
    assert calls == ["init", "shutdown"]


def test_without_a_driver_every_version_is_none_and_nothing_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_driver() -> None:
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", SimpleNamespace(nvmlInit=no_driver))
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(version=SimpleNamespace(cuda=None)))
    monkeypatch.setattr("gpuscout_train.nvidia_versions._driver_from_proc", lambda: None)
    assert nvidia_versions() == {"nvidia_driver": None, "cuda_driver": None, "cuda_runtime": None}
