"""The gpu-check JSON (benchmarks/gpu_check_report.py), on the CPU: a GPU run's outcomes are what it says."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from gpu_check_report import CheckOutcome, machine, write_report

from gpuscout.paths import REPO_DIR


def test_the_report_passes_only_when_checks_ran_and_all_passed(tmp_path: Path) -> None:
    info = {"date": "2026-11-22 12:00 UTC", "gpu": "NVIDIA H100 80GB HBM3", "driver": "580.159.04", "cuda": "13.0"}
    ok = [CheckOutcome("tests/gpu/test_cuda_paths.py::a", "passed", 1.0, {"ratio": 0.97})]
    path = write_report(tmp_path, info, ok)
    assert path.name == "gpu-check-h100-80gb-hbm3-2026-11-22.json"
    payload = json.loads(path.read_text())
    assert payload["passed"] is True and payload["checks"][0]["recorded"] == {"ratio": 0.97}
    failed = [*ok, CheckOutcome("tests/gpu/test_cuda_paths.py::b", "failed", 2.0, {}, "predicted 40 GB")]
    assert json.loads(write_report(tmp_path, info, failed).read_text())["passed"] is False
    skipped = [CheckOutcome("tests/gpu/test_cuda_paths.py::a", "skipped", 0.0)]
    assert json.loads(write_report(tmp_path, {**info, "gpu": None}, skipped).read_text())["passed"] is False


def test_machine_names_the_libraries_and_says_when_there_is_no_gpu() -> None:
    info = machine()
    assert info["torch"] and info["transformers"] and "driver" in info
    assert info["gpu"] is None  # this CPU machine; a GPU machine reports its name


def test_the_cuda_checks_are_collected_and_skipped_without_a_gpu(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "cuda", "tests/gpu", "-q", "-p", "no:cacheprovider", "-rs"],
        cwd=REPO_DIR, capture_output=True, text=True, check=False, timeout=120,
        env={"GPUSCOUT_GPU_CHECK_OUT": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:]
    skipped = re.search(r"(\d+) skipped", proc.stdout)
    assert skipped and int(skipped[1]) >= 10 and "needs a CUDA GPU" in proc.stdout
    assert " passed" not in proc.stdout and " failed" not in proc.stdout
    [report] = tmp_path.glob("gpu-check-cpu-*.json")
    assert json.loads(report.read_text())["passed"] is False  # nothing ran: not a pass
