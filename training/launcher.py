"""Container entry point: start train.py on every GPU of every host of a SageMaker training job.

Reads /opt/ml/input/config/resourceconfig.json (``current_host``, ``hosts``) and SM_NUM_GPUS. One process on a
CPU or single-GPU host runs train.py directly; otherwise ``torchrun`` starts one process per GPU with the first
host (in SageMaker's order) as the rendezvous master. Extra command-line arguments are handed to train.py, which
reads the hyperparameters itself (hyperparameters.json / SM_HPS).

Processes per host follow SageMaker's training toolkit (aws/sagemaker-training-toolkit, src/sagemaker_training/
runner.py ``_get_by_runner_type``): the number of GPUs, 1 on a CPU host, unless the hyperparameter
``sagemaker_mpi_num_of_processes_per_host`` says otherwise (train.py ignores ``sagemaker_*`` hyperparameters). On
one host the rendezvous is 127.0.0.1, as the toolkit's torchrun command has no ``--master_addr`` for one host
(torch_distributed.py ``_create_command``); on several, the first host.

The user's own code (a manifest's job section, docs/byo.md): when GPUSCOUT_ENTRY_POINT is set, the launcher runs
that script from the ``code`` input channel instead of train.py (``run_job_code``): it pip-installs
GPUSCOUT_REQUIREMENTS first, as SageMaker's toolkit does for a source directory, passes the hyperparameters as
``--key value`` arguments, sets the toolkit's SM_* variables the script may read (the image has no toolkit entry
point to set them), starts one process per GPU under torchrun (GPUSCOUT_DISTRIBUTION=per_gpu, the script joins the
process group) or one per host (single), forwards SIGTERM to it, and, when the script printed metric lines instead
of calling the gpuscout_report helper, builds benchmark.json from its output. A failure is written to
/opt/ml/output/failure, which SageMaker shows as the job's FailureReason.

GPUSCOUT_MASTER_ADDR / GPUSCOUT_MASTER_PORT replace the rendezvous address and port. SageMaker never sets them;
they let several "hosts" run on one machine (tests/training/test_multiprocess.py starts algo-1 and algo-2 on
localhost, where the name algo-1 does not resolve).
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

TRAIN_SCRIPT = Path(__file__).resolve().parent / "train.py"
REPORT_SCRIPT = Path(__file__).resolve().parent / "gpuscout_report.py"
CODE_CHANNEL_DIR = "/opt/ml/input/data/code"  # sagemaker_requests.CODE_CHANNEL
MASTER_PORT = 29500
SINGLE_HOST_MASTER = "127.0.0.1"  # torchrun's own default, which SageMaker's toolkit uses on one host
PROCESSES_PER_HOST_HP = "sagemaker_mpi_num_of_processes_per_host"  # the toolkit's name (params.py)

# The EFA/NCCL environment SageMaker's own PyTorch launcher sets before torchrun, from aws/sagemaker-training-toolkit
# (commit 3383937, 2025-09-19): src/sagemaker_training/torch_distributed.py, TorchDistributedRunner._setup. Without
# it, NCCL may fall back to TCP sockets and a multi-node benchmark measures the network, not the GPUs.
# FI_PROVIDER=efa: on every instance type whose catalog entry says "efa": true (configs/instances/<type>.json, which
# the image carries; uses_efa), not on a hand-kept copy of the toolkit's SM_EFA_NCCL_INSTANCES.
# FI_EFA_USE_DEVICE_RDMA=1, RDMAV_FORK_SAFE=1: on the toolkit's SM_EFA_RDMA_INSTANCES (src/sagemaker_training/
# __init__.py), kept as its list: the catalog says whether a type has EFA, not whether its EFA does device RDMA.
EFA_RDMA_INSTANCES = frozenset({"ml.p4d.24xlarge", "ml.p4de.24xlarge", "ml.trn1.32xlarge", "ml.p6e-gb200.36xlarge"})


@dataclass(frozen=True)
class Topology:
    hosts: list[str]
    current_host: str
    gpus_per_host: int
    instance_type: str | None = None  # resourceconfig.json current_instance_type
    network_interface: str = "eth0"  # resourceconfig.json network_interface_name (SageMaker's default: eth0)
    processes_override: int | None = None  # hyperparameter sagemaker_mpi_num_of_processes_per_host

    @property
    def node_rank(self) -> int:
        return self.hosts.index(self.current_host)

    @property
    def processes_per_host(self) -> int:
        return self.processes_override or max(1, self.gpus_per_host)

    @property
    def world_size(self) -> int:
        return len(self.hosts) * self.processes_per_host


def read_hyperparameters(config_dir: Path, env: Mapping[str, str]) -> dict[str, object]:
    """hyperparameters.json, then SM_HPS over it (as train.py merges them)."""
    raw: dict[str, object] = {}
    hp_file = config_dir / "hyperparameters.json"
    try:
        if hp_file.is_file():
            raw.update(json.loads(hp_file.read_text()))
        if env.get("SM_HPS"):
            raw.update(json.loads(env["SM_HPS"]))
    except (ValueError, TypeError) as err:
        raise TrainingError(f"{hp_file} / SM_HPS: unreadable hyperparameters ({err})") from err
    return raw


def _processes_per_host(config_dir: Path, env: Mapping[str, str]) -> int | None:
    """sagemaker_mpi_num_of_processes_per_host from the hyperparameters."""
    raw = read_hyperparameters(config_dir, env)
    if PROCESSES_PER_HOST_HP not in raw:
        return None
    value = raw[PROCESSES_PER_HOST_HP]
    text = str(value).strip()
    if len(text) >= 2 and text[0] == text[-1] == '"':  # the SageMaker SDK JSON-encodes hyperparameter values
        text = text[1:-1]
    if not text.isdigit() or int(text) < 1:
        raise TrainingError(f"{PROCESSES_PER_HOST_HP}={value!r} is not a positive whole number")
    return int(text)


def read_topology(environ: Mapping[str, str] | None = None) -> Topology:
    env = os.environ if environ is None else environ
    config_dir = Path(env.get("SM_INPUT_CONFIG_DIR", "/opt/ml/input/config"))
    resource_file = config_dir / "resourceconfig.json"
    if resource_file.is_file():
        try:
            data = json.loads(resource_file.read_text())
            hosts = [str(h) for h in data["hosts"]]
            current = str(data["current_host"])
            instance_type = data.get("current_instance_type")
            interface = str(data.get("network_interface_name") or "eth0")
        except (ValueError, KeyError, TypeError) as err:
            raise TrainingError(f"{resource_file}: unreadable resource config ({err})") from err
        if current not in hosts:
            raise TrainingError(f"{resource_file}: current_host {current!r} is not in hosts {hosts}")
    else:  # outside SageMaker (gpuscout local): one host
        hosts, current, instance_type, interface = ["localhost"], "localhost", None, "eth0"
    if "SM_NUM_GPUS" in env:
        gpus = int(env["SM_NUM_GPUS"])
    else:
        import torch

        gpus = torch.cuda.device_count()
    return Topology(
        hosts=hosts,
        current_host=current,
        gpus_per_host=gpus,
        instance_type=str(instance_type) if instance_type else None,
        network_interface=interface,
        processes_override=_processes_per_host(config_dir, env),
    )


def uses_efa(instance_type: str | None) -> bool:
    """Whether the instance type has EFA, as its catalog entry says (configs/instances/<type>.json ``efa``).

    A type the catalog does not know (or a catalog that cannot be read) counts as no EFA, with a line in the job's
    log, instead of failing the job: gpuscout itself launches catalogued types only (a manifest's targets are checked
    against the catalog before anything runs), so this is the image run by hand on another type. Left unset,
    FI_PROVIDER only stops forcing libfabric's EFA provider: the job runs, at worst over a slower transport, and the
    log says why. The toolkit's own list is not kept as a fallback: it is the hand-kept copy this replaces, and it
    had already gone stale (it predates P5e/P5en).
    """
    if instance_type is None:  # outside SageMaker (no resourceconfig.json current_instance_type)
        return False
    from gpuscout import paths
    from gpuscout.domain.catalog import load_instance
    from gpuscout.errors import CatalogError

    try:  # the type's own file: the price snapshot has nothing to do with the network
        instance = load_instance(instance_type)
    except CatalogError as err:
        print(
            f"[launcher] no EFA settings for {instance_type}: the instance catalog cannot be read ({err})", flush=True
        )
        return False
    if instance is None:
        print(
            f"[launcher] {instance_type} is not in the instance catalog ({paths.CONFIG_DIR / 'instances'}): treated "
            "as having no EFA (FI_PROVIDER left unset)",
            flush=True,
        )
        return False
    return instance.efa


def distributed_environment(topology: Topology) -> dict[str, str]:
    """The variables SageMaker's PyTorch launcher sets for a torchrun job (see EFA_RDMA_INSTANCES)."""
    env = {"NCCL_SOCKET_IFNAME": topology.network_interface, "NCCL_PROTO": "simple"}
    if uses_efa(topology.instance_type):
        env["FI_PROVIDER"] = "efa"
    if topology.instance_type in EFA_RDMA_INSTANCES:
        env["FI_EFA_USE_DEVICE_RDMA"] = "1"
        env["RDMAV_FORK_SAFE"] = "1"
    return env


def rendezvous(topology: Topology, environ: Mapping[str, str] | None = None) -> tuple[str, int]:
    """torchrun's master address and port: 127.0.0.1 on one host, else the first host; GPUSCOUT_MASTER_* win."""
    env = os.environ if environ is None else environ
    default = SINGLE_HOST_MASTER if len(topology.hosts) == 1 else topology.hosts[0]
    address = env.get("GPUSCOUT_MASTER_ADDR") or default
    try:
        port = int(env.get("GPUSCOUT_MASTER_PORT") or MASTER_PORT)
    except ValueError as err:
        raise TrainingError(f"GPUSCOUT_MASTER_PORT={env['GPUSCOUT_MASTER_PORT']!r} is not a port number") from err
    return address, port


def build_command(
    topology: Topology,
    train_args: Sequence[str],
    python: str = sys.executable,
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    """The command this host runs: train.py itself, or torchrun around it."""
    if len(topology.hosts) == 1 and topology.processes_per_host == 1:
        return [python, str(TRAIN_SCRIPT), *train_args]
    address, port = rendezvous(topology, environ)
    return [
        python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={len(topology.hosts)}",
        f"--node_rank={topology.node_rank}",
        f"--nproc_per_node={topology.processes_per_host}",
        f"--master_addr={address}",
        f"--master_port={port}",
        str(TRAIN_SCRIPT),
        *train_args,
    ]


# -- the user's own code (a job section) ----------------------------------------------------------------------------


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
    training_dir = Path(__file__).resolve().parent
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
    # the helper (gpuscout_report, benchmark_callback) and gpuscout's stdlib modules, then the user's folder
    path = [str(code.code_dir), str(training_dir), str(training_dir.parent), env.get("PYTHONPATH", "")]
    out["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    return out


def build_job_code_command(
    topology: Topology,
    code: JobCode,
    args: Sequence[str],
    python: str = sys.executable,
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    """``python ENTRY_POINT args`` on one process, else torchrun around it (build_command's rules)."""
    if code.distribution == "single":
        topology = Topology(**{**topology.__dict__, "processes_override": 1})
    script = str(code.code_dir / code.entry_point)
    command = build_command(topology, args, python=python, environ=environ)
    return [*command[: command.index(str(TRAIN_SCRIPT))], script, *args]


def _failure_file(env: Mapping[str, str]) -> Path:
    return Path(env.get("SM_OUTPUT_DATA_DIR", "/opt/ml/output/data")).parent / "failure"


def _write_failure(env: Mapping[str, str], reason: str) -> None:
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
    pins = Path(__file__).resolve().parent / "requirements.txt"
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
        _write_failure(env, failure_reason(code.entry_point, status, stderr_tail))
        return 128 - status if status < 0 else status
    if topology.node_rank != 0 or (output / "benchmark.json").is_file():
        return 0
    if topology.world_size > 1:  # every rank's lines are interleaved in one log: they cannot be told apart
        reason = (
            f"no benchmark.json from {topology.world_size} processes; metric lines are read for one process "
            "only: call the gpuscout_report helper (gs.step, rank 0 writes) or set job.distribution: single"
        )
        print(f"launcher: error: {reason}", file=sys.stderr, flush=True)
        _write_failure(env, reason)
        return 1
    # no benchmark.json: the script printed metric lines (docs/byo.md); the helper builds it from them
    log.seek(0)
    with tempfile.NamedTemporaryFile("w", suffix=".log", encoding="utf-8", delete=False) as copy:
        shutil.copyfileobj(log, copy)
    try:
        built = subprocess.run(
            [sys.executable, str(REPORT_SCRIPT), "--from-log", copy.name], env=env, capture_output=True,
            text=True, check=False,
        )  # fmt: skip
    finally:
        os.unlink(copy.name)
    if built.returncode != 0:
        reason = built.stderr.strip().splitlines()[-1] if built.stderr.strip() else "no benchmark.json"
        print(reason, file=sys.stderr, flush=True)
        _write_failure(env, f"{code.entry_point} finished without a benchmark: {reason}")
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["train"]:  # SageMaker starts training containers as `docker run IMAGE train`
        args = args[1:]
    try:
        code = JobCode.from_environment(os.environ)
        if code is not None:
            topology = read_topology()
            config_dir = Path(os.environ.get("SM_INPUT_CONFIG_DIR", "/opt/ml/input/config"))
            hyperparameters = read_hyperparameters(config_dir, os.environ)
            env = {**os.environ, **sagemaker_environment(topology, code, os.environ, hyperparameters)}
            if topology.processes_per_host > 1 or len(topology.hosts) > 1:
                for key, value in distributed_environment(topology).items():
                    env.setdefault(key, value)
            return run_job_code(topology, code, [*script_arguments(hyperparameters), *args], env)
    except TrainingError as err:
        print(f"launcher: error: {err}", file=sys.stderr, flush=True)
        _write_failure(os.environ, str(err))
        return 2
    try:
        topology = read_topology()
        command = build_command(topology, args)
    except TrainingError as err:
        print(f"launcher: error: {err}", file=sys.stderr, flush=True)
        return 2
    if command[1:3] == ["-m", "torch.distributed.run"] and topology.current_host != "localhost":
        for key, value in distributed_environment(topology).items():
            os.environ.setdefault(key, value)  # a value the user set in the job's Environment wins
    print(
        f"[launcher] host {topology.current_host} ({topology.node_rank + 1}/{len(topology.hosts)}): {' '.join(command)}"
    )
    sys.stdout.flush()
    os.execv(command[0], command)  # replaces this process; exit status is train.py's / torchrun's
    return 0  # pragma: no cover - execv does not return


if __name__ == "__main__":
    sys.exit(main())
