"""The manifest sections that say how settings are searched (the space, pruning, trial budget) and where runs and jobs
are tracked (MLflow, Weights & Biases).

May import: gpuscout.domain's manifest_fields, pydantic."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from gpuscout.domain.manifest_fields import CONTROL_RE, ManifestProblemsError, StrictModel
from gpuscout.errors import Problem

SEARCH_DIMENSIONS = (
    "per_device_batch_size",
    "deepspeed_stage",
    "gradient_checkpointing",
    "torch_compile",
    "attention",
    "fused_cross_entropy",
    "dataloader_workers",
    "method",
    "lora_rank",
)


class SearchSpace(StrictModel):
    """The values a settings search tries, per dimension; a dimension left out keeps the base variant's value.
    Gradient accumulation is not a dimension: it follows from ``search.sequences_per_step`` / micro-batch."""

    per_device_batch_size: list[Annotated[int, Field(ge=1, le=4096)]] | None = Field(default=None, min_length=1)
    deepspeed_stage: list[Literal[0, 2, 3]] | None = Field(default=None, min_length=1)
    gradient_checkpointing: list[bool] | None = Field(default=None, min_length=1)
    torch_compile: list[bool] | None = Field(default=None, min_length=1)
    attention: list[Literal["sdpa", "eager", "flex"]] | None = Field(default=None, min_length=1)
    fused_cross_entropy: list[bool] | None = Field(default=None, min_length=1)
    dataloader_workers: list[Annotated[int, Field(ge=0, le=64)]] | None = Field(default=None, min_length=1)
    # full | lora | qlora, and the adapters' ranks (a full candidate has none; the base's lora knobs otherwise)
    method: list[Literal["full", "lora", "qlora"]] | None = Field(default=None, min_length=1)
    lora_rank: list[Annotated[int, Field(ge=1, le=1024)]] | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _distinct(self) -> SearchSpace:
        problems = [
            Problem(name, "values must be distinct")
            for name in SEARCH_DIMENSIONS
            if (values := getattr(self, name)) is not None and len(set(values)) != len(values)
        ]
        if problems:
            raise ManifestProblemsError(problems)
        return self

    def merged(self, override: SearchSpace | None) -> SearchSpace:
        """This space with ``override``'s dimensions in place of its own (an instance type's own ranges)."""
        if override is None:
            return self
        return self.model_copy(update={k: getattr(override, k) for k in override.model_fields_set})


class SearchPruning(StrictModel):
    """Successive halving on the steady-state statistics (docs/search.md)."""

    enabled: bool = True
    min_timed_steps: int = Field(default=4, ge=2, le=10_000)  # the first rung: timed steps before any pruning
    reduction_factor: int = Field(default=2, ge=2, le=10)  # rung k at min_timed_steps x factor^k; 1/factor go on


class SearchSection(StrictModel):
    """Find the best training settings per target instead of listing variants (docs/search.md)."""

    space: SearchSpace = Field(default_factory=SearchSpace)
    by_instance_type: dict[str, SearchSpace] = Field(default_factory=dict)  # an instance type's own ranges
    # Sequences per GPU per optimizer step (micro-batch x accumulation), the same for every candidate, so every
    # candidate trains the same way; None = the base variant's micro-batch x accumulation.
    sequences_per_step: int | None = Field(default=None, ge=1, le=65536)
    max_trials: int = Field(default=16, ge=1, le=500)  # jobs launched per target (candidates that do not fit: none)
    max_cost_usd: float | None = Field(default=None, gt=0.0)  # the search's spend cap; None = constraints.budget_usd
    # cloud: trials of one target's tuning job running at once (MaxParallelTrainingJobs, also capped by the run's
    # concurrency); each extra one can overshoot the spend cap by one trial, which the budget counts before launch
    max_parallel_trials: int = Field(default=1, ge=1, le=20)
    pruning: SearchPruning = Field(default_factory=SearchPruning)
    seed: int | None = Field(default=None, ge=0, le=2**32 - 1)  # the sampler's; None = training.seed


MLFLOW_ARN_RE = r"^arn:aws[a-z-]*:sagemaker:[a-z0-9-]+:\d{12}:mlflow-tracking-server/[A-Za-z0-9-]{1,256}$"


class MlflowTracking(StrictModel):
    # None: a SQLite file in the runs folder (local); in the cloud the ARN of a SageMaker managed MLflow tracking
    # server (arn:aws:sagemaker:REGION:ACCOUNT:mlflow-tracking-server/NAME), or an http(s) URI.
    tracking_uri: str | None = Field(default=None, min_length=1, max_length=2048)
    experiment: str | None = Field(default=None, min_length=1, max_length=500)  # None = the manifest's name

    @field_validator("tracking_uri")
    @classmethod
    def _uri(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if v.startswith("arn:") and not re.match(MLFLOW_ARN_RE, v):
            raise ValueError(
                "a SageMaker MLflow tracking server ARN is arn:aws:sagemaker:REGION:ACCOUNT:mlflow-tracking-server/NAME"
            )
        if not re.match(r"^(arn:|https?://|sqlite:///|file:)", v) or CONTROL_RE.search(v):
            raise ValueError("an ARN, http(s)://..., sqlite:///PATH or file:PATH")
        return v


class WandbTracking(StrictModel):
    project: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    entity: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    # offline: runs are written to the runs folder (wandb sync uploads them later); online needs WANDB_API_KEY.
    mode: Literal["offline", "online"] = "offline"


class TrackingSection(StrictModel):
    """Send every job and the run's results to the user's experiment tracker (docs/search.md "Tracking")."""

    mlflow: MlflowTracking | None = None
    wandb: WandbTracking | None = None
    # a tracking server that does not answer before the first local job: tracking to it off for the run (disable), or
    # the run refused (refuse); gpuscout/local/tracker_check.py
    if_unreachable: Literal["disable", "refuse"] = "disable"

    @model_validator(mode="after")
    def _one_at_least(self) -> TrackingSection:
        if self.mlflow is None and self.wandb is None:
            raise ValueError("name mlflow, wandb or both (leave tracking out for none)")
        return self

    def resolved(self, manifest_name: str) -> TrackingSection:
        """With its defaults filled in: tracking.mlflow.experiment = the manifest's name."""
        if self.mlflow is None or self.mlflow.experiment is not None:
            return self
        return self.model_copy(update={"mlflow": self.mlflow.model_copy(update={"experiment": manifest_name})})
