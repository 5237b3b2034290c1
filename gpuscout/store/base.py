"""The ResultStore contract shared by the SQLite (local) and DynamoDB (cloud) stores.

Records are pydantic models; stores persist them whole (JSON) plus the keys they query on. One contract test
suite (tests/unit/test_store_contract.py) runs against every implementation.

Job events arrive out of order and more than once (EventBridge is at-least-once, unordered).
``apply_job_event`` is therefore conditional: an event is applied only if it is newer than the last applied
one, or equally new with a higher status rank; a terminal status is never replaced by a non-terminal one.
It returns whether the event changed the row.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gpuscout.domain.benchmark import BenchmarkResult
from gpuscout.domain.contention import Contention
from gpuscout.domain.jobspec import JobSpec
from gpuscout.domain.run_analysis import PriceSnapshot, RunAnalysis
from gpuscout.domain.search_plan import SearchPlan


class RunStatus(StrEnum):
    REJECTED = "REJECTED"  # manifest invalid, nothing launched
    REFUSED = "REFUSED"  # valid, but the plan was over budget; nothing launched
    PLANNED = "PLANNED"
    PREPARING = "PREPARING"
    RUNNING = "RUNNING"
    ANALYZING = "ANALYZING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"


FINAL_RUN_STATUSES = frozenset(
    {RunStatus.REJECTED, RunStatus.REFUSED, RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.STOPPED}
)


class JobStatus(StrEnum):
    PLANNED = "PLANNED"
    STARTING = "STARTING"  # InProgress: Starting / Downloading
    TRAINING = "TRAINING"  # InProgress: Training
    STOPPING = "STOPPING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"
    CAPACITY = "CAPACITY"  # no capacity for the instance type
    QUOTA = "QUOTA"  # account quota (ResourceLimitExceeded)
    OOM = "OOM"  # ran out of GPU memory
    PRUNED = "PRUNED"  # a search trial stopped early: clearly worse than the best so far (docs/search.md)


TERMINAL_JOB_STATUSES = frozenset(
    {
        JobStatus.COMPLETED,
        JobStatus.FAILED,
        JobStatus.STOPPED,
        JobStatus.CAPACITY,
        JobStatus.QUOTA,
        JobStatus.OOM,
        JobStatus.PRUNED,
    }
)

# Higher rank wins among events with the same timestamp; terminal states outrank every live state.
JOB_STATUS_RANK: dict[JobStatus, int] = {
    JobStatus.PLANNED: 0,
    JobStatus.STARTING: 1,
    JobStatus.TRAINING: 2,
    JobStatus.STOPPING: 3,
    JobStatus.COMPLETED: 10,
    JobStatus.FAILED: 10,
    JobStatus.STOPPED: 10,
    JobStatus.CAPACITY: 10,
    JobStatus.QUOTA: 10,
    JobStatus.OOM: 10,
    JobStatus.PRUNED: 10,
}


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(value: datetime) -> datetime:
    """Naive datetimes are taken to be UTC (as the stores write them), aware ones are converted to it."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class RunRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_id: str
    name: str
    status: RunStatus
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)
    manifest_source: str  # file path or s3://bucket/key
    manifest: dict[str, Any] | None = None  # the validated manifest (None when REJECTED)
    predicted_cost_usd: float | None = None
    error: str | None = None  # why REJECTED / REFUSED / FAILED
    problems: list[dict[str, str]] = Field(default_factory=list)  # manifest problems when REJECTED
    run_dir: str | None = None  # local runs: folder with data, jobs and report
    execution_arn: str | None = None  # cloud runs
    host: str | None = None  # local runs: where `gpuscout local` ran
    pid: int | None = None  # local runs: its process id (a non-final run whose process is gone is abandoned)
    search: SearchPlan | None = None  # a settings search's plan, if any


class JobRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_id: str
    job_name: str
    status: JobStatus
    instance_type: str
    instance_count: int = 1
    variant_name: str
    repetition: int = 0
    spot: bool = False
    spec: JobSpec  # the planned job
    benchmark: BenchmarkResult | None = None  # the job's benchmark.json
    failure_reason: str | None = None
    billable_seconds: int | None = None
    training_seconds: int | None = None  # TrainingEndTime - TrainingStartTime
    secondary_status_transitions: list[dict[str, Any]] = Field(default_factory=list)
    last_event_time: datetime | None = None  # event time of the last applied state change
    status_rank: int = 0
    updated_at: datetime = Field(default_factory=utcnow)
    contention: Contention | None = None  # local runs: the machine's other load meanwhile
    tuning_job_name: str | None = None  # a cloud search's trial: the SageMaker tuning job that launched it
    # a cloud canary (gpuscout.plan.canary): the jobs whose configuration it runs first. Its row shows its status and
    # bills its spend (the budget guard counts it); it is not a measurement: never read as a benchmark or analysed.
    canary_for: list[str] | None = None

    @property
    def is_canary(self) -> bool:
        return self.canary_for is not None

    @classmethod
    def from_spec(cls, spec: JobSpec, status: JobStatus, **fields: Any) -> JobRecord:
        """The row of a planned job: keys and spec from the JobSpec, anything else from ``fields``."""
        return cls(
            run_id=spec.run_id,
            job_name=spec.job_name,
            status=status,
            instance_type=spec.instance_type,
            instance_count=spec.instance_count,
            variant_name=spec.variant_name,
            repetition=spec.repetition,
            spot=spec.spot,
            spec=spec,
            **fields,
        )


class ResultRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_id: str
    created_at: datetime = Field(default_factory=utcnow)
    analysis: RunAnalysis
    report_uri: str | None = None  # folder or s3:// prefix holding report.md/html/json and charts
    price_snapshot: PriceSnapshot | None = None  # the analysis' own prices, also beside it (rows since the first)

    @field_validator("price_snapshot", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return value or None  # rows of the first releases stored {} when an analysis had no prices


def outdated_result(run_id: str, err: Exception, *, remedy: str) -> str:
    """Why a stored RESULT row cannot be read: an analysis stored by another version of gpuscout, and ``remedy``,
    how this store's run is analysed again (its jobs are stored, so a new analysis replaces it)."""
    first = (str(err).strip().splitlines() or [""])[0]
    return f"run {run_id}: its stored analysis is not in this version's format ({first}); {remedy}"


@runtime_checkable
class ResultStore(Protocol):
    def put_run(self, run: RunRecord) -> None: ...

    def get_run(self, run_id: str) -> RunRecord:
        """Raises RunNotFoundError."""
        ...

    def list_runs(self, limit: int = 50) -> list[RunRecord]:
        """Newest first."""
        ...

    def create_run(self, run: RunRecord, *, replace: Collection[RunStatus] = ()) -> None:
        """Write a new run row atomically: raises RunExistsError when the run exists, unless its status is in
        ``replace`` (then the row is replaced). Two planners racing for one run id: exactly one wins."""
        ...

    def update_run(self, run_id: str, *, unless_status: Collection[RunStatus] = (), **fields: Any) -> RunRecord:
        """Set only the given RunRecord fields (and updated_at), atomically, leaving every other field as it is
        (no lost updates between concurrent writers). When the run's status is in ``unless_status`` nothing is
        written and the current row is returned. Raises RunNotFoundError."""
        ...

    def put_jobs(self, jobs: Sequence[JobRecord]) -> None:
        """Write many rows (a plan's): one batch where the store has one."""
        ...

    def put_job(self, job: JobRecord) -> None:
        """Create or replace a job row (used at planning time and for final results)."""
        ...

    def create_job(self, job: JobRecord) -> bool:
        """Write a job row only if there is none with its key (atomically); True if this call wrote it. A search
        trial's row is created by whichever of its concurrent events comes first."""
        ...

    def get_job(self, run_id: str, job_name: str) -> JobRecord | None: ...

    def list_jobs(self, run_id: str) -> list[JobRecord]:
        """Ordered by job name."""
        ...

    def apply_job_event(
        self,
        run_id: str,
        job_name: str,
        status: JobStatus,
        event_time: datetime,
        **fields: Any,
    ) -> bool:
        """Conditionally apply one job state change (see module docstring). Returns True if the row changed.

        ``fields`` are other JobRecord fields carried by the event (failure_reason, billable_seconds, ...).
        """
        ...

    def put_result(self, result: ResultRecord) -> None: ...

    def get_result(self, run_id: str) -> ResultRecord | None: ...
