"""The image's launcher running the user's own code (a job section) the way a SageMaker training job starts it:
``python -m gpuscout_train.launcher train`` in a SageMaker-shaped tree (config/, the ``code`` channel, output/), with
the Environment and HyperParameters that gpuscout.cloud.sagemaker_requests puts in the CreateTrainingJob request."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gpuscout_train.job_code import failure_reason

from gpuscout.cloud.sagemaker_requests import RequestSettings, training_job_request
from gpuscout.domain.catalog import load_catalog
from gpuscout.domain.manifest_loader import parse_manifest
from gpuscout.paths import REPO_DIR
from gpuscout.plan.canary import plan_cloud_canaries
from gpuscout.plan.planner import plan
from tests.sagemaker_job import LAUNCHER_COMMAND

TWO_TOWER = REPO_DIR / "examples" / "two-tower"
SETTINGS = RequestSettings(
    role_arn="arn:aws:iam::123456789012:role/gs-sagemaker",
    training_image_uri="123456789012.dkr.ecr.us-east-1.amazonaws.com/gpuscout:latest",
    data_bucket="gs-data",
    artifacts_bucket="gs-artifacts",
)
CODE_URI = "s3://gs-data/raw/code/two-tower-0123456789abcdef/"


def _request(max_steps: int = 8, canary: bool = False) -> dict[str, object]:
    """The CreateTrainingJob request gpuscout plans for the two-tower cloud manifest's first job (or its canary)."""
    text = (TWO_TOWER / "cloud.yaml").read_text()
    text = text.replace("source_dir: .", f"source_dir: {CODE_URI}").replace(
        "max_steps: 2000", f"max_steps: {max_steps}"
    )
    manifest = parse_manifest(text, "cloud.yaml")
    catalog = load_catalog()
    jobs = plan(manifest, catalog, run_id="two-tower-cloud-20261123-abcdef").jobs
    spec = jobs[0]
    if canary:
        [first, *_] = plan_cloud_canaries(jobs, instance_type="ml.g5.8xlarge", gpus_per_instance=1,
                                          price_per_hour_usd=2.45)  # fmt: skip
        spec = first.spec
    return training_job_request(spec, SETTINGS, None, enable_network_isolation=False)


def _sagemaker_tree(tmp_path: Path, request: dict[str, object], *, code: Path, processes: int = 1) -> dict[str, str]:
    """What SageMaker puts in the container: resourceconfig.json, hyperparameters.json, the code channel; the
    request's Environment; SM_NUM_GPUS (this machine has none). Paths under tmp_path replace /opt/ml."""
    config = tmp_path / "input" / "config"
    config.mkdir(parents=True)
    (config / "resourceconfig.json").write_text(
        json.dumps({"current_host": "algo-1", "hosts": ["algo-1"], "current_instance_type": "ml.g5.12xlarge"})
    )
    hyperparameters = dict(request["HyperParameters"])  # type: ignore[call-overload]
    if processes > 1:  # the toolkit's own hyperparameter: 2 gloo processes stand in for 2 GPUs
        hyperparameters["sagemaker_mpi_num_of_processes_per_host"] = str(processes)
    (config / "hyperparameters.json").write_text(json.dumps(hyperparameters))
    channel = tmp_path / "input" / "data" / "code"
    shutil.copytree(code, channel)
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SM_", "GPUSCOUT_"))},
        **request["Environment"],  # type: ignore[dict-item]
        "SM_INPUT_CONFIG_DIR": str(config),
        "SM_CHANNEL_CODE": str(channel),
        "SM_OUTPUT_DATA_DIR": str(tmp_path / "output" / "data"),
        "SM_NUM_GPUS": "0",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }


def _launch(tmp_path: Path, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *LAUNCHER_COMMAND, "train"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)  # fmt: skip


@pytest.mark.slow(seconds=16)
def test_the_two_tower_job_runs_through_the_launcher_on_two_ranks(tmp_path: Path) -> None:
    # Given the two-tower job's planned request (code channel, arguments, the helper's settings, requirements)
    request = _request(max_steps=8)
    env = _sagemaker_tree(tmp_path, request, code=TWO_TOWER, processes=2)
    # (small sizes so two CPU ranks finish in seconds; the planned arguments are otherwise unchanged)
    hp_file = Path(env["SM_INPUT_CONFIG_DIR"]) / "hyperparameters.json"
    hp = json.loads(hp_file.read_text())
    assert hp["batch_size"] == "4096" and hp["users"] == "200000"
    hp.update(batch_size="64", users="300", items="200", interactions="4096", embedding_dim="16", hidden="32")
    hp_file.write_text(json.dumps(hp))
    # When SageMaker starts the container
    done = _launch(tmp_path, env)
    # Then requirements were installed (already satisfied here), torchrun started the user's train.py on 2 ranks
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "pip install --disable-pip-version-check -r requirements.txt" in done.stdout
    assert "torch.distributed.run" in done.stdout and "--nproc_per_node=2" in done.stdout
    [command] = [line for line in done.stdout.splitlines() if "torch.distributed.run" in line]
    assert f"{env['SM_CHANNEL_CODE']}/train.py --" in command and " --batch_size 64" in command
    # and rank 0 wrote one benchmark.json counting the samples of both ranks, warm-up excluded, at max_steps
    bench = json.loads((tmp_path / "output" / "data" / "benchmark.json").read_text())
    assert bench["status"] == "completed" and bench["unit"] == "samples"
    assert bench["job_name"] == request["TrainingJobName"] and bench["instance_type"] == "ml.g5.12xlarge"
    assert bench["job"]["entry_point"] == "train.py" and bench["job"]["hyperparameters"]["batch_size"] == "64"
    assert bench["stop"]["steps"] == 8 and bench["timing"]["timed_steps"] == 8 - bench["timing"]["warmup_steps"]
    assert bench["throughput"]["samples_timed"] == 64 * 2 * bench["timing"]["timed_steps"]
    assert not (tmp_path / "output" / "failure").exists()


def test_the_canary_request_stops_the_users_script_after_two_steps(tmp_path: Path) -> None:
    # Given the cloud canary of the two-tower job (job.canary_arguments over the job's own arguments)
    request = _request(canary=True)
    assert request["ResourceConfig"]["InstanceType"] == "ml.g5.8xlarge"  # type: ignore[index]
    env = _sagemaker_tree(tmp_path, request, code=TWO_TOWER)
    hp_file = Path(env["SM_INPUT_CONFIG_DIR"]) / "hyperparameters.json"  # (the model smaller, for a CPU)
    hp_file.write_text(json.dumps({**json.loads(hp_file.read_text()), "users": "3000", "items": "2000"}))
    # When it runs
    done = _launch(tmp_path, env)
    # Then the helper stopped the script after 2 steps (one warm-up)
    assert done.returncode == 0, done.stderr[-3000:]
    bench = json.loads((tmp_path / "output" / "data" / "benchmark.json").read_text())
    assert bench["stop"] == {"rule": "fixed", "reason": "max_steps reached", "steps": 2}
    hp = bench["job"]["hyperparameters"]
    assert (hp["interactions"], hp["batch_size"]) == ("50000", "4096")  # canary_arguments over the job's own


METRIC_LINES_SCRIPT = """
import argparse, time
parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int)
args = parser.parse_args()
for step in range(1, 9):
    time.sleep(0.01)
    print(f"gpuscout_metric step={step} samples={args.batch} loss={1.0 / step:.4f} step_time_s=0.0100", flush=True)
"""


def _own_code(tmp_path: Path, script: str) -> tuple[Path, dict[str, object]]:
    code = tmp_path / "src"
    code.mkdir()
    (code / "fit.py").write_text(script)
    request = {
        "TrainingJobName": "gs-own-code-t0v0r0-abc",
        "HyperParameters": {"batch": "32"},
        "Environment": {"GPUSCOUT_ENTRY_POINT": "fit.py", "GPUSCOUT_DISTRIBUTION": "single", "GPUSCOUT_UNIT": "samples",
                        "GPUSCOUT_MAX_STEPS": "8", "GPUSCOUT_STOP_RULE": "fixed", "GPUSCOUT_WARMUP_STEPS": "2"},
    }  # fmt: skip
    return code, request


def test_a_script_that_only_prints_metric_lines_gets_its_benchmark_from_the_log(tmp_path: Path) -> None:
    code, request = _own_code(tmp_path, METRIC_LINES_SCRIPT)
    done = _launch(tmp_path, _sagemaker_tree(tmp_path / "ml", request, code=code))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gpuscout_metric step=8 samples=32" in done.stdout  # still streamed to the job log
    bench = json.loads((tmp_path / "ml" / "output" / "data" / "benchmark.json").read_text())
    assert bench["job"]["reporter"] == "stdout" and bench["timing"]["timed_steps"] == 6
    assert bench["throughput"]["samples_per_s"] == pytest.approx(32 / 0.01)


def test_a_failing_script_fails_the_job_with_a_reason_sagemaker_shows(tmp_path: Path) -> None:
    code, request = _own_code(tmp_path, "import sys\nprint('loading')\nsys.exit(3)\n")
    done = _launch(tmp_path, _sagemaker_tree(tmp_path / "ml", request, code=code))
    assert done.returncode == 3
    assert (tmp_path / "ml" / "output" / "failure").read_text() == "fit.py exited with code 3"


def test_a_script_that_raises_fails_the_job_with_the_error_in_its_reason(tmp_path: Path) -> None:
    # Given a script that fails with a Python traceback (the usual way a user's code fails)
    script = "import sys\nprint('loading', file=sys.stderr)\nraise ValueError('no fit: ' + 'x' * 2000)\n"
    code, request = _own_code(tmp_path, script)
    # When it runs as a SageMaker job
    done = _launch(tmp_path, _sagemaker_tree(tmp_path / "ml", request, code=code))
    # Then the job fails with the end of the traceback in the reason SageMaker shows (within its 1,024 characters),
    # and the whole stderr still reaches the job log
    assert done.returncode == 1
    failure = (tmp_path / "ml" / "output" / "failure").read_text()
    assert failure.startswith("fit.py exited with code 1; stderr: ...") and len(failure) <= 1000
    assert failure.endswith("x" * 100)
    assert "Traceback (most recent call last):" in done.stderr and "loading" in done.stderr


def test_a_script_failing_under_torchrun_names_its_own_error_not_torchrun_s_report(tmp_path: Path) -> None:
    # Given a script that raises on 2 processes (per_gpu: torchrun starts them and reports the failed worker)
    script = "import os\nraise ValueError('bad batch size 64 on rank ' + os.environ['RANK'])\n"
    code, request = _own_code(tmp_path, script)
    request["Environment"]["GPUSCOUT_DISTRIBUTION"] = "per_gpu"  # type: ignore[index]
    done = _launch(tmp_path, _sagemaker_tree(tmp_path / "ml", request, code=code, processes=2))
    # Then the reason SageMaker shows ends with the script's error; torchrun's report is in the log only
    assert done.returncode != 0
    assert "ChildFailedError" in done.stderr and "Root Cause" in done.stderr
    failure = (tmp_path / "ml" / "output" / "failure").read_text()
    assert failure.startswith("fit.py exited with code 1; stderr: ")
    assert re.search(r"ValueError: bad batch size 64 on rank [01]$", failure), failure
    assert "ChildFailedError" not in failure and "error_file" not in failure and "exitcode" not in failure


def test_the_failure_reason_keeps_the_last_stderr_lines() -> None:
    tail = ["Traceback (most recent call last):", '  File "fit.py", line 3, in <module>', "ValueError: bad batch"]
    assert failure_reason("fit.py", 1, tail) == (
        'fit.py exited with code 1; stderr: Traceback (most recent call last): |   File "fit.py", line 3, in <module> '
        "| ValueError: bad batch"
    )
    assert failure_reason("fit.py", -9, []) == "fit.py was killed by signal 9"


def test_a_script_without_steps_or_benchmark_is_a_failure_not_a_result(tmp_path: Path) -> None:
    code, request = _own_code(tmp_path, "print('trained, but reported nothing')\n")
    done = _launch(tmp_path, _sagemaker_tree(tmp_path / "ml", request, code=code))
    assert done.returncode == 1
    failure = (tmp_path / "ml" / "output" / "failure").read_text()
    assert failure.startswith("fit.py finished without a benchmark:") and "no gpuscout_metric step lines" in failure


def test_a_missing_entry_point_is_a_clear_launcher_error(tmp_path: Path) -> None:
    code, request = _own_code(tmp_path, "")
    request["Environment"]["GPUSCOUT_ENTRY_POINT"] = "absent.py"  # type: ignore[index]
    done = _launch(tmp_path, _sagemaker_tree(tmp_path / "ml", request, code=code))
    assert done.returncode == 2
    assert "launcher: error: absent.py: no such file in the code channel" in done.stderr


def test_stop_training_job_sigterm_reaches_the_users_script(tmp_path: Path) -> None:
    script = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('got SIGTERM', flush=True), sys.exit(143)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    code, request = _own_code(tmp_path, script)
    env = _sagemaker_tree(tmp_path / "ml", request, code=code)
    proc = subprocess.Popen([sys.executable, *LAUNCHER_COMMAND, "train"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    while "ready" not in proc.stdout.readline() and time.monotonic() < deadline:
        pass
    proc.send_signal(signal.SIGTERM)  # what SageMaker sends the container's main process on StopTrainingJob
    out, _ = proc.communicate(timeout=30)
    assert "got SIGTERM" in out and proc.returncode == 143


def test_metric_lines_from_several_processes_are_refused_not_miscounted(tmp_path: Path) -> None:
    # Given a metric-lines script started on 2 processes (their lines interleave in one log)
    code, request = _own_code(tmp_path, METRIC_LINES_SCRIPT)
    request["Environment"]["GPUSCOUT_DISTRIBUTION"] = "per_gpu"  # type: ignore[index]
    env = _sagemaker_tree(tmp_path / "ml", request, code=code, processes=2)
    done = _launch(tmp_path, env)
    # Then the job fails with the reason and the fix instead of a benchmark of a rank's rate with 2x the steps
    assert done.returncode == 1, done.stderr[-2000:]
    failure = (tmp_path / "ml" / "output" / "failure").read_text()
    assert failure.startswith("no benchmark.json from 2 processes") and "job.distribution: single" in failure
    assert not (tmp_path / "ml" / "output" / "data" / "benchmark.json").exists()
