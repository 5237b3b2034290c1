"""The benchmark manifest: a pydantic v2 model (``extra="forbid"`` everywhere) and a safe loader.

``parse_manifest`` / ``load_manifest`` never let anything but a :class:`Manifest` or a
:class:`~gpuscout.errors.ManifestError` out. The error carries every problem found, each with a field path
(``targets[1].instance_type``) and a message that says what is allowed. docs/manifest.md is the reference.

Loading is defensive because manifests arrive from an S3 bucket: at most 256 KiB, strict UTF-8, YAML through a
SafeLoader subclass that refuses anchors/aliases (alias bombs), duplicate keys, non-string keys, keys with control
characters and deep nesting; JSON is accepted by extension or content.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from yaml.events import AliasEvent

from gpuscout.domain.catalog import LOCAL, Catalog, InstanceType, LocalHardware, load_catalog
from gpuscout.domain.models import HF_ID_TO_PRESET, PRESETS, Architecture
from gpuscout.errors import ManifestError, Problem

MAX_MANIFEST_BYTES = 256 * 1024
MAX_NESTING = 32
BUNDLED_SOURCES = ("bundled:hebrew-bible", "bundled:hebrew-chatterbot")
SLUG_RE = r"^[a-z0-9](?:[a-z0-9-]{0,38}[a-z0-9])?$"
S3_URI_RE = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\x00-\x1f]*)?$")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")

Slug = Annotated[str, Field(pattern=SLUG_RE, description="1-40 lowercase letters, digits and inner hyphens")]
Precision = Literal["bf16", "fp16", "fp32"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


class ManifestProblemsError(ValueError):
    """Raised inside a model validator to report several problems at once, with paths relative to that model;
    :func:`parse_manifest` expands them."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


class ModelSpec(_Strict):
    preset: str | None = None
    hf_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
    path: str | None = Field(default=None, min_length=1, max_length=1024)
    architecture: str | None = None  # preset used for FLOPs/memory when hf_id/path is not a known preset

    @field_validator("preset", "architecture")
    @classmethod
    def _known_preset(cls, v: str | None) -> str | None:
        if v is not None and v not in PRESETS:
            raise ValueError(f"unknown preset {v!r}; allowed: {', '.join(PRESETS)}")
        return v

    @field_validator("path")
    @classmethod
    def _clean_path(cls, v: str | None) -> str | None:
        if v is not None and _CONTROL_RE.search(v):
            raise ValueError("path must not contain control characters")
        if v is not None and v.startswith("s3://") and not S3_URI_RE.match(v):
            raise ValueError("an S3 path must look like s3://bucket/prefix")
        return v

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSpec:
        given = [k for k in ("preset", "hf_id", "path") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of preset, hf_id, path (got {', '.join(given) or 'none'})")
        if self.flops_architecture() is None:
            raise ValueError(
                f"{given[0]} {getattr(self, given[0])!r} is not a known preset; set model.architecture to the "
                f"preset with the same dimensions ({', '.join(PRESETS)}) so time and memory can be planned"
            )
        return self

    def flops_architecture(self) -> Architecture | None:
        """Dimensions used for FLOPs and memory planning."""
        if self.architecture:
            return PRESETS[self.architecture]
        if self.preset:
            return PRESETS[self.preset]
        if self.hf_id and self.hf_id in HF_ID_TO_PRESET:
            return PRESETS[HF_ID_TO_PRESET[self.hf_id]]
        return None


class TokenizerSpec(_Strict):
    kind: Literal["qwen", "bpe", "hf"] = "qwen"
    path: str | None = Field(default=None, min_length=1, max_length=1024)
    vocab_size: int | None = Field(default=None, ge=256, le=262144)

    @model_validator(mode="after")
    def _fields_per_kind(self) -> TokenizerSpec:
        if self.kind == "hf" and self.path is None:
            raise ValueError("kind 'hf' needs path (a local folder, s3:// URI or hub id of the tokenizer)")
        if self.kind != "hf" and self.path is not None:
            raise ValueError(f"path is only used with kind 'hf' (kind is {self.kind!r})")
        if self.kind != "bpe" and self.vocab_size is not None:
            raise ValueError(f"vocab_size is only used with kind 'bpe' (kind is {self.kind!r})")
        return self

    @property
    def resolved_vocab_size(self) -> int | None:
        """BPE vocabulary size (default 4096); None for qwen/hf (the model's own vocabulary is used)."""
        return (self.vocab_size or 4096) if self.kind == "bpe" else None


class DatasetSpec(_Strict):
    source: str = Field(min_length=1, max_length=1024)
    format: Literal["auto", "jsonl", "txt", "parquet"] = "auto"
    text_field: str = Field(default="text", min_length=1, max_length=128)
    max_documents: int | None = Field(default=None, ge=1)
    min_characters: int = Field(default=20, ge=0)
    validation_fraction: float = Field(default=0.05, ge=0.0, lt=0.5)

    @field_validator("source")
    @classmethod
    def _known_source(cls, v: str) -> str:
        if _CONTROL_RE.search(v):
            raise ValueError("source must not contain control characters")
        if v.startswith("bundled:") and v not in BUNDLED_SOURCES:
            raise ValueError(f"unknown bundled dataset {v!r}; allowed: {', '.join(BUNDLED_SOURCES)}")
        if v.startswith("s3://") and not S3_URI_RE.match(v):
            raise ValueError("an S3 source must look like s3://bucket/prefix")
        return v

    @property
    def kind(self) -> Literal["bundled", "s3", "local"]:
        if self.source.startswith("bundled:"):
            return "bundled"
        return "s3" if self.source.startswith("s3://") else "local"


class StopRule(_Strict):
    kind: Literal["fixed", "steady_state"] = "fixed"
    ci_tolerance: float = Field(default=0.02, gt=0.0, lt=1.0)
    min_timed_steps: int = Field(default=10, ge=2)


class TrainingSpec(_Strict):
    max_steps: int | None = Field(default=None, ge=1, le=10_000_000)
    max_tokens: int | None = Field(default=None, ge=1, le=10**15)
    warmup_steps: int | None = Field(default=None, ge=0)  # None = auto: max(3, 10 % of max_steps)
    learning_rate: float = Field(default=1e-5, gt=0.0, le=1.0)
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int = Field(default=42, ge=0, le=2**32 - 1)
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    stop_rule: StopRule = Field(default_factory=StopRule)
    eval_interval: int = Field(default=0, ge=0)  # optimizer steps between validation passes; 0 = only at the end
    checkpoint_interval: int = Field(default=0, ge=0)  # optimizer steps between checkpoints; 0 = none
    checkpoint_keep: int = Field(default=2, ge=1, le=100)  # complete checkpoints kept; older ones are deleted
    validation_batches: int = Field(default=8, ge=0)  # batches per validation pass

    @model_validator(mode="after")
    def _length(self) -> TrainingSpec:
        if (self.max_steps is None) == (self.max_tokens is None):
            raise ValueError("give exactly one of max_steps, max_tokens")
        if self.max_steps is not None and self.warmup_steps is not None and self.warmup_steps >= self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be below max_steps ({self.max_steps})")
        return self


class Target(_Strict):
    instance_type: str = Field(min_length=1, max_length=64)
    instance_count: int = Field(default=1, ge=1, le=64)
    spot: bool = False
    price_per_hour_usd: float | None = Field(default=None, gt=0.0)  # overrides the catalog's on-demand price
    spot_price_per_hour_usd: float | None = Field(default=None, gt=0.0)
    max_wait_hours: float | None = Field(default=None, gt=0.0, le=120.0)  # managed spot: wait + run limit

    @field_validator("instance_type")
    @classmethod
    def _in_catalog(cls, v: str, info: ValidationInfo) -> str:
        catalog = _catalog_from(info)
        if v not in catalog.training_types:
            if v in catalog:
                raise ValueError(
                    f"{v} is a {catalog.get(v).role} instance, not a training target; "
                    f"allowed: {', '.join(catalog.training_types)}"
                )
            raise ValueError(f"unknown instance type {v!r}; allowed: {', '.join(catalog.training_types)}")
        return v

    @model_validator(mode="after")
    def _combination(self) -> Target:
        problems: list[Problem] = []
        if self.instance_type == LOCAL:
            if self.price_per_hour_usd is None:
                problems.append(
                    Problem("price_per_hour_usd", "a local target must state what this machine costs per hour")
                )
            if self.spot:
                problems.append(Problem("spot", "spot is a SageMaker option; a local target cannot be spot"))
            if self.instance_count != 1:
                problems.append(Problem("instance_count", "a local target has instance_count 1"))
        if not self.spot:
            for field in ("spot_price_per_hour_usd", "max_wait_hours"):
                if getattr(self, field) is not None:
                    problems.append(Problem(field, "only used with spot: true"))
        if problems:
            raise ManifestProblemsError(problems)
        return self


HyperparameterValue = str | int | float | bool
_HP_KEY_RE = r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$"
Unit = Literal["tokens", "samples"]


class JobEstimate(_Strict):
    """The user's own throughput estimate: the planner's prediction when there is no FLOPs model for the job."""

    units_per_s: float = Field(gt=0.0)  # work units per second per device (a GPU, or this machine's CPU)
    # Work units one device (one process) does per optimizer step: a number, the name of a hyperparameter (e.g.
    # batch_size), or a list of names whose product it is (e.g. [batch_size, gradient_accumulation_steps]).
    units_per_step: float | str | list[str] = Field(default=1.0)
    units_per_s_by_instance_type: dict[str, Annotated[float, Field(gt=0.0)]] = Field(default_factory=dict)

    @field_validator("units_per_step")
    @classmethod
    def _positive_or_name(cls, v: float | str | list[str]) -> float | str | list[str]:
        if isinstance(v, float | int):
            if v <= 0:
                raise ValueError("must be > 0")
            return v
        names = [v] if isinstance(v, str) else v
        if not names or not all(re.match(_HP_KEY_RE, n) for n in names):
            raise ValueError("a number > 0, the name of a hyperparameter, or a list of names (letters, digits, _ . -)")
        return v

    @property
    def step_names(self) -> list[str]:
        v = self.units_per_step
        return [v] if isinstance(v, str) else list(v) if isinstance(v, list) else []


class JobSection(_Strict):
    """Bring your own training job: the user's code instead of the built-in Qwen job (docs/byo.md)."""

    source_dir: str = Field(min_length=1, max_length=1024)  # a folder relative to the manifest's, or s3://.../
    entry_point: str = Field(min_length=1, max_length=256)  # relative to source_dir
    requirements: str | None = Field(default=None, min_length=1, max_length=256)  # relative to source_dir
    arguments: dict[str, HyperparameterValue] = Field(default_factory=dict)  # every variant; variants override
    # The cloud canary (2 steps on the stack's small canary instance) runs with these over the job's arguments:
    # e.g. a smaller batch_size when the job's own does not fit the canary GPU (docs/byo.md "In the cloud").
    canary_arguments: dict[str, HyperparameterValue] = Field(default_factory=dict)
    # per_gpu: one process per GPU (torchrun; the script joins the process group); single: one process per host.
    distribution: Literal["per_gpu", "single"] = "per_gpu"
    unit: Unit = "samples"
    items_per_sample: float | None = Field(default=None, gt=0.0)  # tokens (or items) in one sample, when fixed
    estimate: JobEstimate | None = None  # None: calibrated by a short run on this machine (local targets only)

    @property
    def in_s3(self) -> bool:
        return self.source_dir.startswith("s3://")

    @field_validator("source_dir", "entry_point", "requirements")
    @classmethod
    def _clean(cls, v: str | None) -> str | None:
        if v is not None and _CONTROL_RE.search(v):
            raise ValueError("must not contain control characters")
        return v

    @field_validator("entry_point", "requirements")
    @classmethod
    def _inside(cls, v: str | None) -> str | None:
        if v is not None and (Path(v).is_absolute() or ".." in Path(v).parts):
            raise ValueError("a path relative to source_dir, inside it (no leading / and no ..)")
        return v

    @field_validator("entry_point")
    @classmethod
    def _python(cls, v: str) -> str:
        if not v.endswith(".py"):
            raise ValueError("a Python file (ending in .py), run as python ENTRY_POINT --key value ...")
        return v

    @field_validator("source_dir")
    @classmethod
    def _s3_folder(cls, v: str) -> str:
        if v.startswith("s3://") and not re.match(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/\S+/$", v):
            raise ValueError("an S3 folder is s3://BUCKET/PREFIX/ (with the trailing /), or use a local folder")
        return v

    @field_validator("arguments", "canary_arguments")
    @classmethod
    def _keys(cls, v: dict[str, HyperparameterValue]) -> dict[str, HyperparameterValue]:
        return _check_hp_keys(v)


def _set_to_non_default(model: BaseModel, field: str) -> bool:
    """``field`` was given a value other than its default. A field given its default is not "set": a manifest
    round-trips through model_dump (the cloud's Validate step hands the plan step the dumped manifest)."""
    if field not in model.model_fields_set:
        return False
    info = type(model).model_fields[field]
    return bool(getattr(model, field) != info.get_default(call_default_factory=True))


def _check_hp_keys(v: dict[str, HyperparameterValue]) -> dict[str, HyperparameterValue]:
    for key in v:
        if not re.match(_HP_KEY_RE, key):
            raise ValueError(f"argument name {key!r}: 1-64 letters, digits, _ . - starting with a letter or _")
    return v


class Variant(_Strict):
    name: Slug
    hyperparameters: dict[str, HyperparameterValue] = Field(default_factory=dict)  # job section only
    per_device_batch_size: int | None = Field(default=None, ge=1, le=4096)  # None = the instance's default
    gradient_accumulation_steps: int | None = Field(default=None, ge=1, le=4096)  # None = the instance's default
    deepspeed_stage: Literal[0, 2, 3] = 0
    torch_compile: bool = False
    gradient_checkpointing: bool = False
    dataloader_workers: int = Field(default=2, ge=0, le=64)
    packing: bool = True
    attention: Literal["sdpa", "eager", "flex"] = "sdpa"
    fused_cross_entropy: bool = False
    fused_adamw: bool = False

    @field_validator("hyperparameters")
    @classmethod
    def _keys(cls, v: dict[str, HyperparameterValue]) -> dict[str, HyperparameterValue]:
        return _check_hp_keys(v)


class Constraints(_Strict):
    budget_usd: float = Field(gt=0.0, le=1_000_000.0)
    deadline_hours: float | None = Field(default=None, gt=0.0)
    target_loss: float | None = Field(default=None, gt=0.0)


Objective = Literal["cheapest_per_token", "fastest", "cheapest_within_deadline", "fastest_within_budget"]


SEARCH_DIMENSIONS = (
    "per_device_batch_size",
    "deepspeed_stage",
    "gradient_checkpointing",
    "torch_compile",
    "attention",
    "fused_cross_entropy",
    "dataloader_workers",
)


class SearchSpace(_Strict):
    """The values a settings search tries, per dimension; a dimension left out keeps the base variant's value.
    Gradient accumulation is not a dimension: it follows from ``search.sequences_per_step`` / micro-batch."""

    per_device_batch_size: list[Annotated[int, Field(ge=1, le=4096)]] | None = Field(default=None, min_length=1)
    deepspeed_stage: list[Literal[0, 2, 3]] | None = Field(default=None, min_length=1)
    gradient_checkpointing: list[bool] | None = Field(default=None, min_length=1)
    torch_compile: list[bool] | None = Field(default=None, min_length=1)
    attention: list[Literal["sdpa", "eager", "flex"]] | None = Field(default=None, min_length=1)
    fused_cross_entropy: list[bool] | None = Field(default=None, min_length=1)
    dataloader_workers: list[Annotated[int, Field(ge=0, le=64)]] | None = Field(default=None, min_length=1)

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


class SearchPruning(_Strict):
    """Successive halving on the steady-state statistics (docs/search.md)."""

    enabled: bool = True
    min_timed_steps: int = Field(default=4, ge=2, le=10_000)  # the first rung: timed steps before any pruning
    reduction_factor: int = Field(default=2, ge=2, le=10)  # rung k at min_timed_steps x factor^k; 1/factor go on


class SearchSection(_Strict):
    """Find the best training settings per target instead of listing variants (docs/search.md)."""

    space: SearchSpace = Field(default_factory=SearchSpace)
    by_instance_type: dict[str, SearchSpace] = Field(default_factory=dict)  # an instance type's own ranges
    # Sequences per GPU per optimizer step (micro-batch x accumulation), the same for every candidate, so every
    # candidate trains the same way; None = the base variant's micro-batch x accumulation.
    sequences_per_step: int | None = Field(default=None, ge=1, le=65536)
    max_trials: int = Field(default=16, ge=1, le=500)  # jobs launched per target (candidates that do not fit: none)
    max_cost_usd: float | None = Field(default=None, gt=0.0)  # the search's spend cap; None = constraints.budget_usd
    pruning: SearchPruning = Field(default_factory=SearchPruning)
    seed: int | None = Field(default=None, ge=0, le=2**32 - 1)  # the sampler's; None = training.seed


MLFLOW_ARN_RE = r"^arn:aws[a-z-]*:sagemaker:[a-z0-9-]+:\d{12}:mlflow-tracking-server/[A-Za-z0-9-]{1,256}$"


class MlflowTracking(_Strict):
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
        if not re.match(r"^(arn:|https?://|sqlite:///|file:)", v) or _CONTROL_RE.search(v):
            raise ValueError("an ARN, http(s)://..., sqlite:///PATH or file:PATH")
        return v


class WandbTracking(_Strict):
    project: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    entity: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    # offline: runs are written to the runs folder (wandb sync uploads them later); online needs WANDB_API_KEY.
    mode: Literal["offline", "online"] = "offline"


class TrackingSection(_Strict):
    """Send every job and the run's results to the user's experiment tracker (docs/search.md "Tracking")."""

    mlflow: MlflowTracking | None = None
    wandb: WandbTracking | None = None

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


class Manifest(_Strict):
    name: Slug
    description: str | None = Field(default=None, max_length=2000)
    job: JobSection | None = None  # the user's own training code; None = the built-in Qwen job
    model: ModelSpec | None = None  # required without job
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec)
    dataset: DatasetSpec | None = None  # required without job
    sequence_length: int | None = Field(default=None, ge=16, le=131072)  # required without job
    training: TrainingSpec
    targets: list[Target] = Field(min_length=1, max_length=32)
    variants: list[Variant] = Field(default_factory=list, max_length=64)  # with search: at most one, the base
    repetitions: int = Field(default=1, ge=1, le=10)
    constraints: Constraints
    objective: Objective = "cheapest_per_token"
    network_isolation: bool = False
    search: SearchSection | None = None  # find the best settings per target (docs/search.md)
    tracking: TrackingSection | None = None  # MLflow / Weights & Biases (docs/search.md "Tracking")

    @model_validator(mode="after")
    def _cross_field(self, info: ValidationInfo) -> Manifest:
        catalog = _catalog_from(info)
        problems: list[Problem] = self._job_problems() if self.job else self._builtin_problems()
        problems += self._search_problems()
        names = [v.name for v in self.variants]
        for i, name in enumerate(names):
            if name in names[:i]:
                problems.append(
                    Problem(f"variants[{i}].name", f"duplicate variant name {name!r}; names must be unique")
                )
        seen: dict[tuple[str, int, bool], int] = {}
        for i, t in enumerate(self.targets):
            key = (t.instance_type, t.instance_count, t.spot)
            if key in seen:
                problems.append(
                    Problem(f"targets[{i}]", f"same instance_type, instance_count and spot as targets[{seen[key]}]")
                )
            seen.setdefault(key, i)
        arch = self.model.flops_architecture() if self.model else None
        if arch is not None and self.sequence_length and self.sequence_length > arch.max_position_embeddings:
            problems.append(
                Problem(
                    "sequence_length",
                    f"{self.sequence_length} exceeds the model's max_position_embeddings "
                    f"({arch.max_position_embeddings})",
                )
            )
        if self.objective == "cheapest_within_deadline" and self.constraints.deadline_hours is None:
            problems.append(Problem("constraints.deadline_hours", f"objective {self.objective} needs deadline_hours"))
        if self.tokenizer.kind == "bpe" and self.model is not None and self.model.preset is None:
            problems.append(
                Problem("tokenizer.kind", "a trained BPE tokenizer only works with a random-init model.preset")
            )
        precision = self.training.precision
        for i, t in enumerate(self.targets):
            inst = catalog.get(t.instance_type)
            if precision != "auto" and not inst.is_local and precision not in inst.precisions:
                problems.append(
                    Problem(
                        "training.precision",
                        f"{precision} is not supported by targets[{i}] {t.instance_type} ({inst.gpu_sku}); "
                        f"it supports {', '.join(inst.precisions)} (or use auto)",
                    )
                )
            if inst.is_local:
                continue
            world = inst.gpu_count * t.instance_count
            for j, v in enumerate(self.variants):
                if v.deepspeed_stage > 0 and world < 2:
                    problems.append(
                        Problem(
                            f"variants[{j}].deepspeed_stage",
                            f"ZeRO stage {v.deepspeed_stage} shards across GPUs, but targets[{i}] {t.instance_type} "
                            f"x{t.instance_count} has {world} GPU; use deepspeed_stage 0 there (no offload support)",
                        )
                    )
        if problems:
            raise ManifestProblemsError(problems)
        return self

    def _search_problems(self) -> list[Problem]:
        search = self.search
        if search is None:
            return [] if self.variants else [Problem("variants", "at least one variant (or a search section)")]
        problems = []
        if self.job is not None:
            problems.append(Problem("search", "searches the built-in job's settings; with a job section list variants"))
        if len(self.variants) > 1:
            problems.append(
                Problem("variants", "with a search section give at most one variant: the base settings it varies")
            )
        if self.repetitions != 1:
            problems.append(Problem("repetitions", "a search runs each candidate once (repetitions: 1)"))
        targets = {t.instance_type for t in self.targets}
        for key in search.by_instance_type:
            if key not in targets:
                problems.append(
                    Problem(f"search.by_instance_type.{key}", f"not a target; allowed: {', '.join(sorted(targets))}")
                )
        if search.max_cost_usd is not None and search.max_cost_usd > self.constraints.budget_usd:
            problems.append(
                Problem(
                    "search.max_cost_usd",
                    f"{search.max_cost_usd:g} exceeds constraints.budget_usd ({self.constraints.budget_usd:g})",
                )
            )
        return problems

    @property
    def base_variant(self) -> Variant:
        """A search's base settings: the one variant given, or the defaults."""
        return self.variants[0] if self.variants else Variant(name="base")

    def resolved_tracking(self) -> TrackingSection | None:
        """The tracking section with its defaults filled in (tracking.mlflow.experiment = the manifest's name)."""
        return None if self.tracking is None else self.tracking.resolved(self.name)

    def _builtin_problems(self) -> list[Problem]:
        """The built-in job needs a model, a dataset and a sequence length; per-variant arguments are for a job."""
        problems = [
            Problem(field, "required field is missing (or add a job section to benchmark your own code)")
            for field in ("model", "dataset", "sequence_length")
            if getattr(self, field) is None
        ]
        for i, v in enumerate(self.variants):
            if v.hyperparameters:
                problems.append(Problem(f"variants[{i}].hyperparameters", "only used with a job section"))
        return problems

    def _job_problems(self) -> list[Problem]:
        """A job section replaces the built-in job: its model, data and Qwen-specific settings are refused."""
        job = self.job
        assert job is not None
        problems = [
            Problem(field, "not used with a job section (your script loads its own model and data)")
            for field in ("model", "dataset", "sequence_length", "tokenizer")
            if _set_to_non_default(self, field)
        ]
        if self.training.max_steps is None:
            problems.append(
                Problem("training.max_steps", "a job section needs max_steps (max_tokens is built-in only)")
            )
        if job.unit == "samples" and self.constraints.target_loss is not None:
            problems.append(
                Problem("constraints.target_loss", "time to a target loss is measured for tokens jobs only")
            )
        allowed = {"name", "hyperparameters"}
        for i, v in enumerate(self.variants):
            for field in sorted(f for f in v.model_fields_set - allowed if _set_to_non_default(v, f)):
                problems.append(
                    Problem(f"variants[{i}].{field}", "built-in job setting; with a job section use hyperparameters")
                )
            for position, name in enumerate(job.estimate.step_names if job.estimate else []):
                value = {**job.arguments, **v.hyperparameters}.get(name)
                if position > 0 and value is None:  # a factor may be absent (e.g. no accumulation): 1
                    continue
                if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                    problems.append(
                        Problem(
                            f"variants[{i}].hyperparameters",
                            f"job.estimate.units_per_step names {name!r}, which must be a number > 0 in "
                            f"job.arguments or this variant's hyperparameters",
                        )
                    )
        targets = {t.instance_type for t in self.targets}
        for key in job.estimate.units_per_s_by_instance_type if job.estimate else {}:
            if key not in targets:
                problems.append(
                    Problem(
                        "job.estimate.units_per_s_by_instance_type",
                        f"{key!r} is not a target; allowed: {', '.join(sorted(targets))}",
                    )
                )
        return problems

    def builtin(self) -> tuple[ModelSpec, DatasetSpec, int]:
        """model, dataset and sequence_length of the built-in job (a manifest without a job section has all three,
        the validator guarantees it); ValueError for a job-section manifest."""
        if self.model is None or self.dataset is None or self.sequence_length is None:
            raise ValueError(f"manifest {self.name!r} benchmarks its own job; it has no built-in model and dataset")
        return self.model, self.dataset, self.sequence_length

    def units_per_step(self, variant: Variant) -> float:
        """Work units one optimizer step does, for a job section's prediction."""
        assert self.job is not None and self.job.estimate is not None
        estimate = self.job.estimate
        names = estimate.step_names
        if not names:
            return float(estimate.units_per_step)  # type: ignore[arg-type]
        values = {**self.job.arguments, **variant.hyperparameters}
        return float(math.prod(float(values.get(n, 1) or 1) for n in names))

    def resolved_precision(
        self, target: Target, catalog: Catalog, local_hardware: LocalHardware | None = None
    ) -> Precision:
        """The precision a job on ``target`` trains in: explicit, or ``auto`` = bf16 if supported, else fp16;
        fp32 on CPU. For ``local`` the detected hardware decides (CPU when ``local_hardware`` is None)."""
        inst: InstanceType = catalog.get(target.instance_type)
        supported = (local_hardware.precisions if local_hardware else ("fp32",)) if inst.is_local else inst.precisions
        if self.training.precision != "auto":
            return self.training.precision
        for p in ("bf16", "fp16", "fp32"):
            if p in supported:
                return p
        return "fp32"


# ----------------------------------------------------------------------------------------------------------------
# Safe loading


_YAML_BASE: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when available


def _mark(event: yaml.Event) -> yaml.Mark | None:
    """libyaml's marks are their own type; convert so ConstructorError formats line and column."""
    mark: Any = event.start_mark
    if mark is None or isinstance(mark, yaml.Mark):
        return mark
    return yaml.Mark("", 0, mark.line, mark.column, None, 0)


def _scan_yaml_events(text: str) -> None:
    """Refuse anchors/aliases and deep nesting from the event stream, before anything is composed or expanded."""
    depth = 0
    for event in yaml.parse(text, Loader=_YAML_BASE):
        if isinstance(event, AliasEvent) or getattr(event, "anchor", None) is not None:
            raise yaml.constructor.ConstructorError(
                None, None, "YAML anchors and aliases (&name, *name) are not allowed in a manifest", _mark(event)
            )
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_NESTING:
                raise yaml.constructor.ConstructorError(
                    None, None, f"nesting deeper than {MAX_NESTING} levels", _mark(event)
                )
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


class _ManifestLoader(_YAML_BASE):  # type: ignore[valid-type,misc]
    """Safe loader that refuses duplicate, merge, non-string and control-character keys (anchors, aliases and
    nesting are refused earlier by :func:`_scan_yaml_events`)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        if not isinstance(node, yaml.MappingNode):
            raise yaml.constructor.ConstructorError(None, None, "expected a mapping", node.start_mark)
        seen: set[str] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise yaml.constructor.ConstructorError(
                    None, None, "YAML merge keys (<<) are not allowed in a manifest", key_node.start_mark
                )
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    "mapping keys must be plain strings (quote numbers, booleans and null)",
                    key_node.start_mark,
                )
            key = key_node.value
            if _CONTROL_RE.search(key):
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} contains a control character", key_node.start_mark
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=True)


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if _CONTROL_RE.search(key):
            raise ValueError(f"key {key!r} contains a control character")
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid number in a manifest")


def _json_depth_ok(text: str) -> bool:
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_NESTING:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def _decode(data: bytes | str, source: str) -> str:
    raw = data.encode("utf-8", errors="surrogatepass") if isinstance(data, str) else bytes(data)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            source, [Problem("", f"file is {len(raw):,} bytes; a manifest may be at most {MAX_MANIFEST_BYTES:,}")]
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ManifestError(
            source, [Problem("", f"not valid UTF-8: byte 0x{raw[err.start]:02x} at offset {err.start} ({err.reason})")]
        ) from err
    return text.removeprefix("\ufeff")


def _is_json(text: str, source: str) -> bool:
    suffix = Path(source).suffix.lower()
    if suffix == ".json":
        return True
    if suffix in (".yaml", ".yml"):
        return False
    return text.lstrip().startswith("{")


def _parse_document(text: str, source: str) -> Any:
    if _is_json(text, source):
        if not _json_depth_ok(text):
            raise ManifestError(source, [Problem("", f"JSON nesting deeper than {MAX_NESTING} levels")])
        try:
            return json.loads(text, object_pairs_hook=_json_pairs, parse_constant=_reject_constant)
        except json.JSONDecodeError as err:
            raise ManifestError(
                source, [Problem("", f"invalid JSON at line {err.lineno}, column {err.colno}: {err.msg}")]
            ) from err
        except (ValueError, RecursionError) as err:
            raise ManifestError(source, [Problem("", f"invalid JSON: {err}")]) from err
    try:
        _scan_yaml_events(text)
        return yaml.load(text, Loader=_ManifestLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = err.problem or err.context or "YAML error"
        raise ManifestError(source, [Problem("", f"invalid YAML{where}: {what}")]) from err
    except (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError) as err:
        raise ManifestError(source, [Problem("", f"invalid YAML: {err}")]) from err


def _format_loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _model_at(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the field at ``loc`` (for listing the allowed keys)."""
    model: type[BaseModel] | None = Manifest
    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        ann = field.annotation
        args = getattr(ann, "__args__", ()) or (ann,)
        model = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return model


def _problems_from(err: ValidationError) -> list[Problem]:
    problems: list[Problem] = []
    for e in err.errors(include_url=False):
        loc = tuple(e["loc"])
        ctx_err = (e.get("ctx") or {}).get("error")
        if isinstance(ctx_err, ManifestProblemsError):
            prefix = _format_loc(loc)
            for p in ctx_err.problems:
                sep = "" if not prefix or not p.path or p.path.startswith("[") else "."
                problems.append(Problem(f"{prefix}{sep}{p.path}", p.message))
            continue
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            owner = _model_at(loc)
            allowed = ", ".join(owner.model_fields) if owner else ""
            msg = f"unknown field{'; allowed: ' + allowed if allowed else ''}"
        elif e["type"] == "string_pattern_mismatch" and loc and loc[-1] == "name":
            msg = "must be 1-40 lowercase letters, digits and inner hyphens (e.g. 'qwen7b-p5')"
        elif e["type"] == "missing":
            msg = "required field is missing"
        problems.append(Problem(_format_loc(loc), msg))
    return problems


def _catalog_from(info: ValidationInfo) -> Catalog:
    ctx = info.context if isinstance(info.context, dict) else {}
    catalog = ctx.get("catalog")
    return catalog if isinstance(catalog, Catalog) else load_catalog()


def validate_manifest_data(data: Any, source: str, catalog: Catalog | None = None) -> Manifest:
    """Validate already-parsed data (a dict) as a manifest; ManifestError lists every problem."""
    if not isinstance(data, dict):
        kind = "empty" if data is None else type(data).__name__
        raise ManifestError(source, [Problem("", f"a manifest is a mapping of fields at the top level, not {kind}")])
    catalog = catalog or load_catalog()
    try:
        return Manifest.model_validate(data, context={"catalog": catalog})
    except ValidationError as err:
        raise ManifestError(source, _problems_from(err)) from err


def parse_document(data: bytes | str, source: str) -> Any:
    """A manifest file's data (YAML or JSON, the rules of parse_manifest), not yet validated."""
    return _parse_document(_decode(data, source), source)


def parse_manifest(data: bytes | str, source: str, catalog: Catalog | None = None) -> Manifest:
    """Parse manifest text (YAML or JSON) from ``source`` (a file name or S3 URI used in messages)."""
    text = _decode(data, source)
    return validate_manifest_data(_parse_document(text, source), source, catalog)


def load_manifest(path: Path | str, catalog: Catalog | None = None) -> Manifest:
    """Read and validate a manifest file."""
    p = Path(path)
    try:
        info = p.stat()
        if not stat.S_ISREG(info.st_mode):
            what = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file (a device, FIFO or socket)"
            raise ManifestError(str(p), [Problem("", f"{what}; a manifest is a YAML or JSON file")])
        size = info.st_size
        if size > MAX_MANIFEST_BYTES:
            raise ManifestError(
                str(p), [Problem("", f"file is {size:,} bytes; a manifest may be at most {MAX_MANIFEST_BYTES:,}")]
            )
        raw = p.read_bytes()
    except OSError as err:
        raise ManifestError(str(p), [Problem("", f"cannot read file: {err.strerror or err}")]) from err
    manifest = parse_manifest(raw, str(p), catalog)
    if manifest.job is not None:
        return _resolve_job(manifest, p)
    return _resolve_local_source(manifest, p)


def _resolve_job(manifest: Manifest, path: Path) -> Manifest:
    """A job's source_dir is resolved against the manifest's folder and must hold the entry point (and the
    requirements file when named): a typo fails ``validate``, not a job seconds into ``local``."""
    job = manifest.job
    assert job is not None
    if job.in_s3:  # already uploaded: the cloud's Validate step checks the entry point in S3
        return manifest
    source = Path(job.source_dir).expanduser()
    resolved = source if source.is_absolute() else (path.parent / source).resolve()
    problems: list[Problem] = []
    if not resolved.is_dir():
        problems.append(Problem("job.source_dir", f"{job.source_dir}: no such folder (resolved to {resolved})"))
    else:
        for field in ("entry_point", "requirements"):
            name = getattr(job, field)
            if name is not None and not (resolved / name).is_file():
                problems.append(Problem(f"job.{field}", f"{name}: no such file in {resolved}"))
    if problems:
        raise ManifestError(str(path), problems)
    return manifest.model_copy(update={"job": job.model_copy(update={"source_dir": str(resolved)})})


def _resolve_local_source(manifest: Manifest, path: Path) -> Manifest:
    """A local ``dataset.source`` is resolved against the manifest's folder (not the current directory) and must
    exist: a missing file fails ``validate`` and ``plan``, not a data preparation seconds into ``local``."""
    if manifest.dataset is None or manifest.dataset.kind != "local":
        return manifest
    source = Path(manifest.dataset.source).expanduser()
    resolved = source if source.is_absolute() else (path.parent / source).resolve()
    if not resolved.exists():
        where = (
            ""
            if source.is_absolute()
            else f" (relative paths are resolved against the manifest's folder {path.parent})"
        )
        raise ManifestError(
            str(path), [Problem("dataset.source", f"{manifest.dataset.source}: no such file or folder{where}")]
        )
    if resolved.is_file() and not os.access(resolved, os.R_OK):
        raise ManifestError(str(path), [Problem("dataset.source", f"{resolved}: not readable")])
    dataset = manifest.dataset.model_copy(update={"source": str(resolved)})
    return manifest.model_copy(update={"dataset": dataset})
