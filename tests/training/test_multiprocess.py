"""The real launcher under a SageMaker-shaped environment, several processes, CPU and gloo.

Each job gets the folder tree and the variables a SageMaker training container has (opt/ml/input/config with
hyperparameters.json and resourceconfig.json, SM_* as the training toolkit sets them) and runs
``python -m gpuscout_train.launcher train``, as the image's ENTRYPOINT does. The launcher starts torchrun, torchrun
starts the ranks. Every job runs under a deadline: a hang kills every process of the job and fails the test.

A "kill" is a spot interruption: every process of the job gets SIGKILL at once (torchrun starts each rank in a
session of its own, so the launcher's process group alone is not the whole job; the job's processes are found by a
marker variable they all inherit).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from gpuscout_data import dataset as ds

from gpuscout.domain.benchmark import BenchmarkResult
from gpuscout.paths import TRAIN_MODULE
from tests.sagemaker_job import IMAGE_PYTHONPATH, LAUNCHER_COMMAND

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds a job's processes in /proc")

JOB_TIMEOUT_S = 150  # one launch; the slowest (ZeRO-3, 2 ranks, 12 steps) takes ~20 s on 2 busy cores
MAX_STEPS = 12
# ZeRO-2/3 run on CPU with gloo (DeepSpeed's CPU accelerator, fp32, torch AdamW): the same engine code as on GPUs.

# 8 train blocks, 6 validation blocks of 64 tokens. Batch 2 on 2 ranks: validation rounds of 4 blocks, so rank 0
# has blocks 0-1 and 4-5 and rank 1 only 2-3 (its second forward has no batch of its own): an uneven split.
HPS = {
    "run_id": "r-mp",
    "job_name": "gs-mp",
    "instance_type": "ml.c5.xlarge",
    "model_preset": "qwen2-tiny",
    "per_device_train_batch_size": "2",
    "gradient_accumulation_steps": "1",
    "max_steps": str(MAX_STEPS),
    "warmup_steps": "3",
    "learning_rate": "0.003",
    "seed": "7",
    "precision": "auto",
    "packing": "true",
    "eval_interval": "4",
    "checkpoint_interval": "4",
    "validation_batches": "4",
    "sagemaker_program": "launcher.py",  # SageMaker's own; train.py ignores sagemaker_* names
}
STEADY_STATE = {"stop_rule": "steady_state", "max_steps": "40", "min_timed_steps": "5", "ci_tolerance": "0.9",
                "eval_interval": "0", "checkpoint_interval": "0"}  # fmt: skip


@pytest.fixture(scope="module")
def dataset(dataset: Path) -> Path:
    """The training tests' dataset (conftest), whose split the uneven-validation cases below rely on."""
    out = dataset
    summary = ds.load_summary(out)
    assert (summary.splits["train"].blocks, summary.splits["validation"].blocks) == (8, 6)  # the split above
    return out


# DeepSpeed prints this op's name whenever a CPU process loads (or first compiles) its shared-memory collectives;
# train.py keeps them off (deepspeed_collectives_through_torch)
SHM_OP = "deepspeed_shm_comm"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------- one SageMaker host


@dataclass
class Host:
    """One SageMaker training container's folders and environment, under ``root``."""

    root: Path
    dataset: Path
    hosts: list[str]
    current_host: str
    hyperparameters: dict[str, str]
    extra_env: dict[str, str] = field(default_factory=dict)
    marker: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def config(self) -> Path:
        return self.root / "opt/ml/input/config"

    @property
    def output_data(self) -> Path:
        return self.root / "opt/ml/output/data"

    @property
    def checkpoints(self) -> Path:
        return self.root / "opt/ml/checkpoints"

    @property
    def log(self) -> Path:
        return self.root / "launcher.log"

    def write_config(self) -> None:
        """What SageMaker writes before the container starts."""
        self.config.mkdir(parents=True, exist_ok=True)
        (self.config / "hyperparameters.json").write_text(json.dumps(self.hyperparameters))
        resource = {"current_host": self.current_host, "hosts": self.hosts, "network_interface_name": "lo"}
        (self.config / "resourceconfig.json").write_text(json.dumps(resource))
        channels = {"train": {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated"}}
        (self.config / "inputdataconfig.json").write_text(json.dumps(channels))

    def environment(self) -> dict[str, str]:
        """The SM_* variables SageMaker's training toolkit sets (environment.py to_env_vars), on a CPU host."""
        user_hps = {k: v for k, v in self.hyperparameters.items() if not k.startswith("sagemaker_")}
        framework = {k: v for k, v in self.hyperparameters.items() if k.startswith("sagemaker_")}
        cpus = os.cpu_count() or 1
        opt_ml = self.root / "opt/ml"
        training_env = {
            "hosts": self.hosts, "current_host": self.current_host, "num_gpus": 0, "num_cpus": cpus,
            "hyperparameters": user_hps, "additional_framework_parameters": framework, "network_interface_name": "lo",
            "channel_input_dirs": {"train": str(self.dataset)}, "output_data_dir": str(self.output_data),
            "model_dir": str(opt_ml / "model"), "input_config_dir": str(self.config),
            "job_name": self.hyperparameters.get("job_name", "gs-mp"),
        }  # fmt: skip
        keep = {k: v for k, v in os.environ.items() if not k.startswith(("SM_", "GPUSCOUT_", "RANK", "WORLD_SIZE"))}
        keep = {k: v for k, v in keep.items() if k not in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        return {
            **keep,
            "SM_HOSTS": json.dumps(self.hosts),
            "SM_CURRENT_HOST": self.current_host,
            "SM_NUM_GPUS": "0",
            "SM_NUM_CPUS": str(cpus),
            "SM_NETWORK_INTERFACE_NAME": "lo",
            "SM_CHANNELS": json.dumps(["train"]),
            "SM_CHANNEL_TRAIN": str(self.dataset),
            "SM_INPUT_DIR": str(opt_ml / "input"),
            "SM_INPUT_CONFIG_DIR": str(self.config),
            "SM_OUTPUT_DIR": str(opt_ml / "output"),
            "SM_OUTPUT_DATA_DIR": str(self.output_data),
            "SM_MODEL_DIR": str(opt_ml / "model"),
            "SM_HPS": json.dumps(user_hps),
            "SM_FRAMEWORK_PARAMS": json.dumps(framework),
            "SM_TRAINING_ENV": json.dumps(training_env),
            "GPUSCOUT_CHECKPOINT_DIR": str(self.checkpoints),
            "PYTHONPATH": IMAGE_PYTHONPATH,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "GPUSCOUT_TEST_JOB": self.marker,  # every process of this job inherits it (see kill)
            **self.extra_env,
        }

    def start(self) -> subprocess.Popen[bytes]:
        """``docker run IMAGE train``: the ENTRYPOINT ``python -m gpuscout_train.launcher`` with the argument
        ``train``."""
        self.write_config()
        with self.log.open("ab") as log:
            return subprocess.Popen(
                [sys.executable, *LAUNCHER_COMMAND, "train"], cwd=self.root, env=self.environment(),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def processes(self) -> list[int]:
        """Every live process of this job: the launcher (torchrun after execv), its agent and all the ranks."""
        needle = f"GPUSCOUT_TEST_JOB={self.marker}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if needle in (entry / "environ").read_bytes().split(b"\0"):
                        pids.append(int(entry.name))
                except OSError:  # gone, or not ours
                    continue
        return pids

    def kill(self) -> None:
        """SIGKILL the whole job at once, as a spot interruption stops the container."""
        for _ in range(50):
            pids = self.processes()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):  # it ended between the look and the kill
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        raise AssertionError(f"processes of {self.root} survive SIGKILL: {self.processes()}")

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else "(no log)"

    def result(self) -> BenchmarkResult:
        return BenchmarkResult.model_validate_json((self.output_data / "benchmark.json").read_text())

    def complete_checkpoints(self) -> list[int]:
        return sorted(int(p.name.split("-")[1]) for p in self.checkpoints.glob("step-*") if (p / "complete").is_file())


@dataclass
class Job:
    """A training job of one or more hosts, each its own launcher process."""

    hosts: list[Host]

    def run(self, timeout_s: float = JOB_TIMEOUT_S) -> None:
        """Start every host, wait for all; a deadline kills every process of the job and fails the test."""
        procs = [h.start() for h in self.hosts]
        try:
            deadline = time.monotonic() + timeout_s
            for host, proc in zip(self.hosts, procs, strict=True):
                try:
                    code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"{host.current_host} hung (> {timeout_s} s):\n{self.tails()}") from None
                assert code == 0, f"{host.current_host} exited {code}:\n{self.tails()}"
        finally:
            self.kill()

    def run_until_checkpoint_then_kill(self, timeout_s: float = JOB_TIMEOUT_S) -> list[int]:
        """Start, SIGKILL every process as soon as the first checkpoint is complete; the exit codes."""
        procs = [h.start() for h in self.hosts]
        main = self.hosts[0]  # rank 0 writes the checkpoint's `complete` marker
        try:
            deadline = time.monotonic() + timeout_s
            while not main.complete_checkpoints():
                if time.monotonic() > deadline:
                    raise AssertionError(f"no checkpoint within {timeout_s} s:\n{main.tail()}")
                if any(p.poll() is not None for p in procs):
                    raise AssertionError(f"ended before its first checkpoint:\n{main.tail()}")
                time.sleep(0.01)
            self.kill()
            return [p.wait(timeout=30) for p in procs]
        finally:
            self.kill()

    def kill(self) -> None:
        for host in self.hosts:
            host.kill()

    def tails(self) -> str:
        """Every host's log end: one host's failure often shows as another's hang (torchrun's exit barrier)."""
        return "\n".join(f"--- {h.current_host}:\n{h.tail(2500)}" for h in self.hosts)


def one_host(root: Path, dataset: Path, hps: dict[str, str], processes: int = 2) -> Job:
    hyperparameters = dict(hps)
    if processes > 1:  # SageMaker's processes-per-host hyperparameter: 2 ranks on a CPU host
        hyperparameters["sagemaker_mpi_num_of_processes_per_host"] = str(processes)
    # the rendezvous port is free now (29500 may be taken on a shared machine); the address stays the launcher's
    host = Host(root, dataset, ["algo-1"], "algo-1", hyperparameters, {"GPUSCOUT_MASTER_PORT": str(free_port())})
    return Job([host])


def two_hosts(root: Path, dataset: Path, hps: dict[str, str]) -> Job:
    """algo-1 and algo-2 on this machine, one rank each, each with its own folders (as two containers have)."""
    names = ["algo-1", "algo-2"]
    env = {"GPUSCOUT_MASTER_ADDR": "127.0.0.1", "GPUSCOUT_MASTER_PORT": str(free_port())}  # algo-1 does not resolve
    return Job([Host(root / name, dataset, names, name, dict(hps), dict(env)) for name in names])


def losses(result: BenchmarkResult) -> tuple[dict[int, float], dict[int, float]]:
    assert result.loss is not None
    return {p.step: p.loss for p in result.loss.train}, {p.step: p.loss for p in result.loss.validation}


# ---------------------------------------------------------------- the tests

VARIANTS = [
    pytest.param({}, id="ddp"),
    pytest.param({"deepspeed_stage": "2"}, id="zero2"),
    pytest.param({"deepspeed_stage": "3"}, id="zero3"),
]


@pytest.fixture
def cleanup() -> Iterator[list[Job]]:
    """Jobs a test started; whatever happens (a pytest-timeout included), none of their processes outlives it."""
    jobs: list[Job] = []
    yield jobs
    for job in jobs:
        job.kill()


@pytest.fixture(scope="module")
def one_host_losses() -> dict[str, Any]:
    """Losses of the uninterrupted 2-rank one-host run of HPS, kept by the first test that runs it for the next one
    that compares against it (each such run costs two train.py start-ups on a 2-core machine)."""
    return {}


@pytest.mark.slow(seconds=60)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", VARIANTS)
def test_two_ranks_validate_checkpoint_survive_a_kill_and_resume_identically(
    dataset: Path,
    tmp_path: Path,
    variant: dict[str, str],
    cleanup: list[Job],
    one_host_losses: dict[str, Any],
) -> None:
    hps = {**HPS, **variant}
    # Given one SageMaker CPU host whose launcher starts 2 gloo ranks, When the job runs uninterrupted
    full = one_host(tmp_path / "full", dataset, hps)
    cleanup.append(full)
    full.run()
    reference = full.hosts[0].result()
    # Then both ranks train to the end, validating on the uneven split every 4 steps and at the end
    assert reference.status == "completed" and reference.hardware.world_size == 2
    assert reference.config.global_batch_size == 4
    assert reference.config.deepspeed_stage == int(variant.get("deepspeed_stage", "0"))
    full_log = full.hosts[0].log.read_text()
    assert SHM_OP not in full_log  # ZeRO's collectives are gloo's, as NCCL's on a GPU
    # torch's deprecation of a collective ZeRO calls is printed at most once per rank and message, not on every call
    # (ZeRO-3 printed it 538 times before train_model set LOCAL_SIZE on a CPU)
    assert full_log.count(" is deprecated") <= 2 * 2
    train_ref, val_ref = losses(reference)
    if not variant:
        one_host_losses["HPS"] = (train_ref, val_ref)
    assert sorted(train_ref) == list(range(1, MAX_STEPS + 1)) and sorted(val_ref) == [4, 8, 12]
    assert full.hosts[0].complete_checkpoints() == [8, 12]  # the last two are kept

    # Given the same job, When every process is killed right after its first checkpoint and the job starts again
    spot = one_host(tmp_path / "spot", dataset, hps)
    cleanup.append(spot)
    codes = spot.run_until_checkpoint_then_kill()
    assert codes == [-signal.SIGKILL], spot.hosts[0].tail()
    assert not (spot.hosts[0].output_data / "benchmark.json").exists()  # it did not finish
    spot.hosts[0].log.rename(spot.hosts[0].root / "killed.log")
    spot.run()
    # Then it resumes from a checkpoint before the end and its losses equal the uninterrupted run's, step by step
    resumed = spot.hosts[0].result()
    assert resumed.stop is not None and resumed.stop.resumed_from_step in (4, 8)
    assert "resumed from" in spot.hosts[0].log.read_text()
    train_again, val_again = losses(resumed)
    assert sorted(train_again) == list(range(1, MAX_STEPS + 1))
    assert train_again == train_ref and val_again == val_ref  # bit for bit (gloo, fp32, one thread per rank)


@pytest.mark.slow(seconds=25)
@pytest.mark.timeout(300)
def test_every_rank_stops_on_rank_0s_steady_state_decision_under_zero3(
    dataset: Path, tmp_path: Path, cleanup: list[Job]
) -> None:
    # The steady-state stop is rank 0's decision broadcast between steps, the same code under DDP and ZeRO. It runs
    # under ZeRO-3, where a rank that stopped alone would hang its peers at once (every forward gathers the
    # parameters from all ranks). A test of its own, not a fourth launch in the ZeRO-3 case above: that case took
    # 66 s of make test on the Xeon, and about twice that on the AMD EPYC would pass the suite's 120 s bar per test.
    # Given the steady-state stop rule (a wide tolerance: CPU step times are noisy), When the job runs
    steady = one_host(tmp_path / "steady", dataset, {**HPS, "deepspeed_stage": "3", **STEADY_STATE})
    cleanup.append(steady)
    steady.run()
    # Then every rank stops on rank 0's decision, well before max_steps
    stopped = steady.hosts[0].result()
    assert stopped.status == "completed" and stopped.hardware.world_size == 2
    assert stopped.stop is not None and stopped.stop.rule == "steady_state"
    assert stopped.stop.reason.startswith("throughput CI within"), stopped.stop.reason
    assert 3 + 5 <= stopped.stop.steps < 40  # warmup + min_timed_steps at the earliest
    assert stopped.timing is not None and stopped.timing.total_steps == stopped.stop.steps


@pytest.mark.slow(seconds=30)
@pytest.mark.timeout(300)
def test_two_hosts_on_localhost_train_like_two_ranks_on_one_host(
    dataset: Path, tmp_path: Path, cleanup: list[Job], one_host_losses: dict[str, Any]
) -> None:
    # Given algo-1 and algo-2 (one rank each: world size 2), each with its own resourceconfig.json and folders
    job = two_hosts(tmp_path, dataset, HPS)
    cleanup.append(job)
    # When both launchers run
    job.run()
    # Then algo-1 (rank 0) reports a two-node job; algo-2 writes no benchmark.json of its own
    algo1, algo2 = job.hosts
    result = algo1.result()
    assert result.status == "completed"
    assert (result.hardware.world_size, result.hardware.nodes) == (2, 2)
    assert not (algo2.output_data / "benchmark.json").exists()
    assert "--nnodes=2 --node_rank=1" in algo2.log.read_text()
    assert algo1.complete_checkpoints() == [8, 12] and algo2.complete_checkpoints() == []  # rank 0 writes them
    # and it trains exactly as 2 ranks on one host do (same global batch, same data per rank)
    if "HPS" not in one_host_losses:  # the [ddp] case above ran it when it ran first
        same = one_host(tmp_path / "one-host", dataset, HPS)
        cleanup.append(same)
        same.run()
        one_host_losses["HPS"] = losses(same.hosts[0].result())
    train_one, val_one = one_host_losses["HPS"]
    train_two, val_two = losses(result)
    assert train_two == train_one and val_two == val_one


@pytest.mark.slow(seconds=30)
@pytest.mark.timeout(600)
def test_single_process_deepspeed_resumes_after_a_kill(dataset: Path, tmp_path: Path, cleanup: list[Job]) -> None:
    # Given a CPU host without the processes-per-host hyperparameter: the launcher runs train.py itself (1 rank,
    # DeepSpeed sees SM_TRAINING_ENV and no launcher variables), with ZeRO-3 (ZeRO-2's kill and resume runs on two
    # ranks above; this path does not depend on the stage, and each launch is a train.py start-up)
    hps = {**HPS, "deepspeed_stage": "3"}
    spot = one_host(tmp_path / "spot", dataset, hps, processes=1)
    cleanup.append(spot)
    # When it is killed after its first checkpoint and started again
    assert spot.run_until_checkpoint_then_kill() == [-signal.SIGKILL]
    killed_log = spot.hosts[0].log.read_text()
    launched = next(ln for ln in killed_log.splitlines() if ln.startswith("[launcher]"))
    assert launched.endswith(f" -m {TRAIN_MODULE}") and "torch.distributed.run" not in launched
    spot.hosts[0].log.rename(spot.hosts[0].root / "killed.log")
    spot.run()
    # Then it resumes from its checkpoint and trains to the end on one rank
    resumed = spot.hosts[0].result()
    assert resumed.status == "completed" and resumed.hardware.world_size == 1
    assert resumed.config.deepspeed_stage == 3
    assert resumed.stop is not None and resumed.stop.resumed_from_step in (4, 8)
    train_again, val_again = losses(resumed)
    assert sorted(train_again) == list(range(1, MAX_STEPS + 1)) and sorted(val_again) == [4, 8, 12]
    assert SHM_OP not in killed_log + spot.hosts[0].log.read_text()
    # Its losses equal an uninterrupted run's bit for bit on two ranks above, for DDP, ZeRO-2 and ZeRO-3 (the same
    # resume code; one uninterrupted single-process run more would be a third train.py start-up here)
