"""`gpuscout submit` / `status` and the cloud client layer against moto (CloudFormation outputs, S3, DynamoDB,
Step Functions) and botocore's Stubber; CLI through typer's CliRunner."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import boto3
import pytest
import typer
import yaml
from botocore.exceptions import ClientError
from botocore.stub import Stubber
from moto import mock_aws
from typer.testing import CliRunner

from gpuscout.cli import app as cli
from gpuscout.cli.app import _GuardedGroup
from gpuscout.cli.app import app as full_app
from gpuscout.cli.cloud_commands import register
from gpuscout.cloud.client import (
    AlreadySubmittedError,
    CloudError,
    CloudStack,
    CredentialsError,
    StackNotFoundError,
    execution_console_url,
)
from gpuscout.cloud.quotas import Quota, training_quota_name
from gpuscout.cloud.sources import source_problems
from gpuscout.domain.manifest_loader import load_manifest, parse_manifest
from gpuscout.errors import GpuscoutError, ManifestError
from gpuscout.paths import MANIFESTS_DIR, REPO_DIR
from gpuscout.plan.jobs import make_run_id
from gpuscout.store.base import JobRecord, JobStatus, ResultRecord, RunRecord, RunStatus
from gpuscout.store.dynamodb import DynamoDbStore, table_definition
from tests.account_quotas import account_quotas
from tests.benchmark_results import benchmark_result
from tests.job_specs import job_spec
from tests.run_analyses import run_analysis

REGION = "us-east-1"
DATA_BUCKET = "gpuscout-data-test"
ARTIFACTS_BUCKET = "gpuscout-artifacts-test"
TABLE = "gpuscout-results-test"
VALID = MANIFESTS_DIR / "p4d-to-p5.yaml"
# the shipped example with its placeholder bucket replaced by the deployed stack's data bucket, as its comment says
VALID_TEXT = VALID.read_text().replace("s3://your-data-bucket/", f"s3://{DATA_BUCKET}/")

runner = CliRunner(env={"COLUMNS": "200"})


def make_app() -> typer.Typer:
    """A gpuscout-like app with the cloud commands (the real one's error handling: one message, an exit code)."""
    app = typer.Typer(cls=_GuardedGroup, add_completion=False, pretty_exceptions_enable=False)

    @app.callback()
    def main() -> None:
        """gpuscout (test app)."""

    register(app)
    return app


APP = make_app()


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(APP, list(args))
    return result.exit_code, result.stdout, result.stderr


@dataclass
class Deployed:
    s3: Any
    sfn: Any
    store: DynamoDbStore
    state_machine_arn: str

    def start_execution_for(self, key: str, body: bytes) -> str:
        """What the stack's EventBridge rule does on Object Created (input: bucket, key, etag)."""
        execution_input = {"bucket": DATA_BUCKET, "key": key, "etag": hashlib.md5(body).hexdigest()}
        response = self.sfn.start_execution(stateMachineArn=self.state_machine_arn, input=json.dumps(execution_input))
        return str(response["executionArn"])


def _template(outputs: dict[str, str]) -> str:
    return json.dumps(
        {
            "Resources": {"Data": {"Type": "AWS::S3::Bucket", "Properties": {"BucketName": DATA_BUCKET}}},
            "Outputs": {name: {"Value": value} for name, value in outputs.items()},
        }
    )


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("GPUSCOUT_STACK_NAME", raising=False)


class AccountQuotas:
    """QuotaBook's stand-in: tests set ``values`` (quota name -> instances); every other quota is 10."""

    values: ClassVar[dict[str, float]] = {}
    denied: ClassVar[bool] = False  # Service Quotas refuses the listing (AccessDenied)
    region = REGION

    def __init__(self, client: object) -> None:
        pass

    def quotas(self, wanted: object = (), *, fresh: bool = False) -> dict[str, Quota]:
        if self.denied:
            raise ClientError({"Error": {"Code": "AccessDeniedException", "Message": "not authorized"}},
                              "ListServiceQuotas")  # fmt: skip
        return account_quotas(self.values)


@pytest.fixture
def deployed(aws_env: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[Deployed]:
    """The stack's resources and a CloudFormation stack `Gpuscout` whose outputs name them, in an account whose
    training quotas are 10 instances of every type unless a test sets ``AccountQuotas.values``."""
    monkeypatch.setattr("gpuscout.cloud.client.QuotaBook", AccountQuotas)
    monkeypatch.setattr(AccountQuotas, "values", {})
    with mock_aws():
        s3 = boto3.client("s3", region_name=REGION)
        s3.create_bucket(Bucket=ARTIFACTS_BUCKET)
        dynamodb = boto3.client("dynamodb", region_name=REGION)
        dynamodb.create_table(**table_definition(TABLE))
        sfn = boto3.client("stepfunctions", region_name=REGION)
        definition = {"StartAt": "Validate", "States": {"Validate": {"Type": "Pass", "End": True}}}
        arn = sfn.create_state_machine(
            name="GpuscoutStateMachine",
            definition=json.dumps(definition),
            roleArn="arn:aws:iam::123456789012:role/gpuscout-sfn",
        )["stateMachineArn"]
        boto3.client("cloudformation", region_name=REGION).create_stack(
            StackName="Gpuscout",
            TemplateBody=_template(
                {
                    "DataBucketName": DATA_BUCKET,
                    "ArtifactsBucketName": ARTIFACTS_BUCKET,
                    "ResultsTableName": TABLE,
                    "StateMachineArn": arn,
                }
            ),
        )
        yield Deployed(s3=s3, sfn=sfn, store=DynamoDbStore(TABLE, client=dynamodb), state_machine_arn=arn)


def _manifest(tmp_path: Path, text: str | None = None, name: str = "bench.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text if text is not None else VALID_TEXT)
    return path


def _keys(s3: Any, prefix: str = "") -> list[str]:
    return [o["Key"] for o in s3.list_objects_v2(Bucket=DATA_BUCKET, Prefix=prefix).get("Contents", [])]


# -- submit ------------------------------------------------------------------------------------------------------


def test_submit_uploads_and_prints_the_run_id_the_control_plane_computes(deployed: Deployed, tmp_path: Path) -> None:
    path = _manifest(tmp_path)
    key = "manifests/qwen7b-p4d-to-p5.yaml"
    execution_arn = deployed.start_execution_for(key, path.read_bytes())  # EventBridge's doing, here up front

    code, out, err = invoke("submit", str(path), "--wait", "0")

    assert code == 0, err
    stored = deployed.s3.get_object(Bucket=DATA_BUCKET, Key=key)
    assert stored["Body"].read() == path.read_bytes()
    run_id = make_run_id("qwen7b-p4d-to-p5", key=key, etag=stored["ETag"].strip('"'))
    assert f"run id:    {run_id}" in out
    assert f"s3://{DATA_BUCKET}/{key} (3 job(s))" in out
    assert execution_console_url(REGION, execution_arn) in out
    assert "#/v2/executions/details/arn:aws:states:us-east-1:123456789012:execution:" in out
    assert f"gpuscout status {run_id}" in out
    assert "gpuscout track" not in out  # no tracking section


def test_submit_of_a_tracked_manifest_says_how_to_track_the_run(deployed: Deployed, tmp_path: Path) -> None:
    server = f"arn:aws:sagemaker:{REGION}:123456789012:mlflow-tracking-server/team"
    tracking = f"tracking:\n  mlflow: {{tracking_uri: '{server}'}}\n  wandb: {{project: p}}\n"
    path = _manifest(tmp_path, VALID_TEXT + tracking)
    code, out, err = invoke("submit", str(path), "--wait", "0")
    assert code == 0, err
    (run_id,) = [line.split()[-1] for line in out.splitlines() if line.startswith("run id:")]
    assert f"when it has ended: gpuscout track {run_id} --stack-name Gpuscout" in out


SEARCH = """\
name: search-smoke
model: {preset: qwen2-tiny}
tokenizer: {kind: bpe, vocab_size: 4096}
dataset: {source: "bundled:hebrew-bible", max_documents: 400}
sequence_length: 256
training: {max_steps: 30}
targets:
  - instance_type: ml.g5.12xlarge
  - instance_type: ml.p4d.24xlarge
constraints: {budget_usd: 50}
search:
  space: {per_device_batch_size: [2, 4], gradient_checkpointing: [false, true]}
  sequences_per_step: 8
  max_trials: 3
"""


def test_submit_of_a_search_counts_the_trials_it_may_launch(deployed: Deployed, tmp_path: Path) -> None:
    # Given a search over 4 candidates per target, at most 3 trials each
    code, out, err = invoke("submit", str(_manifest(tmp_path, SEARCH)), "--wait", "0")
    assert code == 0, err
    assert "(a search: up to 6 trial(s))" in out


def test_submit_waits_for_the_execution_and_matches_key_and_etag(deployed: Deployed, tmp_path: Path) -> None:
    path = _manifest(tmp_path)
    body = path.read_bytes()
    other = deployed.sfn.start_execution(  # another manifest's run: not ours
        stateMachineArn=deployed.state_machine_arn,
        input=json.dumps({"bucket": DATA_BUCKET, "key": "manifests/other.yaml", "etag": "0" * 32}),
    )["executionArn"]
    sleeps: list[float] = []
    started: list[str] = []

    def sleep(seconds: float) -> None:  # the S3 event arrives while submit waits
        sleeps.append(seconds)
        if not started:
            started.append(deployed.start_execution_for("manifests/qwen7b-p4d-to-p5.yaml", body))

    ticks = iter(range(100))
    stack = CloudStack(sleep=sleep, clock=lambda: float(next(ticks)))
    submission = stack.submit(path, wait_seconds=10)

    assert submission.execution_arn == started[0] != other
    assert submission.console_url == execution_console_url(REGION, started[0])
    assert sleeps == [2.0]
    assert submission.run_id == make_run_id(submission.manifest_name, key=submission.key, etag=submission.etag)


def test_submit_without_an_execution_yet_links_the_state_machine(deployed: Deployed, tmp_path: Path) -> None:
    code, out, err = invoke("submit", str(_manifest(tmp_path)), "--wait", "0")
    assert code == 0, err
    assert "execution: not started after 0 s; the state machine:" in out
    assert f"#/statemachines/view/{deployed.state_machine_arn}" in out


def test_an_invalid_manifest_never_leaves_the_machine(deployed: Deployed, tmp_path: Path) -> None:
    bad = VALID_TEXT.replace("name: qwen7b-p4d-to-p5", "name: Bad Name").replace("max_steps: 60", "max_stp: 60")
    code, _, err = invoke("submit", str(_manifest(tmp_path, bad)), "--wait", "0")
    assert code == 2
    assert "name" in err and "training.max_stp" in err
    assert _keys(deployed.s3) == []


def test_a_local_target_is_refused_before_upload(deployed: Deployed, tmp_path: Path) -> None:
    text = VALID_TEXT.replace(
        "  - instance_type: ml.p4d.24xlarge\n", "  - instance_type: local\n    price_per_hour_usd: 2.0\n", 1
    )
    with pytest.raises(ManifestError) as info:
        CloudStack().submit(_manifest(tmp_path, text), wait_seconds=0)
    assert [p.path for p in info.value.problems] == ["targets[0].instance_type"]
    assert _keys(deployed.s3) == []


def test_a_json_manifest_keeps_its_suffix(deployed: Deployed, tmp_path: Path) -> None:
    import yaml

    text = json.dumps(yaml.safe_load(VALID_TEXT))
    submission = CloudStack().submit(_manifest(tmp_path, text, "bench.json"), wait_seconds=0)
    assert submission.key == "manifests/qwen7b-p4d-to-p5.json"
    assert _keys(deployed.s3, "manifests/") == [submission.key]


def test_the_same_manifest_twice_is_refused_with_the_existing_run(deployed: Deployed, tmp_path: Path) -> None:
    path = _manifest(tmp_path)
    first = CloudStack().submit(path, wait_seconds=0)
    deployed.store.put_run(
        RunRecord(
            run_id=first.run_id,
            name=first.manifest_name,
            status=RunStatus.RUNNING,
            manifest_source=first.manifest_uri,
        )
    )
    with pytest.raises(AlreadySubmittedError, match=f"already planned as run {first.run_id} \\(RUNNING\\)"):
        CloudStack().submit(path, wait_seconds=0)


def test_the_same_manifest_after_a_failed_run_is_submitted_as_the_next_attempt(
    deployed: Deployed, tmp_path: Path
) -> None:
    # Given a run of this exact manifest that FAILED (data preparation, say)
    path = _manifest(tmp_path)
    first = CloudStack().submit(path, wait_seconds=0)
    failed = RunRecord(run_id=first.run_id, name=first.manifest_name, status=RunStatus.FAILED,
                       manifest_source=first.manifest_uri)  # fmt: skip
    deployed.store.put_run(failed)
    # When it is submitted again, Then it goes, under the id the control plane will plan it as
    again = CloudStack().submit(path, wait_seconds=0)
    assert again.run_id == f"{first.run_id}-r2"


def test_cli_defaults_match_the_client_and_the_cdk_app() -> None:
    import re
    import subprocess
    import sys

    from gpuscout.cli import cloud_commands as cloud_cli
    from gpuscout.cloud import client as cloud

    assert cloud_cli.DEFAULT_STACK_NAME == cloud.DEFAULT_STACK_NAME
    assert cloud_cli.DEFAULT_EXECUTION_WAIT_S == cloud.DEFAULT_EXECUTION_WAIT_S
    app_source = (Path(__file__).resolve().parents[2] / "app.py").read_text()
    assert re.search(r'^STACK_NAME = "(\w+)"', app_source, re.M)[1] == cloud.DEFAULT_STACK_NAME  # type: ignore[index]
    light = (
        "import sys, gpuscout.cli.cloud_commands; print('boto3' in sys.modules, 'gpuscout.cloud.client' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", light], capture_output=True, text=True, check=True).stdout.split() == [
        "False",
        "False",
    ]


# -- stack discovery and AWS errors ------------------------------------------------------------------------------


def test_no_stack_says_how_to_deploy(deployed: Deployed, tmp_path: Path) -> None:
    code, _, err = invoke("submit", str(_manifest(tmp_path)), "--stack-name", "Elsewhere", "--wait", "0")
    assert code == 1
    assert "no CloudFormation stack named 'Elsewhere' in us-east-1" in err
    assert "npx cdk deploy" in err and "--stack-name" in err


def test_stack_name_from_the_environment(deployed: Deployed, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSCOUT_STACK_NAME", "Other")
    code, _, err = invoke("status", "some-run")
    assert code == 1 and "no CloudFormation stack named 'Other'" in err


def test_a_stack_without_the_outputs_is_not_ours(aws_env: None) -> None:
    with mock_aws():
        boto3.client("cloudformation", region_name=REGION).create_stack(
            StackName="Gpuscout", TemplateBody=_template({"DataBucketName": DATA_BUCKET})
        )
        with pytest.raises(StackNotFoundError) as info:
            _ = CloudStack().outputs
    message = str(info.value)
    assert "ArtifactsBucketName, ResultsTableName, StateMachineArn" in message
    assert "npx cdk deploy" in message


def test_no_credentials_is_a_clear_message(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", raising=False)
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", raising=False)
    monkeypatch.delenv("AWS_WEB_IDENTITY_TOKEN_FILE", raising=False)
    code, _, err = invoke("status", "some-run")
    assert code == 1
    assert "no usable AWS credentials" in err and "aws configure" in err


class _StubbedSession:
    def __init__(self, client: Any) -> None:
        self._client = client

    def client(self, service: str) -> Any:
        assert service == "cloudformation"
        return self._client


@pytest.mark.parametrize(
    ("code", "error", "expected"),
    [
        ("ExpiredToken", CredentialsError, "AWS rejected the credentials (ExpiredToken)"),
        ("AccessDenied", CloudError, "access denied (nope); use credentials allowed to use the stack"),
        ("Throttling", CloudError, "Throttling: nope"),
    ],
)
def test_aws_errors_become_cloud_errors(code: str, error: type[Exception], expected: str) -> None:
    client = boto3.client("cloudformation", region_name=REGION, aws_access_key_id="a", aws_secret_access_key="b")
    with Stubber(client) as stubber:
        stubber.add_client_error("describe_stacks", service_error_code=code, service_message="nope")
        with pytest.raises(error) as info:
            _ = CloudStack(session=_StubbedSession(client)).outputs  # type: ignore[arg-type]
    assert expected in str(info.value)
    assert isinstance(info.value.__cause__, Exception)  # chained


# -- status, results, reports ------------------------------------------------------------------------------------


def _seed_run(store: DynamoDbStore, run_id: str = "bench-0123456789ab") -> str:
    store.put_run(
        RunRecord(
            run_id=run_id,
            name="bench",
            status=RunStatus.RUNNING,
            manifest_source=f"s3://{DATA_BUCKET}/manifests/bench.yaml",
            predicted_cost_usd=12.5,
        )
    )
    for name, instance_type, count, status, reason in (
        ("gs-abc123-t0v0r0-p4d-24xlarge-b4", "ml.p4d.24xlarge", 1, JobStatus.COMPLETED, None),
        ("gs-abc123-t1v0r0-p5-48xlarge-b4", "ml.p5.48xlarge", 1, JobStatus.CAPACITY, "InsufficientInstanceCapacity"),
        ("gs-abc123-t2v0r0-p5e-48xlarge-b4", "ml.p5e.48xlarge", 2, JobStatus.TRAINING, None),
    ):
        completed = status is JobStatus.COMPLETED
        store.put_job(
            JobRecord(
                run_id=run_id,
                job_name=name,
                status=status,
                instance_type=instance_type,
                instance_count=count,
                variant_name="b4",
                spot=instance_type == "ml.p5.48xlarge",
                spec=job_spec(
                    name,
                    run_id,
                    instance_type=instance_type,
                    instance_count=count,
                    variant_name="b4",
                    spot=instance_type == "ml.p5.48xlarge",
                ),
                failure_reason=reason,
                billable_seconds=812 if completed else None,
                benchmark=benchmark_result(throughput={"tokens_per_s": 41234.5}) if completed else None,
            )
        )
    return run_id


def test_status_table(deployed: Deployed) -> None:
    run_id = _seed_run(deployed.store)
    code, out, err = invoke("status", run_id)
    assert code == 0, err
    assert f"run {run_id} (bench): RUNNING" in out
    assert "predicted cost $12.50" in out
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("│ gs-")}
    assert "COMPLETED" in lines["gs-abc123-t0v0r0-p4d-24xlarge-b4"]
    assert "41,234" in lines["gs-abc123-t0v0r0-p4d-24xlarge-b4"] and "812" in lines["gs-abc123-t0v0r0-p4d-24xlarge-b4"]
    assert "CAPACITY" in lines["gs-abc123-t1v0r0-p5-48xlarge-b4"]
    assert "InsufficientInstanceCapacity" in lines["gs-abc123-t1v0r0-p5-48xlarge-b4"]
    assert "ml.p5e.48xlarge x2" in lines["gs-abc123-t2v0r0-p5e-48xlarge-b4"]


def test_status_shows_a_canarys_row_as_the_canary_of_its_jobs(deployed: Deployed) -> None:
    run_id = _seed_run(deployed.store)
    covered = ["gs-abc123-t0v0r0-p4d-24xlarge-b4", "gs-abc123-t1v0r0-p5-48xlarge-b4"]
    canary = "gs-abc123-t0v0r0-p4d-24xlarge-b4-canary1"
    deployed.store.put_job(
        JobRecord(
            run_id=run_id, job_name=canary, status=JobStatus.COMPLETED,
            instance_type="ml.g5.8xlarge", variant_name="b4", billable_seconds=95, canary_for=covered,
            spec=job_spec(canary, run_id, instance_type="ml.g5.8xlarge", variant_name="b4"),
        )
    )  # fmt: skip
    code, out, err = invoke("status", run_id)
    assert code == 0, err
    [line] = [line for line in out.splitlines() if "-canary1" in line]
    assert "b4 (canary of 2)" in line and "COMPLETED" in line and "95" in line
    code, out, err = invoke("status", run_id, "--format", "json")
    by_name = {job["job_name"]: job for job in json.loads(out)["jobs"]}
    assert by_name["gs-abc123-t0v0r0-p4d-24xlarge-b4-canary1"]["canary_for"] == covered
    assert by_name["gs-abc123-t0v0r0-p4d-24xlarge-b4"]["canary_for"] is None


def test_status_json(deployed: Deployed) -> None:
    run_id = _seed_run(deployed.store)
    code, out, err = invoke("status", run_id, "--format", "json")
    assert code == 0, err
    payload = json.loads(out)
    assert payload["run_id"] == run_id and payload["status"] == "RUNNING"
    assert payload["job_counts"] == {"COMPLETED": 1, "CAPACITY": 1, "TRAINING": 1}
    by_name = {job["job_name"]: job for job in payload["jobs"]}
    assert by_name["gs-abc123-t0v0r0-p4d-24xlarge-b4"]["tokens_per_s"] == 41234.5
    assert by_name["gs-abc123-t1v0r0-p5-48xlarge-b4"]["spot"] is True


def test_status_of_a_rejected_run_lists_its_problems(deployed: Deployed) -> None:
    deployed.store.put_run(
        RunRecord(
            run_id="bad-0123456789ab",
            name="bad",
            status=RunStatus.REJECTED,
            manifest_source=f"s3://{DATA_BUCKET}/manifests/bad.yaml",
            error="s3://.../bad.yaml: 1 problem(s)",
            problems=[{"path": "variants[0].per_device_batch_sise", "message": "unknown field"}],
        )
    )
    code, out, _ = invoke("status", "bad-0123456789ab")
    assert code == 0
    assert "REJECTED" in out and "variants[0].per_device_batch_sise: unknown field" in out


def test_status_of_an_unknown_run(deployed: Deployed) -> None:
    # right after submit the row may not exist yet: the message says so, and where to look if it never does
    code, _, err = invoke("status", "nope-000000000000")
    said = " ".join(err.split())
    assert code == 1
    assert "no run 'nope-000000000000' in stack Gpuscout's table yet" in said and "try again shortly" in said


def test_results_and_report_from_dynamodb_and_s3(deployed: Deployed, tmp_path: Path) -> None:
    run_id = _seed_run(deployed.store)
    stack = CloudStack()
    with pytest.raises(GpuscoutError, match="has no report yet \\(status RUNNING\\)"):
        stack.report_markdown(run_id)
    prefix = f"reports/{run_id}/"
    for name, body in (("report.md", b"# bench\n"), ("report.html", b"<html></html>"), ("charts/cost.png", b"png")):
        deployed.s3.put_object(Bucket=DATA_BUCKET, Key=prefix + name, Body=body)
    deployed.store.put_result(
        ResultRecord(
            run_id=run_id, analysis=run_analysis(run_id, summary="p4d"), report_uri=f"s3://{DATA_BUCKET}/{prefix}"
        )
    )

    run, jobs, result = stack.result(run_id)
    assert run.run_id == run_id and len(jobs) == 3
    assert result is not None and result.analysis.model_dump(mode="json")["recommendation"]["summary"] == "p4d"
    assert stack.report_markdown(run_id) == "# bench\n"
    folder = stack.download_report(run_id, tmp_path / "reports")
    assert folder == tmp_path / "reports" / run_id
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == [
        "charts/cost.png",
        "report.html",
        "report.md",
    ]


def test_runs_results_and_report_of_a_cloud_run_through_the_main_cli(deployed: Deployed, tmp_path: Path) -> None:
    real = CliRunner(env={"COLUMNS": "200"})
    run_id = _seed_run(deployed.store)
    prefix = f"reports/{run_id}/"
    deployed.s3.put_object(Bucket=DATA_BUCKET, Key=prefix + "report.md", Body=b"# bench report\n")
    deployed.s3.put_object(Bucket=DATA_BUCKET, Key=prefix + "report.html", Body=b"<html/>")
    deployed.store.put_result(
        ResultRecord(run_id=run_id, analysis=run_analysis(run_id), report_uri=f"s3://{DATA_BUCKET}/{prefix}")
    )

    listed = real.invoke(cli.app, ["runs", "--stack-name", "Gpuscout"])
    assert listed.exit_code == 0 and run_id in listed.stdout
    results = real.invoke(cli.app, ["results", run_id, "--stack-name", "Gpuscout", "--format", "json"])
    assert results.exit_code == 0 and json.loads(results.stdout)["run_id"] == run_id
    report = real.invoke(cli.app, ["report", run_id, "--stack-name", "Gpuscout", "--download-dir", str(tmp_path)])
    assert report.exit_code == 0 and "# bench report" in report.stdout
    assert (tmp_path / run_id / "report.html").is_file()
    status = real.invoke(cli.app, ["status", run_id])
    assert status.exit_code == 0 and "RUNNING" in status.stdout


def test_submit_refuses_exactly_what_plan_refuses_before_uploading(deployed: Deployed, tmp_path: Path) -> None:
    # Given a valid manifest whose plan is refused: a batch that cannot fit a 24 GB A10G
    data = yaml.safe_load(VALID_TEXT)
    data["targets"] = [{"instance_type": "ml.g5.8xlarge"}]
    data["variants"] = [{"name": "big", "per_device_batch_size": 64}]
    path = tmp_path / "refused.yaml"
    path.write_text(yaml.safe_dump(data))
    planned = runner.invoke(full_app, ["plan", str(path)])
    plan_code, plan_err = planned.exit_code, planned.stderr
    # When it is submitted, Then it is refused the same way (exit 3, same message) and nothing is uploaded
    code, _, err = invoke("submit", str(path), "--wait", "0")
    assert plan_code == code == 3, err
    assert " ".join(err.split()).split(":", 1)[1] == " ".join(plan_err.split()).split(":", 1)[1]
    assert _keys(deployed.s3) == []


def test_the_example_as_shipped_is_refused_with_the_copy_command_before_upload(
    deployed: Deployed, tmp_path: Path
) -> None:
    # Given p4d-to-p5.yaml with its placeholder bucket (the role of a real stack could never read it)
    with pytest.raises(ManifestError) as info:
        CloudStack().submit(_manifest(tmp_path, VALID.read_text()), wait_seconds=0)
    # Then submit refuses it, names the field and the fix, and uploads nothing
    [problem] = info.value.problems
    assert problem.path == "dataset.source" and f"s3://{DATA_BUCKET}/raw/hebrew-text/" in problem.message
    assert _keys(deployed.s3) == []


# -- a job section: the user's own code ---------------------------------------------------------------------------

TWO_TOWER = REPO_DIR / "examples" / "two-tower"


def test_submit_uploads_the_code_folder_then_the_manifest_that_points_at_it(deployed: Deployed, tmp_path: Path) -> None:
    # Given the two-tower cloud manifest beside its code (and a cache folder that must not travel)
    folder = tmp_path / "two-tower"
    shutil.copytree(TWO_TOWER, folder, ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"\0")
    # When it is submitted
    submission = CloudStack().submit(folder / "cloud.yaml", wait_seconds=0)
    # Then the code went up, content-addressed under raw/code/ (the only prefix the SageMaker role reads),
    code_keys = _keys(deployed.s3, "raw/code/")
    [prefix] = {k.rsplit("/", 1)[0] + "/" for k in code_keys}
    assert prefix.startswith("raw/code/two-tower-cloud-") and len(prefix) == len("raw/code/two-tower-cloud-") + 17
    assert sorted(k.removeprefix(prefix) for k in code_keys) == sorted(
        ["cloud.yaml", "local.yaml", "requirements.txt", "train.py"]
    )
    uploaded = deployed.s3.get_object(Bucket=DATA_BUCKET, Key=prefix + "train.py")["Body"].read()
    assert uploaded == (TWO_TOWER / "train.py").read_bytes()
    # and the manifest submitted is the user's with job.source_dir = that folder, which the control plane accepts
    stored = deployed.s3.get_object(Bucket=DATA_BUCKET, Key=submission.key)["Body"].read()
    manifest = parse_manifest(stored, submission.key)
    assert manifest.job is not None and manifest.job.source_dir == f"s3://{DATA_BUCKET}/{prefix}"
    original = load_manifest(folder / "cloud.yaml")
    assert manifest.model_dump(exclude={"job"}) == original.model_dump(exclude={"job"})
    assert manifest.job.model_dump(exclude={"source_dir"}) == original.job.model_dump(exclude={"source_dir"})
    assert source_problems(manifest, data_bucket=DATA_BUCKET) == []
    assert submission.run_id == make_run_id(manifest.name, key=submission.key, etag=submission.etag)

    # When the code changes, Then it is a new folder (a running job's code never changes under it) and a new run
    (folder / "train.py").write_text((folder / "train.py").read_text() + "\n# tuned\n")
    again = CloudStack().submit(folder / "cloud.yaml", wait_seconds=0)
    assert again.run_id != submission.run_id
    assert len({k.rsplit("/", 1)[0] for k in _keys(deployed.s3, "raw/code/")}) == 2


def test_a_job_manifest_with_requirements_under_network_isolation_is_refused_before_upload(
    deployed: Deployed, tmp_path: Path
) -> None:
    folder = tmp_path / "two-tower"
    shutil.copytree(TWO_TOWER, folder)
    text = (
        (folder / "cloud.yaml")
        .read_text()
        .replace("name: two-tower-cloud", "name: two-tower-cloud\nnetwork_isolation: true")
    )
    (folder / "cloud.yaml").write_text(text)
    with pytest.raises(ManifestError) as info:
        CloudStack().submit(folder / "cloud.yaml", wait_seconds=0)
    [problem] = info.value.problems
    assert problem.path == "job.requirements" and "pip cannot install requirements.txt" in problem.message
    assert _keys(deployed.s3) == []


def test_a_zero_gpu_quota_is_refused_at_submit_with_its_name_and_link_and_nothing_is_uploaded(
    deployed: Deployed, tmp_path: Path
) -> None:
    # Given a new account: the first target type's on-demand training quota is 0
    manifest = _manifest(tmp_path)
    target = yaml.safe_load(manifest.read_text())["targets"][0]["instance_type"]
    AccountQuotas.values = {training_quota_name(target, spot=False): 0.0}
    # When it is submitted
    result = CliRunner().invoke(cli.app, ["submit", str(manifest)])
    # Then it is refused before anything is uploaded, naming the quota, its code and where to raise it
    assert result.exit_code != 0
    text = " ".join(result.output.split())
    assert f"the account's quota '{target} for training job usage' (L-" in text and "is 0 in us-east-1" in text
    assert "https://us-east-1.console.aws.amazon.com/servicequotas/home/services/sagemaker/quotas/L-" in text
    assert _keys(deployed.s3) == []


def test_plan_with_a_stack_name_checks_the_accounts_quotas_too(deployed: Deployed, tmp_path: Path) -> None:
    manifest = _manifest(tmp_path)
    # Given quotas that allow the plan, `gpuscout plan --stack-name` says so after the budget
    allowed = runner.invoke(full_app, ["plan", str(manifest), "--stack-name", "Gpuscout"])
    assert allowed.exit_code == 0, allowed.output
    assert "within budget" in allowed.stdout and "quotas allow it (account quotas in us-east-1)" in allowed.stdout
    # When a target's quota is 0 there, it refuses naming the quota, and nothing is uploaded (plan never uploads)
    target = yaml.safe_load(manifest.read_text())["targets"][0]["instance_type"]
    AccountQuotas.values = {training_quota_name(target, spot=False): 0.0}
    refused = runner.invoke(full_app, ["plan", str(manifest), "--stack-name", "Gpuscout"])
    assert refused.exit_code != 0
    assert f"the account's quota '{target} for training job usage'" in " ".join(refused.output.split())
    assert _keys(deployed.s3) == []
    # When the quotas cannot be read, it says they were not checked, never that they allow it
    AccountQuotas.denied = True
    try:
        unread = runner.invoke(full_app, ["plan", str(manifest), "--stack-name", "Gpuscout"])
    finally:
        AccountQuotas.denied = False
    assert unread.exit_code == 0 and "could not read the account's SageMaker quotas" in " ".join(unread.stdout.split())
    assert "quotas not checked" in unread.stdout and "quotas allow it" not in unread.stdout


def test_plan_with_a_stack_name_says_where_a_canary_too_large_for_the_canary_type_runs(deployed: Deployed) -> None:
    from gpuscout import paths

    # Given the shipped Qwen2.5-7B manifest and a stack whose canaries run on ml.g5.8xlarge (24 GB)
    outputs = {
        "DataBucketName": DATA_BUCKET,
        "ArtifactsBucketName": ARTIFACTS_BUCKET,
        "ResultsTableName": TABLE,
        "StateMachineArn": deployed.state_machine_arn,
        "CanaryInstanceType": "ml.g5.8xlarge",
    }
    cloudformation = boto3.client("cloudformation", region_name=REGION)
    template = {  # the same resources (Gpuscout's stack made the data bucket): its outputs with the canary type
        "Resources": {"Topic": {"Type": "AWS::SNS::Topic"}},
        "Outputs": {name: {"Value": value} for name, value in outputs.items()},
    }
    cloudformation.create_stack(StackName="Canaried", TemplateBody=json.dumps(template))
    manifest = str(paths.MANIFESTS_DIR / "p4d-to-p5.yaml")
    result = runner.invoke(full_app, ["plan", manifest, "--stack-name", "Canaried"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    # Then each canary that would not fit is named with where it runs instead, and the canaries' cost is shown
    assert text.count("but ml.g5.8xlarge has 24 GB (90% usable): runs on one ml.p") == 3
    assert "3 canaries before the jobs, predicted $" in text
    assert "the stack runs in" not in text  # the price snapshot's region is the stack's


def test_plan_says_when_the_price_snapshot_is_another_regions(
    deployed: Deployed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from gpuscout import paths

    config = tmp_path / "configs"
    shutil.copytree(paths.CONFIG_DIR, config)
    snapshot = json.loads((config / "pricing" / "sagemaker.json").read_text())
    (config / "pricing" / "sagemaker.json").write_text(json.dumps({**snapshot, "region": "eu-west-1"}))
    monkeypatch.setattr(paths, "CONFIG_DIR", config)
    result = runner.invoke(full_app, ["plan", str(paths.MANIFESTS_DIR / "smoke-g5.yaml"), "--stack-name", "Gpuscout"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert f"the plan used eu-west-1 rates (the price snapshot); the stack runs in {REGION}" in text
    assert f"gpuscout catalog --refresh --region {REGION}" in text


def test_submit_over_budget_is_refused_before_anything_is_uploaded(deployed: Deployed, tmp_path: Path) -> None:
    # Given a manifest whose plan costs more than its budget
    text = re.sub(r"budget_usd: [0-9.]+", "budget_usd: 0.01", VALID_TEXT)
    assert text != VALID_TEXT
    code, out, err = invoke("submit", str(_manifest(tmp_path, text)), "--wait", "0")
    # Then submit exits 3 with the budget named, and the bucket holds nothing (no run started)
    assert code == 3, out + err
    assert "budget" in err and "Traceback" not in out + err
    assert _keys(deployed.s3) == []
