"""Experiment tracking of a train.py job (training/gpuscout_train/tracking.py), offline: MLflow in a SQLite file, W&B in
offline mode (its run file read back with tests/wandb_offline_reader.py). Nothing here reaches a network."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from gpuscout_train.tracking import JobTracker, summary_metrics

from gpuscout.domain.benchmark import BenchmarkResult
from gpuscout.domain.jobspec import JobSpec, Prediction
from gpuscout.domain.manifest_search import TrackingSection
from gpuscout.domain.metric_lines import parse_metric_line
from gpuscout.domain.tracking import (
    JOB_NAME_TAG,
    LEVEL_TAG,
    RUN_ID_TAG,
    TRACKING_ENV,
    JobTracking,
    tracking_environment,
)
from gpuscout.paths import TRAIN_MODULE
from tests import wandb_offline_reader as wb
from tests.sagemaker_job import IMAGE_PYTHONPATH, job_environment

RUN_ID = "r-track"
JOB = "gs-track-tiny"
HPS = {
    "run_id": RUN_ID,
    "job_name": JOB,
    "instance_type": "local",
    "model_preset": "qwen2-tiny",
    "per_device_train_batch_size": "4",
    "max_steps": "6",
    "learning_rate": "0.003",
    "seed": "7",
    "eval_interval": "3",
    "validation_batches": "1",
}
PRICE_PER_HOUR = 1.8
# What the environment may carry that would change where the trackers write or whether they go online
FOREIGN = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", TRACKING_ENV)


def _spec(tracking: dict[str, Any] | None) -> JobSpec:
    prediction = Prediction(
        tokens_per_s=1e4, mfu_assumed=None, training_seconds=10, overhead_seconds=5, cost_usd=0.01, method="test"
    )
    return JobSpec(
        job_name=JOB, run_id=RUN_ID, target_index=0, variant_name="b4", repetition=0, instance_type="local",
        instance_count=1, gpus_per_instance=0, spot=False, price_per_hour_usd=PRICE_PER_HOUR, precision="fp32",
        max_runtime_seconds=600, hyperparameters=HPS, prediction=prediction,
        tracking=TrackingSection.model_validate(tracking) if tracking else None,
    )  # fmt: skip


def _offline_env(tmp_path: Path) -> dict[str, str]:
    """W&B's own folders (settings, artifact staging and cache) inside the test's folder; quiet."""
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN}
    return env | {
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
    }


def _job_env(root: Path, dataset: Path, tmp_path: Path, extra: Mapping[str, str]) -> dict[str, str]:
    return job_environment(root, dataset, HPS, base=_offline_env(tmp_path), **extra)


def _train(root: Path, dataset: Path, tmp_path: Path, extra: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    """train.py for one job in the SageMaker folder layout under ``root`` (as gpuscout local runs it)."""
    return subprocess.run(
        [sys.executable, "-m", TRAIN_MODULE],
        cwd=root, env=_job_env(root, dataset, tmp_path, extra), capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip


def _step_lines(stdout: str) -> dict[int, dict[str, float]]:
    """The job's step metric lines by step (what the trackers must have too)."""
    lines = [parse_metric_line(line) for line in stdout.splitlines()]
    return {int(v["step"]): v for v in lines if v and "loss" in v}


@pytest.mark.slow(seconds=21)
def test_a_tracked_job_logs_params_steps_and_benchmark_to_mlflow_and_wandb(dataset: Path, tmp_path: Path) -> None:
    from mlflow import MlflowClient

    # Given a job whose manifest tracks with MLflow (the local default: SQLite in the runs folder) and W&B offline
    runs = tmp_path / "runs"
    spec = _spec({"mlflow": {"experiment": "tiny"}, "wandb": {"project": "gpuscout-test"}})
    env = tracking_environment(spec, runs_dir=runs)
    root = runs / RUN_ID / "jobs" / JOB
    # When train.py runs it
    done = _train(root, dataset, tmp_path, env)
    # Then the benchmark is unchanged: completed, and no tracker reported a problem
    assert done.returncode == 0, done.stderr[-3000:]
    assert "train: tracking:" not in done.stderr
    benchmark_file = root / "opt/ml/output/data/benchmark.json"
    result = BenchmarkResult.model_validate_json(benchmark_file.read_text())
    assert result.status == "completed" and result.throughput is not None
    steps = _step_lines(done.stdout)
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]

    # MLflow: one job run in the experiment, at the default places
    client = MlflowClient(tracking_uri=f"sqlite:///{runs / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tiny")
    assert experiment is not None and experiment.artifact_location == (runs / "mlartifacts").as_uri()
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == JOB
    assert run.data.tags[RUN_ID_TAG] == RUN_ID and run.data.tags[JOB_NAME_TAG] == JOB
    assert run.data.tags[LEVEL_TAG] == "job"
    params = run.data.params
    assert {k: params[k] for k in ("run_id", "job_name", "instance_type", "variant")} == {
        "run_id": RUN_ID, "job_name": JOB, "instance_type": "local", "variant": "b4"
    }  # fmt: skip
    assert params["learning_rate"] == "0.003" and params["per_device_train_batch_size"] == "4"
    assert params["usd_per_hour"] == str(PRICE_PER_HOUR) and params["device"] == "cpu"
    # gpuscout's internal fields and unset values are not the user's settings: not logged
    internal = {"canary_layers", "price_per_hour_usd", "search_candidate", "host_allocator", "ci_tolerance"}
    assert not internal & set(params)
    assert "" not in params.values()
    # every step's loss, step time and own rates, as the job's metric lines printed them
    for key, line_key in (("loss", "loss"), ("step_time_s", "step_time_s"), ("step_tokens_per_s", "tokens_per_s"),
                          ("step_samples_per_s", "samples_per_s")):  # fmt: skip
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert sorted(history) == [1, 2, 3, 4, 5, 6], key
        assert history == pytest.approx({s: v[line_key] for s, v in steps.items()}, rel=1e-6), key
    # tokens_per_s in the summary's meaning: the timed steps' so far (none during warm-up), ending at the summary
    timed_history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "tokens_per_s")}
    assert sorted(timed_history) == [s for s in steps if s > result.timing.warmup_steps]
    assert timed_history[max(timed_history)] == pytest.approx(result.throughput.tokens_per_s, rel=1e-9)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")] == [3, 6]
    assert "gpu_util_pct" not in run.data.metrics  # no NVML on CPU: not logged, rather than logged as 0
    metrics = run.data.metrics
    assert metrics["benchmark/tokens_per_s"] == pytest.approx(result.throughput.tokens_per_s)
    assert metrics["benchmark/usd_per_million_tokens"] == pytest.approx(
        PRICE_PER_HOUR / 3600 / result.throughput.tokens_per_s * 1e6
    )
    assert "benchmark/mfu" not in metrics  # None on CPU
    (artifact,) = client.list_artifacts(run.info.run_id)
    assert artifact.path == "benchmark.json"
    logged = Path(client.download_artifacts(run.info.run_id, "benchmark.json", str(tmp_path / "dl")))
    assert logged.read_text() == benchmark_file.read_text()

    # W&B: one offline run in <runs>/wandb, grouped by the run id
    (run_file,) = wb.run_files(runs)
    records = wb.read_records(run_file)
    info = wb.run_info(records)
    assert (info.project, info.display_name, info.run_group, info.job_type) == (
        "gpuscout-test",
        JOB,
        RUN_ID,
        "benchmark",
    )
    config = wb.config(records)
    assert config["learning_rate"] == 0.003 and config["per_device_train_batch_size"] == 4
    assert config["job_name"] == JOB and config["variant"] == "b4" and config["usd_per_hour"] == PRICE_PER_HOUR
    history = {row["_step"]: row for row in wb.history(records)}
    assert sorted(history) == [1, 2, 3, 4, 5, 6]
    for key, line_key in (("loss", "loss"), ("step_tokens_per_s", "tokens_per_s")):
        assert {s: row[key] for s, row in history.items()} == pytest.approx(
            {s: v[line_key] for s, v in steps.items()}, rel=1e-6
        )
    assert history[6]["tokens_per_s"] == pytest.approx(result.throughput.tokens_per_s, rel=1e-9)
    assert "tokens_per_s" not in history[1]  # a warm-up step has no rate in the summary's meaning
    assert "val_loss" in history[3] and "val_loss" in history[6]
    summary = wb.summary(records)
    assert summary["benchmark/tokens_per_s"] == pytest.approx(result.throughput.tokens_per_s)
    assert summary["status"] == "completed"
    assert wb.artifact_files(records) == {f"benchmark-{JOB}": ["benchmark.json"]}
    assert "benchmark.json" in wb.saved_files(records)  # a run file too: syncs from wherever the folder is
    assert (run_file.parent / "files" / "benchmark.json").read_text() == benchmark_file.read_text()


def test_an_untracked_job_imports_neither_tracker(dataset: Path, tmp_path: Path) -> None:
    # Given a job without GPUSCOUT_TRACKING (a manifest without a tracking section)
    root = tmp_path / "job"
    env = _job_env(root, dataset, tmp_path, {}) | {"PYTHONPATH": IMAGE_PYTHONPATH}
    assert tracking_environment(_spec(None), runs_dir=tmp_path) == {}
    # When train.py's main runs to the end
    code = (
        "import json, sys; from gpuscout_train import train; code = train.main([]); "
        "print(json.dumps({'code': code, 'loaded': [m for m in ('mlflow', 'wandb') if m in sys.modules]}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    # Then the job completed and neither mlflow nor wandb was imported
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"code": 0, "loaded": []}


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow(seconds=11)
def test_an_unreachable_tracker_is_reported_once_and_the_benchmark_and_the_other_tracker_go_on(
    dataset: Path, tmp_path: Path
) -> None:
    # Given an MLflow server nobody listens on (no retries, so it fails at once) and W&B offline
    runs = tmp_path / "runs"
    uri = f"http://127.0.0.1:{_closed_port()}"
    spec = _spec({"mlflow": {"tracking_uri": uri, "experiment": "tiny"}, "wandb": {"project": "gpuscout-test"}})
    env = tracking_environment(spec, runs_dir=runs) | {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    root = runs / RUN_ID / "jobs" / JOB
    # When train.py runs
    done = _train(root, dataset, tmp_path, env)
    # Then the job completed, MLflow's failure is one line on stderr, and W&B has every step
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((root / "opt/ml/output/data/benchmark.json").read_text())
    assert result["status"] == "completed"
    problems = [line for line in done.stderr.splitlines() if line.startswith("train: tracking:")]
    assert len(problems) == 1, done.stderr[-3000:]
    assert problems[0].startswith("train: tracking: MLflow stopped at start (")
    assert problems[0].endswith("the benchmark goes on without it")
    (run_file,) = wb.run_files(runs)
    records = wb.read_records(run_file)
    assert [row["_step"] for row in wb.history(records)] == [1, 2, 3, 4, 5, 6]
    assert wb.summary(records)["status"] == "completed"


class _Recorder:
    """A backend that records its calls and raises where told."""

    def __init__(self, name: str, fail_at: str | None = None) -> None:
        self.name, self.fail_at = name, fail_at
        self.calls: list[str] = []
        self.params: dict[str, Any] = {}
        self.tags: dict[str, str] = {}

    def _call(self, what: str) -> None:
        self.calls.append(what)
        if what == self.fail_at:
            raise ConnectionError("server went away\nsecond line")

    def start(self, run_id: str, job_name: str, params: Mapping[str, Any], tags: Mapping[str, str]) -> None:
        self.params, self.tags = dict(params), dict(tags)
        self._call("start")

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        self._call(f"step {step}")

    def finish(self, result: BenchmarkResult, summary: Mapping[str, float], benchmark_file: Path | None) -> None:
        self._call("finish")


def _tiny_result() -> BenchmarkResult:
    return BenchmarkResult.model_validate(
        {"status": "completed", "job_name": JOB, "instance_type": "local",
         "hardware": {"device": "cpu", "gpus_per_node": 0, "nodes": 1, "world_size": 1},
         "software": {"python": "3.11", "gpuscout": "0"}}
    )  # fmt: skip


def test_a_tracker_that_fails_mid_run_is_dropped_after_one_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given two trackers, one of which fails at step 2
    config = JobTracking(variant="b4", instance_count=1, spot=False)
    failing, healthy = _Recorder("MLflow", fail_at="step 2"), _Recorder("W&B")
    tracker = JobTracker(config, backends=[failing, healthy])
    # When a job starts, logs four steps and finishes
    tracker.start(HPS)
    for step in range(1, 5):
        tracker.log_step(step, {"step": step, "loss": 1.0 / step, "grad_norm": None, "lr": float("nan")})
    tracker.finish(_tiny_result(), tmp_path / "benchmark.json")
    # Then the failing one was called up to its failure only, the other throughout, and one line says so
    assert failing.calls == ["start", "step 1", "step 2"]
    assert healthy.calls == ["start", "step 1", "step 2", "step 3", "step 4", "finish"]
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "train: tracking: MLflow stopped at step 2 (ConnectionError: server went away); "
        "the benchmark goes on without it"
    ]


def test_a_tuning_trial_is_tracked_as_its_own_candidate() -> None:
    # Given the variable a SageMaker tuning job's trials share (built from its first candidate)
    config = JobTracking(variant="b1-a4-w0", instance_count=1, spot=False, usd_per_hour=4.5)
    recorder = _Recorder("MLflow")
    # When a trial of another candidate starts, Then it is recorded as that candidate, at the target's price
    JobTracker(config, backends=[recorder]).start(HPS, variant="b4-a1-w0")
    assert recorder.params["variant"] == recorder.tags["gpuscout.variant"] == "b4-a1-w0"
    assert recorder.params["usd_per_hour"] == 4.5 and recorder.params["job_name"] == JOB


def test_tracking_runs_on_rank_0_only_and_a_malformed_setting_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    value = json.dumps({"wandb": {"project": "p", "mode": "offline", "dir": "/x"}, "variant": "b", "instance_count": 1,
                        "spot": False})  # fmt: skip
    assert JobTracker.from_environment(is_main=True, environ={TRACKING_ENV: value}).active
    assert not JobTracker.from_environment(is_main=False, environ={TRACKING_ENV: value}).active
    assert not JobTracker.from_environment(is_main=True, environ={}).active
    assert not JobTracker.from_environment(is_main=True, environ={TRACKING_ENV: "{not json"}).active
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"train: tracking: {TRACKING_ENV} is not valid (") and line.endswith("not tracked")


def test_summary_metrics_leave_out_what_is_unknown() -> None:
    # A failed job has no throughput: nothing but what it measured is summarised, and no price makes no $/1M tokens
    assert summary_metrics(_tiny_result(), usd_per_hour=2.0) == {}
