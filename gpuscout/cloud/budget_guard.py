"""The scheduled budget check: each running run's spend projected to now, and the stop of a run whose projection
crossed its budget (Cloud contract: budget_guard).

job_events guards a run's budget when one of its jobs ends, on measured spend (billed seconds of the jobs that have
ended): a job that runs on is never counted until it ends, so one long job could spend up to twice the budget before
anything stopped it. An EventBridge schedule (stacks/events.py, BUDGET_CHECK_INTERVAL_MINUTES) therefore invokes
lambdas/budget_guard, which calls :func:`check_budgets`: for every RUNNING run among the newest RUNS_CHECKED it
projects the spend and, past the budget, stops the run's live training jobs and its tuning jobs and marks it STOPPED,
with ``events.enforce_budget``'s code and an error that says the spend was projected and to when.

Projected spend = the measured spend (billed seconds x on-demand price per instance-hour x instance count) + for each
job still billing with no billed seconds yet (STARTING, TRAINING, and STOPPING until its final event brings them)
the time since it started x its on-demand price x its instance count, to ``now`` (the caller's clock). The figure
may count a little more than SageMaker bills, never less:

- a job's time is the sum of its recorded secondary status transitions (SageMaker's "Starting" included, before the
  instances bill) but its waits: a spot job's time waiting for capacity ("Starting", "Interrupted") is not counted,
  or a spot benchmark waiting for capacity would be stopped for money it never spent; with no transition recorded,
  an on-demand job still billing counts from its last applied event;
- a spot job's time is counted at the spot price its plan used when the manifest stated one (what the budget check
  at planning counted), else at the on-demand price (its bill can only be lower); time in "Pending" (waiting for
  compute, as a training-plan job does until its plan is active) is a wait too;
- a job counts at most its MaxRuntimeInSeconds (and a margin for the upload): SageMaker bills no more, and a job
  whose final event was lost is not counted on for ever;
- a canary bills like any job, so it counts.

A run crosses its budget between two checks at most one interval before it is seen: it overspends by at most the
interval x the hourly price of its running jobs (plus the minute or two a stopped job takes to stop).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuscout.cloud.events import (
    LIVE_JOB_STATUSES,
    SecondaryStatusTransition,
    SpendFigure,
    TrainingJobStopper,
    enforce_budget,
    measured_spend_usd,
)
from gpuscout.errors import GpuscoutError
from gpuscout.store.base import JobRecord, JobStatus, ResultStore, RunStatus, as_utc

# How many of the newest runs a check reads for RUNNING ones (store.list_runs is newest first): far more than run
# at once within an execution's lifetime (72 h by default).
RUNS_CHECKED = 200
# Jobs that bill until their final event brings their billed seconds: the live ones, and one being stopped.
BILLING_JOB_STATUSES = LIVE_JOB_STATUSES | {JobStatus.STOPPING}


class BudgetCheckError(GpuscoutError):
    """A check could not stop the jobs of a run over its budget (the run stays RUNNING; the next check tries again)."""


# Secondary statuses in which a job waits without instances (a spot job waiting for capacity, or interrupted), and
# which a spot job spends in "Starting" waiting for capacity too (hours, at times): not counted.
# "Pending": waiting for compute (a training-plan job waits there until its plan is active, hours or days).
WAITING_STATUSES = frozenset({"Pending", "Interrupted", "MaxWaitTimeExceeded"})
# A job holds instances at most its MaxRuntimeInSeconds (SageMaker stops it then) and bills no more; the margin covers
# the upload after training. A job whose final event never arrived is not counted on for ever.
RUNTIME_MARGIN_S = 15 * 60


def billing_seconds_so_far(job: JobRecord, *, now: datetime) -> float:
    """Seconds the job has held instances by ``now``, from its recorded secondary status transitions: each lasts to
    its EndTime, else to the next one's StartTime, else to ``now``; waits (WAITING_STATUSES, and "Starting" for a
    spot job, which may wait there for capacity) are left out. With no transition recorded, an on-demand job still
    billing counts from its last applied event; a spot one counts nothing until its transitions arrive."""
    parsed: list[SecondaryStatusTransition] = []
    for transition in job.secondary_status_transitions:
        try:
            parsed.append(SecondaryStatusTransition.model_validate(transition))
        except ValidationError:
            continue  # a transition without a readable StartTime says nothing of when the job held instances
    moment = as_utc(now)
    if not parsed:
        if job.status in BILLING_JOB_STATUSES and job.last_event_time is not None and not job.spot:
            return max(0.0, (moment - as_utc(job.last_event_time)).total_seconds())
        return 0.0
    parsed.sort(key=lambda t: as_utc(t.start_time))
    total = 0.0
    for index, step in enumerate(parsed):
        if step.status in WAITING_STATUSES or (job.spot and step.status == "Starting"):
            continue
        nxt = parsed[index + 1].start_time if index + 1 < len(parsed) else None
        end = as_utc(step.end_time or nxt or moment)
        total += max(0.0, (min(end, moment) - as_utc(step.start_time)).total_seconds())
    return total


def running_spend_usd(job: JobRecord, *, now: datetime) -> float:
    """What a job still billing has spent by ``now`` and is not in its billed seconds yet: the hours it has held
    instances (at most its MaxRuntimeInSeconds and RUNTIME_MARGIN_S) x the price it was planned at (a spot job's
    spot price when its plan had one, else on-demand) x instance count; 0 for a job billed, ended or not started."""
    if job.status not in BILLING_JOB_STATUSES or job.billable_seconds is not None:
        return 0.0
    seconds = billing_seconds_so_far(job, now=now)
    limit = job.spec.max_runtime_seconds
    if limit:
        seconds = min(seconds, float(limit) + RUNTIME_MARGIN_S)
    spot_price = job.spec.spot_price_per_hour_usd if job.spot else None
    price = spot_price if spot_price is not None else job.spec.price_per_hour_usd
    return seconds / 3600 * price * job.instance_count


def projected_spend_usd(jobs: list[JobRecord], *, now: datetime) -> float:
    """The run's measured spend plus what its jobs still billing have spent by ``now`` (see the module docstring)."""
    return measured_spend_usd(jobs) + sum(running_spend_usd(job, now=now) for job in jobs)


def projected_spend(now: datetime) -> Callable[[list[JobRecord]], SpendFigure]:
    """``enforce_budget``'s spend figure for the scheduled check: the spend projected to ``now``."""
    moment = as_utc(now)

    def figure(jobs: list[JobRecord]) -> SpendFigure:
        return SpendFigure(projected_spend_usd(jobs, now=moment), f"spend projected to {moment:%Y-%m-%d %H:%M} UTC")

    return figure


class RunBudgetCheck(BaseModel):
    """One running run, checked: its projected spend, its budget, and what was stopped (nothing under budget)."""

    model_config = ConfigDict(extra="forbid")

    run_id: str
    projected_spend_usd: float
    budget_usd: float | None
    over_budget: bool
    stopped_jobs: list[str] = Field(default_factory=list)  # training and tuning jobs this check stopped


class BudgetCheckOutcome(BaseModel):
    """What one scheduled check did (the handler logs it and emits RunsStoppedOverBudget from it)."""

    model_config = ConfigDict(extra="forbid")

    checked_at: datetime
    runs: list[RunBudgetCheck] = Field(default_factory=list)  # every RUNNING run checked
    errors: list[str] = Field(default_factory=list)  # runs that could not be checked or stopped, with why

    @property
    def stopped_runs(self) -> list[RunBudgetCheck]:
        return [run for run in self.runs if run.over_budget]


def check_budgets(
    store: ResultStore,
    sagemaker: TrainingJobStopper,
    *,
    now: datetime,
    default_budget_usd: float | None = None,
    limit: int = RUNS_CHECKED,
) -> BudgetCheckOutcome:
    """Project every RUNNING run's spend to ``now`` and stop each run whose projection crossed its budget (the
    manifest's, or ``default_budget_usd`` when it states none).

    Idempotent: a run stopped becomes STOPPED, which no later check reads again. A run whose jobs could not be
    stopped is left RUNNING and named in ``errors`` (the next check tries again); the other runs are checked all the
    same.
    """
    outcome = BudgetCheckOutcome(checked_at=as_utc(now))
    spend_of = projected_spend(now)
    for run in store.list_runs(limit=limit):
        if run.status is not RunStatus.RUNNING:
            continue
        try:
            spend, budget, stopped = enforce_budget(
                store, sagemaker, run.run_id, default_budget_usd=default_budget_usd, spend_of=spend_of
            )
        except GpuscoutError as err:  # a stop SageMaker refused, a store read that failed: this run, not the rest
            outcome.errors.append(f"run {run.run_id}: {err}")
            continue
        outcome.runs.append(
            RunBudgetCheck(
                run_id=run.run_id,
                projected_spend_usd=spend,
                budget_usd=budget,
                over_budget=budget is not None and spend > budget,
                stopped_jobs=stopped,
            )
        )
    return outcome
