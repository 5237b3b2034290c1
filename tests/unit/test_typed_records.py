"""A job's benchmark is a ``BenchmarkResult`` from the file it was read from to the analysis that reads it: the
stores convert it to and from JSON, nothing else does, so a field renamed in the model is found by the type check,
not by a test that happens to read it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuscout.domain.benchmark import BenchmarkResult
from gpuscout.store.base import JobRecord
from tests.benchmark_results import benchmark_result
from tests.job_specs import job_spec

REPO = Path(__file__).resolve().parents[2]
FIELD = "    final_train_loss: float | None = None\n"


def test_a_job_record_holds_its_benchmark_as_the_model() -> None:
    record = JobRecord.model_validate(
        {"run_id": "r", "job_name": "j", "status": "COMPLETED", "instance_type": "local", "variant_name": "v",
         "spec": job_spec("j", "r"), "benchmark": benchmark_result()}
    )  # fmt: skip
    assert isinstance(record.benchmark, BenchmarkResult)
    assert JobRecord.model_validate_json(record.model_dump_json()) == record


@pytest.mark.slow(seconds=60)
def test_a_renamed_benchmark_field_breaks_type_checking(tmp_path: Path) -> None:
    # Given a copy of gpuscout whose BenchmarkResult's loss calls final_train_loss final_loss
    shutil.copytree(REPO / "gpuscout", tmp_path / "gpuscout", ignore=shutil.ignore_patterns("__pycache__", "_bundled"))
    model = tmp_path / "gpuscout" / "domain" / "benchmark.py"
    text = model.read_text()
    assert text.count(FIELD) == 1
    model.write_text(text.replace(FIELD, FIELD.replace("final_train_loss", "final_loss")))
    # When the project's type check runs on it
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"), "--cache-dir",
         str(tmp_path / "cache"), "-p", "gpuscout"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    # Then it fails where the analysis and the local results read the field, naming it
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    readers = {line.split(":")[0] for line in errors if '"final_train_loss"' in line}
    assert {"gpuscout/analysis/analyze.py", "gpuscout/local/results.py"} <= readers, errors
