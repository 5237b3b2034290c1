"""The stack's settings: cdk.json context, validated once at synth so a typo fails with a clear message."""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Collection, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gpuscout.domain.catalog import load_catalog

CONTEXT_KEYS = (
    "allowed_instance_types",
    "map_max_concurrency",
    "default_budget_usd",
    "notification_email",
    "removal_policy",
    "processing_instance_type",
    "vpc",
    "checkpoint_expiry_days",
    "execution_timeout_hours",
    "quota_wait_hours",
    "canary_instance_type",
    "log_retention_days",
    "training_image_base",
    "mlflow_tracking_servers",
    "stack_name",
)

QUOTA_RETRY_MINUTES = 5  # how often the workflow retries a launch that hit a quota (stacks/workflow.quota_retry)
HISTORY_EVENT_BUDGET = 20_000  # of the 25,000 events an execution's history holds; the rest is the run itself
NULL_MEANS_OFF = frozenset({"canary_instance_type"})
_INSTANCE_TYPE_RE = re.compile(r"^ml\.[a-z0-9]+(-[a-z0-9]+)*\.[a-z0-9]+$")  # ml.p5.48xlarge, ml.p6-b200.48xlarge
# The training image's base (training/Dockerfile ARG BASE_IMAGE): a public registry, so `cdk deploy` needs no
# `docker login`; the default is the Dockerfile's own.
_PUBLIC_IMAGE_RE = re.compile(r"^public\.ecr\.aws/[a-z0-9._/-]+(:[A-Za-z0-9._-]+|@sha256:[0-9a-f]{64})$")
# A PyTorch DLC's tag names its torch version first: pytorch:2.13.0-cu133-amzn2023-sagemaker, pytorch:2.13-cu133-...,
# pytorch-training:2.10.0-gpu-py313-cu130-ubuntu22.04-sagemaker.
_DLC_TORCH_RE = re.compile(r"^public\.ecr\.aws/deep-learning-containers/pytorch(?:-training)?:(\d+\.\d+(?:\.\d+)?)-")
IMAGE_REQUIREMENTS = Path(__file__).resolve().parents[1] / "training" / "requirements.txt"
# CreateMlflowTrackingServer's TrackingServerName
MLFLOW_SERVER_NAME_RE = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,255}")
_EMAIL_RE = re.compile(r"^[^@\s]+@[^@\s]+\.[A-Za-z]{2,}$")
# CloudWatch Logs accepts only these retention periods (days -> aws_logs.RetentionDays member name).
LOG_RETENTION_DAYS = {
    1: "ONE_DAY",
    3: "THREE_DAYS",
    5: "FIVE_DAYS",
    7: "ONE_WEEK",
    14: "TWO_WEEKS",
    30: "ONE_MONTH",
    60: "TWO_MONTHS",
    90: "THREE_MONTHS",
    120: "FOUR_MONTHS",
    150: "FIVE_MONTHS",
    180: "SIX_MONTHS",
    365: "ONE_YEAR",
    400: "THIRTEEN_MONTHS",
    545: "EIGHTEEN_MONTHS",
    731: "TWO_YEARS",
    1096: "THREE_YEARS",
    1827: "FIVE_YEARS",
    2192: "SIX_YEARS",
    2557: "SEVEN_YEARS",
    2922: "EIGHT_YEARS",
    3288: "NINE_YEARS",
    3653: "TEN_YEARS",
}


def processing_instance_types() -> frozenset[str]:
    """The instance types CreateProcessingJob accepts, from botocore's SageMaker service model."""
    import botocore.session

    model = botocore.session.get_session().get_service_model("sagemaker")
    shape = model.shape_for("ProcessingInstanceType")
    return frozenset(getattr(shape, "enum", ()))  # a StringShape; botocore's stubs type it as Shape


class ConfigError(ValueError):
    """cdk.json context (or a -c override) is invalid; the message names every bad key."""


class RemovalMode(StrEnum):
    RETAIN = "retain"
    DESTROY = "destroy"


class VpcSettings(BaseModel):
    """Run SageMaker jobs inside these private subnets with these security groups (VpcConfig)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    subnet_ids: tuple[str, ...] = Field(min_length=1, max_length=16)
    security_group_ids: tuple[str, ...] = Field(min_length=1, max_length=5)

    @field_validator("subnet_ids")
    @classmethod
    def _subnets(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [s for s in v if not re.fullmatch(r"subnet-[0-9a-f]{8,17}", s)]
        if bad:
            raise ValueError(f"not subnet ids (expected subnet-<hex>): {bad}")
        return v

    @field_validator("security_group_ids")
    @classmethod
    def _security_groups(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [s for s in v if not re.fullmatch(r"sg-[0-9a-f]{8,17}", s)]
        if bad:
            raise ValueError(f"not security group ids (expected sg-<hex>): {bad}")
        return v


def catalog_training_types() -> tuple[str, ...]:
    """Every instance type of the catalog (configs/instances/) with role "training": the default allowed list."""
    return tuple(instance.instance_type for instance in load_catalog() if instance.role == "training")


class StackConfig(BaseModel):
    """Everything the stack reads from context. Defaults live here; cdk.json states them explicitly too. Its
    ``allowed_instance_types`` is null: absent or null means every training type of the catalog, so a type added to
    configs/instances/ is allowed without a second list to edit; a list narrows it (each must be catalogued)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allowed_instance_types: tuple[str, ...] = Field(
        default_factory=catalog_training_types, min_length=1, validate_default=True
    )
    map_max_concurrency: int = Field(default=4, ge=1, le=40)
    default_budget_usd: float = Field(default=100.0, gt=0, le=1_000_000)
    notification_email: str | None = None
    removal_policy: RemovalMode = RemovalMode.RETAIN
    processing_instance_type: str = "ml.m5.xlarge"
    vpc: VpcSettings | None = None
    checkpoint_expiry_days: int = Field(default=14, ge=1, le=3650)
    execution_timeout_hours: int = Field(default=72, ge=1, le=24 * 365)
    # How long a training job whose launch hits an account quota (ResourceLimitExceeded) keeps retrying, every
    # QUOTA_RETRY_MINUTES, while sibling jobs free the quota; at most the execution timeout.
    quota_wait_hours: int = Field(default=24, ge=0, le=24 * 365)
    # Before the fan-out, each distinct configuration runs 2 steps of a 2-layer cut of its model on this (one GPU,
    # cheap) instance; a failure fails the run before any expensive job starts. null: no canary.
    canary_instance_type: str | None = "ml.g5.8xlarge"
    log_retention_days: int = 90
    training_image_base: str | None = None  # None: training/Dockerfile's default BASE_IMAGE
    # The SageMaker managed MLflow tracking servers (names, this account and region) the training jobs may log to;
    # none by default: the jobs' role then holds no MLflow grant and a manifest naming a server is refused.
    mlflow_tracking_servers: tuple[str, ...] = ()
    # CloudFormation stack name; another name deploys a second, independent stack in the same account and region
    stack_name: str = Field(default="Gpuscout", pattern=r"^[A-Za-z][A-Za-z0-9-]{0,127}$")

    @field_validator("training_image_base")
    @classmethod
    def _image_base(cls, v: str | None) -> str | None:
        if v is not None and not _PUBLIC_IMAGE_RE.match(v):
            raise ValueError(
                f"{v!r} is not a public ECR image (public.ecr.aws/<repository>:<tag> or @sha256:<digest>); a private "
                "registry would need a `docker login` before every deploy"
            )
        if v is not None and "-cpu" in v:
            raise ValueError(f"{v!r} is a CPU image: the training image needs the DLC's CUDA build")
        tagged, pinned = dlc_torch_version(v) if v else None, pinned_torch()
        if tagged is not None and not (pinned == tagged or pinned.startswith(tagged + ".")):
            raise ValueError(
                f"{v!r} brings torch {tagged}, but the image installs torch {pinned} (training/requirements.txt) over "
                f"its base's own torch only when they are equal: use a DLC tag of torch {pinned}"
            )
        return v

    @field_validator("mlflow_tracking_servers")
    @classmethod
    def _tracking_servers(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [name for name in v if not MLFLOW_SERVER_NAME_RE.fullmatch(name)]
        if bad:
            raise ValueError(
                f"not MLflow tracking server names (letters, digits and single hyphens, up to 256; the name, not the "
                f"ARN): {bad}"
            )
        if len(set(v)) != len(v):
            raise ValueError("tracking servers listed more than once")
        return v

    @field_validator("allowed_instance_types")
    @classmethod
    def _instance_types(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [t for t in v if not _INSTANCE_TYPE_RE.match(t)]
        if bad:
            raise ValueError(f"not SageMaker instance types (expected ml.<family>.<size>): {bad}")
        if len(set(v)) != len(v):
            raise ValueError("instance types listed more than once")
        return v

    @field_validator("processing_instance_type")
    @classmethod
    def _processing_type(cls, v: str) -> str:
        if not _INSTANCE_TYPE_RE.match(v):
            raise ValueError(f"{v!r} is not a SageMaker instance type (expected ml.<family>.<size>)")
        allowed = processing_instance_types()
        if v not in allowed:
            raise ValueError(
                f"{v!r} cannot run SageMaker Processing jobs (CreateProcessingJob's ProcessingInstanceType); data "
                "preparation needs CPUs, e.g. ml.m5.xlarge, ml.m5.4xlarge or ml.c5.4xlarge"
            )
        return v

    @field_validator("notification_email", mode="before")
    @classmethod
    def _email(cls, v: object) -> object:
        if v in (None, ""):
            return None
        if not isinstance(v, str) or not _EMAIL_RE.match(v):
            raise ValueError(f"{v!r} is not an e-mail address")
        return v

    @field_validator("log_retention_days")
    @classmethod
    def _retention(cls, v: int) -> int:
        if v not in LOG_RETENTION_DAYS:
            raise ValueError(f"CloudWatch Logs accepts only {list(LOG_RETENTION_DAYS)} days, not {v}")
        return v

    @model_validator(mode="after")
    def _quota_wait_within_timeout(self) -> StackConfig:
        if self.quota_wait_hours > self.execution_timeout_hours:
            raise ValueError(
                f"quota_wait_hours ({self.quota_wait_hours}) exceeds execution_timeout_hours "
                f"({self.execution_timeout_hours}): the execution would time out first"
            )
        # Every quota retry of an inline Map iteration adds about 3 events to the execution's history, which Step
        # Functions caps at 25,000: slots all waiting out their quota for the whole wait must stay well below it.
        events = self.map_max_concurrency * self.quota_wait_hours * (60 // QUOTA_RETRY_MINUTES) * 3
        if events > HISTORY_EVENT_BUDGET:
            raise ValueError(
                f"map_max_concurrency ({self.map_max_concurrency}) x quota_wait_hours ({self.quota_wait_hours}) could "
                f"log ~{events:,} quota retries' events, past Step Functions' 25,000-event execution history; lower "
                "either (e.g. quota_wait_hours 6 with 8 concurrent jobs)"
            )
        return self

    def check_catalog(self, *, training_types: Collection[str], known_types: Collection[str]) -> None:
        """Every allowed type (and the canary's) must be a catalogued training instance (facts and prices exist)."""
        problems = [
            f"  - context 'allowed_instance_types': {t!r} is not a training instance in configs/instances/"
            for t in self.allowed_instance_types
            if t not in training_types
        ]
        if self.canary_instance_type is not None and self.canary_instance_type not in training_types:
            problems.append(
                f"  - context 'canary_instance_type': {self.canary_instance_type!r} is not a training instance in "
                "configs/instances/ (null disables the canary)"
            )
        if self.processing_instance_type not in known_types:
            problems.append(
                f"  - context 'processing_instance_type': {self.processing_instance_type!r} is not catalogued"
            )
        if problems:
            raise ConfigError("gpuscout settings do not match the instance catalog:\n" + "\n".join(problems))

    @property
    def allowed_instance_types_csv(self) -> str:
        return ",".join(self.allowed_instance_types)

    @property
    def mlflow_tracking_servers_csv(self) -> str:
        return ",".join(self.mlflow_tracking_servers)


def _decode(value: Any) -> Any:
    """`cdk -c key=value` passes strings; JSON-decode them so lists, numbers and objects work from the CLI too."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def load_config(context: Mapping[str, Any]) -> StackConfig:
    """Validate the stack's context keys (other CDK context keys are ignored); raise ConfigError naming each problem."""
    unknown = [k for k in context if re.fullmatch(r"[a-z][a-z0-9_]*", k) and k not in CONTEXT_KEYS]
    if unknown:
        hints = [
            f"  - context '{k}' is not a gpuscout setting"
            + "".join(f" (did you mean '{m}'?)" for m in difflib.get_close_matches(k, CONTEXT_KEYS, n=1))
            for k in unknown
        ]
        raise ConfigError("unknown keys in cdk.json context (or -c overrides):\n" + "\n".join(hints))
    # null (in cdk.json, or `-c key=null`) means "the default" for every key but those whose null means "off"
    decoded = {key: _decode(context[key]) for key in CONTEXT_KEYS if key in context}
    raw = {key: value for key, value in decoded.items() if value is not None or key in NULL_MEANS_OFF}
    if raw.get("canary_instance_type") == "":  # `-c canary_instance_type=` (null arrives decoded already)
        raw["canary_instance_type"] = None
    for key in ("allowed_instance_types", "mlflow_tracking_servers"):  # `-c key=a,b`
        if isinstance(raw.get(key), str):
            raw[key] = [t.strip() for t in raw[key].split(",") if t.strip()]
    try:
        return StackConfig.model_validate(raw)
    except ValidationError as err:
        problems = "\n".join(
            f"  - context '{'.'.join(str(p) for p in e['loc']) or '<root>'}': {e['msg']}"
            for e in err.errors(include_url=False)
        )
        raise ConfigError(f"invalid gpuscout settings in cdk.json context (or -c overrides):\n{problems}") from err


def dlc_torch_version(image: str) -> str | None:
    """The torch version a PyTorch DLC's tag names (2.13.0, or 2.13 for a floating tag); None for another image or a
    digest (training/Dockerfile still checks the base's torch when it builds)."""
    match = _DLC_TORCH_RE.match(image)
    return match.group(1) if match else None


def pinned_torch() -> str:
    """The torch version training/requirements.txt pins (the training image keeps its base's torch only if equal)."""
    for line in IMAGE_REQUIREMENTS.read_text().splitlines():
        if line.startswith("torch=="):
            return line.split("==", 1)[1].split("#", 1)[0].strip()
    raise ValueError(f"{IMAGE_REQUIREMENTS} pins no torch")
