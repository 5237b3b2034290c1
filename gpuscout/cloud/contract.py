"""The Cloud contract as models (docs/internals.md, "Cloud contract"): every Lambda's event, and the results of the
Validate, Plan, Analyze, Record job failure and Mark run failed steps. The handlers parse their events into these
(Powertools' parser) and dump what the logic returns at the edge; the logic in between (control_plane, plan_step)
takes and returns them. A refusal (step_errors.refusal) and run_role's and record_job_result's results stay plain
JSON.

A step's output is the next state's input, so its JSON is the contract: fields a step leaves unset are left out of
its output (``dump``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Contract(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def dump(self) -> dict[str, Any]:
        """The state's JSON: what the step set (a field left at its default that the step never set is left out)."""
        return self.model_dump(mode="json", exclude_unset=True)


class CaughtError(BaseModel):
    """A Step Functions Catch's ``ResultPath`` value: the error name and its cause (often a JSON document)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    error: str = Field(default="", alias="Error")
    cause: str = Field(default="", alias="Cause")


# -- Validate manifest --------------------------------------------------------------------------------------------


class ExecutionInput(_Contract):
    """What the S3 "Object Created" rule passes to the state machine."""

    bucket: str = Field(min_length=3)
    key: str = Field(min_length=1)
    etag: str = ""


class ValidatedManifest(_Contract):
    """Validate's output (the manifest parsed, defaults filled in), and Plan's input with the execution's ARN added
    by the state machine (recorded on the run, see mark_run_failed)."""

    run_id: str = Field(min_length=1)
    bucket: str
    key: str
    manifest: dict[str, Any]  # the state's JSON copy of the Manifest; Plan validates it again
    execution_arn: str | None = None
    quota_warnings: list[str] = Field(default_factory=list)  # Validate's quota pre-flight (logged there)


# -- Plan jobs -----------------------------------------------------------------------------------------------------


class ItemList(_Contract):
    """One list of SageMaker requests plan_jobs wrote to the artifacts bucket (a Distributed Map's ItemReader)."""

    key: str
    count: int = Field(ge=0)


class PlanItems(_Contract):
    """Where the Maps read their requests (plan_items.py)."""

    bucket: str
    canaries: ItemList
    jobs: ItemList
    tunings: ItemList


class PrepareStep(_Contract):
    skip: bool  # the processed data is in the data bucket already, or a job section prepares nothing
    request: dict[str, Any] | None  # the CreateProcessingJob request (None when nothing is prepared)


class PlannedRun(_Contract):
    """Plan's output: the run, its data preparation, where its requests are and its predicted cost."""

    run_id: str
    prepare: PrepareStep
    plan: PlanItems
    predicted_cost_usd: float | None


# -- Run jobs: a job that failed, a job that finished ---------------------------------------------------------------


class JobFailure(_Contract):
    run_id: str = Field(min_length=1)
    job_name: str = Field(min_length=1)
    error: CaughtError


class RecordedFailure(_Contract):
    run_id: str
    job_name: str
    status: str  # the JobStatus the failure was classified as
    applied: bool  # False when a newer event (SageMaker's own) was there first


class FinishedJob(_Contract):
    """A finished training job (``job_name``) or tuning job (``tuning_job_name``) of the run."""

    run_id: str = Field(min_length=1)
    job_name: str | None = Field(default=None, min_length=1)
    tuning_job_name: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _one_job(self) -> FinishedJob:
        if (self.job_name is None) == (self.tuning_job_name is None):
            raise ValueError("give job_name or tuning_job_name")
        return self


class RunRoleRequest(_Contract):
    run_id: str = Field(min_length=1)
    action: Literal["create", "delete"]


# -- Analyze run ---------------------------------------------------------------------------------------------------


class AnalyzeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # the state machine may pass the whole plan output

    run_id: str = Field(min_length=1)


class AnalyzedRun(_Contract):
    run_id: str
    recommendation: str  # the recommendation's summary
    report_uri: str
    notified: bool | str  # True: the summary was published; False: no topic; else why it was not


# -- Mark run failed -----------------------------------------------------------------------------------------------


class CaughtRunFailure(_Contract):
    """What the state machine's Catch hands over."""

    run_id: str = Field(min_length=1)
    execution_arn: str | None = None
    error: CaughtError


class ExecutionStatusChange(BaseModel):
    """The ``detail`` of a "Step Functions Execution Status Change" event (the fields used here)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    execution_arn: str = Field(alias="executionArn", min_length=1)
    state_machine_arn: str = Field(alias="stateMachineArn")
    status: Literal["RUNNING", "SUCCEEDED", "FAILED", "TIMED_OUT", "ABORTED", "PENDING_REDRIVE"]
    error: str | None = None
    cause: str | None = None


class RunFailed(_Contract):
    """What marking one run failed did: ``applied`` when this call ended it (else why not), its role deleted (True,
    False: none left, or why not), whoever dropped the manifest told (as ``notified`` of AnalyzedRun)."""

    run_id: str
    applied: bool
    status: str | None
    ignored_reason: str | None
    role_deleted: bool | str | None = None
    notified: bool | str | None = None
