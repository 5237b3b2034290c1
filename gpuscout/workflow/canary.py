"""Canary (states "Run canaries", "Canary"): before anything is timed, each distinct configuration runs a few steps
(which configurations, and how each is cut down: gpuscout.plan.canary), so one that cannot run fails in seconds
instead of after the fan-out. Locally the driver launches the canaries and every job a failed canary covers is
recorded with the canary's reason and not run (``run_canaries``). In the cloud the Plan step adds the canaries'
requests and rows (``canary_rows``) and the state machine runs them on the canary instance; a failed one fails the
run before any expensive job."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpuscout.domain.jobspec import JobSpec
from gpuscout.plan.canary import CANARY_STEPS, Canary, plan_canaries
from gpuscout.store.base import JobRecord, JobStatus, ResultStore
from gpuscout.workflow.ports import JobLauncher
from gpuscout.workflow.train_and_record import record_job


def run_canaries(
    specs: Sequence[JobSpec],
    skipped: set[str],
    *,
    launcher: JobLauncher,
    store: ResultStore,
    on_message: Callable[[str, bool], None],
) -> set[str]:
    """One canary per distinct configuration of the jobs not in ``skipped``, launched under "canary"; every job whose
    configuration's canary failed is recorded with the canary's status and reason and not run. Returns those jobs.
    ``on_message(text, warning)``."""
    canaries = plan_canaries([s for s in specs if s.job_name not in skipped])
    by_name = {s.job_name: s for s in specs}
    failed: set[str] = set()
    for index, canary in enumerate(canaries, start=1):
        variants = ", ".join(dict.fromkeys(by_name[n].variant_name for n in canary.covers))
        on_message(f"canary {index}/{len(canaries)}: {variants}: {CANARY_STEPS} steps before timing anything", False)
        outcome = launcher.run(canary.spec.model_copy(update={"tracking": None}), "canary")  # not a measurement
        if outcome.status is JobStatus.COMPLETED:
            continue
        status = JobStatus.FAILED if outcome.status is JobStatus.STOPPED else outcome.status
        reason = (
            f"not run: its canary ({CANARY_STEPS} steps of the same configuration) failed: {outcome.failure_reason} "
            f"(log: {outcome.log})"
        )
        for name in canary.covers:
            record_job(store, by_name[name], status, reason=reason)
            failed.add(name)
        on_message(f"canary {index}/{len(canaries)} ({variants}) failed: {outcome.failure_reason}", True)
    return failed


def canary_rows(canaries: Sequence[Canary]) -> list[JobRecord]:
    """The canaries' own rows (PLANNED) for a driver whose store tracks them: their status in `gpuscout status`, their
    billed time in the budget guard. Each names the jobs it covers."""
    return [JobRecord.from_spec(c.spec, JobStatus.PLANNED, canary_for=list(c.covers)) for c in canaries]
