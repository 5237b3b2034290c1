"""One local job: its SageMaker-shaped ``opt/ml`` folders and environment, train.py (or the user's entry point) as a
child process whose stdout is pumped into its log and parsed for progress, the wait (a settings search may stop it,
``max_runtime_seconds`` does), the stop, and what became of it: benchmark.json read back, or the failure classified
(OOM, failed, stopped, pruned) with the end of its stderr.

May import: gpuscout.domain, gpuscout.store, gpuscout.workflow (its ports) and gpuscout.local's process_control and
contention."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pydantic import ValidationError

from gpuscout import paths
from gpuscout.domain.benchmark import BenchmarkResult, stopped_by_signal
from gpuscout.domain.jobspec import JobSpec
from gpuscout.domain.metric_lines import parse_metric_line
from gpuscout.domain.tracking import tracking_environment
from gpuscout.errors import disk_full_at, says_disk_full
from gpuscout.local.contention import ContentionMonitor
from gpuscout.local.process_control import (
    child_popen_kwargs,
    stop_process_group,
)
from gpuscout.store.base import JobStatus
from gpuscout.workflow.ports import JobOutcome

CURRENT_HOST = "algo-1"
STDERR_TAIL_LINES = 20
FAILURE_REASON_MAX_CHARS = 1500
OOM_MARKERS = ("out of memory", "outofmemoryerror", "cuda oom", "cannot allocate memory")
TERMINATE_GRACE_S = 10.0
TIMED_OUT = "max_runtime_seconds"
# a user's script that keeps training after the helper answered "stop" (or past its max_steps) is ended this long after
STOP_GRACE_S = 15.0
IGNORED_STOP = "ignored_stop"
STDOUT_LOG = "train.log"  # a job's stdout (its metric lines), in its folder
STDERR_LOG = "train.stderr.log"


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
            stdout_log=root / STDOUT_LOG,
            stderr_log=root / STDERR_LOG,
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
    # the gpuscout_report helper answered "stop" at this step (its stop_step metric line), and when it was read
    stop_step: int | None = None
    stop_seen_at: float | None = None
    # a settings search's pruner asked to stop it while other processes competed for the machine: not pruned
    prune_withheld: str | None = None
    # why the job's stdout log could not be written (a full disk): its lines were still read, not kept
    log_lost: str | None = None

    def update(self, line: str) -> None:
        self.lines += 1
        values = parse_metric_line(line)
        if values is None:
            return
        if line.lstrip().startswith("gpuscout_summary"):
            self.summary.update(values)
            return
        if "stop_step" in values and self.stop_step is None:
            self.stop_step, self.stop_seen_at = int(values["stop_step"]), time.monotonic()
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
        # the built-in job prints both rates and is measured in tokens; a user's samples job may print only samples.
        # The live rate is the latest step's alone (warm-up steps included), not the mean the results table shows
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:,.0f} tok/s last step")
        elif self.samples_per_s is not None:
            parts.append(f"{self.samples_per_s:,.0f} samples/s last step")
        else:
            parts.append("tok/s -")
        return "  ".join(parts)


def child_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    # gpuscout and the jobs' packages from this checkout's source roots where gpuscout is not installed (an install
    # finds them either way); what this process's PYTHONPATH names comes first
    env["PYTHONPATH"] = paths.source_pythonpath(env.get("PYTHONPATH"))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra)
    return env


def tail_lines(path: Path, count: int) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = deque((line.rstrip("\n") for line in f if line.strip()), maxlen=count)
    except OSError:
        return ""
    return "\n".join(lines)


def _pump(stream: IO[str], log_path: Path, progress: JobProgress) -> None:
    """Copy the job's stdout into its log and read its metric lines. A log that cannot be written (a full disk) is
    given up, said in ``progress.log_lost``, and the pipe is still drained, so the job never blocks on it."""
    log: IO[str] | None = None
    try:
        log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed below, or given up on a write error
    except OSError as err:
        progress.log_lost = f"{log_path}: {err}"
    for line in stream:
        if log is not None:
            try:
                log.write(line)
                log.flush()
            except OSError as err:
                progress.log_lost = f"{log_path}: {err}"
                _close_quietly(log)
                log = None
        progress.update(line)
    if log is not None:
        _close_quietly(log)


def _close_quietly(log: IO[str]) -> None:
    with contextlib.suppress(OSError):  # its buffer's last write may fail again on the same full disk
        log.close()


def _failure_from_stderr(stderr_log: Path, stdout_log: Path) -> str:
    tail = tail_lines(stderr_log, STDERR_TAIL_LINES) or tail_lines(stdout_log, STDERR_TAIL_LINES)
    if not tail:
        return "no output"
    # The last line of a Python traceback is the exception; keep a little context before it.
    lines = tail.splitlines()
    return "\n".join(lines[-5:])[-FAILURE_REASON_MAX_CHARS:]


def _classify_failure(reason: str) -> JobStatus:
    lowered = reason.lower()
    return JobStatus.OOM if any(marker in lowered for marker in OOM_MARKERS) else JobStatus.FAILED


def _read_benchmark(path: Path) -> tuple[BenchmarkResult | None, str | None]:
    """The validated benchmark.json, or why it could not be used."""
    if not path.is_file():
        return None, None
    try:
        result = BenchmarkResult.model_validate_json(path.read_bytes())
    except (OSError, ValidationError) as err:
        return None, f"benchmark.json is unreadable: {str(err).splitlines()[0]}"
    return result, None


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
    command = [sys.executable, "-m", paths.TRAIN_MODULE]
    cwd, env = folders.root, folders.environment(spec)
    if spec.job_code is not None:
        command, cwd, env = job_code_command(spec, folders)
    started = time.monotonic()
    job_progress = JobProgress()
    with open(folders.stderr_log, "w", encoding="utf-8") as stderr:
        proc = subprocess.Popen(
            command,
            cwd=cwd,
            env=child_env(env),
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
                    poll_interval_s=poll_interval_s, competing=lambda: monitor.summary().competing,
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
    # a job section's script that ended, or was ended after ignoring "stop": its log's steps up to the stop stand
    if spec.job_code is not None and ((proc.returncode == 0 and stopped is None) or stopped == IGNORED_STOP):
        benchmark_from_log(spec, folders, env)
    benchmark, unreadable = _read_benchmark(folders.output_data / "benchmark.json")
    if stopped == IGNORED_STOP:  # the job itself did not end as asked
        where = f"step {job_progress.stop_step}" if job_progress.stop_step else f"max_steps {job_max_steps(spec)}"
        reason = (
            f"the script kept training after gpuscout's helper answered stop ({where}; it reached step "
            f"{job_progress.step}) and was ended {STOP_GRACE_S:.0f} s later: end the loop when gs.step() returns "
            "True (docs/byo.md)"
        )
        return JobOutcome(JobStatus.STOPPED, benchmark, reason, wall, contention)
    completed = benchmark is not None and benchmark.status == "completed"
    # a job that ended as it was pruned finished: it exited 0, or its complete benchmark.json was written before the
    # stop reached it (the signal then cut its exit short); its measurement is whole
    # (a job that stopped itself on the runner's SIGTERM wrote a complete benchmark.json after the stop: not finished)
    stop = benchmark.stop if benchmark else None
    stopped_itself = stopped_by_signal(stop.reason if stop else None)
    finished = completed and not (stopped is not None and stopped_itself)
    finished = finished and (proc.returncode == 0 or (stopped is not None and not timed_out))
    if stopped is not None and not timed_out and not finished:
        return JobOutcome(JobStatus.PRUNED, benchmark, stopped, wall, contention)
    if stopped is None and stopped_itself:  # someone else's SIGTERM: what it measured is kept, but it did not finish
        reason = str(stop.reason if stop else None)
        return JobOutcome(JobStatus.STOPPED, benchmark, reason, wall, contention)
    if timed_out:
        reason = f"MaxRuntimeExceeded: stopped after {spec.max_runtime_seconds} s (max_runtime_seconds)"
        return JobOutcome(JobStatus.STOPPED, benchmark, reason, wall, contention)
    if finished:
        return JobOutcome(JobStatus.COMPLETED, benchmark, None, wall, contention)
    if benchmark is not None and benchmark.failure_reason:
        reason = benchmark.failure_reason
    elif unreadable:
        reason = unreadable
    else:
        tail = _failure_from_stderr(folders.stderr_log, folders.stdout_log)
        script = spec.job_code.entry_point if spec.job_code else "train.py"
        reason = f"{script} exited with code {proc.returncode}: {tail}"
    if says_disk_full(reason) or says_disk_full(job_progress.log_lost or ""):
        reason = f"{disk_full_at(folders.root)}: {reason}"
    return JobOutcome(_classify_failure(reason), benchmark, reason, wall, contention)


def _code_ignore(target: Path) -> Callable[[str, list[str]], set[str]]:
    """What a copy of the user's folder leaves out: caches, .git, and the folder the copy goes into (a runs folder
    inside source_dir would otherwise be copied into itself until the path is too long)."""
    plain = shutil.ignore_patterns("__pycache__", ".git", "*.pyc")
    inside = target.resolve()

    def ignore(directory: str, names: list[str]) -> set[str]:
        skipped = set(plain(directory, names))
        for name in names:
            path = (Path(directory) / name).resolve()
            if path == inside or path in inside.parents:
                skipped.add(name)
        return skipped

    return ignore


def job_code_command(spec: JobSpec, folders: JobFolders) -> tuple[list[str], Path, dict[str, str]]:
    """A job section's command, folder and environment: a copy of the user's folder in the job folder
    (``code/``, as SageMaker puts source_dir in /opt/ml/code), ``python ENTRY_POINT --key value ...`` with the
    variant's hyperparameters and the helper's GPUSCOUT_* settings (``import gpuscout_report`` resolves as gpuscout's
    own packages do)."""
    code = spec.job_code
    assert code is not None
    target = folders.root / "code"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(code.source_dir, target, ignore=_code_ignore(target))
    command = [sys.executable, code.entry_point]
    for key, value in spec.hyperparameters.items():
        command += [f"--{key}", value]
    env = folders.environment(spec) | code.environment | {"GPUSCOUT_ENTRY_POINT": code.entry_point}
    return command, target, env


def benchmark_from_log(spec: JobSpec, folders: JobFolders, env: Mapping[str, str]) -> None:
    """A job section's script that printed metric lines instead of calling the helper: the helper builds
    benchmark.json from its log (``python -m gpuscout_report --from-log``); its error, if any, lands in stderr."""
    if (folders.output_data / "benchmark.json").is_file():
        return
    command = [sys.executable, "-m", paths.REPORT_MODULE, "--from-log", str(folders.stdout_log)]
    with open(folders.stderr_log, "a", encoding="utf-8") as stderr:
        subprocess.run(command, env=child_env(env), stdout=stderr, stderr=stderr, check=False, timeout=120)


def _wait(
    proc: subprocess.Popen[str],
    spec: JobSpec,
    started: float,
    job_progress: JobProgress,
    on_progress: Callable[[JobProgress], None],
    *,
    should_stop: Callable[[JobProgress], str | None] | None,
    poll_interval_s: float,
    competing: Callable[[], bool] = lambda: False,
) -> str | None:
    """Wait for the job, reporting progress; stop it at max_runtime_seconds (returns TIMED_OUT), when
    ``should_stop`` gives a reason (returns it), or STOP_GRACE_S after a user's script was told to stop and went on
    (the helper's stop_step line, or a step past its max_steps: returns IGNORED_STOP). None: it ended by itself."""
    max_steps = job_max_steps(spec) if spec.job_code is not None else None
    overran_at: float | None = None
    while True:
        try:
            proc.wait(timeout=poll_interval_s)
            return None
        except subprocess.TimeoutExpired:
            pass
        on_progress(job_progress)
        if should_stop is not None and (why := should_stop(job_progress)):
            if not competing():  # a search never prunes on a contended measurement: the job runs on, flagged
                _stop(proc)
                return why
            job_progress.prune_withheld = why
        now = time.monotonic()
        if now - started > spec.max_runtime_seconds:
            _stop(proc)
            return TIMED_OUT
        if overran_at is None and max_steps is not None and (job_progress.step or 0) > max_steps:
            overran_at = now
        told = min(t for t in (job_progress.stop_seen_at, overran_at, math.inf) if t is not None)
        if spec.job_code is not None and now - told > STOP_GRACE_S:
            _stop(proc)
            return IGNORED_STOP


def _stop(proc: subprocess.Popen[str]) -> None:
    stop_process_group(proc, TERMINATE_GRACE_S)


def job_max_steps(spec: JobSpec) -> int | None:
    """The job's step budget: train.py's hyperparameter, or what the gpuscout_report helper gets (user's code)."""
    steps = int_or_none(spec.hyperparameters.get("max_steps"))
    if steps is None and spec.job_code is not None:
        steps = int_or_none(spec.job_code.environment.get("GPUSCOUT_MAX_STEPS"))
    return steps


def int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        return None


@dataclass(frozen=True)
class FolderLauncher:
    """The workflow's ``JobLauncher`` on this machine: each job in ``root/<place>/<job name>`` (``JobFolders``), its
    prepared data ``data_dir`` (none for a user's own script), run to its end by ``run_job`` (``on_progress`` and
    ``should_stop`` as there)."""

    root: Path
    data_dir: Path | None

    def folder(self, spec: JobSpec, place: str) -> Path:
        return self.root / place / spec.job_name

    def run(
        self,
        spec: JobSpec,
        place: str,
        *,
        on_progress: Callable[[JobProgress], None] = lambda _progress: None,
        should_stop: Callable[[JobProgress], str | None] | None = None,
    ) -> JobOutcome:
        folders = JobFolders.create(self.folder(spec, place), spec, self.data_dir)
        outcome = run_job(spec, folders, on_progress=on_progress, should_stop=should_stop)
        outcome.log = str(folders.stderr_log)
        return outcome
