"""One workflow, two drivers: ``gpuscout local FILE`` enters each step of gpuscout.workflow once, in the state
machine's order (``workflow.STEPS``). The cloud's walk, through the synthesized state machine with the real handlers,
is asserted in test_state_machine.py (``test_a_finished_job_is_recorded_before_analysis_...``).

The jobs themselves are replaced (a job is a subprocess, not a step: ``run_job`` returns a stored benchmark), and so is
data preparation's subprocess; everything between them runs as a user's command would run it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from gpuscout import paths
from gpuscout.cli import app as cli
from gpuscout.domain.benchmark import BenchmarkResult
from gpuscout.domain.jobspec import JobSpec
from gpuscout.local import job_process, runner
from gpuscout.store.base import JobStatus, RunStatus
from gpuscout.store.sqlite import SqliteStore
from gpuscout.workflow import STATES, STEPS
from gpuscout.workflow.ports import JobOutcome
from tests.benchmark_results import benchmark_result
from tests.prepared_data import prepared_data
from tests.workflow_walk import walked

QUICKSTART = paths.MANIFESTS_DIR / "quickstart.yaml"
TWO_TOWER = paths.REPO_DIR / "examples" / "two-tower"


def _finished(spec: JobSpec, *_args: Any, **_kwargs: Any) -> JobOutcome:
    """A job that completed with a stored benchmark of its own name."""
    bench = BenchmarkResult.model_validate(
        benchmark_result(job_name=spec.job_name, run_id=spec.run_id, instance_type=spec.instance_type)
    )
    return JobOutcome(JobStatus.COMPLETED, bench, None, 1.0)


def _jobs_finish_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(job_process, "run_job", _finished)  # the measured jobs, canaries and calibrations


def _local(tmp_path: Path, manifest: Path) -> tuple[list[str], Any]:
    steps: list[str] = []
    args = ["local", str(manifest), "--runs-dir", str(tmp_path / "runs"), "--db", str(tmp_path / "g.db")]
    with walked(steps):
        result = CliRunner().invoke(cli.app, args)
    return steps, result


def test_gpuscout_local_enters_each_step_once_in_the_state_machines_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the quickstart (the built-in job: data to prepare, canaries), its jobs finishing at once
    data = prepared_data(tmp_path / "data")
    monkeypatch.setattr(runner, "prepare_data", lambda *_a, **_k: data)
    _jobs_finish_at_once(monkeypatch)
    # When `gpuscout local FILE` runs it
    steps, result = _local(tmp_path, QUICKSTART)
    # Then it succeeded, having entered every step but calibrate (the built-in job has a FLOPs model) once, in order
    assert result.exit_code == 0, result.output
    assert steps == [s for s in STEPS if s != "calibrate"]
    [run] = SqliteStore(tmp_path / "g.db").list_runs()
    assert run.status is RunStatus.SUCCEEDED


def test_a_job_section_without_an_estimate_is_calibrated_as_its_own_step_before_the_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the two-tower example without job.estimate (calibrated on this machine), its script finishing at once
    manifest = yaml.safe_load((TWO_TOWER / "local.yaml").read_text())
    del manifest["job"]["estimate"]
    manifest["job"]["source_dir"] = str(TWO_TOWER)
    path = tmp_path / "two-tower.yaml"
    path.write_text(yaml.safe_dump(manifest))
    _jobs_finish_at_once(monkeypatch)
    # When `gpuscout local FILE` runs it
    steps, result = _local(tmp_path, path)
    # Then calibration is a step of its own between validate and plan; a user's job prepares no data and has no
    # canary (its requirements are the user's), and every other step is entered once, in order
    assert result.exit_code == 0, result.output
    assert steps == ["validate", "calibrate", "plan", "train_and_record", "analyze", "report", "close"]
    assert [s for s in STEPS if s in steps] == steps


def test_every_step_is_a_module_of_the_workflow() -> None:
    folder = paths.REPO_DIR / "gpuscout" / "workflow"
    assert {p.stem for p in folder.glob("*.py")} - {"__init__", "ports"} == set(STEPS) == set(STATES)
