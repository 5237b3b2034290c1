"""Fixtures of the cloud integration tests: a moto world with the stack's table and buckets, the Lambdas' environment.

Handlers are called directly (moto's Lambda cannot run Python without Docker); every AWS call they make goes to
moto. ``services()`` and ``get_settings()`` are per-cold-start caches, cleared around each test. Names, manifests,
events and helpers are in ``tests/integration/cloud_world.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import boto3
import pytest
from moto import mock_aws

from gpuscout.cloud.control_plane import services
from gpuscout.cloud.quotas import QuotaBook
from gpuscout.cloud.settings import get_settings
from gpuscout.store.dynamodb import table_definition
from tests.account_quotas import account_quotas
from tests.integration.cloud_world import (
    ARTIFACTS_BUCKET,
    DATA_BUCKET,
    ENVIRONMENT,
    QUOTAS,
    REGION,
    TABLE,
    Cloud,
    LambdaContext,
)


@pytest.fixture
def cloud(monkeypatch: pytest.MonkeyPatch) -> Iterator[Cloud]:
    for name, value in ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("NOTIFICATION_TOPIC_ARN", raising=False)
    get_settings.cache_clear()
    services.cache_clear()
    # moto does not implement Service Quotas' ListServiceQuotas: an account whose training quotas were raised, unless
    # a test sets QUOTAS (quota name -> instances)
    QUOTAS.clear()
    monkeypatch.setattr(QuotaBook, "quotas", lambda self, wanted=(), fresh=False: account_quotas(QUOTAS))
    with mock_aws():
        boto3.client("dynamodb", region_name=REGION).create_table(**table_definition(TABLE))
        s3 = boto3.client("s3", region_name=REGION)
        s3.create_bucket(Bucket=DATA_BUCKET)
        s3.create_bucket(Bucket=ARTIFACTS_BUCKET)
        # what the stack deploys for the runs' own roles (run_role creates them with these, mark_run_failed deletes)
        iam = boto3.client("iam", region_name=REGION)
        for variable in ("RUN_ROLE_BOUNDARY_ARN", "JOB_RUNTIME_POLICY_ARN"):
            document = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:GetObject",
                                                                "Resource": "*"}]}  # fmt: skip
            created = iam.create_policy(
                PolicyName=ENVIRONMENT[variable].rsplit("/", 1)[-1], PolicyDocument=json.dumps(document)
            )
            assert created["Policy"]["Arn"] == ENVIRONMENT[variable]
        yield Cloud(
            services=services(),
            s3=s3,
            sagemaker=boto3.client("sagemaker", region_name=REGION),
            context=LambdaContext(),
        )
    get_settings.cache_clear()
    services.cache_clear()


@pytest.fixture
def with_canary(cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> Cloud:
    """The stack's default: a canary instance type (CANARY_INSTANCE_TYPE) for the Lambdas."""
    monkeypatch.setenv("CANARY_INSTANCE_TYPE", "ml.g5.8xlarge")
    get_settings.cache_clear()
    services.cache_clear()
    return cloud
