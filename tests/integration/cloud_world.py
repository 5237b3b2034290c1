"""The cloud integration tests' moto world: the stack's names, the Lambdas' environment, manifests, events and helpers.

A named module, not conftest.py: test files import it as ``tests.integration.cloud_world``, so files from several test
folders can run in one pytest command (pytest loads each folder's conftest.py as the module ``conftest``; a test file's
``from conftest import ...`` then found whichever folder's came last). The fixtures are in this folder's conftest.py.
"""

from __future__ import annotations

import copy
import io
import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuscout.cloud import run_roles
from gpuscout.cloud.control_plane import Services
from gpuscout.cloud.settings import LambdaSettings
from gpuscout.cloud.step_errors import REFUSAL_KEY, ManifestRejected, PlanRefused

REPO_DIR = Path(__file__).resolve().parents[2]
FIXTURES = REPO_DIR / "tests" / "fixtures"
REGION = "us-east-1"
TABLE = "gpuscout-results"
DATA_BUCKET = "gpuscout-data-123456789012"
ARTIFACTS_BUCKET = "gpuscout-artifacts-123456789012"
RUN_ROLE_PATH = "/gpuscout/us-east-1/Gpuscout/"
PROCESSING_ROLE_ARN = "arn:aws:iam::123456789012:role/gpuscout-processing"
IMAGE_URI = "123456789012.dkr.ecr.us-east-1.amazonaws.com/gpuscout-training:3f2c1a"

ENVIRONMENT = {
    "AWS_DEFAULT_REGION": REGION,
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "TABLE_NAME": TABLE,
    "DATA_BUCKET": DATA_BUCKET,
    "ARTIFACTS_BUCKET": ARTIFACTS_BUCKET,
    "PROCESSING_ROLE_ARN": PROCESSING_ROLE_ARN,
    "RUN_ROLE_PATH": RUN_ROLE_PATH,
    "RUN_ROLE_BOUNDARY_ARN": "arn:aws:iam::123456789012:policy/gpuscout-run-role-boundary",
    "JOB_RUNTIME_POLICY_ARN": "arn:aws:iam::123456789012:policy/gpuscout-job-runtime",
    "RUN_ROLE_PROPAGATION_SECONDS": "0",  # moto's IAM is consistent at once
    "TRAINING_IMAGE_URI": IMAGE_URI,
    "PROCESSING_INSTANCE_TYPE": "ml.m5.xlarge",
    "ALLOWED_INSTANCE_TYPES": "ml.g5.8xlarge,ml.g5.12xlarge,ml.p4d.24xlarge,ml.p5.48xlarge",
    "DEFAULT_BUDGET_USD": "100",
    "POWERTOOLS_SERVICE_NAME": "gpuscout",
    "POWERTOOLS_TRACE_DISABLED": "true",
    "POWERTOOLS_METRICS_NAMESPACE": "gpuscout",
}

CLOUD_MANIFEST = """\
name: cloud-smoke
model:
  preset: qwen2-tiny
tokenizer:
  kind: bpe
  vocab_size: 4096
dataset:
  source: bundled:hebrew-bible
  max_documents: 400
sequence_length: 256
training:
  max_steps: 30
targets:
  - instance_type: ml.g5.8xlarge
  - instance_type: ml.p4d.24xlarge
    spot: true
variants:
  - name: b4
    per_device_batch_size: 4
  - name: b8
    per_device_batch_size: 8
constraints:
  budget_usd: {budget}
"""


def cloud_manifest(budget: float = 50.0, name: str = "cloud-smoke") -> str:
    return CLOUD_MANIFEST.format(budget=budget).replace("name: cloud-smoke", f"name: {name}")


def wide_manifest(variants: int, repetitions: int = 1) -> str:
    """4 targets x ``variants`` (8 batch sizes, so at most 32 configurations) x ``repetitions``, a large budget."""
    targets = "\n".join(f"  - instance_type: {t}" for t in ("ml.g5.8xlarge", "ml.g5.12xlarge", "ml.p4d.24xlarge",
                                                                "ml.p5.48xlarge"))  # fmt: skip
    names = "\n".join(
        f"  - name: b{i % 8 + 1}-a{i:02d}-ckpt-compiled-flex-attention-x\n    per_device_batch_size: {i % 8 + 1}"
        for i in range(variants)
    )
    head = cloud_manifest(budget=100000).split("targets:")[0]
    tail = f"repetitions: {repetitions}\nconstraints:\n  budget_usd: 100000\n"
    return f"{head}targets:\n{targets}\nvariants:\n{names}\n{tail}"


@dataclass
class LambdaContext:
    function_name: str = "gpuscout-test"
    memory_limit_in_mb: int = 512
    invoked_function_arn: str = "arn:aws:lambda:us-east-1:123456789012:function:gpuscout-test"
    aws_request_id: str = "00000000-0000-4000-8000-000000000000"


@dataclass
class Cloud:
    services: Services
    s3: Any
    sagemaker: Any
    context: LambdaContext

    def submit(self, text: str, name: str = "cloud-smoke") -> dict[str, str]:
        """Upload a manifest like `gpuscout submit` does; returns the state machine's execution input."""
        key = f"manifests/{name}.yaml"
        response = self.s3.put_object(Bucket=DATA_BUCKET, Key=key, Body=text.encode())
        return {"bucket": DATA_BUCKET, "key": key, "etag": response["ETag"].strip('"')}

    def items(self, planned: dict[str, Any], kind: str = "jobs") -> list[dict[str, Any]]:
        """The request list ``kind`` (canaries, jobs, tunings) plan_jobs wrote to S3 for the Distributed Maps."""
        reference = planned["plan"]
        body = self.s3.get_object(Bucket=str(reference["bucket"]), Key=str(reference[kind]["key"]))["Body"].read()
        listed = json.loads(body)
        assert isinstance(listed, list), f"{reference[kind]['key']} is not a JSON array"
        return listed

    def upload_benchmark(self, run_id: str, job_name: str, benchmark: dict[str, Any]) -> None:
        """What SageMaker does at the end of a job: tar SM_OUTPUT_DATA_DIR into output.tar.gz."""
        payload = json.dumps(benchmark).encode()
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
            info = tarfile.TarInfo("benchmark.json")
            info.size = len(payload)
            archive.addfile(info, io.BytesIO(payload))
        self.s3.put_object(
            Bucket=ARTIFACTS_BUCKET, Key=f"output/{run_id}/{job_name}/output/output.tar.gz", Body=buffer.getvalue()
        )


QUOTAS: dict[str, float] = {}  # the account's quotas a test changes (quota name -> instances)


def load_event(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / "events" / f"{name}.json").read_text())
    return data


def job_event(name: str, *, run_id: str, job_name: str, instance_type: str | None = None) -> dict[str, Any]:
    """A fixture event re-addressed to one of our planned jobs."""
    event = copy.deepcopy(load_event(name))
    detail = event["detail"]
    arn = f"arn:aws:sagemaker:{REGION}:123456789012:training-job/{job_name}"
    detail["TrainingJobName"] = job_name
    detail["TrainingJobArn"] = arn
    detail["Tags"]["gpuscout:run-id"] = run_id
    if instance_type:
        detail["ResourceConfig"]["InstanceType"] = instance_type
    event["resources"] = [arn]
    return event


def benchmark_for(job_name: str, run_id: str, instance_type: str, fixture: str = "p4d-bs8-r0") -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / "benchmarks" / f"{fixture}.json").read_text())
    data.update(job_name=job_name, run_id=run_id, instance_type=instance_type)
    return data


def metric_directives(output: str) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(record, directive) for each CloudWatch embedded-metric-format directive in the lines a handler printed."""
    for line in output.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        for directive in record.get("_aws", {}).get("CloudWatchMetrics", []):
            yield record, directive


def run_role_arn(run_id: str) -> str:
    """The ARN of run ``run_id``'s own role in this world (gpuscout.cloud.run_roles): what its requests name and
    what the "Create run role" step returns."""
    return run_roles.run_role_arn(LambdaSettings.model_validate(ENVIRONMENT), run_id)


def raise_refusal(output: dict[str, Any]) -> dict[str, Any]:
    """A Validate or Plan handler's ``output`` unless it is a refusal, which is raised as the error it stands for."""
    refused = output.get(REFUSAL_KEY)
    if isinstance(refused, dict):
        error, cause = str(refused["Error"]), str(refused["Cause"])
        if error == "ManifestRejected":
            raise ManifestRejected(output.get("run_id"), cause)
        assert error == "PlanRefused", error
        raise PlanRefused(cause)
    return output
