"""A hostile training job on moto with IAM enforced: the synthesized policies and the run role the run_role
function creates decide what it may write.

A bring-your-own script (or any package it installs) runs with its run's own role (gpuscout.cloud.run_roles) and
network access. It must not be able to write the workflow's launch requests (plans/, search/), the prepared-data
cache, reports, manifests, sources, or another run's results and checkpoints; it may write only its own run's job
output and checkpoints. Data preparation's role alone writes the cache. (moto evaluates the role's inline and attached
policies, not its permissions boundary; test_iam checks the boundary allows no more than job output and checkpoints.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws, settings
from moto.core.authorization import ActionAuthenticatorMixin

from gpuscout.cloud import run_roles
from gpuscout.cloud.settings import LambdaSettings
from tests.infra.conftest import Synthesized, managed_policy_statements, policy_statements

ACCOUNT, REGION = "123456789012", "us-east-1"
DATA, ARTIFACTS = "gs-data-bucket", "gs-artifacts-bucket"
RUN, OTHER_RUN = "run-a", "run-b"
TRUST = {
    "Version": "2012-10-17",
    "Statement": [
        {"Effect": "Allow", "Principal": {"AWS": f"arn:aws:iam::{ACCOUNT}:root"}, "Action": "sts:AssumeRole"}
    ],
}
# 2 buckets; the processing role and its policy; the run roles' runtime policy and boundary; run-a's role (create,
# attach, put: run_roles.create_run_role); 2 assume-role calls. Then every call is authorized by its policies.
SETUP_CALLS = 11


def _resolved(value: Any, buckets: dict[str, str]) -> Any:
    """The policy with CloudFormation's references made concrete: the buckets' ARNs, this account and region."""
    if isinstance(value, list):
        return [_resolved(v, buckets) for v in value]
    if not isinstance(value, dict):
        return value
    if "Fn::Join" in value:
        separator, parts = value["Fn::Join"]
        return separator.join(str(_resolved(p, buckets)) for p in parts)
    if "Fn::GetAtt" in value:
        logical_id, attribute = value["Fn::GetAtt"]
        if logical_id in buckets and attribute == "Arn":
            return f"arn:aws:s3:::{buckets[logical_id]}"
        return f"arn:aws:ecr:{REGION}:{ACCOUNT}:repository/{logical_id.lower()}"  # not an S3 resource
    if "Ref" in value:
        return {"AWS::Partition": "aws", "AWS::Region": REGION, "AWS::AccountId": ACCOUNT}.get(
            value["Ref"], buckets.get(value["Ref"], value["Ref"])
        )
    return {k: _resolved(v, buckets) for k, v in value.items()}


def _document(statements: list[dict[str, Any]], buckets: dict[str, str]) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": _resolved(statements, buckets)})


@pytest.fixture
def clients(synthesized: Synthesized, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """S3 clients acting as run-a's own role (made by the run_role function's code, with the synthesized runtime
    policy attached) and as data preparation's role, on moto with IAM enforced."""
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": REGION}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    storage, roles = synthesized.stack.storage, synthesized.stack.roles
    buckets = {synthesized.logical_id(storage.data): DATA, synthesized.logical_id(storage.artifacts): ARTIFACTS}

    # moto authorizes every call after the first SETUP_CALLS against the caller's IAM policies (what
    # set_initial_no_auth_action_count does around a function, held here for the whole test)
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", SETUP_CALLS)
    monkeypatch.setattr(ActionAuthenticatorMixin, "request_count", 0)
    with mock_aws():
        s3 = boto3.client("s3", region_name=REGION)
        for bucket in (DATA, ARTIFACTS):
            s3.create_bucket(Bucket=bucket)
        iam = boto3.client("iam", region_name=REGION)
        sts = boto3.client("sts", region_name=REGION)
        iam.create_role(RoleName="processing", AssumeRolePolicyDocument=json.dumps(TRUST))
        processing = _document(policy_statements(synthesized, roles.processing), buckets)
        iam.put_role_policy(RoleName="processing", PolicyName="synthesized", PolicyDocument=processing)
        arns = {
            name: iam.create_policy(
                PolicyName=name, PolicyDocument=_document(managed_policy_statements(synthesized, policy), buckets)
            )["Policy"]["Arn"]
            for name, policy in (("runtime", roles.job_runtime_policy), ("boundary", roles.run_role_boundary))
        }
        run_settings = _settings(runtime=arns["runtime"], boundary=arns["boundary"])
        run_role = run_roles.create_run_role(iam, run_settings, RUN)
        acting = {}
        for name, arn in (("training", run_role), ("processing", f"arn:aws:iam::{ACCOUNT}:role/processing")):
            c = sts.assume_role(RoleArn=arn, RoleSessionName="job")["Credentials"]
            acting[name] = boto3.client(
                "s3", region_name=REGION, aws_access_key_id=c["AccessKeyId"],
                aws_secret_access_key=c["SecretAccessKey"], aws_session_token=c["SessionToken"],
            )  # fmt: skip
        yield acting


def _settings(*, runtime: str, boundary: str) -> LambdaSettings:
    return LambdaSettings.model_validate(
        {
            "TABLE_NAME": "gs-table",
            "DATA_BUCKET": DATA,
            "ARTIFACTS_BUCKET": ARTIFACTS,
            "PROCESSING_ROLE_ARN": f"arn:aws:iam::{ACCOUNT}:role/processing",
            "RUN_ROLE_PATH": "/gpuscout/us-east-1/Gpuscout/",
            "RUN_ROLE_BOUNDARY_ARN": boundary,
            "JOB_RUNTIME_POLICY_ARN": runtime,
            "RUN_ROLE_PROPAGATION_SECONDS": "0",
            "TRAINING_IMAGE_URI": f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/gpuscout:latest",
            "AWS_REGION": REGION,
        }
    )


def _denied(call: Any, **kwargs: Any) -> bool:
    try:
        call(**kwargs)
    except ClientError as err:
        return err.response["Error"]["Code"] in {"AccessDenied", "403"}
    return False


@pytest.mark.parametrize(
    ("bucket", "key", "what"),
    [
        (ARTIFACTS, "plans/run-b/jobs.json", "a run's launch requests (the state machine launches what they say)"),
        (ARTIFACTS, "search/run-b/gs-abc-t00.json", "a search's candidates"),
        (DATA, "processed/0123abcd/dataset.json", "the prepared-data cache other runs read"),
        (DATA, "reports/run-b/report.html", "another run's report"),
        (DATA, "manifests/run-c.yaml", "a manifest (it would start a run)"),
        (DATA, "rejected/run-c.error.json", "a rejection"),
        (DATA, "raw/datasets/corpus/part-0.jsonl", "the user's sources"),
        (ARTIFACTS, f"output/{OTHER_RUN}/gs-def-t0v0r0-y/output/output.tar.gz", "another run's results"),
        (ARTIFACTS, f"checkpoints/{OTHER_RUN}/gs-def-t0v0r0-y/step-00000010/state.pt", "another run's checkpoint"),
        (ARTIFACTS, f"output/{RUN}-r2/gs-abc-t0v0r0-x/output/output.tar.gz", "a later attempt's results"),
    ],
)
def test_a_hostile_job_cannot_write_outside_its_output_and_checkpoints(
    clients: dict[str, Any], bucket: str, key: str, what: str
) -> None:
    job = clients["training"]
    assert _denied(job.put_object, Bucket=bucket, Key=key, Body=b"{}"), f"a job could write {what}"
    assert _denied(job.delete_object, Bucket=bucket, Key=key), f"a job could delete {what}"


def test_a_job_writes_its_output_and_checkpoints_and_reads_its_inputs(clients: dict[str, Any]) -> None:
    job = clients["training"]
    job.put_object(Bucket=ARTIFACTS, Key=f"output/{RUN}/gs-abc-t0v0r0-x/output/output.tar.gz", Body=b"tar")
    job.put_object(Bucket=ARTIFACTS, Key=f"checkpoints/{RUN}/gs-abc-t0v0r0-x/step-00000010/state.pt", Body=b"pt")
    assert job.get_object(Bucket=ARTIFACTS, Key=f"checkpoints/{RUN}/gs-abc-t0v0r0-x/step-00000010/state.pt")
    listed = job.list_objects_v2(Bucket=ARTIFACTS, Prefix=f"checkpoints/{RUN}/gs-abc-t0v0r0-x/")  # checkpoint sync
    assert [o["Key"] for o in listed["Contents"]] == [f"checkpoints/{RUN}/gs-abc-t0v0r0-x/step-00000010/state.pt"]
    assert _denied(job.get_object, Bucket=ARTIFACTS, Key="plans/run-a/jobs.json")  # nor read the launch requests


def test_only_data_preparation_writes_the_cache(clients: dict[str, Any]) -> None:
    prep = clients["processing"]
    prep.put_object(Bucket=DATA, Key="processed/0123abcd/dataset.json", Body=b"{}")
    assert clients["training"].get_object(Bucket=DATA, Key="processed/0123abcd/dataset.json")["Body"].read() == b"{}"
    assert _denied(prep.put_object, Bucket=ARTIFACTS, Key="output/run-a/x", Body=b"")
    assert _denied(prep.put_object, Bucket=ARTIFACTS, Key="plans/run-a/jobs.json", Body=b"[]")
