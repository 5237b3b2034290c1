"""train.py as PID 1 (a one-process SageMaker container: launcher.py execs it) stops on SIGTERM within seconds: at the
next step boundary, with a checkpoint of that step and a benchmark.json of what was measured
(gpuscout_train/stop_signal.py). The kernel ignores a signal whose action is the default for a PID namespace's init,
so without the handler the job below would run its 5,000 steps and the test would time out."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gpuscout.paths import TRAIN_MODULE
from tests.sagemaker_job import job_environment

HPS = {
    "run_id": "r-stop",
    "job_name": "gs-test-stop",
    "instance_type": "local",
    "model_preset": "qwen2-tiny",
    "per_device_train_batch_size": "2",
    "max_steps": "5000",
    "warmup_steps": "3",
    "checkpoint_interval": "1000",
    "validation_batches": "1",
}


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare for a PID namespace")
def test_train_py_as_pid_1_stops_on_sigterm_within_seconds_with_its_measurement(dataset: Path, tmp_path: Path):
    env = job_environment(tmp_path, dataset, HPS)
    # Given train.py as the init process of its own PID namespace, as in a one-process training container
    command = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", TRAIN_MODULE]
    outer = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert outer.stdout is not None
        for line in outer.stdout:  # wait until a few steps are timed
            if line.startswith("gpuscout_metric step=8 "):
                break
        else:
            pytest.fail(f"train.py ended before step 8: {outer.wait()} {outer.stderr.read() if outer.stderr else ''}")
        pid_1 = psutil.Process(outer.pid).children()[0]
        assert pid_1.cmdline()[-2:] == ["-m", TRAIN_MODULE]
        # When SageMaker's SIGTERM reaches it (StopTrainingJob, a spot interruption, MaxRuntime)
        sent = time.monotonic()
        pid_1.send_signal(signal.SIGTERM)
        rest, err = outer.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if outer.poll() is None:
            outer.kill()
    # Then it ends within seconds, not SageMaker's 120 s, having written what it measured and a checkpoint
    assert outer.returncode == 0, err[-2000:]
    assert took < 20, took
    assert "SIGTERM received: stopping at the next step boundary" in rest
    result = json.loads((tmp_path / "opt/ml/output/data/benchmark.json").read_text())
    assert result["status"] == "completed"
    stopped_at = result["stop"]["steps"]
    assert 8 <= stopped_at < 5000 and result["stop"]["reason"] == f"stopped on SIGTERM after step {stopped_at}"
    assert result["timing"]["timed_steps"] == stopped_at - 3 and result["throughput"]["tokens_per_s"] > 0
    assert result["loss"]["validation"] == []  # no final validation on the way out
    assert (tmp_path / "opt/ml/checkpoints" / f"step-{stopped_at:08d}" / "complete").is_file()
