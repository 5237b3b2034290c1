"""The one JSON `make gpu-check` leaves in benchmarks/results/: the machine (GPU, driver, CUDA, library versions),
every CUDA check's outcome and the numbers the checks recorded (e.g. predicted vs measured peak memory).

Standard library only (plus torch and NVML when present, read lazily), so it runs on whatever Python holds the
GPU's torch. tests/gpu/conftest.py feeds it pytest's reports; tests/unit/test_gpu_check_report.py tests it on CPU.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "transformers", "triton", "liger-kernel", "deepspeed", "nvidia-ml-py", "tokenizers")


@dataclass
class CheckOutcome:
    test: str
    outcome: str  # passed | failed | skipped
    seconds: float
    recorded: dict[str, Any] = field(default_factory=dict)
    message: str | None = None


def machine() -> dict[str, Any]:
    """GPU, driver, CUDA and library versions of this machine."""
    info: dict[str, Any] = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")}
    for package in PACKAGES:
        try:
            info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            info[package] = None
    try:
        import torch

        info["cuda"] = torch.version.cuda
        info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        info["gpu_memory_gb"] = (
            torch.cuda.get_device_properties(0).total_memory / 1e9 if torch.cuda.is_available() else None
        )
    except ImportError:
        info.update(cuda=None, gpu=None, gpu_memory_gb=None)
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True, timeout=30,
        )  # fmt: skip
        info["driver"] = out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        info["driver"] = None
    return info


def slug(name: str | None) -> str:
    return re.sub(r"[^a-z0-9]+", "-", (name or "cpu").lower().removeprefix("nvidia ")).strip("-")


def report_payload(info: dict[str, Any], checks: list[CheckOutcome]) -> dict[str, Any]:
    """The report's fields. ``passed`` is true only when every check passed and at least one ran (a machine
    without CUDA skips them all: that is not a pass)."""
    ran = [c for c in checks if c.outcome != "skipped"]
    return {
        "kind": "gpu-check",
        "passed": bool(ran) and all(c.outcome == "passed" for c in ran),
        "machine": info,
        "counts": {k: sum(c.outcome == k for c in checks) for k in ("passed", "failed", "skipped")},
        "checks": [c.__dict__ for c in checks],
    }


def write_report(out_dir: Path, info: dict[str, Any], checks: list[CheckOutcome]) -> Path:
    """Write gpu-check-<gpu>-<date>.json (report_payload); returns its path."""
    payload = report_payload(info, checks)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"gpu-check-{slug(info.get('gpu'))}-{str(info.get('date', ''))[:10]}.json"
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def write_checks(path: Path, checks: list[CheckOutcome]) -> None:
    """The checks alone, for benchmarks/gpu_check.py to put in its report beside the steps."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([c.__dict__ for c in checks], indent=2, default=str) + "\n")
