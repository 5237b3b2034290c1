"""The Lambda functions' environment, parsed once per cold start into one validated model.

The names are the Cloud contract in docs/internals.md; the CDK stack sets them. A missing or malformed variable
fails the cold start with a message naming it, instead of a KeyError deep in a handler.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import lru_cache

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gpuscout.errors import GpuscoutError


class SettingsError(GpuscoutError):
    """The Lambda environment is missing a variable or holds an invalid value."""


class LambdaSettings(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    table_name: str = Field(alias="TABLE_NAME", min_length=3)
    data_bucket: str = Field(alias="DATA_BUCKET", min_length=3)
    artifacts_bucket: str = Field(alias="ARTIFACTS_BUCKET", min_length=3)
    # data preparation (writes the prepared-data cache) has the stack's role; each run's training jobs (the untrusted
    # code) get a role of their own, created under this path with this boundary and runtime policy
    # (gpuscout.cloud.run_roles, stacks/roles.py)
    processing_role_arn: str = Field(alias="PROCESSING_ROLE_ARN", pattern=r"^arn:aws[a-z-]*:iam::\d{12}:role/.+")
    # /gpuscout/<region>/<stack name>/: IAM is global, so two stacks of one name in two regions get two paths
    run_role_path: str = Field(
        alias="RUN_ROLE_PATH", pattern=r"^/gpuscout/[a-z0-9-]{1,32}/[A-Za-z][A-Za-z0-9-]{0,127}/$"
    )
    # seconds a newly created run role is given to propagate before the first job is created with it
    run_role_propagation_s: float = Field(alias="RUN_ROLE_PROPAGATION_SECONDS", default=15.0, ge=0, le=60)
    run_role_boundary_arn: str = Field(alias="RUN_ROLE_BOUNDARY_ARN", pattern=r"^arn:aws[a-z-]*:iam::\d{12}:policy/.+")
    job_runtime_policy_arn: str = Field(
        alias="JOB_RUNTIME_POLICY_ARN", pattern=r"^arn:aws[a-z-]*:iam::\d{12}:policy/.+"
    )
    training_image_uri: str = Field(alias="TRAINING_IMAGE_URI", min_length=1)
    processing_instance_type: str = Field(alias="PROCESSING_INSTANCE_TYPE", default="ml.m5.xlarge")
    # the instance every distinct configuration's canary runs on before the fan-out; empty: no canary
    canary_instance_type: str | None = Field(alias="CANARY_INSTANCE_TYPE", default=None)
    # the state machine's timeout: no job may be allowed to wait (spot) or run longer than the execution lives
    execution_timeout_hours: float = Field(alias="EXECUTION_TIMEOUT_HOURS", default=72.0, gt=0)
    allowed_instance_types: tuple[str, ...] = Field(alias="ALLOWED_INSTANCE_TYPES", default=())
    # the SageMaker managed MLflow tracking servers (names) the training jobs' role may log to; empty: none
    mlflow_tracking_servers: tuple[str, ...] = Field(alias="MLFLOW_TRACKING_SERVERS", default=())
    default_budget_usd: float = Field(alias="DEFAULT_BUDGET_USD", default=100.0, gt=0)
    # training jobs running at once per run (the Map's MaxConcurrency); a search's tuning jobs share it
    map_max_concurrency: int = Field(alias="MAP_MAX_CONCURRENCY", default=4, ge=1, le=40)
    service_name: str = Field(alias="POWERTOOLS_SERVICE_NAME", default="gpuscout")
    notification_topic_arn: str | None = Field(alias="NOTIFICATION_TOPIC_ARN", default=None)
    region: str = Field(alias="AWS_REGION", default="us-east-1")  # set by the Lambda runtime

    @field_validator("allowed_instance_types", "mlflow_tracking_servers", mode="before")
    @classmethod
    def _split_comma_list(cls, v: object) -> object:
        if isinstance(v, str):
            return tuple(part.strip() for part in v.split(",") if part.strip())
        return v

    @field_validator("notification_topic_arn", "canary_instance_type", mode="before")
    @classmethod
    def _empty_is_none(cls, v: object) -> object:
        return None if v == "" else v

    @property
    def account(self) -> str:
        """This deployment's account (its roles' ARNs name it)."""
        return self.processing_role_arn.split(":")[4]

    @property
    def partition(self) -> str:
        """aws, aws-cn or aws-us-gov: the partition of this deployment's ARNs."""
        return self.processing_role_arn.split(":")[1]

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LambdaSettings:
        env = os.environ if environ is None else environ
        try:
            return cls.model_validate(dict(env))
        except ValidationError as err:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors(include_url=False)
            )
            raise SettingsError(f"invalid Lambda environment: {problems}") from err


@lru_cache(maxsize=1)
def get_settings() -> LambdaSettings:
    """The settings of this process (cached: parsed once per Lambda cold start)."""
    return LambdaSettings.from_environ()
