"""Experiment tracking for train.py: MLflow and/or Weights & Biases, on rank 0, when the job's ``GPUSCOUT_TRACKING``
variable (gpuscout.domain.tracking.JobTracking as JSON) names them.

What a tracked job records, in each tracker it names:

- at the start: the training settings (the hyperparameters less gpuscout's internal ones), the job's variant,
  instance count, spot flag and on-demand price, and the device (MLflow params / W&B config); MLflow tags
  ``gpuscout.run_id``, ``gpuscout.job_name``, ``gpuscout.level=job``; the W&B run is in group <run id> with job type
  ``benchmark``;
- every optimizer step: the values of its metric line (loss, step_time_s, lr, grad_norm, gpu_mem_gb and any other
  value the line carries), with the step's own rates as ``step_tokens_per_s`` / ``step_samples_per_s`` (warm-up
  steps included) and ``tokens_per_s`` / ``samples_per_s`` in the summary's meaning: all tokens (samples) of the
  timed steps so far over their time, absent during warm-up, so the last value is ``benchmark/tokens_per_s``; and
  ``gpu_util_pct``, the mean GPU utilization NVML sampled during the step (none on CPU, none for a step shorter than
  the sampler's interval); ``val_loss`` at each validation;
- at the end: ``benchmark/<name>`` summary metrics (tokens/s and its interval, samples/s, MFU and HFU when known,
  step times, peak memory, mean GPU utilization, final losses, $ per 1M tokens at the on-demand price when known) and
  benchmark.json: an MLflow artifact; in W&B a file of the run folder (so ``wandb sync`` uploads it from wherever the
  folder is) and, where ``log_artifacts`` (local runs), a W&B Artifact too. The tracker run ends FINISHED, or FAILED
  (MLflow) / exit code 1 (W&B) with a failed benchmark.

Step metrics are logged after the step's clock has stopped, so the logging calls never count in a measured step
time; W&B's service process runs beside the job (its system-metrics sampling is turned off).

Tracking never fails a job: an exception from a tracker (an unreachable server, a missing package) is printed once
on stderr and that tracker is dropped for the rest of the job; the benchmark goes on. An unreachable MLflow server is
retried for a bounded time (gpuscout.domain.tracking.MLFLOW_HTTP_DEFAULTS). mlflow and wandb are imported
only when a tracker starts, so an untracked job never loads them.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError

from gpuscout.domain.benchmark import BenchmarkResult
from gpuscout.domain.jobspec import compared_settings
from gpuscout.domain.metric_lines import usd_per_million_tokens
from gpuscout.domain.tracking import (
    JOB_NAME_TAG,
    LEVEL_TAG,
    RUN_ID_TAG,
    STATUS_TAG,
    TRACKING_ENV,
    JobTracking,
    MlflowDestination,
    WandbDestination,
    bound_mlflow_retries,
    mlflow_experiment_id,
    prepare_mlflow_uri,
)

SUMMARY_PREFIX = "benchmark/"
MLFLOW_BATCH_PARAMS = 100  # MLflow's limit of params per log_batch call
WANDB_TAG_MAX_CHARS = 64


class Backend(Protocol):
    """One tracker of a job (MLflow or W&B); every method may raise, JobTracker then drops the backend."""

    name: str

    def start(self, run_id: str, job_name: str, params: Mapping[str, Any], tags: Mapping[str, str]) -> None: ...

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def finish(self, result: BenchmarkResult, summary: Mapping[str, float], benchmark_file: Path | None) -> None: ...


def _finite(values: Mapping[str, Any]) -> dict[str, float]:
    """The numeric, finite values (None, NaN and infinities are not logged)."""
    out = {}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


def summary_metrics(result: BenchmarkResult, usd_per_hour: float | None) -> dict[str, float]:
    """The ``benchmark/<name>`` figures of a benchmark.json (module docstring); absent ones are left out."""
    values: dict[str, Any] = {}
    t, e, timing, m, loss = result.throughput, result.efficiency, result.timing, result.memory, result.loss
    if t is not None:
        low, high = t.tokens_per_s_ci95 or (None, None)
        values |= {"tokens_per_s": t.tokens_per_s, "tokens_per_s_ci95_low": low, "tokens_per_s_ci95_high": high,
                   "samples_per_s": t.samples_per_s}  # fmt: skip
        if usd_per_hour and t.tokens_per_s:
            values["usd_per_million_tokens"] = usd_per_million_tokens(usd_per_hour, t.tokens_per_s)
    if e is not None:
        values |= {"mfu": e.mfu, "hfu": e.hfu}
    if timing is not None:
        values |= {"step_time_p50_s": timing.step_time_p50_s, "step_time_p90_s": timing.step_time_p90_s,
                   "timed_steps": timing.timed_steps, "wall_time_s": timing.wall_time_s}  # fmt: skip
    values |= {"peak_gpu_mem_gb": m.peak_allocated_gb, "gpu_utilization_mean": m.gpu_utilization_mean,
               "power_w_mean": m.power_w_mean}  # fmt: skip
    if loss is not None:
        values |= {"final_train_loss": loss.final_train_loss, "final_validation_loss": loss.final_validation_loss}
    return {SUMMARY_PREFIX + k: v for k, v in _finite(values).items()}


class MlflowBackend:
    """A job's MLflow run: params, step metrics, summary metrics, benchmark.json as an artifact."""

    name = "MLflow"

    def __init__(self, destination: MlflowDestination) -> None:
        self.destination = destination
        self.client: Any = None
        self.run_id = ""
        self.last_step = 0

    def start(self, run_id: str, job_name: str, params: Mapping[str, Any], tags: Mapping[str, str]) -> None:
        bound_mlflow_retries()
        import mlflow
        from mlflow.entities import Param

        uri = self.destination.tracking_uri
        prepare_mlflow_uri(uri, mlflow)
        client = mlflow.MlflowClient(tracking_uri=uri)
        experiment_id = mlflow_experiment_id(client, self.destination)
        run_tags = {RUN_ID_TAG: run_id, JOB_NAME_TAG: job_name, LEVEL_TAG: "job", **tags}
        run = client.create_run(experiment_id, run_name=job_name, tags=run_tags)
        self.client, self.run_id = client, run.info.run_id
        items = [Param(k, str(v)) for k, v in params.items() if v is not None]
        for i in range(0, len(items), MLFLOW_BATCH_PARAMS):
            client.log_batch(self.run_id, params=items[i : i + MLFLOW_BATCH_PARAMS])

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])
        self.last_step = max(self.last_step, step)

    def finish(self, result: BenchmarkResult, summary: Mapping[str, float], benchmark_file: Path | None) -> None:
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        tags = [RunTag(STATUS_TAG, result.status)]
        if result.failure_reason:
            tags.append(RunTag("gpuscout.failure_reason", result.failure_reason[:4000]))
        metrics = [Metric(k, v, now, self.last_step) for k, v in summary.items()]
        try:
            self.client.log_batch(self.run_id, metrics=metrics, tags=tags)
            if benchmark_file is not None:
                self.client.log_artifact(self.run_id, str(benchmark_file))
        finally:  # the run never stays RUNNING because its last logging failed
            self.client.set_terminated(self.run_id, "FINISHED" if result.status == "completed" else "FAILED")


class WandbBackend:
    """A job's W&B run: config, step history, summary, benchmark.json as a run file (and an Artifact where
    ``log_artifacts``)."""

    name = "W&B"

    def __init__(self, destination: WandbDestination) -> None:
        self.destination = destination
        self.run: Any = None
        self.job_name = ""

    def start(self, run_id: str, job_name: str, params: Mapping[str, Any], tags: Mapping[str, str]) -> None:
        import wandb

        d = self.destination
        Path(d.dir).mkdir(parents=True, exist_ok=True)
        # console off: the job's stdout is the runner's metric channel and stays untouched; stats off: the benchmark
        # samples the GPU itself, and a second sampler would poll during the timed steps
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, save_code=False)
        self.run = wandb.init(
            project=d.project,
            entity=d.entity,
            name=job_name,
            group=run_id,
            job_type="benchmark",
            tags=[value[:WANDB_TAG_MAX_CHARS] for value in tags.values() if value],
            dir=d.dir,
            mode=d.mode,
            config=dict(params),
            settings=settings,
        )
        self.job_name = job_name

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def finish(self, result: BenchmarkResult, summary: Mapping[str, float], benchmark_file: Path | None) -> None:
        import wandb

        run = self.run
        run.summary.update({**summary, "status": result.status})
        if benchmark_file is not None:
            copy = Path(run.dir) / benchmark_file.name  # inside the run folder: synced from wherever it is moved
            shutil.copyfile(benchmark_file, copy)
            run.save(str(copy), base_path=run.dir, policy="now")
            if self.destination.log_artifacts:
                artifact = wandb.Artifact(f"benchmark-{self.job_name}", type="benchmark")
                artifact.add_file(str(benchmark_file), name=benchmark_file.name)
                run.log_artifact(artifact)
        run.finish(exit_code=0 if result.status == "completed" else 1)


def _backends(config: JobTracking) -> list[Backend]:
    backends: list[Backend] = []
    if config.mlflow is not None:
        backends.append(MlflowBackend(config.mlflow))
    if config.wandb is not None:
        backends.append(WandbBackend(config.wandb))
    return backends


class JobTracker:
    """The trackers of one job (none when untracked or not rank 0); see the module docstring."""

    def __init__(self, config: JobTracking | None, backends: list[Backend] | None = None) -> None:
        self.config = config
        self.backends: list[Backend] = (
            backends if backends is not None else (_backends(config) if config is not None else [])
        )

    @classmethod
    def from_environment(cls, *, is_main: bool, environ: Mapping[str, str] | None = None) -> JobTracker:
        """The trackers ``GPUSCOUT_TRACKING`` names, on rank 0 (``is_main``); none elsewhere or without it."""
        raw = (os.environ if environ is None else environ).get(TRACKING_ENV)
        if not raw or not is_main:
            return cls(None)
        try:
            return cls(JobTracking.model_validate_json(raw))
        except ValidationError as err:
            _say(f"{TRACKING_ENV} is not valid ({_first_line(err)}); this job is not tracked")
            return cls(None)

    @property
    def active(self) -> bool:
        return bool(self.backends)

    def _each(self, what: str, call: Callable[[Backend], None]) -> None:
        for backend in list(self.backends):
            try:
                call(backend)
            except Exception as err:  # a tracker never fails the job
                self.backends.remove(backend)
                _say(
                    f"{backend.name} stopped at {what} ({type(err).__name__}: {_first_line(err)}); "
                    "the benchmark goes on without it"
                )

    def start(self, params: Mapping[str, Any], *, variant: str | None = None) -> None:
        """Open each tracker's run; ``params`` are the job's hyperparameters (with run_id and job_name) and facts
        of the device, less gpuscout's internal fields (gpuscout.domain.jobspec.compared_settings), to which the
        job's variant, instance count, spot flag and price are added. ``variant`` overrides the variable's where one
        variable serves several jobs (a SageMaker tuning job's trials, each a search candidate of the same target)."""
        config = self.config
        if not self.backends or config is None:
            return
        variant = variant or config.variant
        everything = {**compared_settings(params), "variant": variant, "instance_count": config.instance_count,
                      "spot": config.spot, "usd_per_hour": config.usd_per_hour}  # fmt: skip
        run_id, job_name = str(params.get("run_id") or ""), str(params.get("job_name") or "")
        tags = {"gpuscout.instance_type": str(params.get("instance_type") or ""), "gpuscout.variant": variant}
        self._each("start", lambda b: b.start(run_id, job_name, everything, tags))

    def log_step(self, step: int, metrics: Mapping[str, Any], *, timed_totals: tuple[float, ...] | None = None) -> None:
        """One step's metrics (``step`` itself and None values are not logged). The line's ``tokens_per_s`` and
        ``samples_per_s`` (the step's own) are logged as ``step_tokens_per_s`` / ``step_samples_per_s``;
        ``tokens_per_s`` / ``samples_per_s`` are the timed steps' so far from ``timed_totals`` (tokens, samples,
        seconds; None during warm-up), benchmark.json's meaning."""
        if not self.backends:
            return
        line = dict(metrics)
        for name in ("tokens_per_s", "samples_per_s"):
            line[f"step_{name}"] = line.pop(name, None)
        if timed_totals is not None and timed_totals[2] > 0:
            tokens, samples, seconds = timed_totals
            line |= {"tokens_per_s": tokens / seconds, "samples_per_s": samples / seconds}
        values = _finite({k: v for k, v in line.items() if k != "step"})
        if values:
            self._each(f"step {step}", lambda b: b.log_step(step, values))

    def finish(self, result: BenchmarkResult, benchmark_file: Path) -> None:
        """Summary metrics and benchmark.json (when the file exists), then close each tracker's run."""
        if not self.backends or self.config is None:
            return
        summary = summary_metrics(result, self.config.usd_per_hour)
        path = benchmark_file if benchmark_file.is_file() else None
        self._each("the end", lambda b: b.finish(result, summary, path))
        self.backends.clear()


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:500]


def _say(message: str) -> None:
    print(f"train: tracking: {message}", file=sys.stderr, flush=True)
