"""Each run's own SageMaker execution role: a run's jobs write only that run's output and checkpoints.

A bring-your-own training script (or any package it installs) runs with its job's role and network access. With one
role for every run, a job could overwrite another run's output archive (the results its recorder reads) or plant a
checkpoint another run's job resumes from. So the workflow creates a role per run (the "Create run role" step,
before the first job) and deletes it when the run ends ("Delete run role" after the analysis, and mark_run_failed
for every other ending; the scheduled budget check sweeps a role left an hour after its run ended):

- its inline policy (RUN_POLICY_NAME) grants the artifacts bucket's ``output/<run_id>/`` and
  ``checkpoints/<run_id>/`` only;
- everything else a job needs (the image, logs, metrics, reading sources and prepared data, VPC interfaces, MLflow)
  is the stack's job runtime managed policy, attached to every run role;
- the stack's permissions boundary caps the role at what one shared job role would have, so even the function
  that creates run roles cannot grant a run role more (its CreateRole grant requires that boundary, and it may
  attach no other managed policy).

Why not one role with session tags (SageMaker's ABAC for multi-tenant training): SageMaker chains session tags from
the session that calls CreateTrainingJob, and here that is Step Functions' ``.sync`` integration, which passes none;
hyperparameter tuning jobs take no SessionChainingConfig at all. A role per run covers canaries, jobs and a
search's trials alike and keeps the ``.sync`` integrations (which stop a run's jobs when its execution is stopped).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import unquote

from botocore.exceptions import BotoCoreError, ClientError

from gpuscout.cloud.settings import LambdaSettings
from gpuscout.cloud.step_errors import CloudStepError
from gpuscout.domain.names import (
    CHECKPOINTS_PREFIX,
    OUTPUT_PREFIX,
    RUN_ARTIFACT_ACTIONS,
    RUN_ROLE_NAME_PREFIX,
    SAGEMAKER_SERVICE,
)
from gpuscout.errors import GpuscoutError, RunNotFoundError
from gpuscout.store.base import FINAL_RUN_STATUSES, ResultStore, as_utc

RUN_POLICY_NAME = "run-artifacts"
RUN_ID_TAG = "gpuscout:run_id"  # on each run role: which run it is (the sweep reads it)
# make_run_id's alphabet (plan.jobs): nothing in a run id can act as an IAM wildcard (* ?) or end a path segment.
_RUN_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_MISSING = {"NoSuchEntity", "NoSuchEntityException"}


def _checked_run_id(run_id: str) -> str:
    if not _RUN_ID.match(run_id):
        raise CloudStepError(f"run id {run_id!r} is not a gpuscout run id (lowercase letters, digits, hyphens)")
    return run_id


def run_role_name(settings: LambdaSettings, run_id: str) -> str:
    """``gs-run-<hash>``: IAM role names are unique per account (IAM is global), so the hash covers the stack's role
    path (one per stack and region) and the run id; 39 characters, within IAM's 64."""
    digest = hashlib.sha256(f"{settings.run_role_path}\x00{_checked_run_id(run_id)}".encode()).hexdigest()
    return f"{RUN_ROLE_NAME_PREFIX}{digest[:32]}"


def run_role_arn(settings: LambdaSettings, run_id: str) -> str:
    name = run_role_name(settings, run_id)
    return f"arn:{settings.partition}:iam::{settings.account}:role{settings.run_role_path}{name}"


def trust_policy(settings: LambdaSettings) -> dict[str, Any]:
    """SageMaker may assume the role, for jobs of this account and region only (confused-deputy guard)."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Principal": {"Service": SAGEMAKER_SERVICE},
                "Action": "sts:AssumeRole",
                "Condition": {
                    "StringEquals": {"aws:SourceAccount": settings.account},
                    "ArnLike": {
                        "aws:SourceArn": f"arn:{settings.partition}:sagemaker:{settings.region}:{settings.account}:*"
                    },
                },
            }
        ],
    }


def run_policy(settings: LambdaSettings, run_id: str) -> dict[str, Any]:
    """The run's own prefixes of the artifacts bucket: SageMaker uploads job output under ``output/<run_id>/`` and
    syncs checkpoints under ``checkpoints/<run_id>/`` both ways (read, write, delete, list)."""
    run_id = _checked_run_id(run_id)
    bucket = f"arn:{settings.partition}:s3:::{settings.artifacts_bucket}"
    prefixes = [f"{prefix}{run_id}/" for prefix in (OUTPUT_PREFIX, CHECKPOINTS_PREFIX)]
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "RunArtifacts",
                "Effect": "Allow",
                "Action": list(RUN_ARTIFACT_ACTIONS),
                "Resource": [f"{bucket}/{prefix}*" for prefix in prefixes],
            },
            {
                "Sid": "ListRunArtifacts",
                "Effect": "Allow",
                "Action": "s3:ListBucket",
                "Resource": bucket,
                "Condition": {"StringLike": {"s3:prefix": [f"{prefix}*" for prefix in prefixes]}},
            },
        ],
    }


def _code(err: ClientError) -> str:
    return str(err.response.get("Error", {}).get("Code", ""))


def create_run_role(
    iam: Any,
    settings: LambdaSettings,
    run_id: str,
    *,
    sleep: Callable[[float], None] = time.sleep,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> str:
    """Create the run's role (boundary, runtime policy, the run's prefixes) and return its ARN. Idempotent: a retried
    step finds the role it created and puts the same policies again. A new role reaches SageMaker only after IAM's
    propagation delay (AWS: "not immediately visible"), and the first CreateTrainingJob may follow within seconds, so
    the role is returned once it is ``settings.run_role_propagation_s`` old (a retried step waits only what is left);
    attaching and putting its policies right after the create are retried on the same delay."""
    name = run_role_name(settings, run_id)
    try:
        try:
            role = iam.create_role(
                Path=settings.run_role_path,
                RoleName=name,
                AssumeRolePolicyDocument=json.dumps(trust_policy(settings)),
                Description=f"gpuscout run {run_id}: its SageMaker jobs (untrusted code)",
                MaxSessionDuration=3600,
                PermissionsBoundary=settings.run_role_boundary_arn,
                Tags=[{"Key": RUN_ID_TAG, "Value": run_id}],
            )["Role"]
        except ClientError as err:
            if _code(err) != "EntityAlreadyExists":
                raise
            role = iam.get_role(RoleName=name)["Role"]
            _check_is_ours(role, settings, run_id, name, err)
        policy = json.dumps(run_policy(settings, run_id))
        for attempt in range(POLICY_ATTEMPTS):
            try:
                iam.attach_role_policy(RoleName=name, PolicyArn=settings.job_runtime_policy_arn)
                iam.put_role_policy(RoleName=name, PolicyName=RUN_POLICY_NAME, PolicyDocument=policy)
                break
            except ClientError as err:  # the new role (or its boundary) not visible to IAM's next call yet
                if _code(err) not in {*_MISSING, "AccessDenied"} or attempt == POLICY_ATTEMPTS - 1:
                    raise
                sleep(2.0**attempt)
    except (ClientError, BotoCoreError) as err:
        raise CloudStepError(f"cannot create the role of run {run_id}: {err}") from err
    age = (now() - as_utc(role["CreateDate"])).total_seconds()
    if age < settings.run_role_propagation_s:
        sleep(settings.run_role_propagation_s - max(age, 0.0))
    return run_role_arn(settings, run_id)


POLICY_ATTEMPTS = 4  # attach + put right after CreateRole: waits of 1, 2 and 4 s between them


def _check_is_ours(role: dict[str, Any], settings: LambdaSettings, run_id: str, name: str, err: Exception) -> None:
    """A role of the run role's name exists (a retry of this step, or a name clash): it must be this stack's run role,
    path, boundary and trust included, or it is not touched."""
    boundary = role.get("PermissionsBoundary", {}).get("PermissionsBoundaryArn")
    trust = role.get("AssumeRolePolicyDocument")  # botocore decodes it into a dict
    try:
        trust = json.loads(unquote(trust)) if isinstance(trust, str) else trust
    except ValueError:
        trust = None
    if (role.get("Path"), boundary, trust) != (
        settings.run_role_path,
        settings.run_role_boundary_arn,
        trust_policy(settings),
    ):
        raise CloudStepError(
            f"role {name} exists but is not this stack's run role for {run_id} (path "
            f"{role.get('Path')}, boundary {boundary}, or its trust policy differs)"
        ) from err


def delete_run_role(iam: Any, settings: LambdaSettings, run_id: str) -> bool:
    """Delete the run's role: every inline policy and managed attachment it has (listed, so a runtime policy the stack
    replaced since is detached too), then the role. True when a role was deleted, False when there was none (never
    created, or deleted already)."""
    name = run_role_name(settings, run_id)
    try:
        for policy in iam.list_role_policies(RoleName=name)["PolicyNames"]:
            iam.delete_role_policy(RoleName=name, PolicyName=policy)
        for attached in iam.list_attached_role_policies(RoleName=name)["AttachedPolicies"]:
            iam.detach_role_policy(RoleName=name, PolicyArn=attached["PolicyArn"])
        iam.delete_role(RoleName=name)
    except ClientError as err:
        if _code(err) in _MISSING:
            return False
        raise CloudStepError(f"cannot delete the role of run {run_id}: {err}") from err
    except BotoCoreError as err:
        raise CloudStepError(f"cannot delete the role of run {run_id}: {err}") from err
    return True


# How long after its run ended a run role may still be left before the sweep deletes it: the workflow's own
# "Delete run role" step and mark_run_failed come first; a run the budget guard STOPPED still stops its jobs.
LEFT_ROLE_GRACE = timedelta(hours=1)


@dataclass
class RoleSweep:
    """What one sweep did: the runs whose role it deleted, and why any role could not be looked at or deleted."""

    swept: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def sweep_run_roles(iam: Any, store: ResultStore, settings: LambdaSettings, *, now: datetime) -> RoleSweep:
    """Delete the run roles left behind: those under this stack's path whose run ended (a final status) more than
    LEFT_ROLE_GRACE ago, or whose run is unknown and that are older than that (what a "Delete run role" that failed
    after its retries, or an execution stopped while its role was created, leaves). A role left would keep the
    runtime policy attached, which also keeps ``cdk destroy`` from deleting it. One role that fails does not stop
    the others; a role deleted meanwhile (the workflow's own deletion) is skipped."""
    sweep = RoleSweep()
    try:
        roles = [r for page in iam.get_paginator("list_roles").paginate(PathPrefix=settings.run_role_path)
                 for r in page["Roles"]]  # fmt: skip
    except (ClientError, BotoCoreError) as err:
        sweep.errors.append(f"cannot list the run roles under {settings.run_role_path}: {err}")
        return sweep
    for role in roles:
        try:
            run_id = _left_behind(iam, store, settings, role, now=now)
            if run_id is not None and delete_run_role(iam, settings, run_id):
                sweep.swept.append(run_id)
        except ClientError as err:
            if _code(err) not in _MISSING:
                sweep.errors.append(f"role {role['RoleName']}: {err}")
        except (BotoCoreError, GpuscoutError) as err:
            sweep.errors.append(f"role {role['RoleName']}: {err}")
    return sweep


def _left_behind(
    iam: Any, store: ResultStore, settings: LambdaSettings, role: dict[str, Any], *, now: datetime
) -> str | None:
    """The run id of ``role`` when it is a run role this code created whose run ended over LEFT_ROLE_GRACE ago."""
    tags = {t["Key"]: t["Value"] for t in iam.list_role_tags(RoleName=role["RoleName"])["Tags"]}
    run_id = tags.get(RUN_ID_TAG, "")
    if not _RUN_ID.match(run_id) or run_role_name(settings, run_id) != role["RoleName"]:
        return None  # not a run role this code created
    try:
        run = store.get_run(run_id)
        ended: datetime | None = run.updated_at if run.status in FINAL_RUN_STATUSES else None
    except RunNotFoundError:
        ended = role["CreateDate"]
    return run_id if ended is not None and now - as_utc(ended) > LEFT_ROLE_GRACE else None
