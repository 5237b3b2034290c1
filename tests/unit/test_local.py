"""The local runner's mechanics with stand-in train.py scripts (fast: no torch in the child process)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from gpuscout import paths
from gpuscout.cli.local_view import RichRunObserver
from gpuscout.domain.catalog import load_catalog
from gpuscout.domain.contention import Contention
from gpuscout.domain.jobspec import JobSpec, Prediction
from gpuscout.errors import BudgetExceededError, DataPreparationError
from gpuscout.local import job_process
from gpuscout.local import runner as local
from gpuscout.local.job_process import JobFolders, JobProgress, job_max_steps, run_job
from gpuscout.local.runner import run_local
from gpuscout.store.base import JobStatus, RunStatus
from gpuscout.store.sqlite import SqliteStore
from gpuscout.workflow.ports import JobOutcome
from tests.prepared_data import DATASET_SUMMARY
from tests.stand_ins import use_stand_ins

QUICKSTART = paths.MANIFESTS_DIR / "quickstart.yaml"
DATASET_JSON = json.dumps(DATASET_SUMMARY)  # the dataset.json fields the runner's data checks read


def _spec(**update: Any) -> JobSpec:
    spec = JobSpec(
        job_name="gs-test-local-v0-r0",
        run_id="run-test",
        target_index=0,
        variant_name="v0",
        repetition=0,
        instance_type="local",
        instance_count=1,
        gpus_per_instance=0,
        spot=False,
        price_per_hour_usd=0.096,
        precision="fp32",
        max_runtime_seconds=600,
        hyperparameters={"max_steps": "3", "job_name": "gs-test-local-v0-r0"},
        prediction=Prediction(
            tokens_per_s=1000, mfu_assumed=None, training_seconds=1, overhead_seconds=0, cost_usd=0, method="test"
        ),
    )
    return spec.model_copy(update=update)


def _fake_training_dir(tmp_path: Path, body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    use_stand_ins(monkeypatch, tmp_path / "stand-ins", train=body)


def _run(tmp_path: Path, spec: JobSpec) -> tuple[JobOutcome, JobFolders]:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "dataset.json").write_text("{}")
    folders = JobFolders.create(tmp_path / "job", spec, data)
    seen: list[int | None] = []
    outcome = run_job(spec, folders, on_progress=lambda progress: seen.append(progress.step), poll_interval_s=0.05)
    assert seen, "run_job reports progress at least once (after the job ends)"
    return outcome, folders


def test_the_job_sees_a_sagemaker_like_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_training_dir(
        tmp_path,
        """
        import json, os, sys
        from pathlib import Path
        keys = ["SM_CHANNEL_TRAIN", "SM_MODEL_DIR", "SM_OUTPUT_DATA_DIR", "SM_HPS", "SM_NUM_GPUS", "SM_HOSTS",
                "SM_CURRENT_HOST", "GPUSCOUT_CHECKPOINT_DIR", "SM_INPUT_CONFIG_DIR"]
        print(json.dumps({k: os.environ[k] for k in keys}))
        print("gpuscout_metric step=3 loss=4.5 tokens_per_s=1234.5")
        sys.exit(3)
        """,
        monkeypatch,
    )
    outcome, folders = _run(tmp_path, _spec())
    env = json.loads(folders.stdout_log.read_text().splitlines()[0])
    assert Path(env["SM_CHANNEL_TRAIN"]) == folders.train_channel
    assert (Path(env["SM_CHANNEL_TRAIN"]) / "dataset.json").is_file()
    assert Path(env["SM_OUTPUT_DATA_DIR"]) == folders.output_data
    assert Path(env["GPUSCOUT_CHECKPOINT_DIR"]).is_dir()
    assert json.loads(env["SM_HPS"])["max_steps"] == "3"
    assert json.loads((Path(env["SM_INPUT_CONFIG_DIR"]) / "hyperparameters.json").read_text())["max_steps"] == "3"
    assert (env["SM_NUM_GPUS"], json.loads(env["SM_HOSTS"]), env["SM_CURRENT_HOST"]) == ("0", ["algo-1"], "algo-1")
    assert outcome.status is JobStatus.FAILED
    assert outcome.failure_reason is not None
    assert "exited with code 3" in outcome.failure_reason


def test_a_crash_is_recorded_with_the_end_of_stderr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_training_dir(tmp_path, "raise RuntimeError('CUDA out of memory. Tried to allocate 2.00 GiB')\n", monkeypatch)
    outcome, _ = _run(tmp_path, _spec())
    assert outcome.status is JobStatus.OOM
    assert outcome.failure_reason is not None
    assert "RuntimeError: CUDA out of memory" in outcome.failure_reason
    assert outcome.benchmark is None


def test_a_job_past_its_runtime_limit_is_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_training_dir(tmp_path, "import time\nprint('started', flush=True)\ntime.sleep(60)\n", monkeypatch)
    outcome, folders = _run(tmp_path, _spec(max_runtime_seconds=1))
    assert outcome.status is JobStatus.STOPPED
    assert outcome.failure_reason is not None
    assert "MaxRuntimeExceeded" in outcome.failure_reason
    assert outcome.wall_seconds < 30
    assert "started" in folders.stdout_log.read_text()


def test_a_job_stopped_after_writing_its_complete_benchmark_is_completed_not_pruned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a job that writes a complete benchmark.json and is then stopped (a search's pruner deciding as it ends;
    # the signal cuts its exit short)
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks" / "g5-2xl-bs4-ckpt-r0.json"
    body = f"""
        import os, pathlib, shutil, time
        out = pathlib.Path(os.environ["SM_OUTPUT_DATA_DIR"])
        shutil.copyfile({str(fixture)!r}, out / "benchmark.json")
        print("written", flush=True)
        time.sleep(60)
    """
    _fake_training_dir(tmp_path, body, monkeypatch)
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset.json").write_text("{}")
    spec = _spec()
    folders = JobFolders.create(tmp_path / "job", spec, data)
    written = folders.output_data / "benchmark.json"
    # When the stop comes once the file is there
    outcome = run_job(spec, folders, should_stop=lambda _p: "pruned" if written.is_file() else None,
                      poll_interval_s=0.05)  # fmt: skip
    # Then its measurement counts: COMPLETED with the benchmark, not PRUNED
    assert outcome.status is JobStatus.COMPLETED, outcome.failure_reason
    assert outcome.benchmark is not None and outcome.benchmark.status == "completed"


def test_progress_follows_metric_lines() -> None:
    progress = JobProgress()
    for line in (
        "[train] loading\n",
        "gpuscout_metric step=4 loss=5.25 tokens_per_s=1500.5 step_time_s=0.1\n",
        "gpuscout_summary tokens_per_s=1400 final_loss=5.0\n",
    ):
        progress.update(line)
    assert (progress.step, progress.loss, progress.tokens_per_s) == (4, 5.25, 1500.5)
    assert progress.summary["final_loss"] == 5.0
    assert progress.describe(20) == "step 4/20  loss 5.2500  1,500 tok/s last step"


def test_over_budget_is_refused_and_recorded(tmp_path: Path) -> None:
    manifest = tmp_path / "tight.yaml"
    manifest.write_text(QUICKSTART.read_text().replace("budget_usd: 1.0", "budget_usd: 0.000001"))
    store = SqliteStore(tmp_path / "g.db")
    with pytest.raises(BudgetExceededError):
        run_local(
            manifest, store=store, runs_dir=tmp_path / "runs", observer=RichRunObserver(Console(file=io.StringIO()))
        )
    [run] = store.list_runs()
    assert run.status is RunStatus.REFUSED
    assert run.error is not None
    assert "exceeds the budget" in run.error
    assert not (tmp_path / "runs").exists()


def test_ctrl_c_stops_the_run_and_keeps_what_was_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset.json").write_text(DATASET_JSON)
    monkeypatch.setattr(local, "prepare_data", lambda *_args, **_kw: data)
    calls: list[str] = []

    def fake_run_job(spec: JobSpec, folders: JobFolders, **_: object) -> JobOutcome:
        calls.append(spec.job_name)
        if len(calls) == 1:
            return JobOutcome(JobStatus.FAILED, None, "RuntimeError: boom", 1.0)
        raise KeyboardInterrupt

    monkeypatch.setattr(job_process, "run_job", fake_run_job)
    store = SqliteStore(tmp_path / "g.db")
    out = io.StringIO()
    run = run_local(
        QUICKSTART,
        store=store,
        runs_dir=tmp_path / "runs",
        observer=RichRunObserver(Console(file=out)),
        catalog=load_catalog(),
        canary=False,  # interrupted while timing (test_canary_* cover the canaries)
    )
    assert run.status is RunStatus.STOPPED
    jobs = store.list_jobs(run.run_id)
    assert len(jobs) == 3
    by_name = {j.job_name: j for j in jobs}
    assert by_name[calls[0]].status is JobStatus.FAILED
    assert by_name[calls[0]].failure_reason == "RuntimeError: boom"
    assert by_name[calls[1]].status is JobStatus.STOPPED
    assert by_name[calls[1]].failure_reason == "interrupted (Ctrl-C)"
    [never] = [j for j in jobs if j.job_name not in calls]
    assert never.status is JobStatus.STOPPED
    assert never.failure_reason == "not started: run interrupted (Ctrl-C)"
    assert "interrupted" in out.getvalue()


def test_failed_data_preparation_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_args: object, **_kw: object) -> Path:
        raise DataPreparationError("data preparation failed (exit 1): no documents left after cleaning")

    monkeypatch.setattr(local, "prepare_data", broken)
    store = SqliteStore(tmp_path / "g.db")
    with pytest.raises(DataPreparationError):
        run_local(
            QUICKSTART, store=store, runs_dir=tmp_path / "runs", observer=RichRunObserver(Console(file=io.StringIO()))
        )
    [run] = store.list_runs()
    assert run.status is RunStatus.FAILED
    assert run.error is not None
    assert "no documents left" in run.error
    # and no job row keeps saying PLANNED: each says it did not start, and why
    reasons = {(j.status, j.failure_reason) for j in store.list_jobs(run.run_id)}
    assert reasons == {(JobStatus.STOPPED, "not started: the run failed (DataPreparationError)")}


def test_a_failed_data_preparation_is_one_line_with_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_stand_ins(
        monkeypatch,
        tmp_path / "stand-ins",
        prepare="import sys\nprint('reading documents')\nprint('Traceback (most recent call last): ...')\n"
        "print('data_preparation: error: corpus.jsonl: no column \\'text\\'; set dataset.text_field to one of: body',"
        " file=sys.stderr)\nsys.exit(2)\n",
    )
    store = SqliteStore(tmp_path / "g.db")
    with pytest.raises(DataPreparationError) as err:
        run_local(QUICKSTART, store=store, runs_dir=tmp_path / "runs")
    message = str(err.value)
    assert message.startswith(
        "data preparation failed: corpus.jsonl: no column 'text'; set dataset.text_field to one of: body (log: "
    )
    assert "\n" not in message and "Traceback" not in message
    [run] = store.list_runs()
    assert run.error is not None and "\n" not in run.error and "dataset.text_field" in run.error


def _fake_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset.json").write_text(DATASET_JSON)
    monkeypatch.setattr(local, "prepare_data", lambda *_args, **_kw: data)


def test_a_failing_canary_keeps_its_configuration_from_being_timed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the quickstart's three configurations, the second of which cannot run (its canary fails)
    _fake_data(tmp_path, monkeypatch)
    calls: list[tuple[str, str]] = []

    def fake_run_job(spec: JobSpec, folders: JobFolders, **_: object) -> JobOutcome:
        calls.append((spec.job_name, spec.hyperparameters["max_steps"]))
        if spec.variant_name == "b4-a1" and spec.job_name.endswith("-canary2"):
            return JobOutcome(JobStatus.OOM, None, "torch.OutOfMemoryError: CUDA out of memory", 3.0)
        return JobOutcome(JobStatus.COMPLETED, None, None, 1.0)

    monkeypatch.setattr(job_process, "run_job", fake_run_job)
    store = SqliteStore(tmp_path / "g.db")
    out = io.StringIO()
    # When the run starts
    run = run_local(QUICKSTART, store=store, runs_dir=tmp_path / "runs", observer=RichRunObserver(Console(file=out)))
    # Then every configuration ran its 2-step canary first, before any timed job
    canaries = [c for c in calls if "-canary" in c[0]]
    assert [c[1] for c in canaries] == ["2", "2", "2"] and calls[:3] == canaries
    # and the failed configuration's job was recorded with the canary's status and reason, never timed
    jobs = {j.variant_name: j for j in store.list_jobs(run.run_id)}
    assert set(jobs) == {"b1-a4", "b4-a1", "b4-a1-nopack"}, "canaries are not stored as jobs"
    assert jobs["b4-a1"].status is JobStatus.OOM
    assert jobs["b4-a1"].failure_reason is not None
    assert jobs["b4-a1"].failure_reason.startswith("not run: its canary (2 steps of the same configuration) failed")
    assert "CUDA out of memory" in jobs["b4-a1"].failure_reason
    timed = [c[0] for c in calls[3:]]
    assert jobs["b4-a1"].job_name not in timed and len(timed) == 2
    assert "canary 2/3 (b4-a1) failed" in " ".join(out.getvalue().split())
    assert (tmp_path / "runs" / run.run_id / "canary").is_dir()


def test_a_canary_runs_once_per_configuration_and_can_be_turned_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a manifest with two repetitions of the quickstart's variants (6 jobs, 3 configurations)
    _fake_data(tmp_path, monkeypatch)
    manifest = tmp_path / "reps.yaml"
    manifest.write_text(QUICKSTART.read_text() + "repetitions: 2\n")
    names: list[str] = []

    def fake_run_job(spec: JobSpec, folders: JobFolders, **_: object) -> JobOutcome:
        names.append(spec.job_name)
        return JobOutcome(JobStatus.COMPLETED, None, None, 1.0)

    monkeypatch.setattr(job_process, "run_job", fake_run_job)
    run_local(manifest, store=SqliteStore(tmp_path / "a.db"), runs_dir=tmp_path / "a")
    assert sum("-canary" in n for n in names) == 3 and len(names) == 9
    names.clear()
    run_local(manifest, store=SqliteStore(tmp_path / "b.db"), runs_dir=tmp_path / "b", canary=False)
    assert not any("-canary" in n for n in names) and len(names) == 6


def test_ctrl_c_during_a_canary_stops_the_run_before_anything_is_timed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_data(tmp_path, monkeypatch)

    def fake_run_job(spec: JobSpec, folders: JobFolders, **_: object) -> JobOutcome:
        raise KeyboardInterrupt

    monkeypatch.setattr(job_process, "run_job", fake_run_job)
    store = SqliteStore(tmp_path / "g.db")
    run = run_local(QUICKSTART, store=store, runs_dir=tmp_path / "runs")
    assert run.status is RunStatus.STOPPED
    assert {j.failure_reason for j in store.list_jobs(run.run_id)} == {"not started: run interrupted (Ctrl-C)"}


def test_progress_shows_tokens_for_the_built_in_job_and_samples_for_a_samples_job() -> None:
    builtin = JobProgress()
    builtin.update("gpuscout_metric step=3 loss=5.1 tokens_per_s=20000 samples_per_s=78.1")
    assert builtin.describe(20) == "step 3/20  loss 5.1000  20,000 tok/s last step"
    own = JobProgress()
    own.update("gpuscout_metric step=4 loss=0.7 samples_per_s=5100")
    assert own.describe(12) == "step 4/12  loss 0.7000  5,100 samples/s last step"


def test_the_progress_of_a_users_own_job_knows_its_step_budget() -> None:
    from gpuscout.domain.jobspec import JobCode

    # Given a job of the user's own code: max_steps reaches its helper through the environment, not hyperparameters
    code = JobCode(source_dir="/src", entry_point="train.py", unit="samples", environment={"GPUSCOUT_MAX_STEPS": "12"})
    spec = _spec(job_code=code, hyperparameters={"batch_size": "128"})
    # Then the progress bar still shows "step n/12", not "n/None"
    assert job_max_steps(spec) == 12
    assert job_max_steps(_spec()) == 3


def test_a_search_never_prunes_a_job_measured_under_competition(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pruner asks to stop it, but other processes compete for the machine meanwhile: its numbers are not the
    setting's, so it runs on (flagged contended in the analysis) instead of being pruned on them."""
    from gpuscout.local import job_process

    _fake_training_dir(tmp_path, """
        import time
        for step in range(1, 6):
            print(f"gpuscout_metric step={step} loss=1.0 tokens_per_s=100 step_time_s=0.1", flush=True)
            time.sleep(0.1)
    """, monkeypatch)  # fmt: skip
    busy = Contention(competing=True, note="measured under competition: other processes used 1.9 of 2 CPU cores")
    monkeypatch.setattr(job_process.ContentionMonitor, "summary", lambda self: busy)
    data = tmp_path / "data"
    data.mkdir()
    spec = _spec()
    folders = JobFolders.create(tmp_path / "job", spec, data)
    progress: list[JobProgress] = []
    outcome = run_job(spec, folders, should_stop=lambda p: progress.append(p) or "pruned: slower than the best",
                      poll_interval_s=0.05)  # fmt: skip
    assert outcome.status is not JobStatus.PRUNED and outcome.contention == busy
    assert progress and progress[-1].prune_withheld == "pruned: slower than the best"
    quiet = busy.model_copy(update={"competing": False, "note": None})
    monkeypatch.setattr(job_process.ContentionMonitor, "summary", lambda self: quiet)
    folders = JobFolders.create(tmp_path / "job2", spec, data)
    outcome = run_job(spec, folders, should_stop=lambda _p: "pruned: slower than the best", poll_interval_s=0.05)
    assert outcome.status is JobStatus.PRUNED  # on a quiet machine the pruner decides as before
