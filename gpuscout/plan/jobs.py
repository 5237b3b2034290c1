"""A run's jobs as the planner hands them on: the ``Plan`` (jobs, canaries, search, budget check), run ids and job
names, repetitions, the hyperparameters train.py receives, and the runtime limits and overheads a job is planned with.

May import: gpuscout.domain, gpuscout.errors and gpuscout.plan.search."""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

from gpuscout.domain.catalog import Catalog, InstanceType
from gpuscout.domain.jobspec import JOB_NAME_RE, JobSpec
from gpuscout.domain.manifest import Manifest
from gpuscout.domain.manifest_targets import Target
from gpuscout.domain.manifest_training import Variant
from gpuscout.domain.names import JOB_NAME_PREFIX
from gpuscout.domain.prices import CatalogPrice
from gpuscout.domain.search_plan import SearchPlan, TargetSearch
from gpuscout.errors import BudgetExceededError, PlanError

CLOUD_OVERHEAD_S = 360.0


LOCAL_OVERHEAD_S = 0.0


RUNTIME_SAFETY_FACTOR = 3.0


RUNTIME_MARGIN_S = 600


MIN_RUNTIME_S = 1800


MAX_RUNTIME_S = 5 * 24 * 3600


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_id: str
    manifest_name: str
    budget_usd: float
    jobs: list[JobSpec]
    search: SearchPlan | None = None  # a settings search: jobs are its candidates, launched as trials

    @property
    def predicted_cost_usd(self) -> float:
        """Every job's predicted cost; for a search, what its trials can cost at most: each target's
        ``max_trials`` costliest candidates run in full, capped by the search's spend cap plus what the trials still
        running when the cap is reached can add (the guard acts when a trial ends): with ``max_parallel_trials``
        at once, up to that many less one of each target's costliest trials."""
        if self.search is None:
            return sum(j.prediction.cost_usd for j in self.jobs)
        total = overshoot = 0.0
        for target, costs in self._largest_first(lambda j: j.prediction.cost_usd):
            total += sum(costs[: target.max_trials])
            parallel = min(self.search.max_parallel_trials, target.max_trials)
            overshoot += sum(costs[: parallel - 1])
        return min(total, self.search.max_cost_usd + overshoot)

    @property
    def predicted_sequential_seconds(self) -> float:
        """The jobs run one after another (as ``gpuscout local`` runs them): every job's time; for a search, at
        most each target's ``max_trials`` longest candidates (only that many trials are launched)."""

        def seconds(job: JobSpec) -> float:
            return job.prediction.training_seconds + job.prediction.overhead_seconds

        if self.search is None:
            return sum(map(seconds, self.jobs))
        return sum(sum(values[: target.max_trials]) for target, values in self._largest_first(seconds))

    def _largest_first(self, value: Callable[[JobSpec], float]) -> list[tuple[TargetSearch, list[float]]]:
        """Each searched target with its candidates' ``value``, largest first (a search's worst case)."""
        assert self.search is not None
        return [
            (target, sorted((value(j) for j in self.jobs if j.target_index == target.target_index), reverse=True))
            for target in self.search.targets
        ]

    @property
    def predicted_seconds(self) -> float:
        """Longest single job (jobs run in parallel in the cloud)."""
        return max((j.prediction.training_seconds + j.prediction.overhead_seconds for j in self.jobs), default=0.0)

    def check_budget(self, extra_usd: float = 0.0) -> float:
        """The predicted cost (a search's: its worst case) plus ``extra_usd`` billed besides the jobs (a cloud run's
        canaries); raises BudgetExceededError when it exceeds the budget, else returns it."""
        total = self.predicted_cost_usd + extra_usd
        if total > self.budget_usd:
            raise BudgetExceededError(total, self.budget_usd)
        return total


def _slug(text: str) -> str:
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]+", "-", text.lower())).strip("-")


def make_run_id(name: str, *, key: str | None = None, etag: str | None = None) -> str:
    """Run id: ``<name>-<hash of key+etag>`` when given (the same S3 object twice -> the same id, so a re-delivered
    event does not start a second run), else ``<name>-<UTC yyyymmdd-hhmmss>-<random>``. Lowercase letters, digits
    and hyphens, at most 48 characters, so it fits in SageMaker names and tags."""
    base = _slug(name)[:24].strip("-") or "run"
    if key is not None or etag is not None:
        digest = hashlib.sha256(f"{key or ''}\x00{etag or ''}".encode()).hexdigest()[:12]
        return f"{base}-{digest}"
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"{base}-{stamp}-{secrets.token_hex(3)}"


def same_arguments(arguments: dict[str, str], *, job_name: str) -> dict[str, str]:
    """A user's job passes the same arguments under every job name."""
    return dict(arguments)


def repeated_specs(
    manifest: Manifest,
    run_id: str,
    *,
    ti: int,
    target: Target,
    vi: int,
    variant: Variant,
    hyperparameters_for: Callable[..., dict[str, str]],
    **fields: Any,
) -> list[JobSpec]:
    """One JobSpec per repetition of a target x variant: names, indices, the target's instance fields and the
    manifest's tracking here, the rest (prices, precision, runtime, prediction, ...) in ``fields``;
    ``hyperparameters_for(job_name=...)``."""
    specs = []
    for rep in range(manifest.repetitions):
        name = job_name(run_id, target_index=ti, target=target, variant_index=vi, variant=variant, rep=rep)
        specs.append(
            JobSpec(
                job_name=name,
                run_id=run_id,
                target_index=ti,
                variant_name=variant.name,
                repetition=rep,
                instance_type=target.instance_type,
                instance_count=target.instance_count,
                spot=target.spot,
                training_plan_arn=target.training_plan_arn,
                hyperparameters=hyperparameters_for(job_name=name),
                tracking=manifest.resolved_tracking(),
                **fields,
            )
        )
    return specs


RUN_HASH_HEX = 10


def job_name(run_id: str, *, target_index: int, target: Target, variant_index: int, variant: Variant, rep: int) -> str:
    """``gs-<run hash>-t<i>v<j>r<k>-<instance>-<variant>``, at most 63 characters. The head is unique by
    construction; the descriptive tail is cut to fit."""
    # 40 bits: two runs' jobs must not share a name (the workflow would adopt the other run's job); 24 bits gave 11
    # collisions in 20,000 runs, 40 bits about one in 5,000 accounts that ever reach 20,000 runs
    run_hash = hashlib.sha256(run_id.encode()).hexdigest()[:RUN_HASH_HEX]
    head = f"{JOB_NAME_PREFIX}{run_hash}-t{target_index}v{variant_index}r{rep}"
    tail = f"{_slug(target.instance_type.removeprefix('ml.'))}-{_slug(variant.name)}"
    name = f"{head}-{tail}"[:63].rstrip("-")
    if not JOB_NAME_RE.match(name):  # cannot happen with slugs; guards the contract
        raise PlanError(f"could not form a valid SageMaker job name from {name!r}")
    return name


def flag_value(value: bool) -> str:
    return "true" if value else "false"


def hyperparameters(
    manifest: Manifest,
    *,
    run_id: str,
    job_name: str,
    instance_type: str,
    variant: Variant,
    batch: int,
    accum: int,
    max_steps: int,
    precision: str,
) -> dict[str, str]:
    """train.py's hyperparameters (docs/internals.md), all strings; warmup_steps omitted for auto."""
    t = manifest.training
    model, _, sequence_length = manifest.builtin()
    hp: dict[str, str] = {"run_id": run_id, "job_name": job_name, "instance_type": instance_type}
    if model.preset:
        hp["model_preset"] = model.preset
    else:
        hp["model_name_or_path"] = model.hf_id or model.path or ""
    hp.update(
        {
            "sequence_length": str(sequence_length),
            "per_device_train_batch_size": str(batch),
            "gradient_accumulation_steps": str(accum),
            "max_steps": str(max_steps),
            "learning_rate": repr(variant.learning_rate or t.learning_rate),
            "weight_decay": repr(t.weight_decay),
            "seed": str(t.seed),
            "precision": precision,
            "packing": flag_value(variant.packing),
            "attention_implementation": variant.attention,
            "gradient_checkpointing": flag_value(variant.gradient_checkpointing),
            "torch_compile": flag_value(variant.torch_compile),
            "dataloader_num_workers": str(variant.dataloader_workers),
            "deepspeed_stage": str(variant.deepspeed_stage),
            "fused_cross_entropy": flag_value(variant.fused_cross_entropy),
            "fused_adamw": flag_value(variant.fused_adamw),
            "host_allocator": variant.host_allocator,
            "stop_rule": t.stop_rule.kind,
            "ci_tolerance": repr(t.stop_rule.ci_tolerance),
            "min_timed_steps": str(t.stop_rule.min_timed_steps),
            "eval_interval": str(t.eval_interval),
            "checkpoint_interval": str(t.checkpoint_interval),
            "checkpoint_keep": str(t.checkpoint_keep),
            "validation_batches": str(t.validation_batches),
        }
    )
    if t.stop_rule.min_timed_seconds is not None:
        hp["min_timed_seconds"] = repr(t.stop_rule.min_timed_seconds)
    if (adapter := variant.adapter()) is not None:
        hp.update(
            {
                "method": adapter.method,
                "lora_rank": str(adapter.rank),
                "lora_alpha": str(adapter.alpha),
                "lora_dropout": repr(adapter.dropout),
                "lora_target_modules": ",".join(adapter.target_modules),
            }
        )
    if variant.cross_entropy_kernel != "auto":
        hp["cross_entropy_kernel"] = variant.cross_entropy_kernel
    if t.warmup_steps is not None:
        hp["warmup_steps"] = str(t.warmup_steps)
    return hp


def planned_price(target: Target, inst: InstanceType, where: str, catalog: Catalog) -> CatalogPrice:
    """The on-demand price per instance-hour a plan uses, with its kind: the target's override (``manifest``), else
    the catalog's snapshot; PlanError naming the fix where neither exists."""
    if target.price_per_hour_usd is not None:
        return CatalogPrice(
            usd_per_hour=target.price_per_hour_usd, kind="manifest", region="", date="", source="manifest target"
        )
    if inst.price is not None:
        return inst.price
    if inst.is_local:
        raise PlanError(f"{where}: a local target must state price_per_hour_usd")
    reason = catalog.prices.unpriced.get(inst.instance_type) if catalog.prices else None
    why = f"the price snapshot has no rate for it ({reason})" if reason else "the price snapshot has no rate for it"
    hint = " (under a training plan: the plan's price per instance-hour)" if inst.training_plan_only else ""
    raise PlanError(
        f"{where}: no price: {why}; set targets[].price_per_hour_usd{hint}, or refresh the snapshot with "
        "`gpuscout catalog --refresh`"
    )
