"""The Plan step (Cloud contract: plan_jobs): a validated manifest -> SageMaker requests written to S3 for the
Distributed Maps (plan_items.py), RUN and JOB rows, the run's predicted cost.

Idempotency: a second delivery of the same manifest object finds its run already planned and raises PlanRefused
without launching anything or touching the first run's rows; a run that ended FAILED or REFUSED may be tried again as
``<run_id>-r2`` (then ``-r3``, ...), a new run with its own rows and job names (SageMaker job names cannot be reused).
"""

from __future__ import annotations

from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from gpuscout.cloud.contract import PlannedRun, PrepareStep, ValidatedManifest
from gpuscout.cloud.plan_items import (
    MAX_ITEM_BYTES,
    MAX_REQUESTS_PER_RUN,
    STATE_PAYLOAD_LIMIT_BYTES,
    PlanItemsError,
    oversized_items,
    write_plan_items,
)
from gpuscout.cloud.run_roles import run_role_arn
from gpuscout.cloud.sagemaker_requests import (
    DataSource,
    RequestSettings,
    processing_job_request,
    training_job_request,
)
from gpuscout.cloud.settings import LambdaSettings
from gpuscout.cloud.step_errors import CloudStepError, PlanRefused
from gpuscout.cloud.tuning_requests import (
    TuningRequestError,
    search_target,
    search_target_key,
    tuning_job_request,
)
from gpuscout.domain.catalog import Catalog, load_catalog
from gpuscout.domain.manifest import Manifest
from gpuscout.domain.manifest_loader import validate_manifest_data
from gpuscout.errors import BudgetExceededError, GpuscoutError, RunExistsError, RunNotFoundError
from gpuscout.plan.canary import Canary, cloud_canaries, predicted_canary_cost_usd
from gpuscout.plan.jobs import Plan
from gpuscout.plan.planner import plan
from gpuscout.store.base import ResultStore, RunRecord, RunStatus
from gpuscout.workflow import canary as workflow_canary
from gpuscout.workflow import plan as workflow_plan

# A run that ended like this may be planned again from the same manifest object (as <run_id>-r<attempt>).
RETRYABLE_RUN_STATUSES = frozenset({RunStatus.FAILED, RunStatus.REFUSED})
MAX_ATTEMPTS = 20


def request_settings(settings: LambdaSettings, run_id: str) -> RequestSettings:
    """The account's parts of run ``run_id``'s requests; their RoleArn is the run's own role (run_roles), which the
    workflow creates after planning (the SageMaker tasks pass the role that step returns, never a request's)."""
    return RequestSettings(
        role_arn=run_role_arn(settings, run_id),
        processing_role_arn=settings.processing_role_arn,
        training_image_uri=settings.training_image_uri,
        data_bucket=settings.data_bucket,
        artifacts_bucket=settings.artifacts_bucket,
        processing_instance_type=settings.processing_instance_type,
    )


def data_source_of(manifest: Manifest) -> DataSource:
    _, dataset, sequence_length = manifest.builtin()
    return DataSource(
        source=dataset.source,
        tokenizer=manifest.tokenizer.kind,
        sequence_length=sequence_length,
        max_documents=dataset.max_documents,
        tokenizer_path=manifest.tokenizer.path,
        vocab_size=manifest.tokenizer.resolved_vocab_size,
        text_field=dataset.text_field,
        format=dataset.format,
        min_characters=dataset.min_characters,
        validation_fraction=dataset.validation_fraction,
    )


def _object_exists(s3: Any, bucket: str, key: str) -> bool:
    try:
        s3.head_object(Bucket=bucket, Key=key)
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") in {"404", "NoSuchKey", "NotFound"}:
            return False
        raise CloudStepError(f"cannot check s3://{bucket}/{key}: {err}") from err
    return True


def run_id_to_plan(store: ResultStore, run_id: str, source: str) -> str:
    """The run id this delivery of the manifest object plans: the object's own id the first time, else the next
    ``<run_id>-r<n>`` after attempts that ended FAILED or REFUSED. Raises PlanRefused when an attempt is planned,
    running or ended otherwise (a duplicate delivery, or a run that already concluded)."""
    for attempt in range(1, MAX_ATTEMPTS + 1):
        candidate = run_id if attempt == 1 else f"{run_id}-r{attempt}"
        try:
            existing = store.get_run(candidate)
        except RunNotFoundError:
            return candidate
        if existing.status not in RETRYABLE_RUN_STATUSES:
            raise PlanRefused(
                f"{source} (this exact object) was already planned as run {candidate} ({existing.status.value}); "
                "nothing was launched again"
            )
    raise PlanRefused(f"{source} (this exact object) failed {MAX_ATTEMPTS} times; change the manifest to run it")


def interleave_by_instance_type(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Round-robin over instance types (in order of first appearance), keeping each type's own order.

    The Map starts jobs in list order, MaxConcurrency at a time. Account quotas are per instance type and often
    1-2 instances, so consecutive jobs of one type would fill the Map's slots with jobs waiting for that quota
    while other types sit idle; interleaved, each type's jobs are spread over the slots."""
    by_type: dict[str, list[dict[str, Any]]] = {}
    for job in jobs:
        by_type.setdefault(str(job["request"]["ResourceConfig"]["InstanceType"]), []).append(job)
    queues = list(by_type.values())
    ordered: list[dict[str, Any]] = []
    while any(queues):
        for queue in queues:
            if queue:
                ordered.append(queue.pop(0))
    return ordered


def _spot_max_wait_seconds(manifest: Manifest, target_index: int) -> int | None:
    """The target's max_wait_hours in seconds (MaxWaitTimeInSeconds of its spot jobs); None when unset."""
    hours = manifest.targets[target_index].max_wait_hours
    return int(hours * 3600) if hours else None


def plan_jobs(
    validated: ValidatedManifest,
    *,
    store: ResultStore,
    s3: Any,
    settings: LambdaSettings,
    catalog: Catalog | None = None,
) -> PlannedRun:
    """Plan step: job specs -> requests; RUN + JOB rows (PLANNED). A search section becomes one tuning job request
    per target instead (``tunings``; its trials get their rows as they start) and the candidates' file per tuning job
    in the artifacts bucket. Raises PlanRefused over budget, or for a search target SageMaker cannot tune (REFUSED
    run), or when this manifest object was already planned (nothing is written then)."""
    source = f"s3://{validated.bucket}/{validated.key}"
    run_id = run_id_to_plan(store, validated.run_id, source)
    execution_arn = validated.execution_arn or None
    catalog = catalog or load_catalog()
    manifest = validate_manifest_data(validated.manifest, source, catalog)
    run = RunRecord(
        run_id=run_id,
        name=manifest.name,
        status=RunStatus.PLANNED,
        manifest_source=source,
        manifest=manifest.model_dump(mode="json"),
        execution_arn=execution_arn,
    )
    try:
        the_plan = plan(manifest, catalog, run_id=run_id)
    except GpuscoutError as err:  # the planner cannot plan it (PlanError and the like): a REFUSED run that says why
        store.put_run(run.model_copy(update={"status": RunStatus.REFUSED, "error": f"cannot plan: {err}"}))
        raise PlanRefused(f"{source}: cannot plan: {err}") from err
    # The canaries run before the jobs and are billed too: in the predicted cost and the budget check.
    canaries = cloud_canaries(the_plan.jobs, manifest, catalog, settings.canary_instance_type)
    try:
        run = workflow_plan.within_budget(
            the_plan, run, store=store, extra_cost_usd=predicted_canary_cost_usd(canaries)
        )
    except BudgetExceededError as err:
        raise PlanRefused(f"{source}: {err}") from err

    # The user's own code (a job section) reads its own data: nothing to prepare.
    data = data_source_of(manifest) if manifest.job is None else None
    req_settings = request_settings(settings, run_id)
    skip_prepare = data is None or _object_exists(s3, settings.data_bucket, data.dataset_manifest_key())
    jobs_out: list[dict[str, Any]] = []
    try:
        tunings, search_files = _tunings(the_plan, manifest, req_settings, data, settings)
    except TuningRequestError as err:
        store.put_run(run.model_copy(update={"status": RunStatus.REFUSED, "error": str(err)}))
        raise PlanRefused(f"{source}: {err}") from err
    # A search's candidates are launched by its tuning jobs (one per target), not one by one.
    for spec in the_plan.jobs if the_plan.search is None else ():
        max_wait = _spot_max_wait_seconds(manifest, spec.target_index)
        request = training_job_request(
            spec,
            req_settings,
            data,
            enable_network_isolation=manifest.network_isolation,
            spot_max_wait_seconds=max_wait,
        )
        jobs_out.append({"job_name": spec.job_name, "request": request})
    items = {
        "canaries": _canary_requests(canaries, manifest=manifest, req_settings=req_settings, data=data),
        "jobs": interleave_by_instance_type(jobs_out),
        "tunings": tunings,
    }
    # before any row: what the state machine cannot carry is refused here, not failed uncatchably later
    refused = _size_refusal(items)
    if refused is not None:
        store.put_run(run.model_copy(update={"status": RunStatus.REFUSED, "error": refused}))
        raise PlanRefused(f"{source}: {refused}")
    try:
        plan_reference = write_plan_items(s3, settings.artifacts_bucket, run_id, items)
    except PlanItemsError as err:
        raise CloudStepError(str(err)) from err
    output = PlannedRun(
        run_id=run_id,
        prepare=PrepareStep(
            skip=skip_prepare,
            request=processing_job_request(run_id, req_settings, data) if data is not None else None,
        ),
        plan=plan_reference,  # where the requests are (plan_items.py): the Maps read them from S3
        predicted_cost_usd=run.predicted_cost_usd,
    )
    for key, body in search_files.items():  # what job_events needs to record the trials (tuning_requests)
        try:
            s3.put_object(Bucket=settings.artifacts_bucket, Key=key, Body=body, ContentType="application/json")
        except (ClientError, BotoCoreError) as err:
            raise CloudStepError(f"cannot write s3://{settings.artifacts_bucket}/{key}: {err}") from err
    rows = workflow_plan.planned_rows(the_plan)
    # (a search's rows appear as its trials start); a canary's row: its status in `gpuscout status`, its billed time
    # in the budget guard
    rows += workflow_canary.canary_rows(canaries)
    store.put_jobs(rows)
    try:
        store.create_run(run)  # last: a run row means every job row exists; atomic, so one of two racers wins
    except RunExistsError as err:
        raise PlanRefused(
            f"{source} (this exact object) was planned concurrently as run {run_id} ({err.status}); nothing was "
            "launched again"
        ) from err
    return output


def _size_refusal(items: dict[str, list[dict[str, Any]]]) -> str | None:
    """Why the state machine cannot run these requests (plan_items.py), or None."""
    count = sum(len(listed) for listed in items.values())
    if count > MAX_REQUESTS_PER_RUN:
        return (
            f"the plan makes {count} SageMaker requests ({len(items['canaries'])} canaries, {len(items['jobs'])} jobs, "
            f"{len(items['tunings'])} tuning jobs); a cloud run takes at most {MAX_REQUESTS_PER_RUN}; split the "
            "manifest into several runs"
        )
    oversized = oversized_items(items, MAX_ITEM_BYTES)
    if oversized:
        return (
            f"{len(oversized)} request(s) exceed {MAX_ITEM_BYTES // 1024} KiB, what one Distributed Map item may be "
            f"(Step Functions passes at most {STATE_PAYLOAD_LIMIT_BYTES // 1024} KiB): {', '.join(oversized[:5])}; "
            "shorten the environment or hyperparameters"
        )
    return None


def _tunings(
    the_plan: Plan,
    manifest: Manifest,
    req_settings: RequestSettings,
    data: DataSource | None,
    settings: LambdaSettings,
) -> tuple[list[dict[str, Any]], dict[str, bytes]]:
    """A search's tuning jobs: ``[{"job_name", "target_index", "request"}]`` (one per target) and the files job_events
    reads (artifacts key -> JSON). The run's concurrency (``MAP_MAX_CONCURRENCY``) is shared: the tuning jobs' Map
    runs at most that many at once, each with ``search.max_parallel_trials`` parallel trials within that share (at
    least one)."""
    search = the_plan.search
    if search is None:
        return [], {}
    assert data is not None  # a search varies the built-in job (the manifest refuses it with a job section)
    concurrency = settings.map_max_concurrency
    share = max(1, concurrency // min(len(search.targets), concurrency))
    per_tuning_job = min(search.max_parallel_trials, share)  # the manifest's, within the run's share
    tunings: list[dict[str, Any]] = []
    files: dict[str, bytes] = {}
    for target in search.targets:
        specs = [j for j in the_plan.jobs if j.target_index == target.target_index]
        max_wait = _spot_max_wait_seconds(manifest, target.target_index)
        request = tuning_job_request(
            target,
            specs,
            search,
            req_settings,
            data,
            enable_network_isolation=manifest.network_isolation,
            max_parallel_jobs=per_tuning_job,
            spot_max_wait_seconds=max_wait,
        )
        name = str(request["HyperParameterTuningJobName"])
        tunings.append({"job_name": name, "target_index": target.target_index, "request": request})
        found = search_target(target, specs, search)
        files[search_target_key(found.run_id, name)] = found.model_dump_json().encode()
    return tunings, files


def _canary_requests(
    canaries: list[Canary],
    *,
    manifest: Manifest,
    req_settings: RequestSettings,
    data: DataSource | None,
) -> list[dict[str, Any]]:
    """One CreateTrainingJob request per distinct configuration, on the stack's canary instance, or on its job's type
    where the memory model says the canary type's GPU is too small (gpuscout.plan.canary.cloud_canaries, which
    says why in ``placement``); none when the stack has no canary instance type."""
    return [
        {
            "job_name": c.spec.job_name,
            "covers": list(c.covers),
            "placement": c.placement,
            "request": training_job_request(  # a canary is not a measurement: not tracked
                c.spec.model_copy(update={"tracking": None}),
                req_settings,
                data,
                enable_network_isolation=manifest.network_isolation,
            ),
        }
        for c in canaries
    ]
