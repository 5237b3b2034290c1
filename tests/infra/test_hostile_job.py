"""A hostile training job on moto with IAM enforced: the synthesized roles' own policies decide what it may write.

A bring-your-own script (or any package it installs) runs with the training jobs' role and network access. It must
not be able to write the workflow's launch requests (plans/, search/), the prepared-data cache, reports, manifests or
sources; it may write only job output and checkpoints. Data preparation's role alone writes the cache.
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

from tests.infra.conftest import Synthesized, policy_statements

ACCOUNT, REGION = "123456789012", "us-east-1"
DATA, ARTIFACTS = "gs-data-bucket", "gs-artifacts-bucket"
TRUST = {
    "Version": "2012-10-17",
    "Statement": [
        {"Effect": "Allow", "Principal": {"AWS": f"arn:aws:iam::{ACCOUNT}:root"}, "Action": "sts:AssumeRole"}
    ],
}
SETUP_CALLS = 8  # 2 buckets, 2 roles, 2 policies, 2 assume-role calls: then every call is authorized by its policy


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


@pytest.fixture
def clients(synthesized: Synthesized, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """S3 clients acting as the training jobs' role and as data preparation's role, on moto with IAM enforced."""
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": REGION}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    storage, roles = synthesized.stack.storage, synthesized.stack.roles
    buckets = {synthesized.logical_id(storage.data): DATA, synthesized.logical_id(storage.artifacts): ARTIFACTS}
    documents = {
        name: {"Version": "2012-10-17", "Statement": _resolved(policy_statements(synthesized, role), buckets)}
        for name, role in (("training", roles.sagemaker), ("processing", roles.processing))
    }

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
        acting = {}
        for name, document in documents.items():
            iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(TRUST))
            iam.put_role_policy(RoleName=name, PolicyName="synthesized", PolicyDocument=json.dumps(document))
        for name in documents:
            creds = sts.assume_role(RoleArn=f"arn:aws:iam::{ACCOUNT}:role/{name}", RoleSessionName="job")
            c = creds["Credentials"]
            acting[name] = boto3.client(
                "s3", region_name=REGION, aws_access_key_id=c["AccessKeyId"],
                aws_secret_access_key=c["SecretAccessKey"], aws_session_token=c["SessionToken"],
            )  # fmt: skip
        yield acting


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
    job.put_object(Bucket=ARTIFACTS, Key="output/run-a/gs-abc-t0v0r0-x/output/output.tar.gz", Body=b"tar")
    job.put_object(Bucket=ARTIFACTS, Key="checkpoints/run-a/gs-abc-t0v0r0-x/step-00000010/state.pt", Body=b"pt")
    assert job.get_object(Bucket=ARTIFACTS, Key="checkpoints/run-a/gs-abc-t0v0r0-x/step-00000010/state.pt")
    assert _denied(job.get_object, Bucket=ARTIFACTS, Key="plans/run-a/jobs.json")  # nor read the launch requests


def test_only_data_preparation_writes_the_cache(clients: dict[str, Any]) -> None:
    prep = clients["processing"]
    prep.put_object(Bucket=DATA, Key="processed/0123abcd/dataset.json", Body=b"{}")
    assert clients["training"].get_object(Bucket=DATA, Key="processed/0123abcd/dataset.json")["Body"].read() == b"{}"
    assert _denied(prep.put_object, Bucket=ARTIFACTS, Key="output/run-a/x", Body=b"")
    assert _denied(prep.put_object, Bucket=ARTIFACTS, Key="plans/run-a/jobs.json", Body=b"[]")
