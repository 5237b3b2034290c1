"""SageMaker "Training Job State Change" events -> the JOB row, the job's benchmark, and the run's budget guard.

EventBridge delivers these at least once and in any order, and SageMaker may send several events per state
change. Each event is applied with ``ResultStore.apply_job_event`` (conditional on event time and status rank),
so duplicates and stale events change nothing. On a terminal state the job's ``benchmark.json`` is read from the
tarred ``SM_OUTPUT_DATA_DIR`` SageMaker uploaded (``output/<run_id>/<job>/output/output.tar.gz``) and stored in the
same conditional update as the status.

Budget guard: after a job ends, the run's measured spend (billable seconds x on-demand price x instance count,
summed over finished jobs) is compared with the manifest's budget (a search's ``max_cost_usd`` when lower); once it
is crossed, every job of the run still in progress is stopped (a search trial by stopping its tuning job, which
would otherwise start the next trial) and the run is marked STOPPED. ``enforce_budget`` takes the spend figure as a
function of the run's jobs, so the scheduled check (gpuscout.cloud.budget_guard) stops a run with the same code on
its projected spend, which counts the jobs still running too.

Settings search (gpuscout.cloud.tuning_requests): a tuning job's trials have no row until their first event. An
event with a ``TuningJobArn`` for a job without a row creates it (``ResultStore.create_job``, so one of two
concurrent first events wins) from the candidate's JobSpec, found by its ``search_candidate`` hyperparameter in the
search file the plan step wrote. A trial that ends Stopped while its tuning job runs on with early stopping Auto was
stopped early by SageMaker: PRUNED, with that reason.
"""

from __future__ import annotations

import json
import re
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol

from botocore.exceptions import BotoCoreError, ClientError
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from gpuscout.analysis.terms import RunTerms
from gpuscout.cloud.sagemaker_requests import RUN_ID_TAG, output_tar_key
from gpuscout.cloud.tuning_requests import (
    CANDIDATE_HYPERPARAMETER,
    SearchTarget,
    search_target_key,
    tuning_job_name,
    tuning_name_of_arn,
)
from gpuscout.domain.benchmark import BenchmarkResult
from gpuscout.domain.names import JOB_NAME_PREFIX
from gpuscout.errors import GpuscoutError, RunNotFoundError
from gpuscout.store.base import FINAL_RUN_STATUSES, TERMINAL_JOB_STATUSES, JobRecord, JobStatus, ResultStore, RunStatus

if TYPE_CHECKING:  # the boto3 clients' response shapes (boto3-stubs, a development dependency)
    from botocore.response import StreamingBody
    from mypy_boto3_s3.type_defs import GetObjectOutputTypeDef
    from mypy_boto3_sagemaker.type_defs import (
        DescribeHyperParameterTuningJobResponseTypeDef,
        DescribeTrainingJobResponseTypeDef,
        EmptyResponseMetadataTypeDef,
        ListTrainingJobsForHyperParameterTuningJobResponseTypeDef,
    )

BENCHMARK_FILE = "benchmark.json"
MAX_BENCHMARK_BYTES = 32 * 1024 * 1024

OOM_MARKERS = ("OutOfMemory", "CUDA out of memory", "out of memory")
CAPACITY_MARKERS = ("CapacityError", "InsufficientCapacity", "Insufficient capacity")
QUOTA_MARKERS = ("ResourceLimitExceeded",)
STDERR_MARK = "; stderr: "  # gpuscout_train/launcher.py's failure reason: what follows is the user's script's stderr
STARTING_SECONDARY = frozenset(
    {
        "Starting",
        "Pending",
        "Downloading",
        "LaunchingMLInstances",
        "PreparingTrainingStack",
        "DownloadingTrainingImage",
        "Interrupted",  # spot capacity reclaimed; SageMaker waits for capacity, then restarts
        "Restarting",
    }
)
LIVE_JOB_STATUSES = frozenset({JobStatus.STARTING, JobStatus.TRAINING})


class EventError(GpuscoutError):
    """A job-state event could not be processed (unreadable output, unknown job)."""


def parse_event_timestamp(value: object) -> object:
    """SageMaker events carry epoch milliseconds (number or digit string); ISO strings are accepted too."""
    if value is None or value == "" or isinstance(value, datetime):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return datetime.fromtimestamp(value / 1000, tz=UTC)
    if isinstance(value, str) and value.replace(".", "", 1).isdigit():
        return datetime.fromtimestamp(float(value) / 1000, tz=UTC)
    return value


EventTime = Annotated[datetime, BeforeValidator(parse_event_timestamp)]


class _Detail(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class SecondaryStatusTransition(_Detail):
    status: str = Field(alias="Status")
    start_time: EventTime = Field(alias="StartTime")
    end_time: EventTime | None = Field(default=None, alias="EndTime")
    status_message: str | None = Field(default=None, alias="StatusMessage")


class ResourceConfig(_Detail):
    instance_type: str | None = Field(default=None, alias="InstanceType")
    instance_count: int | None = Field(default=None, alias="InstanceCount")


class TrainingJobStateChange(_Detail):
    """The ``detail`` of a "SageMaker Training Job State Change" event (a DescribeTrainingJob snapshot)."""

    training_job_name: str = Field(alias="TrainingJobName")
    training_job_arn: str | None = Field(default=None, alias="TrainingJobArn")
    training_job_status: Literal["InProgress", "Completed", "Failed", "Stopping", "Stopped"] = Field(
        alias="TrainingJobStatus"
    )
    secondary_status: str | None = Field(default=None, alias="SecondaryStatus")
    failure_reason: str | None = Field(default=None, alias="FailureReason")
    resource_config: ResourceConfig | None = Field(default=None, alias="ResourceConfig")
    enable_managed_spot_training: bool | None = Field(default=None, alias="EnableManagedSpotTraining")
    creation_time: EventTime | None = Field(default=None, alias="CreationTime")
    training_start_time: EventTime | None = Field(default=None, alias="TrainingStartTime")
    training_end_time: EventTime | None = Field(default=None, alias="TrainingEndTime")
    last_modified_time: EventTime | None = Field(default=None, alias="LastModifiedTime")
    billable_time_in_seconds: int | None = Field(default=None, alias="BillableTimeInSeconds")
    tuning_job_arn: str | None = Field(default=None, alias="TuningJobArn")  # a search trial's tuning job
    hyper_parameters: dict[str, str] = Field(default_factory=dict, alias="HyperParameters")
    training_time_in_seconds: int | None = Field(default=None, alias="TrainingTimeInSeconds")
    secondary_status_transitions: list[SecondaryStatusTransition] = Field(
        default_factory=list, alias="SecondaryStatusTransitions"
    )
    tags: dict[str, str] = Field(default_factory=dict, alias="Tags")

    @field_validator("tags", mode="before")
    @classmethod
    def _tags_as_dict(cls, v: object) -> object:
        # Events carry {"key": "value"}; DescribeTrainingJob-style lists of {"Key", "Value"} are accepted too.
        if isinstance(v, list):
            return {str(t.get("Key")): str(t.get("Value")) for t in v if isinstance(t, dict)}
        return {} if v is None else v


def classify_failure(reason: str | None) -> JobStatus:
    """A SageMaker failure reason or Step Functions error -> CAPACITY / QUOTA / OOM / FAILED. The stderr a user's
    script left in its reason (gpuscout_train/launcher.py, after STDERR_MARK) counts for OOM only: a quota or capacity
    word in the script's own output (its boto3 error, a log line) is not SageMaker's."""
    text = reason or ""
    own = text.split(STDERR_MARK, 1)[0].lower()
    if any(marker.lower() in own for marker in QUOTA_MARKERS):
        return JobStatus.QUOTA
    if any(marker.lower() in own for marker in CAPACITY_MARKERS):
        return JobStatus.CAPACITY
    if any(marker.lower() in text.lower() for marker in OOM_MARKERS):
        return JobStatus.OOM
    return JobStatus.FAILED


def job_status_of(detail: TrainingJobStateChange) -> JobStatus:
    """TrainingJobStatus / SecondaryStatus -> gpuscout JobStatus."""
    status = detail.training_job_status
    if status == "InProgress":
        if detail.secondary_status in STARTING_SECONDARY or detail.secondary_status is None:
            return JobStatus.STARTING
        return JobStatus.TRAINING  # Training, Uploading
    if status == "Stopping":
        return JobStatus.STOPPING
    if status == "Completed":
        return JobStatus.COMPLETED
    if status == "Stopped":
        return JobStatus.STOPPED
    return classify_failure(detail.failure_reason)


class ObjectReader(Protocol):
    def get_object(self, *, Bucket: str, Key: str) -> GetObjectOutputTypeDef: ...  # noqa: N803 - boto3's names


class TrainingJobStopper(Protocol):
    """The SageMaker calls the budget guard and the trial classification make (boto3's SageMaker client)."""

    def stop_training_job(self, *, TrainingJobName: str) -> EmptyResponseMetadataTypeDef: ...  # noqa: N803

    def stop_hyper_parameter_tuning_job(
        self,
        *,
        HyperParameterTuningJobName: str,  # noqa: N803 - boto3 keyword names
    ) -> EmptyResponseMetadataTypeDef: ...

    def describe_hyper_parameter_tuning_job(
        self,
        *,
        HyperParameterTuningJobName: str,  # noqa: N803 - boto3 keyword names
    ) -> DescribeHyperParameterTuningJobResponseTypeDef: ...


def _open_object(s3: ObjectReader, bucket: str, key: str) -> StreamingBody | None:
    """An object's body stream (boto3's StreamingBody); None when there is no such object; EventError when S3 cannot
    be read."""
    try:
        return s3.get_object(Bucket=bucket, Key=key)["Body"]
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") in {"NoSuchKey", "404", "NotFound"}:
            return None
        raise EventError(f"cannot read s3://{bucket}/{key}: {err}") from err
    except BotoCoreError as err:
        raise EventError(f"cannot read s3://{bucket}/{key}: {err}") from err


def _read_object(s3: ObjectReader, bucket: str, key: str) -> bytes | None:
    """An object's bytes (small files only: the plan step's); None when there is no such object."""
    body = _open_object(s3, bucket, key)
    if body is None:
        return None
    try:
        data: bytes = body.read()
    except BotoCoreError as err:
        raise EventError(f"cannot read s3://{bucket}/{key}: {err}") from err
    return data


def read_benchmark(s3: ObjectReader, bucket: str, run_id: str, job_name: str) -> BenchmarkResult | None:
    """benchmark.json from the job's output.tar.gz; None when the job uploaded no output (or no benchmark).

    The archive is streamed (tarfile's "r|*": S3's body read in chunks, gzip inflated as it goes) and only
    benchmark.json is kept, so the recorder's memory does not grow with the archive: a job may put hundreds of MB of
    checkpoints or tracker files beside its result (a 512 MB Lambda read the whole archive before)."""
    key = output_tar_key(run_id, job_name)
    body = _open_object(s3, bucket, key)
    if body is None:
        return None
    raw: bytes | None = None
    try:
        with tarfile.open(fileobj=body, mode="r|*") as archive:
            for member in archive:
                if not (member.isfile() and member.name.rsplit("/", 1)[-1] == BENCHMARK_FILE):
                    continue
                if member.size > MAX_BENCHMARK_BYTES:
                    raise EventError(f"{BENCHMARK_FILE} in s3://{bucket}/{key} is {member.size} bytes, too large")
                handle = archive.extractfile(member)
                raw = handle.read() if handle is not None else b""
                break
    except tarfile.TarError as err:
        raise EventError(f"s3://{bucket}/{key} is not a readable tar archive: {err}") from err
    except (BotoCoreError, OSError) as err:  # the stream broke off (a reset connection, a truncated gzip)
        raise EventError(f"cannot read s3://{bucket}/{key}: {err}") from err
    finally:
        close = getattr(body, "close", None)
        if close is not None:
            close()
    if raw is None:
        return None
    try:
        return BenchmarkResult.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as err:
        raise EventError(f"{BENCHMARK_FILE} in s3://{bucket}/{key} is invalid: {err}") from err


class JobEventOutcome(BaseModel):
    """What processing one event did (the handler logs it and emits metrics from it)."""

    model_config = ConfigDict(extra="forbid")

    run_id: str | None
    job_name: str
    status: JobStatus
    applied: bool
    ignored_reason: str | None = None
    instance_type: str | None = None
    tokens_per_s: float | None = None
    measured_spend_usd: float | None = None
    budget_usd: float | None = None
    stopped_jobs: list[str] = Field(default_factory=list)


def _transition_dicts(detail: TrainingJobStateChange) -> list[dict[str, Any]]:
    return [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in detail.secondary_status_transitions]


def _run_id_of(detail: TrainingJobStateChange, store: ResultStore) -> str | None:
    run_id = detail.tags.get(RUN_ID_TAG)
    if run_id:
        return run_id
    finder = getattr(store, "find_run_id", None)
    if callable(finder):
        found = finder(detail.training_job_name)
        return str(found) if found else None
    return None


def measured_spend_usd(jobs: list[JobRecord]) -> float:
    """Billed spend so far: billable seconds x on-demand price per instance-hour x instance count.

    BillableTimeInSeconds already reflects managed-spot savings, so it is priced at the on-demand rate.
    """
    total = 0.0
    for job in jobs:
        if job.billable_seconds is None:
            continue
        price = job.spec.price_per_hour_usd
        total += job.billable_seconds / 3600 * price * job.instance_count
    return total


@dataclass(frozen=True)
class SpendFigure:
    """A run's spend and what it is, as the budget guard's error says it: "measured spend" (billed seconds of finished
    jobs) or "spend projected to <time>" (gpuscout.cloud.budget_guard: the jobs still running counted too)."""

    usd: float
    wording: str


def measured_spend(jobs: list[JobRecord]) -> SpendFigure:
    """The spend job_events and record_job_result guard on: billed seconds of the jobs that have ended."""
    return SpendFigure(measured_spend_usd(jobs), "measured spend")


def run_budget_usd(manifest: dict[str, Any] | None) -> float | None:
    """The manifest's budget, or its search's spend cap (``search.max_cost_usd``) when that is lower."""
    return RunTerms.stored(manifest).spend_limit_usd


def _stopped(what: str, stop: Callable[[], object]) -> bool:
    """Call ``stop``: True when it stopped ``what``; False when it was already stopping or finished between our
    read and the call (nothing left to stop); EventError for any other refusal."""
    try:
        stop()
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") not in {"ValidationException", "ResourceNotFound"}:
            raise EventError(f"cannot stop {what}: {err}") from err
        return False
    return True


def _stopped_training_job(sagemaker: TrainingJobStopper, name: str) -> bool:
    return _stopped(f"training job {name}", partial(sagemaker.stop_training_job, TrainingJobName=name))


def _stopped_tuning_job(sagemaker: TrainingJobStopper, name: str) -> bool:
    """Stop a tuning job: SageMaker stops its running trials, and it launches no further one."""
    stop = partial(sagemaker.stop_hyper_parameter_tuning_job, HyperParameterTuningJobName=name)
    return _stopped(f"tuning job {name}", stop)


def enforce_budget(
    store: ResultStore,
    sagemaker: TrainingJobStopper,
    run_id: str,
    *,
    default_budget_usd: float | None = None,
    spend_of: Callable[[list[JobRecord]], SpendFigure] = measured_spend,
) -> tuple[float, float | None, list[str]]:
    """Stop the run's live jobs and tuning jobs once its spend (``spend_of`` its jobs: measured unless told otherwise)
    crosses the budget, and mark the run STOPPED with an error that says which spend crossed it. Returns (spend,
    budget, stopped)."""
    run = store.get_run(run_id)
    jobs = store.list_jobs(run_id)
    figure = spend_of(jobs)
    spend = figure.usd
    budget = run_budget_usd(run.manifest)
    if budget is None:
        budget = default_budget_usd
    if budget is None or spend <= budget:
        return spend, budget, []
    stopped: list[str] = []
    # Every tuning job of the run, whatever its trials' rows say: between trials (one at a time) none is live, and a
    # trial SageMaker just launched has no row yet, but the tuning job would go on launching them.
    tuning_jobs = sorted(
        {j.tuning_job_name for j in jobs if j.tuning_job_name}
        | {tuning_job_name(run_id, t.target_index) for t in (run.search.targets if run.search else [])}
    )
    for job in jobs:
        if (
            job.status in LIVE_JOB_STATUSES
            and not job.tuning_job_name
            and _stopped_training_job(sagemaker, job.job_name)
        ):
            stopped.append(job.job_name)
    stopped += [name for name in tuning_jobs if _stopped_tuning_job(sagemaker, name)]
    ended = (RunStatus.STOPPED, RunStatus.SUCCEEDED, RunStatus.FAILED)
    if run.status not in ended:  # unless_status: a run another writer ended meanwhile keeps its status and reason
        store.update_run(
            run_id,
            unless_status=ended,
            status=RunStatus.STOPPED,
            error=f"budget guard: {figure.wording} was ${spend:,.2f}, over the budget of ${budget:,.2f}; "
            f"stopped {len(stopped)} running job(s)",
        )
    return spend, budget, stopped


def read_search_target(s3: ObjectReader, bucket: str, run_id: str, tuning_name: str) -> SearchTarget | None:
    """The plan step's file for a tuning job (tuning_requests.SearchTarget); None when there is none."""
    key = search_target_key(run_id, tuning_name)
    body = _read_object(s3, bucket, key)
    if body is None:
        return None
    try:
        return SearchTarget.model_validate_json(body)
    except ValidationError as err:
        raise EventError(f"s3://{bucket}/{key} is not a search target file: {err}") from err


# SageMaker names a tuning job's trials <tuning job name>-NNN-xxxxxxxx (gpuscout's tuning job names: tuning_job_name)
_TRIAL_NAME_RE = re.compile(rf"^({re.escape(JOB_NAME_PREFIX)}[0-9a-f]{{12}}-t\d{{2}})-\d{{3}}-[0-9a-f]{{8}}$")


def tuning_job_of(detail: TrainingJobStateChange) -> str | None:
    """The tuning job that launched this training job: from TuningJobArn, or, should an event lack it, from the
    trial's name (a tuning job's name prefixes its trials' names)."""
    if detail.tuning_job_arn:
        return tuning_name_of_arn(detail.tuning_job_arn)
    match = _TRIAL_NAME_RE.match(detail.training_job_name)
    return match.group(1) if match else None


def _create_trial_row(
    detail: TrainingJobStateChange,
    run_id: str,
    tuning_name: str,
    *,
    store: ResultStore,
    s3: ObjectReader,
    bucket: str,
) -> str | None:
    """Create a search trial's row from its candidate's JobSpec unless it exists; None, or why it cannot be."""
    try:
        store.get_run(run_id)
    except RunNotFoundError:
        return f"run {run_id} is not in this stack's table"
    target = read_search_target(s3, bucket, run_id, tuning_name)
    if target is None:
        return f"tuning job {tuning_name} is not a search of run {run_id}"
    candidate = detail.hyper_parameters.get(CANDIDATE_HYPERPARAMETER, "").strip('"')
    if candidate not in target.candidates:
        return f"{CANDIDATE_HYPERPARAMETER}={candidate!r} is not a candidate of tuning job {tuning_name}"
    spec = target.trial_spec(candidate, detail.training_job_name)
    store.create_job(JobRecord.from_spec(spec, JobStatus.PLANNED, tuning_job_name=tuning_name))
    return None


def _early_stopped(detail: TrainingJobStateChange, name: str, sagemaker: TrainingJobStopper) -> str | None:
    """Why a Stopped trial was stopped by its tuning job's early stopping, or None (it ran out of time
    (SecondaryStatus MaxRuntimeExceeded / MaxWaitTimeExceeded), was stopped with its tuning job, by the budget
    guard or by a person): SecondaryStatus Stopped while the tuning job is still going and stops trials early."""
    if detail.secondary_status != "Stopped":
        return None
    try:
        tuning = sagemaker.describe_hyper_parameter_tuning_job(HyperParameterTuningJobName=name)
    except (ClientError, BotoCoreError) as err:
        raise EventError(f"cannot describe tuning job {name}: {err}") from err
    config = tuning.get("HyperParameterTuningJobConfig")
    if tuning.get("HyperParameterTuningJobStatus") in {"Stopping", "Stopped"}:
        return None
    if config is None or config.get("TrainingJobEarlyStoppingType") != "Auto":
        return None
    objective = config.get("HyperParameterTuningJobObjective")
    metric = (objective.get("MetricName") if objective else None) or "its objective"
    return (
        f"stopped early by tuning job {name}: its {metric} was worse than the median of the earlier trials' "
        "running averages at the same point"
    )


def handle_training_job_event(
    detail: TrainingJobStateChange,
    envelope_time: datetime,
    *,
    store: ResultStore,
    s3: ObjectReader,
    sagemaker: TrainingJobStopper,
    artifacts_bucket: str,
    default_budget_usd: float | None = None,
) -> JobEventOutcome:
    """Apply one training-job state change (idempotent and order-safe); see the module docstring."""
    status = job_status_of(detail)
    run_id = _run_id_of(detail, store)
    job_name = detail.training_job_name
    if run_id is None:
        return JobEventOutcome(
            run_id=None, job_name=job_name, status=status, applied=False, ignored_reason="not a gpuscout job"
        )
    event_time = detail.last_modified_time or envelope_time
    fields: dict[str, Any] = {"secondary_status_transitions": _transition_dicts(detail)}
    tuning_name = tuning_job_of(detail)
    job = store.get_job(run_id, job_name)
    if tuning_name and job is None:
        why = _create_trial_row(detail, run_id, tuning_name, store=store, s3=s3, bucket=artifacts_bucket)
        if why is not None:
            return JobEventOutcome(run_id=run_id, job_name=job_name, status=status, applied=False, ignored_reason=why)
        job = store.get_job(run_id, job_name)
    if detail.failure_reason:
        fields["failure_reason"] = detail.failure_reason
    if tuning_name and status is JobStatus.STOPPED:
        pruned = _early_stopped(detail, tuning_name, sagemaker)
        if pruned is not None:
            status, fields["failure_reason"] = JobStatus.PRUNED, pruned
    if detail.billable_time_in_seconds is not None:
        fields["billable_seconds"] = detail.billable_time_in_seconds
    if detail.training_start_time and detail.training_end_time:
        fields["training_seconds"] = int((detail.training_end_time - detail.training_start_time).total_seconds())
    elif detail.training_time_in_seconds is not None:
        fields["training_seconds"] = detail.training_time_in_seconds
    benchmark: BenchmarkResult | None = None
    terminal = status in TERMINAL_JOB_STATUSES
    if terminal and not (job is not None and job.is_canary):  # a canary is no measurement: no benchmark
        benchmark = read_benchmark(s3, artifacts_bucket, run_id, job_name)
        if benchmark is not None:
            fields["benchmark"] = benchmark
    applied = store.apply_job_event(run_id, job_name, status, event_time, **fields)
    outcome = JobEventOutcome(
        run_id=run_id,
        job_name=job_name,
        status=status,
        applied=applied,
        ignored_reason=None if applied else "stale, duplicate or unknown job",
        instance_type=job.instance_type if job else None,
        tokens_per_s=benchmark.throughput.tokens_per_s if applied and benchmark and benchmark.throughput else None,
    )
    if applied and status in LIVE_JOB_STATUSES:
        outcome.stopped_jobs = _live_job_of_run(store, sagemaker, run_id, job_name, tuning_name)
    if applied and terminal:
        spend, budget, stopped = enforce_budget(store, sagemaker, run_id, default_budget_usd=default_budget_usd)
        outcome.measured_spend_usd = spend
        outcome.budget_usd = budget
        outcome.stopped_jobs = stopped
    return outcome


def _live_job_of_run(
    store: ResultStore, sagemaker: TrainingJobStopper, run_id: str, job_name: str, tuning_name: str | None
) -> list[str]:
    """A job of the run is live: the run is RUNNING now; or, when the run is already over, the job is stopped.
    Returns the jobs stopped."""
    run = store.get_run(run_id)
    if run.status in {RunStatus.PLANNED, RunStatus.PREPARING}:
        # conditional: a run another writer ended meanwhile (the budget guard, mark_run_failed) stays ended
        store.update_run(run_id, unless_status=FINAL_RUN_STATUSES, status=RunStatus.RUNNING)
    elif run.status in {RunStatus.STOPPED, RunStatus.FAILED}:
        # a job launched after its run was stopped (a quota retry that went through once the stop freed the quota,
        # or a launch racing the status read): nothing else would stop it, so it is stopped here
        return _stop_late_job(sagemaker, job_name, tuning_name)
    return []


def _stop_late_job(sagemaker: TrainingJobStopper, job_name: str, tuning_name: str | None) -> list[str]:
    """Stop a job (a search trial: its tuning job, which would launch more) of a run that is already over."""
    if tuning_name is not None:
        return [tuning_name] if _stopped_tuning_job(sagemaker, tuning_name) else []
    return [job_name] if _stopped_training_job(sagemaker, job_name) else []


class TrainingJobDescriber(TrainingJobStopper, Protocol):
    def describe_training_job(
        self,
        *,
        TrainingJobName: str,  # noqa: N803 - boto3 keyword names
    ) -> DescribeTrainingJobResponseTypeDef: ...


def record_described_job(
    run_id: str,
    job_name: str,
    *,
    store: ResultStore,
    s3: ObjectReader,
    sagemaker: TrainingJobDescriber,
    artifacts_bucket: str,
    default_budget_usd: float | None = None,
) -> JobEventOutcome:
    """Record a job's final state from DescribeTrainingJob, right after the state machine's ``.sync`` task saw it end.

    The ``.sync`` task returns on the same SageMaker event that asynchronously triggers job_events, so nothing after
    the Map may assume job_events has run. A DescribeTrainingJob response has the shape of that event's detail, so
    it goes through ``handle_training_job_event``: the same status mapping, benchmark read, conditional write
    (event time + status rank: whichever of the two arrives second is a no-op or a newer snapshot, never a
    downgrade) and budget guard.
    """
    try:
        described = sagemaker.describe_training_job(TrainingJobName=job_name)
    except (ClientError, BotoCoreError) as err:
        raise EventError(f"cannot describe training job {job_name}: {err}") from err
    fields = {k: v for k, v in described.items() if k != "ResponseMetadata"}
    fields["Tags"] = {RUN_ID_TAG: run_id}  # DescribeTrainingJob carries no tags; the state machine knows the run
    detail = TrainingJobStateChange.model_validate(fields)
    if detail.training_job_name != job_name:
        raise EventError(f"DescribeTrainingJob({job_name}) answered for {detail.training_job_name}")
    return handle_training_job_event(
        detail,
        detail.last_modified_time or datetime.now(UTC),
        store=store,
        s3=s3,
        sagemaker=sagemaker,
        artifacts_bucket=artifacts_bucket,
        default_budget_usd=default_budget_usd,
    )


class TuningTrialLister(TrainingJobDescriber, Protocol):
    def list_training_jobs_for_hyper_parameter_tuning_job(
        self, **kwargs: Any
    ) -> ListTrainingJobsForHyperParameterTuningJobResponseTypeDef: ...


def record_tuning_trials(
    run_id: str,
    tuning_job_name: str,
    *,
    store: ResultStore,
    s3: ObjectReader,
    sagemaker: TuningTrialLister,
    artifacts_bucket: str,
    default_budget_usd: float | None = None,
) -> list[JobEventOutcome]:
    """Record every trial of a tuning job the state machine saw end, from ListTrainingJobsForHyperParameterTuningJob
    and each trial's DescribeTrainingJob (:func:`record_described_job`: the same path as a job-state event, so a
    trial job_events has not seen yet gets its row here), before the analysis reads the table."""
    names: list[str] = []
    kwargs: dict[str, Any] = {"HyperParameterTuningJobName": tuning_job_name, "MaxResults": 100}
    while True:
        try:
            page = sagemaker.list_training_jobs_for_hyper_parameter_tuning_job(**kwargs)
        except (ClientError, BotoCoreError) as err:
            raise EventError(f"cannot list the trials of tuning job {tuning_job_name}: {err}") from err
        names += [str(s["TrainingJobName"]) for s in page.get("TrainingJobSummaries", [])]
        if not page.get("NextToken"):
            break
        kwargs["NextToken"] = page["NextToken"]
    return [
        record_described_job(
            run_id,
            name,
            store=store,
            s3=s3,
            sagemaker=sagemaker,
            artifacts_bucket=artifacts_bucket,
            default_budget_usd=default_budget_usd,
        )
        for name in sorted(names)
    ]
