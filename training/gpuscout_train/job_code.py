"""The user's own code (a manifest's job section, docs/byo.md), run by the image's launcher instead of train.py.

When GPUSCOUT_ENTRY_POINT is set, the launcher runs that script from the ``code`` input channel (``run_job_code``):
it pip-installs GPUSCOUT_REQUIREMENTS first, as SageMaker's toolkit does for a source directory, passes the
hyperparameters as ``--key value`` arguments, sets the toolkit's SM_* variables the script may read (the image has no
toolkit entry point to set them), starts one process per GPU under torchrun (GPUSCOUT_DISTRIBUTION=per_gpu, the
script joins the process group) or one per host (single), forwards SIGTERM to it, and, when the script printed
metric lines instead of calling the gpuscout_report helper, builds benchmark.json from its output. A failure is
written to /opt/ml/output/failure, which SageMaker shows as the job's FailureReason.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

from gpuscout.errors import TrainingError

from .topology import Topology, process_command

CODE_CHANNEL_DIR = "/opt/ml/input/data/code"  # sagemaker_requests.CODE_CHANNEL
IMAGE_REQUIREMENTS = Path(__file__).resolve().parents[1] / "requirements.txt"  # training/requirements.txt


@dataclass(frozen=True)
class JobCode:
    entry_point: str  # relative to code_dir
    code_dir: Path
    requirements: str | None
    distribution: str  # per_gpu | single

    @classmethod
    def from_environment(cls, env: Mapping[str, str]) -> JobCode | None:
        entry = env.get("GPUSCOUT_ENTRY_POINT")
        if not entry:
            return None
        distribution = env.get("GPUSCOUT_DISTRIBUTION", "per_gpu")
        if distribution not in ("per_gpu", "single"):
            raise TrainingError(f"GPUSCOUT_DISTRIBUTION={distribution!r}: per_gpu or single")
        code_dir = Path(env.get("SM_CHANNEL_CODE") or CODE_CHANNEL_DIR)
        code = cls(entry, code_dir, env.get("GPUSCOUT_REQUIREMENTS") or None, distribution)
        for name in filter(None, (code.entry_point, code.requirements)):
            if not (code_dir / name).is_file():
                raise TrainingError(f"{name}: no such file in the code channel {code_dir}")
        return code


def script_arguments(hyperparameters: Mapping[str, object]) -> list[str]:
    """``--key value`` for every hyperparameter but SageMaker's own ``sagemaker_*`` ones."""
    args: list[str] = []
    for key, value in hyperparameters.items():
        if not key.startswith("sagemaker_"):
            args += [f"--{key}", str(value)]
    return args


def sagemaker_environment(
    topology: Topology, code: JobCode, env: Mapping[str, str], hyperparameters: Mapping[str, object]
) -> dict[str, str]:
    """The SageMaker training toolkit's variables a script may read (sagemaker-training-toolkit, environment.py),
    for what gpuscout's jobs have: hosts, GPUs, channels, output folders, hyperparameters; each only when unset."""
    ml = Path("/opt/ml")
    config_dir = Path(env.get("SM_INPUT_CONFIG_DIR", ml / "input" / "config"))
    values = {
        "SM_HOSTS": json.dumps(topology.hosts),
        "SM_CURRENT_HOST": topology.current_host,
        "SM_NUM_GPUS": str(topology.gpus_per_host),
        "SM_CURRENT_INSTANCE_TYPE": topology.instance_type or "local",
        "SM_INPUT_CONFIG_DIR": str(config_dir),
        "SM_OUTPUT_DATA_DIR": str(ml / "output" / "data"),
        "SM_MODEL_DIR": str(ml / "model"),
        "SM_CHANNEL_CODE": str(code.code_dir),
        "SM_HPS": json.dumps(dict(hyperparameters)),
        "SM_USER_ENTRY_POINT": code.entry_point,
    }
    out = {key: env.get(key) or value for key, value in values.items()}
    # the user's folder, for the processes torchrun starts; gpuscout_report resolves the way gpuscout_train did
    path = [str(code.code_dir), env.get("PYTHONPATH", "")]
    out["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    return out


def build_job_code_command(
    topology: Topology,
    code: JobCode,
    args: Sequence[str],
    python: str = sys.executable,
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    """``python ENTRY_POINT args`` on one process, else torchrun around it (process_command's rules)."""
    if code.distribution == "single":
        topology = Topology(**{**topology.__dict__, "processes_override": 1})
    script = str(code.code_dir / code.entry_point)
    return process_command(topology, [script, *args], python=python, environ=environ)


def _failure_file(env: Mapping[str, str]) -> Path:
    return Path(env.get("SM_OUTPUT_DATA_DIR", "/opt/ml/output/data")).parent / "failure"


def write_failure(env: Mapping[str, str], reason: str) -> None:
    """SageMaker reads /opt/ml/output/failure into the job's FailureReason (kept short: the API truncates it)."""
    try:
        path = _failure_file(env)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():  # the script's own (more specific) reason wins
            path.write_text(reason[:FAILURE_MAX_CHARS])
    except OSError:
        pass


_CHILDREN: list[subprocess.Popen[str]] = []  # the process this launcher waits on now (pip, then the script)
TEE_DRAIN_S = 30.0  # after the script exits, how long its output may still be read (a descendant may hold the pipe)
FAILURE_MAX_CHARS = 1000  # of /opt/ml/output/failure; SageMaker's FailureReason holds at most 1,024
STDERR_TAIL_LINES = 5  # of the script's stderr in the failure reason
STDERR_KEEP_LINES = 200  # kept while the script runs: torchrun's report of a failed worker comes after its traceback
# torchrun's (the elastic agent's) own glog-style log lines, e.g. "E1123 18:56:34.245000 14000 .../torch/distributed/
# elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 ..."
_ELASTIC_LOG = re.compile(r"^[EWI]\d{4} [\d:.]+ +\d+ .*torch[/\\]distributed[/\\]elastic[/\\]")


def _forward(signum: int, _frame: FrameType | None) -> None:
    """SageMaker's SIGTERM (StopTrainingJob, MaxRuntime) to PID 1, passed to the child's process group (torchrun
    passes it on to its workers); with no child yet, the launcher itself ends as SIGTERM would end it."""
    if not _CHILDREN:
        raise SystemExit(128 + signum)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(_CHILDREN[-1].pid, signum)


def _start(command: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
    child = subprocess.Popen(list(command), start_new_session=True, text=True, **kwargs)
    _CHILDREN.append(child)
    return child


def install_requirements(code: JobCode, python: str = sys.executable) -> None:
    """``pip install -r`` the job's requirements, constrained to the image's own pins (training/requirements.txt) so
    a requirement cannot swap the torch or transformers the benchmark is meant to measure."""
    if code.requirements is None:
        return
    command = [python, "-m", "pip", "install", "--disable-pip-version-check", "-r", code.requirements]
    pins = IMAGE_REQUIREMENTS
    if pins.is_file():
        command += ["-c", str(pins)]
    print(f"[launcher] {' '.join(command)}", flush=True)
    status = _start(command, cwd=code.code_dir).wait()
    if status != 0:
        raise TrainingError(f"pip install -r {code.requirements} failed (exit {status}); see the job log")


def _tee(stream: Iterable[str], log: IO[str]) -> None:
    for line in stream:
        sys.stdout.write(line)
        sys.stdout.flush()
        log.write(line)


def _tee_stderr(stream: Iterable[str], tail: deque[str]) -> None:
    """The script's stderr, passed through to the job log as it comes; its last lines kept for the failure reason."""
    for line in stream:
        sys.stderr.write(line)
        sys.stderr.flush()
        if line.strip():
            tail.append(line.rstrip())


def script_lines(stderr_tail: Sequence[str]) -> list[str]:
    """The script's own stderr lines: under torchrun, its report of the failed worker (from the elastic agent's
    "failed (exitcode" log line on: its traceback and the Root Cause box) and its other log lines are left out, so
    the last lines are the script's traceback."""
    lines = list(stderr_tail)
    for i, line in enumerate(lines):
        if _ELASTIC_LOG.match(line) and "failed (exitcode" in line:
            lines = lines[:i]
            break
    return [line for line in lines if not _ELASTIC_LOG.match(line)]


def failure_reason(entry_point: str, status: int, stderr_tail: Sequence[str]) -> str:
    """What SageMaker shows as the job's FailureReason: how the script ended and the end of its stderr (a Python
    traceback's last lines name the error), within FAILURE_MAX_CHARS with the end kept."""
    what = f"was killed by signal {-status}" if status < 0 else f"exited with code {status}"
    reason = f"{entry_point} {what}"
    lines = script_lines(stderr_tail)
    if not lines:
        return reason
    room = FAILURE_MAX_CHARS - len(reason) - len("; stderr: ")
    text = " | ".join(lines[-STDERR_TAIL_LINES:])
    if len(text) > room:
        text = "..." + text[-(room - 3) :]
    return f"{reason}; stderr: {text}"


def run_job_code(topology: Topology, code: JobCode, args: Sequence[str], env: dict[str, str]) -> int:
    """Run the user's script (module docstring) and return its exit status (or 1 when its result is unusable)."""
    previous = {sig: signal.signal(sig, _forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        install_requirements(code)
        command = build_job_code_command(topology, code, args, environ=env)
        print(f"[launcher] host {topology.current_host}: {' '.join(command)}", flush=True)
        with tempfile.TemporaryFile("w+", encoding="utf-8") as log:
            child = _start(command, cwd=code.code_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           encoding="utf-8", errors="replace", bufsize=1)  # fmt: skip
            assert child.stdout is not None and child.stderr is not None
            tail: deque[str] = deque(maxlen=STDERR_KEEP_LINES)
            readers = [threading.Thread(target=_tee, args=(child.stdout, log), daemon=True),
                       threading.Thread(target=_tee_stderr, args=(child.stderr, tail), daemon=True)]  # fmt: skip
            for reader in readers:
                reader.start()
            status = child.wait()
            deadline = time.monotonic() + TEE_DRAIN_S  # a descendant still holding a pipe must not hang the job
            for reader in readers:
                reader.join(timeout=max(0.0, deadline - time.monotonic()))
            log.flush()
            return _finish(topology, code, env, status, log, stderr_tail=list(tail))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _finish(
    topology: Topology, code: JobCode, env: dict[str, str], status: int, log: IO[str], *, stderr_tail: Sequence[str]
) -> int:
    """The job's exit status from the script's: a failure reason for SageMaker, benchmark.json from metric lines."""
    output = Path(env["SM_OUTPUT_DATA_DIR"])
    if status != 0:
        write_failure(env, failure_reason(code.entry_point, status, stderr_tail))
        return 128 - status if status < 0 else status
    if topology.node_rank != 0 or (output / "benchmark.json").is_file():
        return 0
    if topology.world_size > 1:  # every rank's lines are interleaved in one log: they cannot be told apart
        reason = (
            f"no benchmark.json from {topology.world_size} processes; metric lines are read for one process "
            "only: call the gpuscout_report helper (gs.step, rank 0 writes) or set job.distribution: single"
        )
        print(f"launcher: error: {reason}", file=sys.stderr, flush=True)
        write_failure(env, reason)
        return 1
    # no benchmark.json: the script printed metric lines (docs/byo.md); the helper builds it from them
    log.seek(0)
    with tempfile.NamedTemporaryFile("w", suffix=".log", encoding="utf-8", delete=False) as copy:
        shutil.copyfileobj(log, copy)
    try:
        built = subprocess.run(
            [sys.executable, "-m", "gpuscout_report", "--from-log", copy.name], env=env, capture_output=True,
            text=True, check=False,
        )  # fmt: skip
    finally:
        os.unlink(copy.name)
    if built.returncode != 0:
        reason = built.stderr.strip().splitlines()[-1] if built.stderr.strip() else "no benchmark.json"
        print(reason, file=sys.stderr, flush=True)
        write_failure(env, f"{code.entry_point} finished without a benchmark: {reason}")
        return 1
    return 0
