"""The manifest sections that say what is trained and how: the model, tokenizer and dataset, the training budget and
stop rule, a job section (the user's own code and its estimate), and the variants (the settings compared).

May import: gpuscout.domain's adapters, catalog, models and manifest_fields, pydantic."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from gpuscout.domain.adapters import (
    DEFAULT_ALPHA,
    DEFAULT_DROPOUT,
    DEFAULT_RANK,
    DEFAULT_TARGET_MODULES,
    Adapter,
    LinearModule,
    Method,
)
from gpuscout.domain.manifest_fields import CONTROL_RE, S3_URI_RE, Slug, StrictModel
from gpuscout.domain.models import HF_ID_TO_PRESET, PRESETS, Architecture

BUNDLED_SOURCES = ("bundled:hebrew-bible", "bundled:hebrew-chatterbot")
# A job's throughput is measured over its timed steps, the steps after its warm-up; fewer than this give no interval,
# so no verdict can rest on the job (gpuscout.analysis), and train.py refuses a job with none.
MIN_TIMED_STEPS = 2


def default_warmup_steps(max_steps: int) -> int:
    """train.py's warm-up when none is set (gpuscout_train.metrics.default_warmup_steps): max(3, 10 %), always
    leaving one step to time."""
    return max(0, min(max(3, math.ceil(0.1 * max_steps)), max_steps - 1))


def fewest_max_steps(warmup_steps: int | None) -> int:
    """The fewest steps a job may have to leave MIN_TIMED_STEPS timed ones (warm-up: None = train.py's default)."""
    if warmup_steps is not None:
        return warmup_steps + MIN_TIMED_STEPS
    return next(n for n in range(MIN_TIMED_STEPS, 100) if n - default_warmup_steps(n) >= MIN_TIMED_STEPS)


def timed_steps_problem(max_steps: int, warmup_steps: int | None) -> str | None:
    """Why a job of ``max_steps`` (and this warm-up, None = train.py's default) cannot be measured, or None."""
    warmup = default_warmup_steps(max_steps) if warmup_steps is None else warmup_steps
    timed = max_steps - warmup
    if timed >= MIN_TIMED_STEPS:
        return None
    how = f"the automatic warm-up of max(3, 10 %) is {warmup}" if warmup_steps is None else f"warmup_steps is {warmup}"
    return (
        f"{max_steps} step{'' if max_steps == 1 else 's'} leave{'s' if max_steps == 1 else ''} {max(timed, 0)} timed "
        f"({how}); every job needs at least {MIN_TIMED_STEPS} timed steps to be measured"
    )


class ModelSpec(StrictModel):
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
        if v is not None and CONTROL_RE.search(v):
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


class TokenizerSpec(StrictModel):
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


class DatasetSpec(StrictModel):
    source: str = Field(min_length=1, max_length=1024)
    format: Literal["auto", "jsonl", "txt", "parquet"] = "auto"
    text_field: str = Field(default="text", min_length=1, max_length=128)
    max_documents: int | None = Field(default=None, ge=1)
    min_characters: int = Field(default=20, ge=0)
    validation_fraction: float = Field(default=0.05, ge=0.0, lt=0.5)

    @field_validator("source")
    @classmethod
    def _known_source(cls, v: str) -> str:
        if CONTROL_RE.search(v):
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


class StopRule(StrictModel):
    kind: Literal["fixed", "steady_state"] = "fixed"
    ci_tolerance: float = Field(default=0.02, gt=0.0, lt=1.0)
    min_timed_steps: int = Field(default=10, ge=2)
    # and at least this much timed work before stopping (None = train.py's default: 60 s on a GPU, none on a CPU)
    min_timed_seconds: float | None = Field(default=None, ge=0.0, le=86_400.0)


class TrainingSpec(StrictModel):
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
        if self.max_steps is not None and (problem := timed_steps_problem(self.max_steps, self.warmup_steps)):
            fix = f"give max_steps {fewest_max_steps(self.warmup_steps)} or more"
            if self.warmup_steps is not None:
                fix += f", or warmup_steps at most {self.max_steps - MIN_TIMED_STEPS}"
            raise ValueError(f"max_steps: {problem}: {fix}")
        return self


HyperparameterValue = str | int | float | bool
_HP_KEY_RE = r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$"
Unit = Literal["tokens", "samples"]


class JobEstimate(StrictModel):
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


class JobSection(StrictModel):
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
        if v is not None and CONTROL_RE.search(v):
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


def set_to_non_default(model: BaseModel, field: str) -> bool:
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


class LoraSpec(StrictModel):
    """A LoRA adapter's knobs (peft's names): rank, alpha (the update is scaled by alpha / rank), dropout on the
    adapters' input, and which linear layers of every decoder block carry one (default: all seven)."""

    rank: int = Field(default=DEFAULT_RANK, ge=1, le=1024)
    alpha: int = Field(default=DEFAULT_ALPHA, ge=1, le=65536)
    dropout: float = Field(default=DEFAULT_DROPOUT, ge=0.0, lt=1.0)
    target_modules: list[LinearModule] = Field(default_factory=lambda: list(DEFAULT_TARGET_MODULES), min_length=1)

    @field_validator("target_modules")
    @classmethod
    def _unique(cls, v: list[LinearModule]) -> list[LinearModule]:
        if len(set(v)) != len(v):
            raise ValueError("each module once")
        return v


class Variant(StrictModel):
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
    # which fused loss runs with fused_cross_entropy (docs/manifest.md): auto = chunked, the project's own
    cross_entropy_kernel: Literal["auto", "chunked", "liger", "torch"] = "auto"
    fused_adamw: bool = False
    # train.py's host memory allocator: "training" keeps freed memory for the next step, "system" leaves malloc as
    # the environment set it (training/gpuscout_train/host_allocator.py, docs/metrics.md "Host allocator")
    host_allocator: Literal["training", "system"] = "training"
    # What trains (docs/manifest.md "Methods"): every weight (full), LoRA adapters on a frozen base (lora), or the
    # adapters on a 4-bit base (qlora, CUDA only); ``lora`` holds the adapters' knobs (defaults when omitted).
    method: Method = "full"
    lora: LoraSpec | None = None
    # this variant's learning rate (None = training.learning_rate): adapters usually train at a rate about ten times a
    # full fine-tune's, and comparing methods at equal quality needs each at its own
    learning_rate: float | None = Field(default=None, gt=0.0, le=1.0)
    # the targets (by instance type) this variant runs on; None = every target (a 7B LoRA on one L40S beside a full
    # fine-tune on a P5, without the full fine-tune planned on the L40S too)
    instance_types: list[Annotated[str, Field(min_length=1, max_length=64)]] | None = Field(default=None, min_length=1)

    @field_validator("hyperparameters")
    @classmethod
    def _keys(cls, v: dict[str, HyperparameterValue]) -> dict[str, HyperparameterValue]:
        return _check_hp_keys(v)

    @model_validator(mode="after")
    def _kernel_needs_fused_loss(self) -> Variant:
        if self.cross_entropy_kernel != "auto" and not self.fused_cross_entropy:
            raise ValueError(f"cross_entropy_kernel: {self.cross_entropy_kernel} chooses a fused loss; it needs "
                             "fused_cross_entropy: true")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _adapter_settings(self) -> Variant:
        if self.method == "full" and self.lora is not None:
            raise ValueError("lora: adapter settings need method lora or qlora (method is full)")
        if self.method != "full" and self.deepspeed_stage:
            raise ValueError(f"method {self.method} trains only the adapters, which ZeRO does not need to shard; "
                             "use deepspeed_stage 0 (one GPU, or data parallel across several)")  # fmt: skip
        return self

    def runs_on(self, instance_type: str) -> bool:
        """Whether this variant is planned on a target of ``instance_type`` (``instance_types``)."""
        return self.instance_types is None or instance_type in self.instance_types

    def adapter(self) -> Adapter | None:
        """The adapter this variant trains, or None for full fine-tuning."""
        if self.method == "full":
            return None
        spec = self.lora or LoraSpec()
        return Adapter(method=self.method, rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout,
                       target_modules=tuple(spec.target_modules))  # fmt: skip
