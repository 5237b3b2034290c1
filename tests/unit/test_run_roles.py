"""Each run's own SageMaker role (gpuscout.cloud.run_roles), created and deleted against moto IAM."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws

from gpuscout.cloud import run_roles
from gpuscout.cloud.settings import LambdaSettings
from gpuscout.cloud.step_errors import CloudStepError
from gpuscout.store.base import RunRecord, RunStatus
from gpuscout.store.sqlite import SqliteStore

ACCOUNT = "123456789012"


def _settings(iam: Any, path: str = "/gpuscout/us-east-1/Gpuscout/") -> LambdaSettings:
    document = json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:ListBucket",
                                                                    "Resource": "*"}]})  # fmt: skip
    arns = {
        name: iam.create_policy(PolicyName=f"{name}{path.replace('/', '-')}", PolicyDocument=document)["Policy"]["Arn"]
        for name in ("runtime", "boundary")
    }
    return LambdaSettings.model_validate(
        {
            "TABLE_NAME": "gs-table",
            "DATA_BUCKET": "gs-data",
            "ARTIFACTS_BUCKET": "gs-artifacts",
            "PROCESSING_ROLE_ARN": f"arn:aws:iam::{ACCOUNT}:role/gs-processing",
            "RUN_ROLE_PATH": path,
            "RUN_ROLE_BOUNDARY_ARN": arns["boundary"],
            "JOB_RUNTIME_POLICY_ARN": arns["runtime"],
            "TRAINING_IMAGE_URI": f"{ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com/gpuscout:latest",
            "AWS_REGION": "us-east-1",
        }
    )


@pytest.fixture
def iam(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "testing")
    with mock_aws():
        yield boto3.client("iam", region_name="us-east-1")


def test_a_run_role_has_the_boundary_the_runtime_policy_and_its_runs_prefixes_only(iam: Any) -> None:
    settings = _settings(iam)
    waited: list[float] = []
    arn = run_roles.create_run_role(iam, settings, "demo-0123abcd", sleep=waited.append)
    # a new role is given IAM's propagation delay before the first job is created with it
    assert settings.run_role_propagation_s == 15.0 and len(waited) == 1 and 14.0 < waited[0] <= 15.0
    name = run_roles.run_role_name(settings, "demo-0123abcd")
    assert (
        arn
        == f"arn:aws:iam::{ACCOUNT}:role/gpuscout/us-east-1/Gpuscout/{name}"
        == run_roles.run_role_arn(settings, "demo-0123abcd")
    )
    assert name.startswith("gs-run-") and len(name) == 39
    role = iam.get_role(RoleName=name)["Role"]
    assert role["Path"] == "/gpuscout/us-east-1/Gpuscout/"
    assert role["PermissionsBoundary"]["PermissionsBoundaryArn"] == settings.run_role_boundary_arn
    assert role["AssumeRolePolicyDocument"] == run_roles.trust_policy(settings)
    assert {t["Key"]: t["Value"] for t in iam.list_role_tags(RoleName=name)["Tags"]} == {
        "gpuscout:run_id": "demo-0123abcd"
    }
    attached = iam.list_attached_role_policies(RoleName=name)["AttachedPolicies"]
    assert [p["PolicyArn"] for p in attached] == [settings.job_runtime_policy_arn]
    assert iam.list_role_policies(RoleName=name)["PolicyNames"] == [run_roles.RUN_POLICY_NAME]
    inline = iam.get_role_policy(RoleName=name, PolicyName=run_roles.RUN_POLICY_NAME)["PolicyDocument"]
    assert inline == run_roles.run_policy(settings, "demo-0123abcd")
    assert "output/demo-0123abcd/" in json.dumps(inline) and "output/*" not in json.dumps(inline)


def test_creating_again_is_a_retry_and_deleting_leaves_nothing(iam: Any) -> None:
    settings = _settings(iam)
    waited: list[float] = []
    first = run_roles.create_run_role(iam, settings, "demo-0123abcd", sleep=waited.append)
    # a retried step 10 s later waits only what is left of the delay; 20 s later, not at all
    for later, left in ((10, 5.0), (20, None)):
        again = run_roles.create_run_role(
            iam, settings, "demo-0123abcd", sleep=waited.append,
            now=lambda later=later: datetime.now(UTC) + timedelta(seconds=later),
        )  # fmt: skip
        assert again == first
        assert (waited[-1] == pytest.approx(left, abs=1.0)) if left else len(waited) == 2
    assert len(iam.list_roles(PathPrefix="/gpuscout/")["Roles"]) == 1
    assert run_roles.delete_run_role(iam, settings, "demo-0123abcd") is True
    assert iam.list_roles(PathPrefix="/gpuscout/")["Roles"] == []
    # deleting again (the analysis' step, then mark_run_failed) or a role never created: nothing to do
    assert run_roles.delete_run_role(iam, settings, "demo-0123abcd") is False
    assert run_roles.delete_run_role(iam, settings, "never-created") is False
    # a role whose runtime policy the stack has since replaced: what it has attached is detached, whatever its ARN
    run_roles.create_run_role(iam, settings, "demo-0123abcd", sleep=lambda _: None)
    name = run_roles.run_role_name(settings, "demo-0123abcd")
    older = iam.create_policy(
        PolicyName="runtime-before", PolicyDocument=json.dumps(run_roles.run_policy(settings, "x"))
    )
    iam.attach_role_policy(RoleName=name, PolicyArn=older["Policy"]["Arn"])
    assert run_roles.delete_run_role(iam, settings, "demo-0123abcd") is True
    # the runtime policy itself stays (the stack owns it)
    assert iam.get_policy(PolicyArn=settings.job_runtime_policy_arn)["Policy"]["Arn"] == settings.job_runtime_policy_arn


def test_two_stacks_in_one_account_never_share_a_run_role(iam: Any) -> None:
    # another stack name, or the same stack name in another region (IAM is global; the path names both)
    one, other = _settings(iam), _settings(iam, path="/gpuscout/eu-west-1/Gpuscout/")
    assert run_roles.run_role_name(one, "demo-0123abcd") != run_roles.run_role_name(other, "demo-0123abcd")
    run_roles.create_run_role(iam, one, "demo-0123abcd", sleep=lambda _: None)
    run_roles.create_run_role(iam, other, "demo-0123abcd", sleep=lambda _: None)
    assert len(iam.list_roles(PathPrefix="/gpuscout/")["Roles"]) == 2


def test_a_role_of_that_name_without_the_boundary_is_not_taken_over(iam: Any) -> None:
    settings = _settings(iam)
    name = run_roles.run_role_name(settings, "demo-0123abcd")
    iam.create_role(Path="/gpuscout/us-east-1/Gpuscout/", RoleName=name, AssumeRolePolicyDocument=json.dumps({}))
    with pytest.raises(CloudStepError, match="not this stack's run role"):
        run_roles.create_run_role(iam, settings, "demo-0123abcd")
    assert iam.list_attached_role_policies(RoleName=name)["AttachedPolicies"] == []
    # nor one with this stack's boundary that trusts someone else
    iam.delete_role(RoleName=name)
    outsider = {"AWS": "arn:aws:iam::999999999999:root"}
    foreign = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                       "Principal": outsider}]}  # fmt: skip
    iam.create_role(Path="/gpuscout/us-east-1/Gpuscout/", RoleName=name, AssumeRolePolicyDocument=json.dumps(foreign),
                    PermissionsBoundary=settings.run_role_boundary_arn)  # fmt: skip
    with pytest.raises(CloudStepError, match="trust policy differs"):
        run_roles.create_run_role(iam, settings, "demo-0123abcd")
    assert iam.list_attached_role_policies(RoleName=name)["AttachedPolicies"] == []


@pytest.mark.parametrize("run_id", ["", "Demo", "demo/../x", "demo*", "demo?", "-demo", "x" * 64])
def test_only_a_gpuscout_run_id_goes_into_a_policy(iam: Any, run_id: str) -> None:
    settings = _settings(iam)
    with pytest.raises(CloudStepError, match="is not a gpuscout run id"):
        run_roles.run_policy(settings, run_id)
    with pytest.raises(CloudStepError, match="is not a gpuscout run id"):
        run_roles.create_run_role(iam, settings, run_id)
    assert iam.list_roles(PathPrefix="/gpuscout/")["Roles"] == []


def _run(run_id: str, status: RunStatus, updated_at: datetime) -> RunRecord:
    return RunRecord(run_id=run_id, name=run_id, status=status, manifest_source="s3://gs-data/manifests/x.yaml",
                     created_at=updated_at, updated_at=updated_at)  # fmt: skip


def test_the_sweep_deletes_only_roles_whose_run_ended_over_an_hour_ago(iam: Any, tmp_path: Path) -> None:
    settings, store = _settings(iam), SqliteStore(tmp_path / "runs.db")
    now = datetime.now(UTC)
    ended_long_ago, ended_just_now, running = "demo-aaaa", "demo-bbbb", "demo-cccc"
    store.put_run(_run(ended_long_ago, RunStatus.SUCCEEDED, now - timedelta(hours=2)))  # "Delete run role" failed
    store.put_run(_run(ended_just_now, RunStatus.STOPPED, now - timedelta(minutes=10)))  # its jobs are stopping
    store.put_run(_run(running, RunStatus.RUNNING, now - timedelta(hours=30)))
    for run_id in (ended_long_ago, ended_just_now, running):
        run_roles.create_run_role(iam, settings, run_id, sleep=lambda _: None)
    # a role of another stack (another path) and one under this path this code did not create are not touched
    other = _settings(iam, path="/gpuscout/eu-west-1/Gpuscout/")
    run_roles.create_run_role(iam, other, ended_long_ago, sleep=lambda _: None)
    iam.create_role(Path=settings.run_role_path, RoleName="gs-run-handmade", AssumeRolePolicyDocument="{}",
                    Tags=[{"Key": run_roles.RUN_ID_TAG, "Value": ended_long_ago}])  # fmt: skip

    assert run_roles.sweep_run_roles(iam, store, settings, now=now) == run_roles.RoleSweep(swept=[ended_long_ago])
    left = {r["RoleName"] for r in iam.list_roles(PathPrefix="/gpuscout/")["Roles"]}
    assert left == {
        run_roles.run_role_name(settings, ended_just_now),
        run_roles.run_role_name(settings, running),
        run_roles.run_role_name(other, ended_long_ago),
        "gs-run-handmade",
    }
    # an hour later the stopped run's role goes too; a role whose run is unknown goes once it is over an hour old
    store.put_run(_run(ended_just_now, RunStatus.STOPPED, now - timedelta(hours=1, minutes=1)))
    run_roles.create_run_role(iam, settings, "demo-unknown", sleep=lambda _: None)
    assert run_roles.sweep_run_roles(iam, store, settings, now=now).swept == [ended_just_now]
    assert run_roles.sweep_run_roles(iam, store, settings, now=now + timedelta(hours=2)).swept == ["demo-unknown"]


class _FailingDelete:
    """The IAM client, except that deleting ``role`` fails as an IAM outage would."""

    def __init__(self, iam: Any, role: str) -> None:
        self._iam, self._role = iam, role

    def __getattr__(self, name: str) -> Any:
        return getattr(self._iam, name)

    def delete_role(self, **kwargs: Any) -> Any:
        if kwargs["RoleName"] == self._role:
            raise ClientError({"Error": {"Code": "ServiceFailure", "Message": "try later"}}, "DeleteRole")
        return self._iam.delete_role(**kwargs)


def test_one_role_that_cannot_be_deleted_does_not_stop_the_sweep(iam: Any, tmp_path: Path) -> None:
    settings, store = _settings(iam), SqliteStore(tmp_path / "runs.db")
    now = datetime.now(UTC)
    for run_id in ("demo-aaaa", "demo-bbbb"):
        store.put_run(_run(run_id, RunStatus.FAILED, now - timedelta(hours=2)))
        run_roles.create_run_role(iam, settings, run_id, sleep=lambda _: None)
    stuck = run_roles.run_role_name(settings, "demo-aaaa")
    sweep = run_roles.sweep_run_roles(_FailingDelete(iam, stuck), store, settings, now=now)
    assert sweep.swept == ["demo-bbbb"]
    [error] = sweep.errors
    assert stuck in error and "try later" in error
    assert [r["RoleName"] for r in iam.list_roles(PathPrefix="/gpuscout/")["Roles"]] == [stuck]
    # the next check deletes it
    assert run_roles.sweep_run_roles(iam, store, settings, now=now) == run_roles.RoleSweep(swept=["demo-aaaa"])
