"""``gpuscout local``: the whole benchmark on this machine, with the same scripts the cloud runs.

Steps: load + validate the manifest -> plan with the detected hardware (refuse over budget) -> prepare data once
(``training/data_preparation.py``, cached under ``runs/.cache/data/<key>``) -> for every job, a SageMaker-like
``opt/ml`` folder tree and ``training/train.py`` as a subprocess with the same SM_* variables SageMaker sets ->
benchmark.json into the store -> analysis + report -> ranked table and recommendation.

A failing job never stops the others. Ctrl-C stops the job in flight, marks the run STOPPED and keeps (and
analyzes) what was measured.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError

from gpuscout import paths
from gpuscout.domain.benchmark import BenchmarkResult
from gpuscout.domain.catalog import LOCAL, Catalog, load_catalog
from gpuscout.domain.dataset_checks import dataset_problems, global_batch_blocks
from gpuscout.domain.jobspec import JobSpec
from gpuscout.domain.metric_lines import parse_metric_line
from gpuscout.domain.tracking import local_destinations, tracking_environment
from gpuscout.errors import BudgetExceededError, DataPreparationError, GpuscoutError, ManifestError, Problem
from gpuscout.local.contention import ContentionMonitor
from gpuscout.local.lock import RunsFolderLock
from gpuscout.local.process_control import (
    SignalGuard,
    child_popen_kwargs,
    process_alive,
    stop_process_group,
    this_host,
)
from gpuscout.local.startup import measure_startup_seconds
from gpuscout.plan.canary import CANARY_STEPS, plan_canaries
from gpuscout.store.base import (
    FINAL_RUN_STATUSES,
    JOB_STATUS_RANK,
    JobRecord,
    JobStatus,
    ResultRecord,
    ResultStore,
    RunRecord,
    RunStatus,
    utcnow,
)

if TYPE_CHECKING:
    from gpuscout.analysis.tracking import TrackingOutcome

CURRENT_HOST = "algo-1"
STDERR_TAIL_LINES = 20
FAILURE_REASON_MAX_CHARS = 1500
OOM_MARKERS = ("out of memory", "outofmemoryerror", "cuda oom", "cannot allocate memory")
TERMINATE_GRACE_S = 10.0
TIMED_OUT = "max_runtime_seconds"
SMALL_CORPUS_DOCUMENTS = 2000


# -- planning ---------------------------------------------------------------------------------------------------


def plan_manifest(
    manifest_path: Path | str,
    catalog: Catalog | None = None,
    *,
    run_id: str | None = None,
    on_message: Callable[[str], None] = lambda _message: None,
) -> Any:
    """Load and validate a manifest, then plan it (hardware detected when a target is ``local``; a job section
    without job.estimate calibrated first, ``calibrate_job``).

    Returns ``(manifest, plan)``; raises ManifestError / PlanError. The budget is *not* checked here.
    """
    from gpuscout.domain.catalog import detect_local_hardware
    from gpuscout.domain.manifest import load_manifest
    from gpuscout.plan.planner import make_run_id, plan

    catalog = catalog or load_catalog()
    manifest = load_manifest(manifest_path, catalog=catalog)
    local_hardware = None
    if any(t.instance_type == LOCAL for t in manifest.targets):
        local_hardware = detect_local_hardware().model_copy(update={"startup_s": measure_startup_seconds()})
    if local_hardware is not None:
        for warning in half_precision_warnings(manifest, local_hardware):
            on_message(warning)
    calibration = None
    if manifest.job is not None and manifest.job.estimate is None and local_hardware is not None:
        calibration = calibrate_job(manifest, catalog, local_hardware, on_message=on_message)
    the_plan = plan(
        manifest, catalog, run_id=run_id or make_run_id(manifest.name), local_hardware=local_hardware,
        calibration=calibration,
    )  # fmt: skip
    return manifest, the_plan


def half_precision_warnings(manifest: Any, local_hardware: Any) -> list[str]:
    """One warning per variant of a job section whose arguments ask its script for bf16/fp16 when the jobs run on a
    CPU without native bf16 (gpuscout.domain.cpu): there its matmuls run at about 1 % of fp32 speed, and the run
    would measure that. The built-in training job trains in fp32 on a CPU (the planner refuses 16 bits there)."""
    from gpuscout.domain.cpu import half_precision_argument

    if manifest.job is None or local_hardware.device != "cpu" or local_hardware.cpu_bf16_native is not False:
        return []
    if not any(t.instance_type == LOCAL for t in manifest.targets):
        return []
    out = []
    for variant in manifest.variants:
        asked = half_precision_argument({**manifest.job.arguments, **variant.hyperparameters})
        if asked:
            out.append(
                f"warning: variant {variant.name!r} passes {asked} to its script on this CPU, and "
                f"{local_hardware.cpu_bf16_reason}: 16-bit matmuls run at about 1 % of fp32 speed here, so its "
                "figures would measure that; pass fp32 on a CPU (set it per variant) or run it on a GPU"
            )
    return out


CALIBRATION_TIMED_STEPS = 5
CALIBRATION_WARMUP_STEPS = 2


def calibrate_job(
    manifest: Any,
    catalog: Catalog,
    local_hardware: Any,
    *,
    on_message: Callable[[str], None] = lambda _message: None,
) -> dict[str, Any]:
    """A job section without job.estimate: each variant's script runs CALIBRATION_WARMUP_STEPS +
    CALIBRATION_TIMED_STEPS steps on this machine (stopped by the gpuscout_report helper, a temporary folder), and
    its measured rate and step time become the plan's prediction (planner.Calibration). A variant whose calibration
    fails is a PlanError with the reason: nothing is planned or timed."""
    import tempfile

    from gpuscout.domain.manifest import JobEstimate
    from gpuscout.errors import PlanError
    from gpuscout.plan.planner import Calibration, plan

    job = manifest.job
    provisional = manifest.model_copy(update={"job": job.model_copy(update={"estimate": JobEstimate(units_per_s=1.0)})})
    specs = plan(provisional, catalog, run_id="calibration", local_hardware=local_hardware).jobs
    firsts = {s.variant_name: s for s in reversed(specs) if s.instance_type == LOCAL}  # first local job per variant
    steps = CALIBRATION_WARMUP_STEPS + CALIBRATION_TIMED_STEPS
    settings = {"GPUSCOUT_MAX_STEPS": str(steps), "GPUSCOUT_WARMUP_STEPS": str(CALIBRATION_WARMUP_STEPS),
                "GPUSCOUT_STOP_RULE": "fixed"}  # fmt: skip
    measured: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpuscout-calibration-") as tmp:
        for variant in manifest.variants:
            spec = firsts[variant.name]
            assert spec.job_code is not None
            code = spec.job_code.model_copy(update={"environment": {**spec.job_code.environment, **settings}})
            spec = spec.model_copy(update={"job_code": code, "job_name": f"calibration-{len(measured) + 1}"})
            on_message(f"calibrating {variant.name!r}: {steps} steps on this machine (no job.estimate)")
            outcome = run_job(spec, JobFolders.create(Path(tmp) / spec.job_name, spec, None))
            bench = outcome.benchmark or {}
            timing, throughput = bench.get("timing") or {}, bench.get("throughput") or {}
            rate = throughput.get(f"{job.unit}_per_s")
            timed = int(timing.get("timed_steps") or 0)
            if outcome.status is not JobStatus.COMPLETED or not rate or not timed:
                reason = outcome.failure_reason or "the script reported no timed steps"
                raise PlanError(
                    f"variant {variant.name!r}: its calibration ({steps} steps on this machine) failed: {reason}"
                )
            measured[variant.name] = Calibration(float(rate), float(timing["train_time_s"]) / timed, timed)
    return measured


# -- data preparation -----------------------------------------------------------------------------------------


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def data_cache_key(manifest: Any) -> str:
    """Hash of everything that determines the prepared data: source, tokenizer, sequence length, caps, script."""
    dataset, tokenizer = manifest.dataset, manifest.tokenizer
    source = dataset.source
    if dataset.kind == "local":
        source = str(Path(source).expanduser().resolve())
    script = paths.TRAINING_DIR / "data_preparation.py"
    key = {
        "source": source,
        "format": dataset.format,
        "text_field": dataset.text_field,
        "max_documents": dataset.max_documents,
        "min_characters": dataset.min_characters,
        "validation_fraction": dataset.validation_fraction,
        "tokenizer": tokenizer.kind,
        "tokenizer_path": tokenizer.path,
        "vocab_size": tokenizer.resolved_vocab_size,
        "sequence_length": manifest.sequence_length,
        "script_sha256": _file_sha256(script) if script.is_file() else None,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def data_preparation_command(manifest: Any, output: Path, *, workers: int) -> list[str]:
    dataset, tokenizer = manifest.dataset, manifest.tokenizer
    command = [
        sys.executable,
        str(paths.TRAINING_DIR / "data_preparation.py"),
        "--input",
        dataset.source,
        "--output",
        str(output),
        "--tokenizer",
        tokenizer.kind,
        "--sequence-length",
        str(manifest.sequence_length),
        "--validation-fraction",
        str(dataset.validation_fraction),
        "--min-characters",
        str(dataset.min_characters),
        "--text-field",
        dataset.text_field,
        "--workers",
        str(workers),
        "--seed",
        str(manifest.training.seed),
    ]
    if tokenizer.resolved_vocab_size is not None:
        command += ["--vocab-size", str(tokenizer.resolved_vocab_size)]
    if tokenizer.path is not None:
        command += ["--tokenizer-path", tokenizer.path]
    if dataset.max_documents is not None:
        command += ["--max-documents", str(dataset.max_documents)]
    return command


def prep_workers(max_documents: int | None) -> int:
    """Tokenizer processes for data preparation: one for small capped corpora (starting a process pool costs more
    than it saves on a few hundred documents), else up to four."""
    if max_documents is not None and max_documents <= SMALL_CORPUS_DOCUMENTS:
        return 1
    return max(1, min(4, os.cpu_count() or 1))


def verify_prepared(folder: Path) -> str | None:
    """Why a prepared dataset cannot be reused (a shard missing or changed: its sha256 over the shards, in the
    order data_preparation.py hashed them, differs from dataset.json's), or None when it is intact."""
    try:
        summary = json.loads((folder / "dataset.json").read_text(encoding="utf-8"))
        digest = hashlib.sha256()
        for split in ("train", "validation"):
            for shard in summary["splits"][split]["shards"]:
                for kind in ("input_ids", "segment_ids"):
                    with open(folder / shard[kind], "rb") as handle:
                        while chunk := handle.read(1 << 20):
                            digest.update(chunk)
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    if digest.hexdigest() != summary.get("sha256"):
        return "sha256 of the shards differs from dataset.json"
    return None


def remove_stale_staging(cache_dir: Path) -> list[Path]:
    """Remove staging folders (``.<key>.<pid>.tmp``) whose preparing process no longer exists."""
    removed = []
    for staging in cache_dir.glob(".*.*.tmp"):
        pid = _int_or_none(staging.name.rsplit(".", 2)[-2])
        if staging.is_dir() and pid is not None and not process_alive(pid):
            shutil.rmtree(staging, ignore_errors=True)
            removed.append(staging)
    return removed


def _preparation_error(log_path: Path, returncode: int) -> str:
    """The one line that says why data preparation failed: its own error line, else the log's last line."""
    lines = [line.strip() for line in _tail_lines(log_path, STDERR_TAIL_LINES).splitlines() if line.strip()]
    for line in reversed(lines):
        if "data_preparation: error:" in line:
            return line.split("data_preparation: error:", 1)[1].strip()
    return f"exit {returncode}" + (f": {lines[-1]}" if lines else "")


def prepare_data(manifest: Any, cache_dir: Path, notify: Callable[[str], None] = lambda _text: None) -> Path:
    """Prepared dataset folder for the manifest, reused from ``cache_dir`` when the same inputs were prepared."""
    key = data_cache_key(manifest)
    target = cache_dir / key
    if (target / "dataset.json").is_file():
        problem = verify_prepared(target)
        if problem is None:
            notify(f"data: reusing prepared data {target}")
            return target
        notify(f"data: the cached data in {target} is damaged ({problem}); preparing it again")
        shutil.rmtree(target, ignore_errors=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(cache_dir)
    staging = cache_dir / f".{key}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    workers = prep_workers(manifest.dataset.max_documents)
    command = data_preparation_command(manifest, staging, workers=workers)
    log_path = cache_dir / f"{key}.prepare.log"
    notify(f"data: preparing {manifest.dataset.source} ({manifest.tokenizer.kind} tokenizer) -> {target}")
    started = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=_child_env({}), **child_popen_kwargs()
        )
        try:
            proc.wait()
        except BaseException:  # Ctrl-C, SIGTERM, SIGHUP: no half-prepared data and no orphan left behind
            stop_process_group(proc, TERMINATE_GRACE_S)
            shutil.rmtree(staging, ignore_errors=True)
            raise
    if proc.returncode != 0 or not (staging / "dataset.json").is_file():
        shutil.rmtree(staging, ignore_errors=True)
        raise DataPreparationError(
            f"data preparation failed: {_preparation_error(log_path, proc.returncode)} (log: {log_path})"
        )
    try:
        staging.rename(target)
    except OSError:
        # Another process prepared the same data at the same time: use theirs.
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "dataset.json").is_file():
            raise
    notify(f"data: prepared in {time.monotonic() - started:.1f} s")
    return target


# -- one job ------------------------------------------------------------------------------------------------------


@dataclass
class JobFolders:
    root: Path  # runs/<run_id>/jobs/<job_name>
    opt_ml: Path
    config: Path
    train_channel: Path
    model: Path
    output: Path
    output_data: Path
    checkpoints: Path
    stdout_log: Path
    stderr_log: Path

    @classmethod
    def create(cls, root: Path, spec: JobSpec, data_dir: Path | None) -> JobFolders:
        opt_ml = root / "opt" / "ml"
        folders = cls(
            root=root,
            opt_ml=opt_ml,
            config=opt_ml / "input" / "config",
            train_channel=opt_ml / "input" / "data" / "train",
            model=opt_ml / "model",
            output=opt_ml / "output",
            output_data=opt_ml / "output" / "data",
            checkpoints=opt_ml / "checkpoints",
            stdout_log=root / "train.log",
            stderr_log=root / "train.stderr.log",
        )
        for folder in (folders.config, folders.train_channel.parent, folders.model, folders.output_data):
            folder.mkdir(parents=True, exist_ok=True)
        folders.checkpoints.mkdir(parents=True, exist_ok=True)
        if folders.train_channel.is_symlink() or folders.train_channel.exists():
            folders.train_channel.unlink()
        if data_dir is not None:  # a job section's code reads its own data: no train channel
            folders.train_channel.symlink_to(data_dir.resolve(), target_is_directory=True)
        (folders.config / "hyperparameters.json").write_text(json.dumps(spec.hyperparameters, indent=2) + "\n")
        resource = {"current_host": CURRENT_HOST, "hosts": [CURRENT_HOST], "network_interface_name": "lo"}
        (folders.config / "resourceconfig.json").write_text(json.dumps(resource, indent=2) + "\n")
        (folders.config / "inputdataconfig.json").write_text(
            json.dumps({"train": {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated"}}) + "\n"
        )
        return folders

    def environment(self, spec: JobSpec) -> dict[str, str]:
        """The SM_* variables SageMaker sets in a training container, pointing into this folder tree (and, for a
        tracked built-in job, GPUSCOUT_TRACKING)."""
        tracked = spec.tracking is not None and spec.job_code is None
        return {
            "SM_CHANNEL_TRAIN": str(self.train_channel),
            "SM_CHANNELS": json.dumps(["train"]),
            "SM_MODEL_DIR": str(self.model),
            "SM_OUTPUT_DIR": str(self.output),
            "SM_OUTPUT_DATA_DIR": str(self.output_data),
            "SM_INPUT_DIR": str(self.opt_ml / "input"),
            "SM_INPUT_CONFIG_DIR": str(self.config),
            "SM_HPS": json.dumps(spec.hyperparameters),
            "SM_NUM_GPUS": str(spec.gpus_per_instance),
            "SM_NUM_CPUS": str(os.cpu_count() or 1),
            "SM_HOSTS": json.dumps([CURRENT_HOST]),
            "SM_CURRENT_HOST": CURRENT_HOST,
            "SM_CURRENT_INSTANCE_TYPE": spec.instance_type,
            "SM_TRAINING_ENV": json.dumps({"job_name": spec.job_name, "hosts": [CURRENT_HOST]}),
            "GPUSCOUT_CHECKPOINT_DIR": str(self.checkpoints),
            "GPUSCOUT_RUN_ID": spec.run_id,
            "GPUSCOUT_JOB_NAME": spec.job_name,
            # root is <runs_dir>/<run_id>/jobs/<job_name>: the trackers' local defaults live in <runs_dir>
            **(tracking_environment(spec, runs_dir=self.root.parents[2]) if tracked else {}),
        }


@dataclass
class JobProgress:
    """What the latest metric lines of a running job said."""

    step: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    lines: int = 0
    summary: dict[str, float] = field(default_factory=dict)

    samples_per_s: float | None = None
    steps: list[tuple[int, float, float]] = field(default_factory=list)  # (step, tokens, seconds) per step line

    def update(self, line: str) -> None:
        self.lines += 1
        values = parse_metric_line(line)
        if values is None:
            return
        if line.lstrip().startswith("gpuscout_summary"):
            self.summary.update(values)
            return
        if "step" in values:
            self.step = int(values["step"])
        if "loss" in values:
            self.loss = values["loss"]
        if "tokens_per_s" in values:
            self.tokens_per_s = values["tokens_per_s"]
        if "samples_per_s" in values:
            self.samples_per_s = values["samples_per_s"]
        seconds = values.get("step_time_s")
        if "step" in values and self.tokens_per_s is not None and seconds:
            self.steps.append((int(values["step"]), self.tokens_per_s * seconds, seconds))

    def describe(self, max_steps: int | None) -> str:
        parts = [f"step {self.step if self.step is not None else '-'}{f'/{max_steps}' if max_steps else ''}"]
        parts.append(f"loss {self.loss:.4f}" if self.loss is not None else "loss -")
        # the built-in job prints both rates and is measured in tokens; a user's samples job may print only samples
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:,.0f} tok/s")
        elif self.samples_per_s is not None:
            parts.append(f"{self.samples_per_s:,.0f} samples/s")
        else:
            parts.append("tok/s -")
        return "  ".join(parts)


@dataclass
class JobOutcome:
    status: JobStatus
    benchmark: dict[str, Any] | None
    failure_reason: str | None
    wall_seconds: float
    contention: dict[str, Any] | None = None  # the machine's other load while the job ran (contention.py)


class RunObserver(Protocol):
    """What the runner tells its caller while a run goes on (the CLI draws it: gpuscout.cli.local_view)."""

    def planned(self, the_plan: Any) -> None: ...

    def message(self, text: str, *, warning: bool = False) -> None: ...

    def jobs_running(self) -> AbstractContextManager[None]: ...

    def job_started(self, index: int, total: int, spec: JobSpec, max_steps: int | None) -> None: ...

    def job_progress(self, spec: JobSpec, progress: JobProgress, max_steps: int | None) -> None: ...

    def job_finished(self, spec: JobSpec, outcome: JobOutcome) -> None: ...

    def interrupted(self) -> None: ...

    def finished(
        self, run: RunRecord, analysis: Mapping[str, Any] | None, jobs: Sequence[JobRecord], report_md: Path | None
    ) -> None: ...


class SilentObserver:
    """A RunObserver that shows nothing (library use, tests)."""

    def planned(self, the_plan: Any) -> None:
        return None

    def message(self, text: str, *, warning: bool = False) -> None:
        return None

    def jobs_running(self) -> AbstractContextManager[None]:
        return nullcontext()

    def job_started(self, index: int, total: int, spec: JobSpec, max_steps: int | None) -> None:
        return None

    def job_progress(self, spec: JobSpec, progress: JobProgress, max_steps: int | None) -> None:
        return None

    def job_finished(self, spec: JobSpec, outcome: JobOutcome) -> None:
        return None

    def interrupted(self) -> None:
        return None

    def finished(
        self, run: RunRecord, analysis: Mapping[str, Any] | None, jobs: Sequence[JobRecord], report_md: Path | None
    ) -> None:
        return None


def _child_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    pythonpath = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(paths.REPO_DIR) + (os.pathsep + pythonpath if pythonpath else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra)
    return env


def _tail_lines(path: Path, count: int) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = deque((line.rstrip("\n") for line in f if line.strip()), maxlen=count)
    except OSError:
        return ""
    return "\n".join(lines)


def _pump(stream: IO[str], log_path: Path, progress: JobProgress) -> None:
    with open(log_path, "w", encoding="utf-8") as log:
        for line in stream:
            log.write(line)
            log.flush()
            progress.update(line)


def _failure_from_stderr(stderr_log: Path, stdout_log: Path) -> str:
    tail = _tail_lines(stderr_log, STDERR_TAIL_LINES) or _tail_lines(stdout_log, STDERR_TAIL_LINES)
    if not tail:
        return "no output"
    # The last line of a Python traceback is the exception; keep a little context before it.
    lines = tail.splitlines()
    return "\n".join(lines[-5:])[-FAILURE_REASON_MAX_CHARS:]


def _classify_failure(reason: str) -> JobStatus:
    lowered = reason.lower()
    return JobStatus.OOM if any(marker in lowered for marker in OOM_MARKERS) else JobStatus.FAILED


def _read_benchmark(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The validated benchmark.json as a dict, or why it could not be used."""
    if not path.is_file():
        return None, None
    try:
        result = BenchmarkResult.model_validate_json(path.read_bytes())
    except (OSError, ValidationError) as err:
        return None, f"benchmark.json is unreadable: {str(err).splitlines()[0]}"
    return result.model_dump(mode="json"), None


def run_job(
    spec: JobSpec,
    folders: JobFolders,
    *,
    on_progress: Callable[[JobProgress], None] = lambda _progress: None,
    should_stop: Callable[[JobProgress], str | None] | None = None,
    poll_interval_s: float = 0.25,
) -> JobOutcome:
    """Run train.py (or a job section's entry point) for one job; never raises for a failing job
    (KeyboardInterrupt propagates after cleanup). ``should_stop`` (a settings search's pruner) is asked at every
    poll; the job it names a reason for is stopped and returned PRUNED with that reason."""
    command = [sys.executable, str(paths.TRAINING_DIR / "train.py")]
    cwd, env = folders.root, folders.environment(spec)
    if spec.job_code is not None:
        command, cwd, env = job_code_command(spec, folders)
    started = time.monotonic()
    job_progress = JobProgress()
    with open(folders.stderr_log, "w", encoding="utf-8") as stderr:
        proc = subprocess.Popen(
            command,
            cwd=cwd,
            env=_child_env(env),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            encoding="utf-8",
            errors="replace",
            bufsize=1,
            **child_popen_kwargs(),
        )
        assert proc.stdout is not None
        reader = threading.Thread(
            target=_pump, args=(proc.stdout, folders.stdout_log, job_progress), name=f"log-{spec.job_name}"
        )
        reader.start()
        stopped: str | None = None
        monitor = ContentionMonitor(proc.pid)
        try:
            with monitor:
                stopped = _wait(
                    proc, spec, started, job_progress, on_progress, should_stop=should_stop,
                    poll_interval_s=poll_interval_s,
                )  # fmt: skip
        except KeyboardInterrupt:
            _stop(proc)
            reader.join(timeout=TERMINATE_GRACE_S)
            raise
        reader.join(timeout=TERMINATE_GRACE_S)
    wall = time.monotonic() - started
    on_progress(job_progress)
    if should_stop is not None and stopped is None:
        should_stop(job_progress)  # the steps printed after the last poll still count (the job has finished)
    timed_out = stopped == TIMED_OUT
    contention = monitor.summary()
    if spec.job_code is not None and proc.returncode == 0 and stopped is None:
        benchmark_from_log(spec, folders, env)
    benchmark, unreadable = _read_benchmark(folders.output_data / "benchmark.json")
    completed = benchmark is not None and benchmark["status"] == "completed"
    # a job that ended as it was pruned finished: it exited 0, or its complete benchmark.json was written before the
    # stop reached it (the signal then cut its exit short); its measurement is whole
    finished = completed and (proc.returncode == 0 or (stopped is not None and not timed_out))
    if stopped is not None and not timed_out and not finished:
        return JobOutcome(JobStatus.PRUNED, benchmark, stopped, wall, contention)
    if timed_out:
        reason = f"MaxRuntimeExceeded: stopped after {spec.max_runtime_seconds} s (max_runtime_seconds)"
        return JobOutcome(JobStatus.STOPPED, benchmark, reason, wall, contention)
    if finished:
        return JobOutcome(JobStatus.COMPLETED, benchmark, None, wall, contention)
    if benchmark is not None and benchmark.get("failure_reason"):
        reason = str(benchmark["failure_reason"])
    elif unreadable:
        reason = unreadable
    else:
        tail = _failure_from_stderr(folders.stderr_log, folders.stdout_log)
        script = spec.job_code.entry_point if spec.job_code else "train.py"
        reason = f"{script} exited with code {proc.returncode}: {tail}"
    return JobOutcome(_classify_failure(reason), benchmark, reason, wall, contention)


def job_code_command(spec: JobSpec, folders: JobFolders) -> tuple[list[str], Path, dict[str, str]]:
    """A job section's command, folder and environment: a copy of the user's folder in the job folder
    (``code/``, as SageMaker puts source_dir in /opt/ml/code), ``python ENTRY_POINT --key value ...`` with the
    variant's hyperparameters, training/ on PYTHONPATH (``import gpuscout_report``) and the helper's GPUSCOUT_*
    settings."""
    code = spec.job_code
    assert code is not None
    target = folders.root / "code"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(code.source_dir, target, ignore=shutil.ignore_patterns("__pycache__", ".git", "*.pyc"))
    command = [sys.executable, code.entry_point]
    for key, value in spec.hyperparameters.items():
        command += [f"--{key}", value]
    env = folders.environment(spec) | code.environment | {"GPUSCOUT_ENTRY_POINT": code.entry_point}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(paths.TRAINING_DIR), str(paths.REPO_DIR), os.environ.get("PYTHONPATH", "")]
    )
    return command, target, env


def benchmark_from_log(spec: JobSpec, folders: JobFolders, env: Mapping[str, str]) -> None:
    """A job section's script that printed metric lines instead of calling the helper: the helper builds
    benchmark.json from its log (training/gpuscout_report.py --from-log); its error, if any, lands in stderr."""
    if (folders.output_data / "benchmark.json").is_file():
        return
    command = [sys.executable, str(paths.TRAINING_DIR / "gpuscout_report.py"), "--from-log", str(folders.stdout_log)]
    with open(folders.stderr_log, "a", encoding="utf-8") as stderr:
        subprocess.run(command, env=_child_env(env), stdout=stderr, stderr=stderr, check=False, timeout=120)


def _wait(
    proc: subprocess.Popen[str],
    spec: JobSpec,
    started: float,
    job_progress: JobProgress,
    on_progress: Callable[[JobProgress], None],
    *,
    should_stop: Callable[[JobProgress], str | None] | None,
    poll_interval_s: float,
) -> str | None:
    """Wait for the job, reporting progress; stop it at max_runtime_seconds (returns TIMED_OUT) or when
    ``should_stop`` gives a reason (returns it). None: the job ended by itself."""
    while True:
        try:
            proc.wait(timeout=poll_interval_s)
            return None
        except subprocess.TimeoutExpired:
            pass
        on_progress(job_progress)
        if should_stop is not None and (why := should_stop(job_progress)):
            _stop(proc)
            return why
        if time.monotonic() - started > spec.max_runtime_seconds:
            _stop(proc)
            return TIMED_OUT


def _stop(proc: subprocess.Popen[str]) -> None:
    stop_process_group(proc, TERMINATE_GRACE_S)


def _max_steps(spec: JobSpec) -> int | None:
    """The job's step budget: train.py's hyperparameter, or what the gpuscout_report helper gets (user's code)."""
    steps = _int_or_none(spec.hyperparameters.get("max_steps"))
    if steps is None and spec.job_code is not None:
        steps = _int_or_none(spec.job_code.environment.get("GPUSCOUT_MAX_STEPS"))
    return steps


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        return None


# -- results table ------------------------------------------------------------------------------------------------


def _stop_text(a: Mapping[str, Any]) -> str | None:
    from gpuscout.analysis.results import JobAnalysis

    if a.get("tokens_per_s") is None and a.get("samples_per_s") is None:
        return None
    return JobAnalysis.model_validate(a).stop_text


def _note(a: Mapping[str, Any]) -> str | None:
    """Exclusion or failure first; else what makes the row's number weaker than it looks."""
    if a.get("excluded_reason") or a.get("failure"):
        return a.get("excluded_reason") or a.get("failure")
    flags = []  # the stop rule's outcome has a column of its own ("stop")
    if a.get("ci_kind") == "unreliable":
        flags.append(str(a.get("ci_method") or "unreliable interval"))
    if a.get("contention_note"):
        flags.append(str(a["contention_note"]))
    return "; ".join(f for f in flags if f) or None


def result_rows(analysis: Mapping[str, Any] | None, jobs: Sequence[JobRecord]) -> list[dict[str, Any]]:
    """Flat rows, best first: from the stored analysis, or from the job rows when the run was not analyzed."""
    if analysis and analysis.get("jobs") is not None:
        rows = []
        for a in analysis["jobs"]:
            ci = a.get("tokens_per_s_ci95") or (None, None)
            samples_ci = a.get("samples_per_s_ci95") or (None, None)
            rows.append(
                {
                    "unit": a.get("unit", "tokens"),
                    "samples_per_s": a.get("samples_per_s"),
                    "samples_per_s_ci95_low": samples_ci[0],
                    "samples_per_s_ci95_high": samples_ci[1],
                    "usd_per_million_samples": a.get("usd_per_million_samples"),
                    "usd_per_million_samples_spot": a.get("usd_per_million_samples_spot"),
                    "rank": a.get("rank"),
                    "job_name": a.get("job_name"),
                    "variant": a.get("variant_name"),
                    "instance_type": a.get("instance_type"),
                    "instance_count": a.get("instance_count", 1),
                    "gpus": a.get("gpus", 0),
                    "spot": a.get("spot", False),
                    "status": a.get("status"),
                    "repetitions": a.get("repetitions"),
                    "tokens_per_s": a.get("tokens_per_s"),
                    "tokens_per_s_ci95_low": ci[0],
                    "tokens_per_s_ci95_high": ci[1],
                    "mfu": a.get("mfu"),
                    "usd_per_hour": a.get("usd_per_hour"),
                    "usd_per_million_tokens": a.get("usd_per_million_tokens"),
                    "usd_per_million_tokens_spot": a.get("usd_per_million_tokens_spot"),
                    "final_train_loss": a.get("final_train_loss"),
                    "ci_kind": a.get("ci_kind"),
                    "ci_method": a.get("ci_method"),
                    "timed_steps": a.get("timed_steps"),
                    "stop_rule": a.get("stop_rule"),
                    "stop_reason": a.get("stop_reason"),
                    "tolerance_reached": a.get("tolerance_reached"),
                    "stop": _stop_text(a),
                    "contention": a.get("contention_note"),
                    "note": _note(a),
                }
            )
        return sorted(rows, key=lambda r: (r["rank"] is None, r["rank"] or 0, r["job_name"] or ""))
    rows = []
    for job in jobs:
        throughput = (job.benchmark or {}).get("throughput") or {}
        efficiency = (job.benchmark or {}).get("efficiency") or {}
        ci = throughput.get("tokens_per_s_ci95") or (None, None)
        rows.append(
            {
                "rank": None,
                "job_name": job.job_name,
                "variant": job.variant_name,
                "instance_type": job.instance_type,
                "instance_count": job.instance_count,
                "gpus": job.spec.get("gpus_per_instance", 0) * job.instance_count,
                "spot": job.spot,
                "status": job.status.value,
                "repetitions": 1 if job.status is JobStatus.COMPLETED else 0,
                "tokens_per_s": throughput.get("tokens_per_s"),
                "tokens_per_s_ci95_low": ci[0],
                "tokens_per_s_ci95_high": ci[1],
                "mfu": efficiency.get("mfu"),
                "usd_per_hour": job.spec.get("price_per_hour_usd"),
                "usd_per_million_tokens": None,
                "usd_per_million_tokens_spot": None,
                "final_train_loss": ((job.benchmark or {}).get("loss") or {}).get("final_train_loss"),
                "ci_kind": None,
                "ci_method": None,
                "timed_steps": ((job.benchmark or {}).get("timing") or {}).get("timed_steps"),
                "stop_rule": ((job.benchmark or {}).get("stop") or {}).get("rule"),
                "stop_reason": ((job.benchmark or {}).get("stop") or {}).get("reason"),
                "tolerance_reached": None,
                "stop": ((job.benchmark or {}).get("stop") or {}).get("reason"),
                "contention": (job.contention or {}).get("note"),
                "note": job.failure_reason,
            }
        )
    return rows


# -- the whole run ------------------------------------------------------------------------------------------------


def _analyze_and_report(
    run: RunRecord, store: ResultStore, manifest: Any, catalog: Catalog, *, report_dir: Path, observer: RunObserver
) -> dict[str, Any]:
    """Analyze the run and store the result; then write the report. A report that cannot be written is a warning
    (the analysis is stored either way and ``gpuscout results`` shows it)."""
    from gpuscout.analysis.analyze import analyze_run
    from gpuscout.analysis.report import write_report

    jobs = store.list_jobs(run.run_id)
    analysis = analyze_run(run, jobs, manifest=manifest, catalog=catalog)
    dumped = analysis.model_dump(mode="json")
    result = ResultRecord(
        run_id=run.run_id, analysis=dumped, price_snapshot=analysis.price_snapshot.model_dump(mode="json")
    )
    store.put_result(result)
    try:
        write_report(analysis, report_dir)
    except Exception as err:  # the measured results are stored; a broken chart must not hide them
        observer.message(
            f"the report could not be written ({type(err).__name__}: {err}); "
            "the results are stored, see `gpuscout results`",
            warning=True,
        )
        return dumped
    store.put_result(result.model_copy(update={"report_uri": str(report_dir)}))
    return dumped


def repriced_analysis(run: RunRecord, result: ResultRecord | None) -> dict[str, Any]:
    """The stored analysis re-priced with today's catalog prices (and the manifest's overrides)."""
    from gpuscout.analysis.analyze import reprice
    from gpuscout.analysis.pricing import PriceBook

    if result is None:
        raise GpuscoutError(f"run {run.run_id} has no stored analysis to re-price (status {run.status.value})")
    prices = PriceBook.from_catalog(load_catalog()).with_manifest_overrides(run.manifest)
    return reprice(result.analysis, prices).model_dump(mode="json")


def ensure_writable(folder: Path) -> None:
    """A runs folder that cannot be written is a clear error before anything is planned or prepared."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise GpuscoutError(f"--runs-dir {folder}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise GpuscoutError(f"--runs-dir {folder}: {existing} is not writable; choose another folder with --runs-dir")


def run_local(
    manifest_path: Path | str,
    *,
    store: ResultStore,
    runs_dir: Path = Path("runs"),
    observer: RunObserver | None = None,
    catalog: Catalog | None = None,
    data_cache_dir: Path | None = None,
    allow_concurrent: bool = False,
    canary: bool = True,
    resume: str | None = None,
) -> RunRecord:
    """Run a manifest's benchmark on this machine and return the final run row (see module docstring).

    ``resume``: the id of an earlier run of the same settings-search manifest that ended (interrupted, or
    abandoned by a process that is gone): it goes on under that id, its finished trials kept (docs/search.md).

    One run at a time per runs folder (``lock.RunsFolderLock``) unless ``allow_concurrent``. With ``canary``, each
    distinct configuration first runs a few steps (gpuscout.plan.canary); a configuration whose canary fails is not
    timed."""
    observer = observer or SilentObserver()
    catalog = catalog or load_catalog()
    manifest_path = Path(manifest_path)
    runs_dir = Path(runs_dir).resolve()  # train.py runs in its job folder: every path it gets must be absolute
    ensure_writable(runs_dir)
    previous = _resumable(store, resume) if resume else None
    manifest, the_plan = plan_manifest(manifest_path, catalog, run_id=resume, on_message=observer.message)
    if previous is not None:
        _check_resume(previous, manifest, the_plan)
    if manifest.job is not None and manifest.job.in_s3:
        raise ManifestError(
            str(manifest_path),
            [
                Problem(
                    "job.source_dir",
                    f"{manifest.job.source_dir} is in S3; `gpuscout local` runs a local folder (aws s3 sync "
                    f"{manifest.job.source_dir} code/ and set job.source_dir: code)",
                )
            ],
        )
    run_id: str = the_plan.run_id
    run_dir = runs_dir / run_id
    run = RunRecord(
        run_id=run_id,
        name=manifest.name,
        status=RunStatus.PLANNED,
        manifest_source=str(manifest_path),
        manifest=manifest.model_dump(mode="json"),
        predicted_cost_usd=the_plan.predicted_cost_usd,
        search=the_plan.search.model_dump(mode="json") if the_plan.search else None,
        run_dir=str(run_dir),
        host=this_host(),
        pid=os.getpid(),
    )
    observer.planned(the_plan)
    try:
        the_plan.check_budget()
    except BudgetExceededError as err:
        store.put_run(run.model_copy(update={"status": RunStatus.REFUSED, "error": str(err), "run_dir": None}))
        raise
    lock = nullcontext() if allow_concurrent else RunsFolderLock(runs_dir, run_id=run_id, host=this_host())
    with lock:
        return _run_planned(
            run, manifest, the_plan, manifest_path, store=store, observer=observer, catalog=catalog,
            data_cache_dir=data_cache_dir or runs_dir / ".cache" / "data", canary=canary,
        )  # fmt: skip


def _resumable(store: ResultStore, run_id: str) -> RunRecord:
    run = store.get_run(run_id)
    if run.search is None:
        raise GpuscoutError(f"--resume {run_id}: not a settings search (only a search's trials can be resumed)")
    if run.status not in FINAL_RUN_STATUSES and not is_abandoned(run):
        raise GpuscoutError(
            f"--resume {run_id}: the run is {run.status.value} in process {run.pid} on {run.host}; "
            "stop it first (or close it with `gpuscout analyze`)"
        )
    if run.status in {RunStatus.REJECTED, RunStatus.REFUSED}:
        raise GpuscoutError(f"--resume {run_id}: the run was {run.status.value}; nothing ran")
    return run


def _check_resume(previous: RunRecord, manifest: Any, the_plan: Any) -> None:
    """A resumed search must be the same search: same manifest, same candidates."""
    if previous.manifest != manifest.model_dump(mode="json"):
        raise GpuscoutError(
            f"--resume {previous.run_id}: the manifest differs from the one that run used "
            f"({previous.manifest_source}); resume with that manifest, or start a new run"
        )
    if previous.search != the_plan.search.model_dump(mode="json"):
        raise GpuscoutError(
            f"--resume {previous.run_id}: this machine plans other candidates than that run did "
            "(different hardware or memory); start a new run"
        )


def _run_planned(
    run: RunRecord,
    manifest: Any,
    the_plan: Any,
    manifest_path: Path,
    *,
    store: ResultStore,
    observer: RunObserver,
    catalog: Catalog,
    data_cache_dir: Path,
    canary: bool = True,
) -> RunRecord:
    specs: list[JobSpec] = list(the_plan.jobs)
    run_id = run.run_id
    run_dir = Path(str(run.run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(manifest_path, run_dir / f"manifest{manifest_path.suffix or '.yaml'}")
    (run_dir / "plan.json").write_text(
        json.dumps([s.model_dump(mode="json") for s in specs], indent=2) + "\n", encoding="utf-8"
    )
    store.put_run(run)
    for spec in specs if the_plan.search is None else ():  # a search's rows appear as its trials start
        store.put_job(_job_record(spec, JobStatus.PLANNED))

    current: JobSpec | None = None
    interrupted: str | None = None
    failure: Exception | None = None
    with SignalGuard() as guard:
        try:
            data_dir: Path | None = None
            refused: set[str] = set()
            if manifest.job is None:
                store.update_run(run_id, status=RunStatus.PREPARING)
                data_dir = prepare_data(manifest, data_cache_dir, observer.message)
                refused = check_prepared_data(data_dir, manifest, specs, store=store, observer=observer)
            elif manifest.job.requirements:
                observer.message(
                    f"job: {manifest.job.requirements} is not installed by `gpuscout local`; the job runs in this "
                    f"environment ({sys.executable})",
                    warning=True,
                )
            store.update_run(run_id, status=RunStatus.RUNNING)
            if canary and data_dir is not None and the_plan.search is None:  # a failing trial fails alone
                refused |= run_canaries(specs, refused, run_dir, data_dir, store=store, observer=observer)
            with observer.jobs_running():
                trials = 0

                def run_one(spec: JobSpec, should_stop: Callable[[JobProgress], str | None] | None) -> JobRecord:
                    nonlocal current, trials
                    current, trials = spec, trials + 1
                    max_steps = _max_steps(spec)
                    observer.job_started(trials if the_plan.search else specs.index(spec) + 1, len(specs), spec,
                                         max_steps)  # fmt: skip
                    store.put_job(_job_record(spec, JobStatus.TRAINING))
                    folders = JobFolders.create(run_dir / "jobs" / spec.job_name, spec, data_dir)
                    progress = partial(observer.job_progress, spec, max_steps=max_steps)
                    outcome = run_job(spec, folders, on_progress=progress, should_stop=should_stop)
                    record = _job_record(spec, outcome.status, outcome)
                    store.put_job(record)
                    observer.job_finished(spec, outcome)
                    current = None
                    return record

                if the_plan.search is not None:
                    _run_search(the_plan, [s for s in specs if s.job_name not in refused], store=store,
                                observer=observer, run_one=run_one)  # fmt: skip
                else:
                    for spec in specs:
                        if spec.job_name not in refused:
                            run_one(spec, None)
        except KeyboardInterrupt as err:
            guard.defer()
            interrupted = getattr(err, "signal_name", "Ctrl-C")
            observer.interrupted()
        except Exception as err:  # data preparation failed, or the run folder could not be written
            guard.defer()
            failure = err
        finally:
            # From here on a second Ctrl-C, SIGTERM or SIGHUP is recorded, not raised: the run always ends in a
            # final state with what was measured analysed.
            guard.defer()
        if failure is not None:
            note = (str(failure).strip().splitlines() or [""])[0]  # the stored note is one line
            store.update_run(run_id, status=RunStatus.FAILED, error=f"{type(failure).__name__}: {note}")
            raise failure
        final, analysis, jobs = close_run(
            run_id,
            store,
            manifest,
            catalog,
            run_dir=run_dir,
            observer=observer,
            interrupted=interrupted,
            current_job=current.job_name if current else None,
        )
    report_md = run_dir / "report" / "report.md"
    observer.finished(final, analysis, jobs, report_md if report_md.is_file() else None)
    return final


def _run_search(
    the_plan: Any,
    specs: Sequence[JobSpec],
    *,
    store: ResultStore,
    observer: RunObserver,
    run_one: Callable[[JobSpec, Callable[[JobProgress], str | None] | None], JobRecord],
) -> None:
    """A settings search (gpuscout.local.search): each trial is ``run_one`` with the search's pruner asked at every
    poll; trials already finished in the store (a resumed run) are not run again."""
    from gpuscout.local.search import StopCheck, run_search
    from gpuscout.plan.search import describe_plan

    for line in describe_plan(the_plan.search):
        observer.message(line)
    finished = {j.job_name: j for j in store.list_jobs(the_plan.run_id) if j.status in FINISHED_TRIAL_STATUSES}

    def run_trial(spec: JobSpec, check: StopCheck) -> JobRecord:
        seen = 0

        def should_stop(progress: JobProgress) -> str | None:
            nonlocal seen
            steps = progress.steps[seen:]
            seen += len(steps)
            for step, tokens, seconds in steps:
                if why := check(step, tokens, seconds):
                    return why
            return None

        return run_one(spec, should_stop)

    summary = run_search(the_plan.search, specs, run_trial=run_trial, done=finished, on_message=observer.message)
    observer.message(
        f"search: {summary.launched} trial(s) launched, {len(summary.pruned)} pruned, "
        f"${summary.spent_usd:.4f} spent" + (f"; stopped: {summary.stopped_because}" if summary.stopped_because else "")
    )


def check_prepared_data(
    data_dir: Path, manifest: Any, specs: Sequence[JobSpec], *, store: ResultStore, observer: RunObserver
) -> set[str]:
    """Degenerate data, before anything is measured (domain.dataset_checks): warnings are shown loudly; a job whose
    global batch the training split cannot fill is recorded FAILED with the fix and not run. Returns those jobs."""
    try:
        summary = json.loads((data_dir / "dataset.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DataPreparationError(f"prepared data in {data_dir} is unreadable ({err}); delete the folder") from err
    requested = manifest.tokenizer.resolved_vocab_size
    for problem in dataset_problems(summary, requested_vocab_size=requested):
        observer.message(f"data: {problem.message}", warning=True)
    refused: set[str] = set()
    for spec in specs:
        batch = global_batch_blocks(spec.hyperparameters, spec.gpus_per_instance * spec.instance_count or 1)
        for problem in dataset_problems(summary, global_batch=batch):
            if problem.severity == "refuse":
                reason = f"not run: degenerate data: {problem.message}"
                store.put_job(_job_record(spec, JobStatus.FAILED).model_copy(update={"failure_reason": reason}))
                observer.message(f"{spec.job_name}: {reason}", warning=True)
                refused.add(spec.job_name)
    return refused


def run_canaries(
    specs: Sequence[JobSpec],
    skipped: set[str],
    run_dir: Path,
    data_dir: Path,
    *,
    store: ResultStore,
    observer: RunObserver,
) -> set[str]:
    """Run one canary per distinct configuration (gpuscout.plan.canary) under run_dir/canary/; every job whose
    configuration's canary failed is recorded with the canary's status and reason and not run. Returns those jobs."""
    canaries = plan_canaries([s for s in specs if s.job_name not in skipped])
    by_name = {s.job_name: s for s in specs}
    failed: set[str] = set()
    for index, canary in enumerate(canaries, start=1):
        variants = ", ".join(dict.fromkeys(by_name[n].variant_name for n in canary.covers))
        observer.message(f"canary {index}/{len(canaries)}: {variants}: {CANARY_STEPS} steps before timing anything")
        folders = JobFolders.create(run_dir / "canary" / canary.spec.job_name, canary.spec, data_dir)
        outcome = run_job(canary.spec.model_copy(update={"tracking": None}), folders)  # not a measurement: untracked
        if outcome.status is JobStatus.COMPLETED:
            continue
        status = JobStatus.FAILED if outcome.status is JobStatus.STOPPED else outcome.status
        reason = (
            f"not run: its canary ({CANARY_STEPS} steps of the same configuration) failed: {outcome.failure_reason} "
            f"(log: {folders.stderr_log})"
        )
        for name in canary.covers:
            store.put_job(_job_record(by_name[name], status).model_copy(update={"failure_reason": reason}))
            failed.add(name)
        observer.message(f"canary {index}/{len(canaries)} ({variants}) failed: {outcome.failure_reason}", warning=True)
    return failed


UNFINISHED_JOB_STATUSES = (JobStatus.PLANNED, JobStatus.STARTING, JobStatus.TRAINING, JobStatus.STOPPING)
# A resumed search keeps these trials (an interrupted one, STOPPED, runs again).
FINISHED_TRIAL_STATUSES = (JobStatus.COMPLETED, JobStatus.PRUNED, JobStatus.FAILED, JobStatus.OOM)


def close_run(
    run_id: str,
    store: ResultStore,
    manifest: Any,
    catalog: Catalog,
    *,
    run_dir: Path,
    observer: RunObserver,
    interrupted: str | None,
    current_job: str | None = None,
) -> tuple[RunRecord, dict[str, Any] | None, list[JobRecord]]:
    """Bring a run to its final state: unfinished jobs STOPPED (with why), finished jobs analysed and reported,
    the run SUCCEEDED, STOPPED or FAILED. ``interrupted`` names what stopped it (Ctrl-C, SIGTERM, "abandoned ...").
    Used at the end of every ``run_local`` and by ``gpuscout analyze`` for a run whose process is gone."""
    for job in store.list_jobs(run_id):
        if job.status in UNFINISHED_JOB_STATUSES:
            why = interrupted or "run ended"
            reason = f"interrupted ({why})" if job.job_name == current_job else f"not finished: run interrupted ({why})"
            if job.status is JobStatus.PLANNED:
                reason = f"not started: run interrupted ({why})"
            store.put_job(job.model_copy(update={"status": JobStatus.STOPPED, "failure_reason": reason}))
    jobs = store.list_jobs(run_id)
    completed = [j for j in jobs if j.status is JobStatus.COMPLETED]
    analysis: dict[str, Any] | None = None
    if completed:
        store.update_run(run_id, status=RunStatus.ANALYZING)
        try:
            analysis = _analyze_and_report(
                store.get_run(run_id), store, manifest, catalog, report_dir=run_dir / "report", observer=observer
            )
        except Exception as err:
            store.update_run(run_id, status=RunStatus.FAILED, error=f"analysis failed: {err}")
            raise
    tracking = manifest.resolved_tracking()
    if analysis is not None and tracking is not None:  # the run's results to its experiment trackers
        from gpuscout.analysis.tracking import log_run

        logged = log_run(run_id, analysis, run_dir / "report", local_destinations(tracking, run_dir.parent))
        for line in logged.logged + logged.problems:
            observer.message(f"tracking: {line}", warning=line in logged.problems)
    if interrupted:
        final = store.update_run(run_id, status=RunStatus.STOPPED, error=f"interrupted ({interrupted})")
    elif completed:
        final = store.update_run(run_id, status=RunStatus.SUCCEEDED, error=None)
    else:
        final = store.update_run(run_id, status=RunStatus.FAILED, error=f"all {len(jobs)} jobs failed")
    return final, analysis, jobs


def is_abandoned(run: RunRecord) -> bool:
    """A local run that is not final, started on this host by a process that no longer exists."""
    if run.status in FINAL_RUN_STATUSES or run.pid is None or run.host != this_host():
        return False
    return not process_alive(run.pid)


def track_local_run(run: RunRecord, store: ResultStore) -> TrackingOutcome:
    """``gpuscout track RUN_ID``: log a local run's stored analysis and report to its manifest's trackers again (as
    the end of ``gpuscout local`` did; e.g. after a tracker was unreachable then). The trackers' defaults are the run
    folder's (``<runs dir>/mlflow.db``, ``<runs dir>/wandb/``); a relative ``tracking_uri`` is taken from the current
    folder."""
    from gpuscout.analysis.tracking import log_run, run_to_track

    tracking, analysis = run_to_track(run, store.get_result(run.run_id))
    if run.run_dir is None:
        raise GpuscoutError(f"run {run.run_id} has no local run folder (a cloud run? pass --stack-name)")
    run_dir = Path(run.run_dir)
    return log_run(run.run_id, analysis, run_dir / "report", local_destinations(tracking, run_dir.parent))


def close_abandoned_run(
    run: RunRecord, store: ResultStore, *, observer: RunObserver | None = None, catalog: Catalog | None = None
) -> RunRecord:
    """``gpuscout analyze RUN_ID``: close a run whose ``gpuscout local`` process is gone (SIGKILL, a reboot, an
    OOM kill) from what its finished jobs left: analysis, report and a final status. A final run is re-analysed and
    its report regenerated from the stored jobs; its status stays."""
    from gpuscout.domain.manifest import validate_manifest_data

    observer = observer or SilentObserver()
    catalog = catalog or load_catalog()
    if run.run_dir is None or run.manifest is None:
        raise GpuscoutError(f"run {run.run_id} has no local run folder or manifest to analyse")
    running = run.status not in FINAL_RUN_STATUSES and run.pid is not None and run.host == this_host()
    if running and run.pid is not None and process_alive(run.pid):
        raise GpuscoutError(
            f"run {run.run_id} is still running (pid {run.pid} on {run.host}); stop it first (Ctrl-C or kill -TERM)"
        )
    manifest = validate_manifest_data(run.manifest, run.manifest_source, catalog)
    run_dir = Path(run.run_dir)
    if run.status in FINAL_RUN_STATUSES:
        analysis = None
        jobs = store.list_jobs(run.run_id)
        if any(j.status is JobStatus.COMPLETED for j in jobs):
            analysis = _analyze_and_report(
                run, store, manifest, catalog, report_dir=run_dir / "report", observer=observer
            )
        final = store.get_run(run.run_id)
    else:
        where = f"pid {run.pid} on {run.host}" if run.pid is not None else "its process"
        final, analysis, jobs = close_run(
            run.run_id,
            store,
            manifest,
            catalog,
            run_dir=run_dir,
            observer=observer,
            interrupted=f"abandoned: {where} ended without closing the run",
        )
    report_md = run_dir / "report" / "report.md"
    observer.finished(final, analysis, jobs, report_md if report_md.is_file() else None)
    return final


def _job_record(spec: JobSpec, status: JobStatus, outcome: JobOutcome | None = None) -> JobRecord:
    return JobRecord.from_spec(
        spec,
        status,
        benchmark=outcome.benchmark if outcome else None,
        failure_reason=outcome.failure_reason if outcome else None,
        training_seconds=round(outcome.wall_seconds) if outcome else None,
        contention=outcome.contention if outcome else None,
        status_rank=JOB_STATUS_RANK[status],
        last_event_time=utcnow(),
    )
