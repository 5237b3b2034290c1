"""What a reader must know beside a run's numbers, from its job rows: which measurements were taken while other
processes competed for the machine, whose final validation failed, and what a stopped or partly failed run did not
finish. analyze.py puts them on the analysis; the recommendation and the reports show them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpuscout.store.base import JobRecord, JobStatus, RunRecord, RunStatus


def contention_note(jobs: Sequence[JobRecord]) -> str | None:
    """Which repetitions were measured while other processes competed for the machine (local runs)."""
    flagged = [j.contention for j in jobs if j.contention and j.contention.competing]
    if not flagged:
        return None
    first = flagged[0].note or "measured under competition"
    return first if len(jobs) == 1 else f"{len(flagged)} of {len(jobs)} repetitions {first}"


def validation_note(reps: Sequence[Any]) -> str | None:
    """Which repetitions' final validation failed (train.py kept the measurement; there is no final val loss)."""
    failed = [r.validation_error for r in reps if r.validation_error]
    if not failed:
        return None
    which = "" if len(reps) == 1 else f"{len(failed)} of {len(reps)} repetitions: "
    first = failed[0] if len(failed[0]) <= 160 else failed[0][:159] + "…"
    return f"final validation failed, no validation loss ({which}{first}); the throughput stands"


INCOMPLETE_LISTED = 4


def incomplete_note(run: RunRecord, jobs: Sequence[JobRecord]) -> str | None:
    """One sentence naming what a stopped or partly failed run did not finish; None when every planned job finished
    (a search's pruned trials and the cloud's canaries are not jobs the verdict misses)."""
    measured = [j for j in jobs if not j.is_canary]
    unfinished = [j for j in measured if j.status not in (JobStatus.COMPLETED, JobStatus.PRUNED)]
    stopped = run.status == RunStatus.STOPPED
    if not unfinished and not stopped:
        return None
    head = "Incomplete run: it was stopped" if stopped else "Not everything ran"
    if not unfinished:
        return f"{head}; every planned job had finished."
    names = ", ".join(
        f"{j.instance_type} / {j.variant_name}"
        + (f" rep {j.repetition + 1}" if j.repetition else "")
        + f" ({j.status.value})"
        for j in unfinished[:INCOMPLETE_LISTED]
    )
    more = f" and {len(unfinished) - INCOMPLETE_LISTED} more" if len(unfinished) > INCOMPLETE_LISTED else ""
    return (
        f"{head}; {len(unfinished)} of {len(measured)} jobs did not finish: {names}{more}. "
        "The verdict covers only what finished."
    )
