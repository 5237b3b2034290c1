"""The answer to a run: per target x variant metrics, costs, ranking and a recommendation (``analyze_run``).

Pipeline (each stage O(n) or O(n log n) in the number of jobs):

1. ``measure``: group JobRecords by target x variant (repetitions together) and compute everything that does not
   depend on a price: tokens/s mean and 95 % CI, MFU, epoch and target-loss seconds, billed and overhead seconds.
2. ``price``: turn seconds into dollars with a PriceBook (on-demand and spot).
3. ``recommend.decide``: exclusions, ranking by the manifest's objective, Pareto front, recommendation.

``reprice`` repeats stages 2 and 3 on a stored analysis with new prices.
"""

from __future__ import annotations

import gc
import json
import math
import operator
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import chain
from typing import Any

import numpy as np  # a matplotlib dependency, so always present where gpuscout's core runs
from numpy.typing import NDArray

from gpuscout.analysis import costs, step_series
from gpuscout.analysis.caveats import contention_note, incomplete_note, validation_note
from gpuscout.analysis.disturbed import disturbance_note, disturbed, kernel_note, undisturbed_factor
from gpuscout.analysis.machines import machines_of
from gpuscout.analysis.pricing import PriceBook
from gpuscout.analysis.recommend import decide, with_incomplete
from gpuscout.analysis.step_series import downsample
from gpuscout.analysis.terms import RunTerms
from gpuscout.domain import intervals
from gpuscout.domain.adapters import Adapter
from gpuscout.domain.benchmark import BenchmarkResult, Disturbance, LossPoint, StepAccount
from gpuscout.domain.catalog import LOCAL, Catalog
from gpuscout.domain.disturbance import judged, recompiled
from gpuscout.domain.jobspec import NAME_HYPERPARAMETERS, JobSpec
from gpuscout.domain.manifest_training import MIN_TIMED_STEPS
from gpuscout.domain.run_analysis import (
    Constraints,
    JobAnalysis,
    RunAnalysis,
    SearchOutcome,
    SearchTargetOutcome,
    SearchTrial,
    TimeBreakdown,
)
from gpuscout.domain.search_plan import SearchPlan
from gpuscout.store.base import JobRecord, JobStatus, RunRecord

# -- stage 1: measure ---------------------------------------------------------------------------------------------
_FAILURE_WORDS = {
    JobStatus.OOM: "out of GPU memory",
    JobStatus.CAPACITY: "no capacity for the instance type",
    JobStatus.QUOTA: "account quota exceeded (ResourceLimitExceeded)",
    JobStatus.FAILED: "failed",
    JobStatus.STOPPED: "stopped before it finished",
    JobStatus.PRUNED: "pruned by the settings search",
}


def _group_key(job: JobRecord) -> tuple[Any, ...]:
    target_index = job.spec.target_index
    return (target_index, job.instance_type, job.instance_count, job.spot, job.variant_name)


def _failure_text(job: JobRecord) -> str:
    words = _FAILURE_WORDS.get(job.status, f"did not finish (status {job.status.value})")
    reason = job.failure_reason or (job.benchmark.failure_reason if job.benchmark else None)
    return f"{words}: {reason}" if reason and job.status is not JobStatus.OOM else words


def _mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


@dataclass(frozen=True)
class _Rep:
    """One completed benchmark as analysis reads it: the BenchmarkResult itself, its ranked rate, its loss curve as
    one array and its disturbance as this release's detector judges it (built once per job by ``_completed``)."""

    bench: BenchmarkResult
    tokens_per_s: float  # the ranked rate: tokens/s, or samples/s when unit is samples
    ci95: tuple[float, float] | None
    curve: NDArray[np.float64]  # (points, 3): tokens, elapsed s, train loss (one array, not a tuple per point)
    disturbance: Disturbance | None  # as this release's detector judges the steps (domain/disturbance.py)

    @property
    def unit(self) -> str:
        return self.bench.unit

    @property
    def device(self) -> str:
        return self.bench.hardware.device

    @property
    def world_size(self) -> int:
        return self.bench.hardware.world_size

    @property
    def gpu_sku(self) -> str | None:
        return self.bench.hardware.gpu_sku

    @property
    def mfu(self) -> float | None:
        return self.bench.efficiency.mfu if self.bench.efficiency else None

    @property
    def hfu(self) -> float | None:
        return self.bench.efficiency.hfu if self.bench.efficiency else None

    @property
    def step_p50(self) -> float | None:
        return self.bench.timing.step_time_p50_s if self.bench.timing else None

    @property
    def step_p90(self) -> float | None:
        return self.bench.timing.step_time_p90_s if self.bench.timing else None

    @property
    def wall_time_s(self) -> float | None:
        return self.bench.timing.wall_time_s if self.bench.timing else None

    @property
    def train_time_s(self) -> float | None:
        return self.bench.timing.train_time_s if self.bench.timing else None

    @property
    def startup_time_s(self) -> float:
        return self.bench.timing.startup_time_s if self.bench.timing else 0.0

    @property
    def timed_steps(self) -> int | None:
        return self.bench.timing.timed_steps if self.bench.timing else None

    @property
    def peak_memory_gb(self) -> float | None:
        return self.bench.memory.peak_allocated_gb

    @property
    def peak_reserved_gb(self) -> float | None:
        return self.bench.memory.peak_reserved_gb

    @property
    def final_train_loss(self) -> float | None:
        return self.bench.loss.final_train_loss if self.bench.loss else None

    @property
    def validation_error(self) -> str | None:
        return self.bench.loss.validation_error if self.bench.loss else None

    @property
    def curve_points(self) -> list[LossPoint]:
        return self.bench.loss.train if self.bench.loss else []

    @property
    def dataset_tokens(self) -> int:
        return self.bench.dataset.tokens if self.bench.dataset else 0

    @property
    def stop_rule(self) -> str | None:
        return self.bench.stop.rule if self.bench.stop else None

    @property
    def stop_reason(self) -> str | None:
        return self.bench.stop.reason if self.bench.stop else None

    @property
    def steps(self) -> list[StepAccount]:
        return self.bench.steps

    @property
    def host_allocator(self) -> str | None:
        return self.bench.software.host_allocator

    def trained(self) -> dict[str, Any]:
        """JobAnalysis's method, adapter, trainable and total parameters, from benchmark.json's config."""
        config = self.bench.config
        if config is None:
            return {}
        lora = config.lora
        label = Adapter("qlora" if config.method == "qlora" else "lora", rank=lora.rank).label if lora else None
        trainable = config.params_trainable if config.params_trainable is not None else config.params_total
        return {"method": config.method, "adapter": label, "params_trainable": trainable,
                "params_total": config.params_total or None}  # fmt: skip


_LOSS_POINT = operator.attrgetter("tokens", "elapsed_s", "loss")  # LossPoint -> (tokens, s, loss)


def _curve_array(points: Sequence[LossPoint]) -> NDArray[np.float64]:
    """LossPoints -> one (points, 3) float array of tokens, elapsed s, loss (not a tuple object per point)."""
    return np.fromiter(chain.from_iterable(map(_LOSS_POINT, points)), dtype=float, count=3 * len(points)).reshape(-1, 3)


def _prediction_fields(spec: JobSpec) -> dict[str, Any]:
    """The plan's predicted rate (in the job's unit) and how it was made, as the job's spec recorded them."""
    rate = spec.prediction.rate
    return {"predicted_rate": rate or None, "prediction_method": spec.prediction.method}


def _completed(bench: BenchmarkResult) -> _Rep | str:
    """A completed job's benchmark as analysis reads it, or why it cannot be used."""
    if bench.status != "completed":
        return f"failed: {bench.failure_reason or 'benchmark.json reports a failure'}"
    throughput = bench.throughput
    rate = (throughput.samples_per_s if bench.unit == "samples" else throughput.tokens_per_s) if throughput else None
    if throughput is None or not rate or rate <= 0:
        return "failed: benchmark.json reports no throughput"
    ci = throughput.samples_per_s_ci95 if bench.unit == "samples" else throughput.tokens_per_s_ci95
    curve = _curve_array(bench.loss.train if bench.loss else [])
    return _Rep(bench=bench, tokens_per_s=float(rate), ci95=ci, curve=curve, disturbance=judged(bench))


def settings_key(job: JobRecord) -> str:
    """What the job actually runs (instance, count, spot, precision and every hyperparameter but its names): two
    variants with the same key are the same settings, so any difference between them is noise."""
    spec = job.spec
    hyperparameters = {k: v for k, v in spec.hyperparameters.items() if k not in NAME_HYPERPARAMETERS}
    return json.dumps(
        [
            job.instance_type,
            job.instance_count,
            job.spot,
            spec.precision,
            spec.deepspeed_config,
            hyperparameters,
        ],
        sort_keys=True,
        default=str,
    )


def interval_problem(mean: float, ci: tuple[float, float] | None, timed_steps: int | None) -> str | None:
    """Why a throughput interval cannot support a verdict, or None when it can (docs/costs.md, "The verdict")."""
    if timed_steps is not None and timed_steps < MIN_TIMED_STEPS:
        return f"{timed_steps} timed step{'s' if timed_steps != 1 else ''}; at least {MIN_TIMED_STEPS} are needed"
    if ci is None:
        return "no interval"
    low, high = ci
    if not (math.isfinite(low) and math.isfinite(high)):
        return "interval not finite"
    if high - low <= 0:
        return "zero-width interval"
    if low <= 0:
        return f"the interval {mean:,.0f} ± {(high - low) / 2:,.0f} reaches zero or below"
    return None


def stop_outcome(reps: Sequence[_Rep], spec: JobSpec) -> dict[str, Any]:
    """The stop rule's outcome over the repetitions: rule, reason, and for steady_state whether every repetition's
    within-run throughput interval reached the tolerance (the widest half-width counts)."""
    rule = next((r.stop_rule for r in reps if r.stop_rule), None)
    reasons = sorted({r.stop_reason for r in reps if r.stop_reason})
    out: dict[str, Any] = {"stop_rule": rule, "stop_reason": "; ".join(reasons) or None, "tolerance_reached": None}
    if rule != "steady_state":
        return out
    try:
        tolerance = float(spec.hyperparameters.get("ci_tolerance", 0.02))
    except (TypeError, ValueError):
        tolerance = 0.02
    widths = [(r.ci95[1] - r.ci95[0]) / 2 / r.tokens_per_s for r in reps if r.ci95 is not None and r.tokens_per_s > 0]
    achieved = max(widths) if widths else None
    reached = achieved is not None and achieved <= tolerance
    out.update(
        ci_tolerance=tolerance,
        ci_half_width_fraction=achieved,
        tolerance_reached=reached,
    )
    return out


def _measure_group(
    jobs: list[JobRecord],
    target_loss: float | None,
    loss_requests: list[tuple[int, costs.LossRequest]],
    out: list[dict[str, Any]],
) -> dict[str, Any]:
    """One target x variant's JobAnalysis fields; time to target loss is only requested (fits run batched)."""
    jobs = sorted(jobs, key=lambda j: (j.repetition, j.job_name))
    first = jobs[0]
    completed: list[tuple[JobRecord, _Rep]] = []
    failures: list[str] = []
    for job in jobs:
        if job.status is JobStatus.COMPLETED and job.benchmark is not None:
            rep = _completed(job.benchmark)
            if isinstance(rep, str):
                failures.append(rep)
            else:
                completed.append((job, rep))
        elif job.status is JobStatus.COMPLETED:
            failures.append("completed without a benchmark.json")
        else:
            failures.append(_failure_text(job))

    # billed time: every repetition that ran, failed ones included
    billed_by_job: list[float] = []
    billed_source = None
    for job in jobs:
        if job.billable_seconds is not None:
            billed_by_job.append(float(job.billable_seconds))
            billed_source = "SageMaker BillableTimeInSeconds"
        elif job.benchmark and job.benchmark.timing is not None:
            billed_by_job.append(job.benchmark.timing.wall_time_s)
            billed_source = billed_source or "wall time of the training script (local run)"

    spec = first.spec
    gpus_per_instance = spec.gpus_per_instance
    fields: dict[str, Any] = {
        "job_name": first.job_name,
        "job_names": [j.job_name for j in jobs],
        "target_index": spec.target_index,
        "instance_type": first.instance_type,
        "instance_count": first.instance_count,
        "gpus": gpus_per_instance * first.instance_count,
        "variant_name": first.variant_name,
        "spot": first.spot,
        "repetitions": len(completed),
        "repetitions_planned": len(jobs),
        "status": "completed" if completed else _worst_status(jobs),
        "failure": None if completed else "; ".join(sorted(set(failures))),
        "billed_seconds": math.fsum(billed_by_job) if billed_by_job else None,
        "billed_source": billed_source,
        "target_loss": target_loss,
        **_prediction_fields(spec),
    }
    if not completed:
        return fields

    measured = completed
    if any(not disturbed(rep) for _, rep in completed):  # a disturbed repetition re-measured cleanly is left out
        completed = [(job, rep) for job, rep in completed if not disturbed(rep)]
        fields["repetitions"] = len(completed)
    reps = [r for _, r in completed]
    tps = [r.tokens_per_s for r in reps]
    mean_tps, ci = intervals.mean_ci95(tps)
    if ci is not None:
        ci_method = f"t-interval over {len(tps)} repetitions"
        ci_kind = "between_repetitions"
    else:
        ci, ci_method = reps[0].ci95, "within-run interval over timed steps (1 repetition)"
        ci_kind = "within_run"
    timed = [r.timed_steps for r in reps if r.timed_steps is not None]
    unreliable = interval_problem(mean_tps, ci, min(timed) if timed else None)
    if unreliable is not None:
        ci, ci_kind = None, "unreliable"
        ci_method = f"{ci_method}: unreliable ({unreliable})"
    world = reps[0].world_size or fields["gpus"] or 1
    peak = [r.peak_memory_gb for r in reps if r.peak_memory_gb is not None]
    reserved = [r.peak_reserved_gb for r in reps if r.peak_reserved_gb is not None]
    rss = [r.bench.memory.host_rss_peak_gb for r in reps if r.bench.memory.host_rss_peak_gb is not None]
    breakdowns = [
        costs.phase_seconds(
            job.secondary_status_transitions,
            startup_s=rep.startup_time_s,
            wall_time_s=rep.wall_time_s,
            train_time_s=rep.train_time_s,
        )
        for job, rep in completed
    ]
    breakdown = TimeBreakdown(
        **{phase: math.fsum(b[phase] for b, _ in breakdowns) / len(breakdowns) for phase in costs.PHASES},
        source=breakdowns[0][1],
    )
    dataset_tokens = reps[0].dataset_tokens
    shown = next((r for r in reps if disturbed(r)), reps[0])  # the per-step charts' repetition: a disturbed one if any
    tokens_rate: float | None = mean_tps
    tokens_ci = ci
    if reps[0].unit == "samples":  # a job section's samples job: the rate and its interval are samples/s
        fields.update(unit="samples", samples_per_s=mean_tps, samples_per_s_ci95=ci)
        tokens_rate, tokens_ci = None, None  # tokens fields stay empty: no tokens figure is ranked or priced
    fields.update(
        gpus=world if reps[0].device == "cuda" else fields["gpus"],
        gpu_sku=reps[0].gpu_sku,
        tokens_per_s=tokens_rate,
        tokens_per_s_ci95=tokens_ci,
        ci_method=ci_method,
        ci_kind=ci_kind,
        timed_steps=min(timed) if timed else None,
        **stop_outcome(reps, spec),
        settings_key=settings_key(first),
        contention_note=contention_note([job for job, _ in completed]),
        disturbance_note=disturbance_note(measured, reps),
        disturbed=any(disturbed(rep) for rep in reps),
        recompiled=any(recompiled(rep.disturbance) for rep in reps),
        undisturbed_factor=undisturbed_factor(reps),
        kernel_note=kernel_note(reps),
        host_allocator=reps[0].host_allocator,
        **reps[0].trained(),
        tokens_per_s_per_gpu=tokens_rate / world
        if tokens_rate is not None and reps[0].device == "cuda"
        else None,  # no GPUs, no per-GPU figure
        mfu=_mean([r.mfu for r in reps if r.mfu is not None]),
        hfu=_mean([r.hfu for r in reps if r.hfu is not None]),
        step_time_p50_s=_mean([r.step_p50 for r in reps if r.step_p50 is not None]),
        step_time_p90_s=_mean([r.step_p90 for r in reps if r.step_p90 is not None]),
        peak_memory_gb=max(peak) if peak else None,
        peak_reserved_gb=max(reserved) if reserved else None,
        host_rss_peak_gb=max(rss) if rss else None,
        validation_note=validation_note(reps),
        final_train_loss=_mean([r.final_train_loss for r in reps if r.final_train_loss is not None]),
        dataset_tokens=dataset_tokens,
        epoch_seconds=costs.epoch_seconds(dataset_tokens, tokens_rate) if dataset_tokens > 0 and tokens_rate else None,
        time_breakdown=breakdown,
        overhead_seconds=breakdown.overhead_seconds,
        loss_curve=list(map(_LOSS_POINT, downsample(reps[0].curve_points))),  # for the charts
        step_times=step_series.step_times(shown.steps),
        step_rates=step_series.step_rates(shown.steps, shown.unit),
        step_losses=step_series.step_losses(shown.curve_points),
    )
    if target_loss is not None:
        loss_requests.append((len(out), ([r.curve for r in reps], target_loss, tps)))
    return fields


def _worst_status(jobs: Sequence[JobRecord]) -> str:
    # the most telling status when every repetition failed: capacity/quota/OOM say more than a bare FAILED
    order = [JobStatus.CAPACITY, JobStatus.QUOTA, JobStatus.OOM, JobStatus.FAILED, JobStatus.STOPPED, JobStatus.PRUNED]
    statuses = {j.status for j in jobs}
    for status in order:
        if status in statuses:
            return status.value
    return sorted(s.value for s in statuses)[0]


def measure(jobs: Sequence[JobRecord], target_loss: float | None = None) -> list[JobAnalysis]:
    """Stage 1: one JobAnalysis per target x variant, price-independent fields only."""
    groups: dict[tuple[Any, ...], list[JobRecord]] = {}
    for job in jobs:
        groups.setdefault(_group_key(job), []).append(job)
    fields: list[dict[str, Any]] = []
    loss_requests: list[tuple[int, costs.LossRequest]] = []
    for group in groups.values():
        fields.append(_measure_group(group, target_loss, loss_requests, fields))
    outcomes = costs.times_to_target_loss([request for _, request in loss_requests])
    for (index, (curves, _, _)), outcome in zip(loss_requests, outcomes, strict=True):
        reps = len(curves)
        fields[index].update(
            target_loss_method=outcome.method,
            target_loss_detail=outcome.detail
            + (f" ({reps} repetitions)" if reps > 1 and outcome.tokens is not None else ""),
            target_loss_tokens=outcome.tokens,
            target_loss_seconds=outcome.seconds,
        )
    measured = [JobAnalysis(**f) for f in fields]  # validated once, with the target-loss fields already in
    measured.sort(key=lambda a: (a.instance_type, a.instance_count, a.variant_name, a.spot, a.job_name))
    return measured


# -- stage 2: price -----------------------------------------------------------------------------------------------
def _cost_ci(usd_per_hour: float, count: int, ci: tuple[float, float] | None) -> tuple[float, float] | None:
    if ci is None or ci[0] <= 0:
        return None
    # cost falls as throughput rises: the interval's ends swap
    return (
        costs.usd_per_million_tokens(usd_per_hour, count, ci[1]),
        costs.usd_per_million_tokens(usd_per_hour, count, ci[0]),
    )


def price_job(job: JobAnalysis, prices: PriceBook, spec: JobSpec | None = None) -> JobAnalysis:
    """Stage 2: dollar fields of one JobAnalysis from the PriceBook (or the job spec's plan-time price)."""
    if job.instance_type in prices or spec is None:
        price = prices.get(job.instance_type)
    else:
        price = prices.ensure(
            job.instance_type,
            spec.price_per_hour_usd,
            spec.spot_price_per_hour_usd,
            source="job spec (plan-time price)",
        )
    on_demand = price.on_demand_usd_per_hour
    spot: float | None = price.spot_usd_per_hour
    if job.instance_type == LOCAL:  # this machine: there is no spot market for it
        spot = None
    billed_rate = spot if job.spot and spot is not None else on_demand
    n = job.instance_count
    update: dict[str, Any] = {
        "usd_per_hour": on_demand,
        "spot_usd_per_hour": spot,
        "price_source": f"{price.on_demand_source}; spot: {price.spot_source}",
        # Billed at the on-demand rate: for managed spot jobs SageMaker's BillableTimeInSeconds already carries
        # the spot saving (saving = 1 - billable / training time), and local runs are never spot.
        "billed_usd": costs.usd_for_seconds(job.billed_seconds, on_demand, n)
        if job.billed_seconds is not None
        else None,
    }
    if job.samples_per_s:  # the same formula per 1M samples
        sps = job.samples_per_s
        update |= {
            "usd_per_million_samples": costs.usd_per_million_tokens(on_demand, n, sps),
            "usd_per_million_samples_spot": costs.usd_per_million_tokens(spot, n, sps) if spot is not None else None,
            "usd_per_million_samples_ci95": _cost_ci(on_demand, n, job.samples_per_s_ci95),
            "usd_per_million_samples_spot_ci95": _cost_ci(spot, n, job.samples_per_s_ci95)
            if spot is not None
            else None,
            "overhead_usd": costs.usd_for_seconds(job.overhead_seconds or 0.0, billed_rate, n),
        }
    if job.tokens_per_s:
        tps = job.tokens_per_s
        update |= {
            "usd_per_million_tokens": costs.usd_per_million_tokens(on_demand, n, tps),
            "usd_per_million_tokens_spot": costs.usd_per_million_tokens(spot, n, tps) if spot is not None else None,
            "usd_per_million_tokens_ci95": _cost_ci(on_demand, n, job.tokens_per_s_ci95),
            "usd_per_million_tokens_spot_ci95": _cost_ci(spot, n, job.tokens_per_s_ci95) if spot is not None else None,
            "overhead_usd": costs.usd_for_seconds(job.overhead_seconds or 0.0, billed_rate, n),
        }
        if job.epoch_seconds is not None:
            update |= {
                "epoch_hours": job.epoch_seconds / costs.SECONDS_PER_HOUR,
                "epoch_usd": costs.usd_for_seconds(job.epoch_seconds, on_demand, n),
                "epoch_usd_spot": costs.usd_for_seconds(job.epoch_seconds, spot, n) if spot is not None else None,
            }
        if job.target_loss_seconds is not None:
            update |= {
                "target_loss_hours": job.target_loss_seconds / costs.SECONDS_PER_HOUR,
                "target_loss_usd": costs.usd_for_seconds(job.target_loss_seconds, billed_rate, n),
            }
        training_s, basis = None, None
        if job.target_loss is not None:
            if job.target_loss_seconds is not None:
                training_s, basis = job.target_loss_seconds, f"train to loss {job.target_loss:g} + overheads"
        elif job.epoch_seconds is not None:
            training_s, basis = job.epoch_seconds, f"one epoch of {job.dataset_tokens:,} tokens + overheads"
        if training_s is not None:
            total_s = training_s + (job.overhead_seconds or 0.0)
            update |= {
                "workload_basis": basis,
                "workload_hours": total_s / costs.SECONDS_PER_HOUR,
                "workload_usd": costs.usd_for_seconds(total_s, billed_rate, n),
            }
    return job.model_copy(update=update)


# -- entry points -------------------------------------------------------------------------------------------------
@contextmanager
def _collection_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while the analysis builds its objects.

    A large run's JobRecords are tens of thousands of long-lived dicts and lists; every automatic collection that
    the analysis's own allocations trigger walks all of them again (about a fifth of analyze_run's time for 10,000
    jobs). The analysis creates no reference cycles, so reference counting frees what it drops, and collection
    resumes, as it was, when the block ends.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _assumptions(prices: PriceBook, objective: str, constraints: Constraints) -> list[str]:
    notes = [
        "tokens/s counts non-padding tokens of all GPUs over timed steps (warmup excluded).",
        "Cost per 1M tokens = price per instance-hour x instances / 3600 / tokens per s x 1e6.",
        f"Spot prices: {prices.spot.assumption}",
        "Billed cost = BillableTimeInSeconds (cloud) or script wall time (local) x on-demand price x instances; "
        "for managed spot jobs BillableTimeInSeconds already carries the spot saving. This machine (local) has no "
        "spot price.",
        "95 % confidence intervals: Student t over repetitions; with one repetition, the run's own interval "
        "over timed steps.",
        "Verdict: a clear winner needs non-overlapping between-repetition intervals (2+ repetitions, run "
        "interleaved); one repetition gives at most a provisional verdict; an interval reaching zero, of zero width "
        "or from fewer than 2 timed steps cannot tell; the same settings under two names never have a winner.",
    ]
    if constraints.target_loss is not None:
        notes.append(
            f"Time to loss {constraints.target_loss:g}: measured on the train-loss curve when reached, else "
            f"projected by a power-law (or log-linear) fit; never beyond {costs.MAX_EXTRAPOLATION:g}x the measured "
            "tokens."
        )
    if constraints.deadline_hours is not None:
        notes.append(
            f"Deadline {constraints.deadline_hours:g} h applies to the full workload (training plus overheads)."
        )
    if objective == "fastest_within_budget" and constraints.budget_usd is not None:
        notes.append(f"Budget ${constraints.budget_usd:,.2f} applies to the full workload's cost.")
    notes.extend(prices.notes)
    return notes


def analyze_run(
    run: RunRecord,
    jobs: Sequence[JobRecord],
    *,
    terms: RunTerms | None = None,
    catalog: Catalog | Mapping[str, Mapping[str, Any]] | None = None,  # a mapping: type -> price fields (tests)
    prices: PriceBook | None = None,
) -> RunAnalysis:
    """Analyze one run's jobs: metrics, costs, exclusions, ranking and a recommendation.

    ``terms`` are the objective, constraints and stated prices (default: those of the manifest stored on the run,
    analysis/terms.py). ``prices`` defaults to the catalog table with the manifest's price overrides; a caller may
    pass a book refreshed from the AWS Price List API (``PriceBook.refresh_from_aws``). docs/costs.md has every
    formula.
    """

    terms = terms if terms is not None else RunTerms.stored(run.manifest)
    objective = terms.objective
    constraints = Constraints.model_validate(terms.constraints.model_dump())
    if prices is None:
        prices = PriceBook.from_catalog(catalog).with_manifest_overrides(terms)
    specs = {j.job_name: j.spec for j in jobs}
    with _collection_paused():
        measured = measure(jobs, constraints.target_loss)
        priced = [price_job(a, prices, specs.get(a.job_name)) for a in measured]
        ranked, recommendation, excluded = decide(priced, objective, constraints, search=run.search is not None)
    incomplete = incomplete_note(run, jobs)
    recommendation = with_incomplete(recommendation, incomplete)
    dataset_tokens = next((a.dataset_tokens for a in ranked if a.dataset_tokens), None)
    return RunAnalysis(
        run_id=run.run_id,
        run_name=run.name,
        description=terms.description or None,
        objective=objective,
        constraints=constraints,
        dataset_tokens=dataset_tokens,
        unit="samples" if any(j.unit == "samples" for j in ranked) else "tokens",
        jobs=ranked,
        recommendation=recommendation,
        excluded=excluded,
        price_snapshot=prices.snapshot(),
        total_billed_usd=math.fsum(a.billed_usd or 0.0 for a in ranked),
        assumptions=_assumptions(prices, objective, constraints),
        search=search_outcome(run.search, jobs, ranked) if run.search else None,
        incomplete=incomplete,
        machines=machines_of(jobs),
    )


def search_outcome(plan: SearchPlan, jobs: Sequence[JobRecord], ranked: Sequence[JobAnalysis]) -> SearchOutcome:
    """The search's story per target from its plan (``RunRecord.search``) and its trials' rows."""
    targets = []
    for t in plan.targets:
        rows = sorted(
            (j for j in jobs if j.spec.target_index == t.target_index),
            key=lambda j: (j.updated_at, j.job_name),
        )
        ran = {j.variant_name for j in rows}
        best = next(
            (a.variant_name for a in ranked if a.rank is not None and a.job_name in {j.job_name for j in rows}), None
        )
        targets.append(
            SearchTargetOutcome(
                instance_type=t.instance_type,
                dimensions=t.dimensions,
                candidates=len(t.candidates),
                skipped=[SearchTrial(variant=c.name, status="SKIPPED", reason=c.reason) for c in t.skipped],
                trials=[
                    SearchTrial(variant=j.variant_name, status=j.status.value, reason=j.failure_reason) for j in rows
                ],
                not_launched=[name for name in t.candidates if name not in ran],
                best=best,
            )
        )
    return SearchOutcome(
        pruning=plan.pruning, min_timed_steps=plan.min_timed_steps, reduction_factor=plan.reduction_factor,
        max_cost_usd=plan.max_cost_usd, targets=targets,
    )  # fmt: skip


def reprice(analysis: RunAnalysis | Mapping[str, Any], prices: PriceBook) -> RunAnalysis:
    """Re-price a stored analysis (RunAnalysis or its JSON dict) with new prices; measurements are reused."""

    old = analysis if isinstance(analysis, RunAnalysis) else RunAnalysis.model_validate(analysis)
    fresh = [a.model_copy(update={"excluded_reason": None, "rank": None, "on_pareto_front": False}) for a in old.jobs]
    for previous in old.price_snapshot.prices.values():
        prices.setdefault(previous)  # instance types the new prices do not cover keep their old price
    priced = [price_job(a, prices) for a in fresh]
    ranked, recommendation, excluded = decide(priced, old.objective, old.constraints, search=old.search is not None)
    return old.model_copy(
        update={
            "jobs": ranked,
            "recommendation": with_incomplete(recommendation, old.incomplete),
            "excluded": excluded,
            "price_snapshot": prices.snapshot(),
            "total_billed_usd": math.fsum(a.billed_usd or 0.0 for a in ranked),
            "assumptions": _assumptions(prices, old.objective, old.constraints),
            "generated_at": datetime.now(UTC),
        }
    )
