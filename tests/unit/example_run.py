"""The fixture run (tests/fixtures/benchmarks/example_run.json) the analysis, report and regression tests share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpuscout.store.base import JobRecord, RunRecord

BENCHMARKS = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"


def load_example_run() -> tuple[RunRecord, list[JobRecord], dict[str, Any]]:
    """(run, jobs with their benchmark.json loaded, catalog prices) of the example run."""
    data = json.loads((BENCHMARKS / "example_run.json").read_text())
    jobs = []
    for item in data["jobs"]:
        record = dict(item["record"])
        if item["benchmark_file"]:
            record["benchmark"] = json.loads((BENCHMARKS / item["benchmark_file"]).read_text())
        jobs.append(JobRecord.model_validate(record))
    return RunRecord.model_validate(data["run"]), jobs, data["catalog_prices"]
