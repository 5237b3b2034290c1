"""The benchmark manifest: the whole document as one pydantic v2 model (``extra="forbid"`` everywhere) over its
sections (manifest_training: what is trained; manifest_targets: where, and the answer wanted; manifest_search: how it
is searched and tracked), with the checks that span sections. docs/manifest.md is the reference; manifest_loader reads
a file into it safely.

May import: gpuscout.domain's catalog, models and manifest_* section modules, pydantic."""

from __future__ import annotations

import json
import math

from pydantic import Field, ValidationInfo, model_validator

from gpuscout.domain.catalog import Catalog, InstanceType, LocalHardware
from gpuscout.domain.manifest_fields import ManifestProblemsError, Precision, Slug, StrictModel, catalog_from
from gpuscout.domain.manifest_search import SearchSection, TrackingSection
from gpuscout.domain.manifest_targets import Constraints, Objective, Target
from gpuscout.domain.manifest_training import (
    DatasetSpec,
    JobSection,
    ModelSpec,
    TokenizerSpec,
    TrainingSpec,
    Variant,
    set_to_non_default,
)
from gpuscout.errors import Problem


class Manifest(StrictModel):
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
        catalog = catalog_from(info)
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
        problems += self._variant_target_problems()
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
                if v.deepspeed_stage > 0 and world < 2 and v.runs_on(t.instance_type):
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

    def _variant_target_problems(self) -> list[Problem]:
        """A variant's ``instance_types`` name targets, and a variant runs on at least one."""
        targets = {t.instance_type for t in self.targets}
        names = ", ".join(sorted(targets))
        idle = [
            Problem(f"targets[{i}]", f"no variant runs on {t.instance_type} (no variant's instance_types name it)")
            for i, t in enumerate(self.targets)
            if self.variants and not any(v.runs_on(t.instance_type) for v in self.variants)
        ]
        return idle + [
            Problem(f"variants[{j}].instance_types[{k}]", f"{name} is not a target; targets: {names}")
            for j, v in enumerate(self.variants)
            for k, name in enumerate(v.instance_types or [])
            if name not in targets
        ]

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
        quality = [n for n in ("method", "lora_rank") if len(getattr(search.space, n) or []) > 1 or any(
            len(getattr(space, n) or []) > 1 for space in search.by_instance_type.values())]  # fmt: skip
        if quality and (self.constraints.target_loss is None or search.pruning.enabled):
            problems.append(Problem(f"search.space.{quality[0]}", (
                "methods and ranks differ in what a token of training does to the loss, not only in speed: a search "
                "over them needs constraints.target_loss (each candidate is compared by the time and cost to that "
                "loss) and search.pruning.enabled: false (the pruner compares $ per token)")))  # fmt: skip
        if self.variants and self.variants[0].instance_types is not None:
            problems.append(Problem("variants[0].instance_types", "a search varies its base on every target; list "
                                    "only the targets to search"))  # fmt: skip
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
        for ti, target in enumerate(self.targets):
            if target.training_plan_arn is not None:  # HyperParameterTuningResourceConfig has no TrainingPlanArn
                problems.append(Problem(
                    f"targets[{ti}].training_plan_arn",
                    "a settings search runs as a SageMaker tuning job, which cannot run on a training plan; "
                    "list the settings as variants instead",
                ))  # fmt: skip
        return problems

    def planned_pairs(self) -> int:
        """Target x variant pairs that are planned: each variant on its ``instance_types`` (every target without)."""
        return sum(v.runs_on(t.instance_type) for t in self.targets for v in self.variants)

    def duplicate_variants(self) -> list[list[str]]:
        """Groups of variants (names, manifest order) whose settings are the same once defaults are filled in: the
        same jobs, run and paid for again under another name (repetitions are the way to repeat a measurement)."""
        groups: dict[str, list[str]] = {}
        for variant in self.variants:
            settings = variant.model_dump(mode="json", exclude={"name"}, exclude_defaults=True)
            groups.setdefault(json.dumps(settings, sort_keys=True), []).append(variant.name)
        return [names for names in groups.values() if len(names) > 1]

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
        preset = self.model is not None and self.model.preset is not None
        searched = self.search is not None and "qlora" in (self.search.space.method or [])
        quantized = [f"variants[{i}].method" for i, v in enumerate(self.variants) if v.method == "qlora"]
        why = "qlora quantizes pretrained weights: give model.hf_id or model.path (a preset is random weights)"
        problems += [Problem(path, why) for path in quantized + (["search.space.method"] if searched else []) if preset]
        for i, v in enumerate(self.variants):
            if v.method == "qlora" and v.torch_compile:
                problems.append(Problem(f"variants[{i}].torch_compile", "not with method qlora: bitsandbytes' 4-bit "
                                        "layers are not measured under torch.compile"))  # fmt: skip
        return problems

    def _job_problems(self) -> list[Problem]:
        """A job section replaces the built-in job: its model, data and Qwen-specific settings are refused."""
        job = self.job
        assert job is not None
        problems = [
            Problem(field, "not used with a job section (your script loads its own model and data)")
            for field in ("model", "dataset", "sequence_length", "tokenizer")
            if set_to_non_default(self, field)
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
            for field in sorted(f for f in v.model_fields_set - allowed if set_to_non_default(v, f)):
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
