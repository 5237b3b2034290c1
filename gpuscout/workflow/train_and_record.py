"""Train and Record (states "Run jobs", "Train", "Record job result"): each planned job runs, and its row is recorded
with how it ended and its benchmark.json. Locally the job is a subprocess (local/job_process.py) and the driver
records it here as it ends; in the cloud SageMaker runs it and its state-change events are recorded with the same
row model (cloud/events.py), conditionally, because they arrive at least once and in any order.

A measurement judged disturbed is measured once more before the ranking (``measure_again``), under a name of its
own, unless torch.compile's compiles explain the disturbance."""

from __future__ import annotations

from collections.abc import Sequence

from gpuscout.domain.benchmark import Disturbance
from gpuscout.domain.disturbance import judged, recompiled
from gpuscout.domain.jobspec import JobSpec
from gpuscout.store.base import JOB_STATUS_RANK, JobRecord, JobStatus, ResultStore, utcnow
from gpuscout.workflow.ports import JobOutcome


def record_job(
    store: ResultStore, spec: JobSpec, status: JobStatus, outcome: JobOutcome | None = None, *, reason: str = ""
) -> JobRecord:
    """Store the job's row, its spec and ``status`` with what ``outcome`` measured once it ended (``reason``, when
    given, is its failure reason instead of the outcome's), and return it."""
    record = JobRecord.from_spec(
        spec,
        status,
        benchmark=outcome.benchmark if outcome else None,
        failure_reason=reason or (outcome.failure_reason if outcome else None),
        training_seconds=round(outcome.wall_seconds) if outcome else None,
        contention=outcome.contention if outcome else None,
        status_rank=JOB_STATUS_RANK[status],
        last_event_time=utcnow(),
    )
    store.put_job(record)
    return record


def disturbance_to_measure_again(record: JobRecord) -> tuple[Disturbance, bool] | None:
    """For a completed job whose measurement this release judges disturbed: (the disturbance, whether measuring it
    again could help). Not when torch.compile compiled graphs in its slow steps: the same settings compile again."""
    if record.status is not JobStatus.COMPLETED or record.benchmark is None:
        return None
    disturbance = judged(record.benchmark)
    if disturbance is None or not disturbance.disturbed:
        return None
    return disturbance, not recompiled(disturbance)


def remeasure_spec(record: JobRecord, specs: Sequence[JobSpec]) -> JobSpec:
    """The same job once more, under a name of its own, as the next repetition of its target x variant: the analysis
    ranks a variant on its undisturbed repetitions and says which one it left out."""
    spec = record.spec
    name = f"{spec.job_name[:60].rstrip('-')}-m2"
    same = [s.repetition for s in specs if (s.target_index, s.variant_name) == (spec.target_index, spec.variant_name)]
    return spec.model_copy(
        update={
            "job_name": name,
            "repetition": max(same, default=spec.repetition) + 1,
            "hyperparameters": (  # train.py's job_name; a user's own script's arguments stay as they are
                {**spec.hyperparameters, "job_name": name}
                if "job_name" in spec.hyperparameters
                else spec.hyperparameters
            ),
        }
    )
