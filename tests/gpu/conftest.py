"""CUDA-only checks (`make gpu-check`): skipped without a CUDA GPU; the outcomes and recorded numbers go to one JSON
in benchmarks/results/ (benchmarks/gpu_check_report.py) when GPUSCOUT_GPU_CHECK_OUT names the folder; under
`make gpu-check` (benchmarks/gpu_check.py) to the file GPUSCOUT_GPU_CHECK_CHECKS names, for its report."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
from gpu_check_report import CheckOutcome, machine, write_checks, write_report  # noqa: E402

_OUTCOMES: list[CheckOutcome] = []


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA GPU (make gpu-check on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords and not cuda_available():
            item.add_marker(skip)


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Any:
    """record(name=value, ...): numbers a check wants in the gpu-check JSON."""

    def put(**values: Any) -> None:
        request.node.user_properties.extend(values.items())

    return put


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.nodeid.startswith("tests/gpu/"):
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        message = None if report.passed else str(report.longrepr)[-1500:]
        _OUTCOMES.append(
            CheckOutcome(
                report.nodeid, report.outcome, round(report.duration, 2), dict(report.user_properties), message
            )
        )


def pytest_sessionfinish(session: pytest.Session) -> None:
    checks_file = os.environ.get("GPUSCOUT_GPU_CHECK_CHECKS")  # set by benchmarks/gpu_check.py (make gpu-check)
    if checks_file:
        write_checks(Path(checks_file), _OUTCOMES)
        return
    out = os.environ.get("GPUSCOUT_GPU_CHECK_OUT")
    if out and _OUTCOMES:
        path = write_report(Path(out), machine(), _OUTCOMES)
        print(f"\n[gpu-check] wrote {path}")
