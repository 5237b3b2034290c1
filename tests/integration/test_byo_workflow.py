"""A job section (the user's own code) through the deployed workflow: `gpuscout submit`'s code upload, the
synthesized state machine on moto with every Lambda served by its real handler (test_state_machine's harness), and
each training job SageMaker starts run for real: the image's launcher (gpuscout_train/launcher.py) in a SageMaker-shaped
folder, with the code channel downloaded from S3, the request's hyperparameters and Environment, on this CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import test_state_machine as sm

from gpuscout.cloud.job_code import code_digest, code_files, code_prefix
from gpuscout.paths import REPO_DIR
from gpuscout.store.base import JobStatus, RunStatus
from tests.infra.conftest import Synthesized, synthesized  # noqa: F401 - fixture
from tests.integration.cloud_world import DATA_BUCKET, Cloud
from tests.sagemaker_job import LAUNCHER_COMMAND

TWO_TOWER = REPO_DIR / "examples" / "two-tower"
# The two-tower job on one 4 x A10G instance, on-demand and spot, two batch sizes; sized for a CPU (arguments), with
# max_steps 8 so each job is a few seconds here.
MANIFEST = """
name: two-tower-wf
job:
  source_dir: {source_dir}
  entry_point: train.py
  requirements: requirements.txt
  unit: samples
  arguments: {{embedding_dim: 16, hidden: 32, users: 300, items: 200, interactions: 4096}}
  canary_arguments: {{interactions: 1024}}
  estimate: {{units_per_s: 200000, units_per_step: batch_size}}
training:
  max_steps: 8
  warmup_steps: 2
targets:
  - instance_type: ml.g5.12xlarge
  - instance_type: ml.g5.12xlarge
    spot: true
variants:
  - name: b64
    hyperparameters: {{batch_size: 64}}
  - name: b128
    hyperparameters: {{batch_size: 128}}
constraints:
  budget_usd: 20.0
objective: cheapest_per_token
"""


def _upload_code(cloud: Cloud) -> str:
    """What `gpuscout submit` uploads for a local source_dir (tests/unit/test_cloud_cli.py covers submit itself)."""
    files = code_files(TWO_TOWER)
    prefix = code_prefix("two-tower-wf", code_digest(files))
    for f in files:
        cloud.s3.put_object(Bucket=DATA_BUCKET, Key=prefix + f.relative, Body=f.data)
    return f"s3://{DATA_BUCKET}/{prefix}"


class LauncherJobs:
    """moto SageMaker's CreateTrainingJob, run: the launcher in <root>/<job name>/ (as /opt/ml)."""

    def __init__(self, cloud: Cloud, root: Path) -> None:
        self.cloud, self.root = cloud, root
        self.ran: dict[str, dict[str, Any]] = {}

    def request_for(self, lambdas: sm.InProcessLambdas, job_name: str) -> dict[str, Any]:
        [planned] = [out for name, out in lambdas.outputs if name == "plan_jobs"]
        items = [*self.cloud.items(planned), *self.cloud.items(planned, "canaries")]
        return next(item["request"] for item in items if item["job_name"] == job_name)

    def __call__(self, lambdas: sm.InProcessLambdas, kwargs: dict[str, Any]) -> dict[str, Any]:
        name = kwargs["training_job_name"]
        request = self.request_for(lambdas, name)
        # what SageMaker received is what plan_jobs built (moto's model has no Environment: the request's is used)
        assert kwargs["hyper_parameters"] == request["HyperParameters"]
        assert kwargs["input_data_config"] == request["InputDataConfig"]
        ml = self.root / name
        config = ml / "input" / "config"
        config.mkdir(parents=True)
        (config / "hyperparameters.json").write_text(json.dumps(kwargs["hyper_parameters"]))
        instance_type = kwargs["resource_config"]["InstanceType"]
        (config / "resourceconfig.json").write_text(
            json.dumps({"current_host": "algo-1", "hosts": ["algo-1"], "current_instance_type": instance_type})
        )
        for channel in kwargs["input_data_config"]:  # SageMaker downloads each channel before the container starts
            uri = channel["DataSource"]["S3DataSource"]["S3Uri"]
            bucket, _, prefix = uri.removeprefix("s3://").partition("/")
            listed = self.cloud.s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
            for obj in listed:
                target = ml / "input" / "data" / channel["ChannelName"] / obj["Key"].removeprefix(prefix)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(self.cloud.s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("SM_", "GPUSCOUT_", "AWS_"))},
            **request["Environment"],
            "SM_INPUT_CONFIG_DIR": str(config),
            "SM_CHANNEL_CODE": str(ml / "input" / "data" / "code"),
            "SM_OUTPUT_DATA_DIR": str(ml / "output" / "data"),
            "SM_NUM_GPUS": "0",  # this machine's CPU stands in for the instance's GPU
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
        }
        done = subprocess.run([sys.executable, *LAUNCHER_COMMAND, "train"], cwd=ml, env=env,
                              capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        benchmark: dict[str, Any] = json.loads((ml / "output" / "data" / "benchmark.json").read_text())
        self.ran[name] = {"request": request, "benchmark": benchmark, "stdout": done.stdout}
        return benchmark


@pytest.mark.slow(seconds=36)
def test_the_users_code_runs_through_the_deployed_workflow(
    with_canary: Cloud,
    synthesized: Synthesized,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    cloud = with_canary
    # Given the two-tower code uploaded as `gpuscout submit` does, and its manifest submitted
    source_dir = _upload_code(cloud)
    jobs = LauncherJobs(cloud, tmp_path)
    # When the workflow runs (every training job run by the image's launcher on this CPU)
    run = sm._execute_live(cloud, synthesized, monkeypatch, MANIFEST.format(source_dir=source_dir), name="byo",
                           run_job=jobs)  # fmt: skip
    assert run.described["status"] == "SUCCEEDED", json.dumps(run.events[-3:], default=str)[-3000:]
    order = [name for name, _ in run.lambdas.calls]
    assert order[:3] == ["validate_manifest", "plan_jobs", "run_role"] and order[-2:] == ["analyze_run", "run_role"]
    # Then nothing was prepared (the user's code reads its own data),
    assert sm._entered_inputs(run.events, "Prepare data") == []
    assert cloud.sagemaker.list_processing_jobs()["ProcessingJobSummaries"] == []
    # two canaries (one per batch size: spot and on-demand share a configuration) ran first on the canary instance,
    # stopped by the helper after 2 steps, with job.canary_arguments,
    names = sm._training_jobs(cloud)
    canaries = [n for n in names if "-canary" in n]
    assert canaries == names[:2] and len(names) == 6
    for name in canaries:
        ran = jobs.ran[name]
        assert ran["request"]["ResourceConfig"]["InstanceType"] == "ml.g5.8xlarge"
        assert ran["benchmark"]["stop"]["steps"] == 2
        assert ran["benchmark"]["job"]["hyperparameters"]["interactions"] == "1024"
    # and the four jobs ran the user's train.py from the code channel, 8 steps each, and were recorded and ranked.
    store = cloud.services.store
    rows = store.list_jobs(run.run_id)
    # (the two canaries have rows of their own, for `gpuscout status` and the budget guard: never analysed)
    assert sorted(j.job_name for j in rows if j.is_canary) == sorted(canaries)
    recorded = [j for j in rows if not j.is_canary]
    assert len(recorded) == 4 and all(j.status is JobStatus.COMPLETED for j in recorded)
    for job in recorded:
        ran = jobs.ran[job.job_name]
        assert "/input/data/code/train.py --" in ran["stdout"]
        assert ran["benchmark"]["stop"]["steps"] == 8 and ran["benchmark"]["unit"] == "samples"
        assert job.benchmark is not None and job.benchmark.throughput.samples_per_s > 0
    assert store.get_run(run.run_id).status is RunStatus.SUCCEEDED
    result = store.get_result(run.run_id)
    assert result is not None and result.analysis.model_dump(mode="json")["unit"] == "samples"
    ranked = sorted(result.analysis.model_dump(mode="json")["jobs"], key=lambda a: a["rank"])
    assert len(ranked) == 4 and all(a["usd_per_million_samples"] > 0 for a in ranked)
    report = cloud.s3.get_object(Bucket=DATA_BUCKET, Key=f"reports/{run.run_id}/report.md")["Body"].read().decode()
    assert "samples/s" in report and "$/1M samples" in report


def test_a_missing_entry_point_in_s3_rejects_the_manifest_before_anything_runs(
    cloud: Cloud,
    synthesized: Synthesized,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a source_dir under raw/ without the entry point
    source_dir = f"s3://{DATA_BUCKET}/raw/code/empty-0000000000000000/"
    cloud.s3.put_object(Bucket=DATA_BUCKET, Key="raw/code/empty-0000000000000000/requirements.txt", Body=b"torch\n")
    run = sm._execute_live(cloud, synthesized, monkeypatch, MANIFEST.format(source_dir=source_dir), name="byo-bad")
    # Then Validate rejected it with the field and the folder, and no job was created
    assert run.described["status"] == "FAILED"
    assert [name for name, _ in run.lambdas.calls] == ["validate_manifest"]
    rejected = json.loads(cloud.s3.get_object(Bucket=DATA_BUCKET, Key="rejected/byo-bad.error.json")["Body"].read())
    assert {"path": "job.entry_point", "message": f"train.py: no such file in {source_dir}"} in rejected["problems"]
    assert sm._training_jobs(cloud) == []
