"""The cloud workflow's Lambda steps (validate, plan, record a failed job, analyze): the Cloud contract.

Each function is what one Lambda handler calls; inputs and outputs are the state machine's JSON
(docs/internals.md, "Cloud contract"). AWS clients and the store are passed in, so tests run them against moto.

Idempotency: the run id is deterministic from the manifest object (key + ETag, ``plan.jobs.make_run_id``); the Plan
step (plan_step.py) refuses a second delivery of the same object and plans a new attempt after a FAILED or REFUSED
run. Its errors (ManifestRejected, PlanRefused, CloudStepError) are in step_errors.py.

Every way an execution can end must leave its run final: the state machine catches failures after planning into
``mark_run_failed``; an EventBridge rule on "Step Functions Execution Status Change" (FAILED, TIMED_OUT, ABORTED)
covers what cannot be caught (timeouts, aborts, States.DataLimitExceeded) through ``fail_run_of_execution``. Both
only ever move a non-final run of *their* execution (the run row records the execution that planned it) to FAILED.
"""

from __future__ import annotations

import json
import logging
import mimetypes
import tempfile
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote_plus

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from gpuscout.analysis.pricing import PRICE_LIST_REGION, PriceBook
from gpuscout.analysis.terms import RunTerms
from gpuscout.cloud import run_roles
from gpuscout.cloud.contract import (
    AnalyzedRun,
    ExecutionInput,
    JobFailure,
    RecordedFailure,
    RunFailed,
    ValidatedManifest,
)
from gpuscout.cloud.events import classify_failure, parse_event_timestamp, read_search_target
from gpuscout.cloud.notify import sns_notifier
from gpuscout.cloud.plan_items import (
    STATE_PAYLOAD_LIMIT_BYTES,
    request_count_problems,
)
from gpuscout.cloud.quotas import QuotaBook, plan_needs
from gpuscout.cloud.quotas import check as check_quotas
from gpuscout.cloud.settings import LambdaSettings, get_settings
from gpuscout.cloud.sources import TrackingServers, cloud_problems
from gpuscout.cloud.step_errors import CloudStepError, ManifestRejected, PlanRefused, refusal
from gpuscout.domain.catalog import Catalog, load_catalog
from gpuscout.domain.manifest import Manifest
from gpuscout.domain.names import REJECTED_PREFIX, REPORTS_PREFIX
from gpuscout.errors import (
    GpuscoutError,
    ManifestError,
    Problem,
    RunNotFoundError,
)
from gpuscout.plan.canary import cloud_canaries
from gpuscout.plan.jobs import make_run_id
from gpuscout.plan.planner import plan
from gpuscout.store.base import (
    FINAL_RUN_STATUSES,
    JobRecord,
    JobStatus,
    ResultStore,
    RunRecord,
    RunStatus,
    utcnow,
)
from gpuscout.store.dynamodb import DynamoDbStore
from gpuscout.workflow import analyze as analyze_step
from gpuscout.workflow import close as close_step
from gpuscout.workflow import report as report_step
from gpuscout.workflow import validate as validate_step

logger = logging.getLogger(__name__)
MAX_MANIFEST_BYTES = 1024 * 1024
# Validate's output carries the parsed manifest to Plan through the state: room is kept for the run id, bucket, key,
# quota warnings and the execution's ARN, so an oversized manifest is a rejection here, not an uncatchable
# States.DataLimitExceeded after this step.
MAX_PARSED_MANIFEST_BYTES = STATE_PAYLOAD_LIMIT_BYTES - 32 * 1024
MAX_QUOTA_WARNINGS = 20  # carried in Validate's output (each one line): the state stays small
# How many of the newest runs fail_run_of_execution searches for the run of a failed execution.
RUNS_SEARCHED_FOR_AN_EXECUTION = 200
MAX_ERROR_CHARS = 4000


@dataclass(frozen=True)
class Services:
    """What a Lambda step works with, built once per cold start from the environment."""

    settings: LambdaSettings
    store: DynamoDbStore
    s3: Any
    sagemaker: Any
    pricing: Any  # AWS Price List API client (its endpoint is in us-east-1)
    sns: Any = None  # the run-summary notification (analyze)
    service_quotas: Any = None  # the account's SageMaker quotas (validate's pre-flight, quotas.py)
    iam: Any = None  # the runs' own roles (run_roles: run_role creates and deletes them, mark_run_failed deletes)


@lru_cache(maxsize=1)
def services() -> Services:
    settings = get_settings()
    return Services(
        settings=settings,
        store=DynamoDbStore(settings.table_name, client=boto3.client("dynamodb")),
        s3=boto3.client("s3"),
        sagemaker=boto3.client("sagemaker"),
        pricing=boto3.client("pricing", region_name=PRICE_LIST_REGION),
        sns=boto3.client("sns"),
        iam=boto3.client("iam"),
        # short timeouts and 2 attempts: the quota pre-flight must not eat Validate's minute (quotas.py warns instead)
        service_quotas=boto3.client(
            "service-quotas",
            config=Config(connect_timeout=5, read_timeout=10, retries={"max_attempts": 2, "mode": "standard"}),
        ),
    )


def manifest_stem(key: str) -> str:
    """``manifests/qwen-p5.yaml`` -> ``qwen-p5``."""
    name = PurePosixPath(key).name
    for suffix in (".yaml", ".yml", ".json"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _cloud_problems(manifest: Manifest, settings: LambdaSettings) -> list[Problem]:
    """What a valid manifest may still not do in this stack (gpuscout.cloud.sources)."""
    return cloud_problems(
        manifest,
        data_bucket=settings.data_bucket,
        allowed_instance_types=settings.allowed_instance_types,
        execution_timeout_hours=settings.execution_timeout_hours,
        tracking_servers=TrackingServers(
            names=settings.mlflow_tracking_servers, account=settings.account, region=settings.region
        ),
    )


def _job_code_problems(s3: Any, manifest: Manifest) -> list[Problem]:
    """A job section's entry point (and requirements file) must be in its S3 source_dir: a missing one is a rejected
    manifest now, not a failed job after the instance started. Runs after _cloud_problems (source_dir under raw/)."""
    job = manifest.job
    if job is None:
        return []
    bucket, _, prefix = job.source_dir.removeprefix("s3://").partition("/")
    problems = []
    for field in ("entry_point", "requirements"):
        name = getattr(job, field)
        if name is None:
            continue
        key = prefix + name
        try:
            s3.head_object(Bucket=bucket, Key=key)
        except ClientError as err:
            # 403 too: the role may read raw/*, so a forbidden HEAD there is a missing key (no ListBucket grant)
            if err.response.get("Error", {}).get("Code") not in {"404", "403", "NoSuchKey", "NotFound"}:
                raise CloudStepError(f"cannot check s3://{bucket}/{key}: {err}") from err
            problems.append(Problem(f"job.{field}", f"{name}: no such file in {job.source_dir}"))
    return problems


def _read_object(s3: Any, bucket: str, key: str) -> tuple[str, bytes, str]:
    """(the key read, body, ETag). S3's event notifications may carry a key URL-encoded (a space as '+', '%2F' ...):
    when ``key`` names no object and its decoded form differs, the decoded key is read instead, and returned, so the
    run id and file names come from the object's real key. The raw key is tried first: a key with a literal '+' is
    read as it is (only an object named both ways would be ambiguous)."""
    decoded = unquote_plus(key)
    for candidate in dict.fromkeys((key, decoded)):
        try:
            response = s3.get_object(Bucket=bucket, Key=candidate)
            body: bytes = response["Body"].read(MAX_MANIFEST_BYTES + 1)
        except ClientError as err:
            # without s3:ListBucket (Validate's role has none) S3 answers a missing key 403 AccessDenied, not 404
            code = err.response.get("Error", {}).get("Code")
            missing = code in {"NoSuchKey", "404", "NotFound", "AccessDenied", "403"}
            if missing and candidate != decoded:
                continue
            raise CloudStepError(f"cannot read s3://{bucket}/{candidate}: {err}") from err
        except BotoCoreError as err:
            raise CloudStepError(f"cannot read s3://{bucket}/{candidate}: {err}") from err
        return candidate, body, str(response.get("ETag", "")).strip('"')
    raise AssertionError("unreachable: the last candidate returns or raises")


def _fits_the_state(source: str) -> validate_step.Check:
    """Validate's output carries the parsed manifest (defaults filled in) to Plan: it must fit the state."""

    def check(manifest: Manifest) -> Manifest:
        parsed_size = len(json.dumps(manifest.model_dump(mode="json"), separators=(",", ":")).encode())
        if parsed_size > MAX_PARSED_MANIFEST_BYTES:
            raise ManifestError(
                source,
                [
                    Problem(
                        "",
                        f"the parsed manifest is {parsed_size / 1024:.0f} KiB with its defaults filled in; the "
                        f"workflow carries at most {MAX_PARSED_MANIFEST_BYTES // 1024} KiB of it between states (Step "
                        f"Functions' {STATE_PAYLOAD_LIMIT_BYTES // 1024} KiB limit); shorten descriptions or split the "
                        "variants into several manifests",
                    )
                ],
            )
        return manifest

    return check


def _runs_in_this_stack(source: str, s3: Any, settings: LambdaSettings) -> validate_step.Check:
    """What a valid manifest may still not do in this stack, then its job code's files in S3."""

    def check(manifest: Manifest) -> Manifest:
        refused = _cloud_problems(manifest, settings) or _job_code_problems(s3, manifest)
        if refused:
            raise ManifestError(source, refused)
        return manifest

    return check


def validate_manifest(
    execution_input: ExecutionInput,
    *,
    store: ResultStore,
    s3: Any,
    settings: LambdaSettings,
    catalog: Catalog | None = None,
    quota_book: QuotaBook | None = None,
) -> ValidatedManifest:
    """Validate step. Returns the validated manifest (run id, bucket, key, parsed manifest, quota warnings) or raises
    ManifestRejected after writing ``rejected/<name>.error.json`` (every problem with its field path) and a REJECTED
    run row. With ``quota_book`` the plan's jobs and canaries are checked against the account's SageMaker training
    quotas (quotas.py): a quota of 0 rejects the manifest, naming the quota and where to raise it."""
    bucket = execution_input.bucket
    key, body, object_etag = _read_object(s3, bucket, execution_input.key)
    source = f"s3://{bucket}/{key}"
    etag = (execution_input.etag or object_etag).strip('"')
    stem = manifest_stem(key)
    catalog = catalog or load_catalog()
    manifest: Manifest | None = None
    try:
        if len(body) > MAX_MANIFEST_BYTES:
            raise ManifestError(source, [Problem("", f"a manifest is at most {MAX_MANIFEST_BYTES} bytes")])
        manifest = validate_step.validate(
            body, source, catalog=catalog, checks=[_fits_the_state(source), _runs_in_this_stack(source, s3, settings)]
        )
        refused, quota_warnings = _plan_problems(manifest, catalog, settings, quota_book)
        if refused:
            raise ManifestError(source, refused)
    except ManifestError as err:
        name = err.manifest_name or (manifest.name if manifest else stem)
        run_id = make_run_id(name, key=key, etag=etag)
        report = {**err.to_dict(), "run_id": run_id, "etag": etag, "rejected_at": utcnow().isoformat()}
        error_key = f"{REJECTED_PREFIX}{stem}.error.json"
        try:
            s3.put_object(
                Bucket=bucket,
                Key=error_key,
                Body=json.dumps(report, indent=2).encode(),
                ContentType="application/json",
            )
        except (ClientError, BotoCoreError) as s3_err:
            raise CloudStepError(f"cannot write s3://{bucket}/{error_key}: {s3_err}") from s3_err
        store.put_run(
            RunRecord(
                run_id=run_id,
                name=name,
                status=RunStatus.REJECTED,
                manifest_source=source,
                error=str(err),
                problems=[{"path": p.path, "message": p.message} for p in err.problems],
            )
        )
        raise ManifestRejected(
            run_id,
            f"{source} is invalid ({len(err.problems)} problem(s); details in s3://{bucket}/{error_key}):\n"
            + "\n".join(f"  - {p}" for p in err.problems),
        ) from err
    return ValidatedManifest(
        run_id=make_run_id(manifest.name, key=key, etag=etag),
        bucket=bucket,
        key=key,
        manifest=manifest.model_dump(mode="json"),
        quota_warnings=quota_warnings[:MAX_QUOTA_WARNINGS],
    )


def _plan_problems(
    manifest: Manifest, catalog: Catalog, settings: LambdaSettings, book: QuotaBook | None
) -> tuple[list[Problem], list[str]]:
    """What the plan of a valid manifest cannot do in this stack: more SageMaker requests than a run takes
    (plan_items.py, canaries counted) and, with a quota ``book``, the account's quotas (quotas.py). Nothing when the
    manifest cannot be planned (the Plan step says why)."""
    try:
        the_plan = plan(manifest, catalog, run_id="validate-preflight")
    except GpuscoutError:
        return [], []
    search_targets = len(the_plan.search.targets) if the_plan.search else None
    canaries = cloud_canaries(the_plan.jobs, manifest, catalog, settings.canary_instance_type)
    problems = request_count_problems(the_plan.jobs, search_targets=search_targets, canaries=len(canaries))
    if problems or book is None:
        return problems, []
    needs = plan_needs(
        the_plan.jobs,
        concurrency=settings.map_max_concurrency,
        canary_instance_type=settings.canary_instance_type,
        max_parallel_trials=the_plan.search.max_parallel_trials if the_plan.search else None,
        canaries=[c.spec for c in canaries],
    )
    problems, warnings = check_quotas(needs, book)
    for warning in warnings:
        logger.warning("quota pre-flight: %s", warning)
    return problems, warnings


def _describe_from_cause(cause: str) -> dict[str, Any]:
    """The Map Catch's Cause: a DescribeTrainingJob JSON (``.sync`` failures) or a plain API error message."""
    try:
        parsed = json.loads(cause)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


# The row that records a search target's failed tuning job (its trials, if any ran, have their own rows).
TUNING_JOB_VARIANT = "tuning-job"


def record_job_failure(
    failure: JobFailure, *, store: ResultStore, s3: Any = None, artifacts_bucket: str | None = None
) -> RecordedFailure:
    """A Map iteration's caught error -> CAPACITY / QUOTA / OOM / FAILED on the JOB row. Never raises for a
    classifiable error, so one missing instance type does not fail the benchmark.

    When the Cause is the job's description, the row is written as of just before the job's last modification, so
    SageMaker's own terminal event (which carries billable time and the benchmark) still wins when it arrives.
    A search's tuning job has no row: with ``s3`` and ``artifacts_bucket`` its failure gets one, named after the
    tuning job (variant ``tuning-job``, the target's first candidate's spec), so the report says why the target
    has no trials.
    """
    run_id, job_name = failure.run_id, failure.job_name
    if s3 is not None and artifacts_bucket and store.get_job(run_id, job_name) is None:
        target = read_search_target(s3, artifacts_bucket, run_id, job_name)
        if target is not None:
            spec = next(iter(target.candidates.values()))
            spec = spec.model_copy(update={"job_name": job_name, "variant_name": TUNING_JOB_VARIANT})
            store.create_job(JobRecord.from_spec(spec, JobStatus.PLANNED, tuning_job_name=job_name))
    error_name, cause = failure.error.error, failure.error.cause
    described = _describe_from_cause(cause)
    reason = str(described.get("FailureReason") or cause or error_name or "unknown error")
    status = classify_failure(f"{error_name} {reason}")
    event_time = utcnow()
    last_modified = parse_event_timestamp(described.get("LastModifiedTime"))
    if isinstance(last_modified, datetime):
        event_time = last_modified - timedelta(milliseconds=1)
    fields: dict[str, Any] = {"failure_reason": f"{error_name}: {reason}" if error_name else reason}
    billable = described.get("BillableTimeInSeconds")
    if isinstance(billable, int):
        fields["billable_seconds"] = billable
    applied = store.apply_job_event(run_id, job_name, status, event_time, **fields)
    return RecordedFailure(run_id=run_id, job_name=job_name, status=status.value, applied=applied)


def mark_run_failed(run_id: str, reason: str, *, store: ResultStore, execution_arn: str | None = None) -> RunFailed:
    """Move a run that is not final yet to FAILED with ``reason``. Idempotent: a missing run, a final one, or a run
    planned by another execution than ``execution_arn`` (when both are known) is left alone (``applied: false``)."""
    try:
        run = store.get_run(run_id)
    except RunNotFoundError:
        return RunFailed(run_id=run_id, applied=False, status=None, ignored_reason="no such run")
    ignored: str | None = None
    if run.status in FINAL_RUN_STATUSES:
        ignored = f"already final ({run.status.value})"
    elif execution_arn and run.execution_arn and run.execution_arn != execution_arn:
        ignored = PLANNED_BY_ANOTHER_EXECUTION
    if ignored is not None:
        return RunFailed(run_id=run_id, applied=False, status=run.status.value, ignored_reason=ignored)
    store.update_run(run_id, status=RunStatus.FAILED, error=reason[:MAX_ERROR_CHARS])
    return RunFailed(run_id=run_id, applied=True, status=RunStatus.FAILED.value, ignored_reason=None)


PLANNED_BY_ANOTHER_EXECUTION = "planned by another execution"


def delete_run_roles(outcomes: list[RunFailed], *, iam: Any, settings: LambdaSettings) -> None:
    """Delete the own role (run_roles) of each run in mark_run_failed's ``outcomes`` that ended with this execution
    (a run another execution planned keeps its role). Each outcome gets ``role_deleted``: True, False (none left),
    or why it could not be deleted (a role left behind grants no more than its boundary; the run stays FAILED)."""
    for outcome in outcomes:
        if outcome.ignored_reason == PLANNED_BY_ANOTHER_EXECUTION:
            continue
        try:
            outcome.role_deleted = run_roles.delete_run_role(iam, settings, outcome.run_id)
        except CloudStepError as err:
            logger.error("run role of %s not deleted: %s", outcome.run_id, err)
            outcome.role_deleted = str(err)


def caught_failure_reason(error_name: str, cause: str) -> str:
    """One line for the run row from a Catch's {"Error", "Cause"} (the Cause may be a long JSON description)."""
    described = _describe_from_cause(cause)
    reason = str(described.get("FailureReason") or cause or "no cause given")
    return f"{error_name or 'error'}: {reason}"


NOT_ANALYSED_RECOMMENDATION = "No recommendation: the run failed before it was analysed (see Error above)."
NOT_ANALYSED_REPORT = "none (the run was not analysed)"
NOT_PUBLISHED_REPORT = "none (the run was analysed, but its report was not published; see Error above)"


def tell_refusal(refused: dict[str, Any], *, sns: Any, topic_arn: str | None) -> bool | str:
    """Publish why a run never started (a Validate or Plan refusal, gpuscout.cloud.step_errors): whoever dropped
    the manifest into the bucket is told, as for a run that ended. True when sent, False without a topic, else why
    not (the refusal stands either way)."""
    detail = refused.get("refused") or {}
    return close_step.notify_refusal(
        refused.get("run_id"),
        str(detail.get("Error", "")),
        str(detail.get("Cause", "")),
        notifier=sns_notifier(sns, topic_arn),
    )


def refuse(
    run_id: str | None, error: ManifestRejected | PlanRefused, *, sns: Any, topic_arn: str | None
) -> tuple[dict[str, Any], bool | str]:
    """What the Validate or Plan handler returns for ``error`` (a refusal is a result: step_errors.refusal), once
    whoever dropped the manifest was told (tell_refusal); and whether they were, or why not."""
    refused = refusal(run_id, error)
    return refused, tell_refusal(refused, sns=sns, topic_arn=topic_arn)


def tell_run_failed(run_id: str, *, store: ResultStore, sns: Any, topic_arn: str | None) -> bool | str:
    """Publish the run summary analyze sends for a finished run, for a run that ended FAILED before its analysis (an
    error, a timeout, an abort, a failed canary): the same message, so every way a run ends is told. True when
    sent, False without a topic, else why it was not (the run stays FAILED either way)."""
    notifier = sns_notifier(sns, topic_arn)
    if notifier is None:
        return False
    try:
        run, jobs = store.get_run(run_id), store.list_jobs(run_id)
    except (GpuscoutError, ClientError, BotoCoreError) as err:  # the run is FAILED already; the summary is lost
        logger.error("cannot read run %s for its summary: %s", run_id, err)
        return f"cannot read the run for its summary: {err}"
    recommendation, report_uri = NOT_ANALYSED_RECOMMENDATION, NOT_ANALYSED_REPORT
    try:  # analysed, then failed (its report could not be published): the summary says what the analysis found
        result = store.get_result(run_id)
    except (GpuscoutError, ClientError, BotoCoreError) as err:
        logger.error("cannot read the analysis of run %s for its summary: %s", run_id, err)
        result = None
    if result is not None:
        recommendation, report_uri = result.analysis.recommendation.summary, result.report_uri or NOT_PUBLISHED_REPORT
    return close_step.notify_run(run, jobs, recommendation=recommendation, report_uri=report_uri, notifier=notifier)


def fail_run_of_execution(
    execution_arn: str,
    status: str,
    *,
    store: ResultStore,
    error: str | None = None,
    cause: str | None = None,
) -> list[RunFailed]:
    """An execution ended FAILED, TIMED_OUT or ABORTED: mark the runs it planned FAILED (usually one; none when it
    ended before planning, or when planning refused it). Runs are found among the newest
    RUNS_SEARCHED_FOR_AN_EXECUTION by the execution ARN plan_jobs recorded."""
    reason = f"the workflow execution ended {status}" + (f" ({error}: {cause or 'no cause given'})" if error else "")
    runs = [r for r in store.list_runs(limit=RUNS_SEARCHED_FOR_AN_EXECUTION) if r.execution_arn == execution_arn]
    return [mark_run_failed(r.run_id, reason, store=store, execution_arn=execution_arn) for r in runs]


@dataclass(frozen=True)
class S3ReportSink:
    """The cloud's ``workflow.ports.ReportSink``: reports/<run_id>/ in the data bucket."""

    s3: Any
    bucket: str

    def publish(self, run_id: str, folder: Path) -> str:
        """Every file the report wrote (pages, JSON, charts), keeping relative paths so the pages' links work."""
        prefix = f"{REPORTS_PREFIX}{run_id}/"
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            key = prefix + path.relative_to(folder).as_posix()
            content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
            try:
                self.s3.upload_file(str(path), self.bucket, key, ExtraArgs={"ContentType": content_type})
            except (ClientError, BotoCoreError) as err:
                raise CloudStepError(f"cannot upload {path.name} to s3://{self.bucket}/{prefix}: {err}") from err
        return f"s3://{self.bucket}/{prefix}"


def analyze(
    run_id: str,
    *,
    store: ResultStore,
    s3: Any,
    settings: LambdaSettings,
    catalog: Catalog | None = None,
    prices: PriceBook | None = None,
    pricing_client: Any = None,
    work_dir: Path | None = None,
    sns: Any = None,
) -> AnalyzedRun:
    """Analyze step (the workflow's analyze, report and close steps): RunAnalysis + report files in
    ``reports/<run_id>/`` of the data bucket + RESULT row + the final run status; then, when the stack has a topic
    (NOTIFICATION_TOPIC_ARN) and ``sns`` is given, the run summary is published to it. ``notified`` in the result
    says whether it was sent, or why not."""
    run = store.get_run(run_id)
    jobs = analyze_step.measured_jobs(store, run_id)
    catalog = catalog or load_catalog()
    if prices is None:
        prices = PriceBook.from_catalog(catalog).with_manifest_overrides(RunTerms.stored(run.manifest))
        if pricing_client is not None:
            # Today's SageMaker Training list prices for the run's region; any failure keeps the catalog table's
            # price and says so in the analysis notes. Manifest overrides still win.
            prices.refresh_from_aws({j.instance_type for j in jobs}, settings.region, client=pricing_client)
    analysis, jobs = analyze_step.analyze_run(run, store, catalog=catalog, prices=prices, jobs=jobs)
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        report_uri = report_step.write_report(
            analysis, Path(tmp) / run_id, store=store, sink=S3ReportSink(s3, settings.data_bucket)
        )
    final = close_step.close_status(store, run_id, jobs)
    summary = analysis.recommendation.summary
    notified = close_step.notify_run(
        final, jobs, recommendation=summary, report_uri=report_uri,
        notifier=sns_notifier(sns, settings.notification_topic_arn),
    )  # fmt: skip
    return AnalyzedRun(run_id=run_id, recommendation=summary, report_uri=report_uri, notified=notified)
