"""Bounded jobs: a user's script that goes on after gpuscout's helper
answered "stop" is ended within the grace period, with the reason, and what it measured up to the stop stands; the
helper says when it answered; the log replay counts only the steps before the stop."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import gpuscout_report
import pytest
import yaml

from gpuscout.domain.catalog import LocalHardware, load_catalog
from gpuscout.domain.manifest_loader import load_manifest
from gpuscout.local import job_process
from gpuscout.local.job_process import JobFolders, run_job
from gpuscout.plan.planner import plan
from gpuscout.store.base import JobStatus

IGNORES_STOP = """
import time
import gpuscout_report as gs

step = 0
while step < 100000:  # the answer of gs.step() is ignored
    gs.step(samples=8, loss=1.0, seconds=0.01)
    step += 1
    time.sleep(0.01)
"""

PRINTS_PAST_MAX_STEPS = """
import time

step = 0
while True:  # no helper at all, and no end: metric lines past max_steps
    step += 1
    print(f"gpuscout_metric step={step} samples=8 loss=1.0 step_time_s=0.01", flush=True)
    time.sleep(0.01)
"""


def _spec(tmp_path: Path, script: str, *, max_steps: int = 6):
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(textwrap.dedent(script))
    manifest = {
        "name": "runaway", "job": {"source_dir": str(code), "entry_point": "train.py", "unit": "samples",
                                   "estimate": {"units_per_s": 1000, "units_per_step": 8}},
        "training": {"max_steps": max_steps, "warmup_steps": 1},
        "targets": [{"instance_type": "local", "price_per_hour_usd": 0.1}],
        "variants": [{"name": "v"}], "constraints": {"budget_usd": 1.0},
    }  # fmt: skip
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(manifest))
    hw = LocalHardware(device="cpu", cpu_count=2, memory_gib=8.0, startup_s=0.0)
    [spec] = plan(load_manifest(path, load_catalog()), load_catalog(), run_id="r", local_hardware=hw).jobs
    return spec


@pytest.mark.parametrize("script", [IGNORES_STOP, PRINTS_PAST_MAX_STEPS], ids=["ignores-the-helper", "no-helper"])
def test_a_script_that_goes_on_after_stop_is_ended_within_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str
) -> None:
    monkeypatch.setattr(job_process, "STOP_GRACE_S", 2.0)
    spec = _spec(tmp_path, script)
    assert spec.max_runtime_seconds > 60  # what bounded it before: minutes, not seconds
    started = time.monotonic()
    outcome = run_job(spec, JobFolders.create(tmp_path / "job", spec, None), poll_interval_s=0.05)
    assert time.monotonic() - started < 2.0 + job_process.TERMINATE_GRACE_S + 10
    assert outcome.status is JobStatus.STOPPED
    assert outcome.failure_reason and "kept training after gpuscout's helper answered stop" in outcome.failure_reason
    assert "end the loop when gs.step() returns True" in outcome.failure_reason
    bench = outcome.benchmark
    assert bench is not None and bench.status == "completed"  # what it measured up to the stop
    assert bench.timing.timed_steps == 5  # 6 steps, 1 warm-up: not the hundreds it ran on


def test_the_helper_says_once_when_it_answered_stop(tmp_path: Path) -> None:
    lines: list[str] = []
    rep = gpuscout_report.Reporter(output_dir=tmp_path, emit=lines.append, max_steps=3, warmup_steps=1)
    answers = [rep.step(samples=4, loss=1.0, seconds=0.1) for _ in range(5)]
    assert answers == [False, False, True, True, True]
    assert [line for line in lines if "stop_step" in line] == ["gpuscout_metric stop_step=3"]


def test_the_minimal_script_docs_byo_starts_with_runs_and_stops_by_itself(tmp_path: Path) -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "byo.md").read_text()
    script = text.split("```python\n", 1)[1].split("```", 1)[0]
    spec = _spec(tmp_path, script)
    outcome = run_job(spec, JobFolders.create(tmp_path / "job", spec, None), poll_interval_s=0.05)
    assert outcome.status is JobStatus.COMPLETED, outcome.failure_reason
    assert outcome.benchmark is not None and outcome.benchmark.timing.timed_steps == 5
