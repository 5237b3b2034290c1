"""The deployed stack, seen from a user's machine: find it, submit a manifest, read runs, results and reports.

Everything goes through boto3 with the caller's credentials and region (profile, environment, SSO). The stack is
found by name (CloudFormation outputs ``DataBucketName``, ``ArtifactsBucketName``, ``ResultsTableName``,
``StateMachineArn``); nothing else is configured. Every AWS failure becomes a CloudError subclass with a message
that says what to do.

``submit`` validates the manifest locally first (a bad manifest never leaves the machine), uploads it to
``s3://<data bucket>/manifests/<name>.yaml`` (the S3 event starts the state machine) and computes the run id exactly
as the control plane does (``plan.jobs.make_run_id`` of the manifest name, key and ETag). A manifest with a job section
(the user's own code) has its ``source_dir`` uploaded first and is submitted pointing at it (gpuscout.cloud.job_code).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING
from urllib.parse import quote

import boto3
from boto3.exceptions import Boto3Error
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    CredentialRetrievalError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
    PartialCredentialsError,
    TokenRetrievalError,
)

from gpuscout.cloud.job_code import code_digest, code_files, code_prefix, folder_problem, with_source_dir
from gpuscout.cloud.plan_items import request_count_problems
from gpuscout.cloud.plan_step import run_id_to_plan
from gpuscout.cloud.quotas import QuotaBook, plan_needs
from gpuscout.cloud.quotas import check as check_quotas
from gpuscout.cloud.sagemaker_requests import output_tar_key
from gpuscout.cloud.sources import (
    hyperparameter_problems,
    search_problems,
    source_problems,
    target_problems,
    tracking_problems,
)
from gpuscout.cloud.step_errors import PlanRefused
from gpuscout.domain.catalog import Catalog, load_catalog
from gpuscout.domain.jobspec import JobSpec
from gpuscout.domain.manifest import Manifest
from gpuscout.domain.manifest_loader import load_manifest, parse_manifest
from gpuscout.domain.names import MANIFESTS_PREFIX, OUTPUT_PREFIX
from gpuscout.errors import GpuscoutError, ManifestError, Problem
from gpuscout.plan.canary import cloud_canaries, predicted_canary_cost_usd
from gpuscout.plan.jobs import make_run_id
from gpuscout.plan.planner import plan
from gpuscout.store.base import JobRecord, ResultRecord, RunRecord
from gpuscout.store.dynamodb import DynamoDbStore

if TYPE_CHECKING:  # the clients' types (boto3-stubs, a development dependency)
    from mypy_boto3_cloudformation import CloudFormationClient
    from mypy_boto3_dynamodb import DynamoDBClient
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_service_quotas import ServiceQuotasClient
    from mypy_boto3_stepfunctions import SFNClient

DEFAULT_STACK_NAME = "Gpuscout"
OUTPUT_DATA_BUCKET = "DataBucketName"
OUTPUT_ARTIFACTS_BUCKET = "ArtifactsBucketName"
OUTPUT_TABLE = "ResultsTableName"
OUTPUT_STATE_MACHINE = "StateMachineArn"
DEFAULT_MAP_CONCURRENCY = 4  # the stack's default map_max_concurrency (stacks/config.py), for older stacks
REQUIRED_OUTPUTS = (OUTPUT_DATA_BUCKET, OUTPUT_ARTIFACTS_BUCKET, OUTPUT_TABLE, OUTPUT_STATE_MACHINE)
# How long `submit` looks for the execution the upload started (EventBridge usually starts it within seconds).
DEFAULT_EXECUTION_WAIT_S = 15.0
EXECUTION_POLL_INTERVAL_S = 2.0
# Executions started before the upload (minus clock skew) cannot be ours; at most this many are inspected per poll.
CLOCK_SKEW = timedelta(minutes=2)
MAX_EXECUTIONS_INSPECTED = 25

_CREDENTIAL_ERROR_CODES = frozenset(
    {
        "ExpiredToken",
        "ExpiredTokenException",
        "InvalidClientTokenId",
        "UnrecognizedClientException",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "RequestExpired",
    }
)
_ACCESS_DENIED_CODES = frozenset({"AccessDenied", "AccessDeniedException", "Forbidden", "403"})
_CREDENTIALS_HINT = (
    "configure credentials (`aws configure`, `aws sso login`, or AWS_PROFILE / AWS_ACCESS_KEY_ID) and try again"
)


class CloudError(GpuscoutError):
    """An AWS call for the deployed stack failed."""


class CredentialsError(CloudError):
    """No usable AWS credentials or region."""


class StackNotFoundError(CloudError):
    """The CloudFormation stack does not exist (or is not a gpuscout stack) in this account and region."""


class AlreadySubmittedError(CloudError):
    """This exact manifest object was already submitted; the control plane would refuse it as a duplicate."""


@contextmanager
def aws_errors(action: str) -> Iterator[None]:
    """Turn botocore failures of ``action`` (e.g. "read s3://b/k") into CloudError subclasses with a hint."""
    try:
        yield
    except (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError, TokenRetrievalError) as err:
        raise CredentialsError(f"cannot {action}: no usable AWS credentials ({err}); {_CREDENTIALS_HINT}") from err
    except NoRegionError as err:
        raise CredentialsError(
            f"cannot {action}: no AWS region configured; set AWS_DEFAULT_REGION, or a region in your AWS profile "
            "(~/.aws/config, selected with AWS_PROFILE)"
        ) from err
    except EndpointConnectionError as err:
        raise CloudError(f"cannot {action}: AWS is unreachable ({err})") from err
    except ClientError as err:
        error = err.response.get("Error", {})
        code, message = str(error.get("Code", "")), str(error.get("Message", "")) or str(err)
        if code in _CREDENTIAL_ERROR_CODES:
            raise CredentialsError(
                f"cannot {action}: AWS rejected the credentials ({code}); {_CREDENTIALS_HINT}"
            ) from err
        if code in _ACCESS_DENIED_CODES:
            raise CloudError(
                f"cannot {action}: access denied ({message}); use credentials allowed to use the stack"
            ) from err
        raise CloudError(f"cannot {action}: {code or 'error'}: {message}") from err
    except (BotoCoreError, Boto3Error) as err:  # Boto3Error: e.g. a download's RetriesExceededError
        raise CloudError(f"cannot {action}: {err}") from err


@dataclass(frozen=True)
class StackOutputs:
    """What the CLI needs of a deployed stack."""

    stack_name: str
    region: str
    data_bucket: str
    artifacts_bucket: str
    table_name: str
    state_machine_arn: str
    canary_instance_type: str | None = None  # None: canaries off, or a stack deployed before this output existed
    map_max_concurrency: int | None = None  # None: a stack deployed before this output existed


@dataclass(frozen=True)
class Submission:
    """A submitted manifest: its run id, where it went, and where to watch it."""

    run_id: str
    manifest_name: str
    bucket: str
    key: str
    etag: str
    job_count: int  # the jobs the run launches (canaries aside); a search: at most this many trials
    execution_arn: str | None  # None when the execution had not started within the wait
    console_url: str  # the execution's page, or the state machine's when not found yet
    search: bool = False  # a settings search: job_count is the most trials its tuning jobs may launch
    tracked: bool = False  # the manifest has a tracking section: `gpuscout track` logs the run level at the end
    warnings: tuple[str, ...] = ()  # the quota pre-flight's (jobs would wait for each other; quotas not readable)

    @property
    def manifest_uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


def execution_console_url(region: str, execution_arn: str) -> str:
    return (
        f"https://{region}.console.aws.amazon.com/states/home?region={region}"
        f"#/v2/executions/details/{quote(execution_arn, safe=':')}"
    )


def state_machine_console_url(region: str, state_machine_arn: str) -> str:
    return (
        f"https://{region}.console.aws.amazon.com/states/home?region={region}"
        f"#/statemachines/view/{quote(state_machine_arn, safe=':')}"
    )


def manifest_key(manifest: Manifest, path: Path) -> str:
    """``manifests/<manifest name>.yaml`` (``.json`` for a JSON file, so the Lambda parses it the same way)."""
    suffix = ".json" if path.suffix.lower() == ".json" else ".yaml"
    return f"{MANIFESTS_PREFIX}{manifest.name}{suffix}"


def local_etag(body: bytes) -> str:
    """The ETag S3 gives a single-part upload stored with SSE-S3 (the stack's encryption): the MD5 of the body."""
    return hashlib.md5(body, usedforsecurity=False).hexdigest()


class CloudStack:
    """One deployed gpuscout stack, reached with the caller's AWS session."""

    def __init__(
        self,
        stack_name: str = DEFAULT_STACK_NAME,
        *,
        session: boto3.Session | None = None,
        sleep: Callable[[float], None] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.stack_name = stack_name
        self._session = session or boto3.Session()
        self._sleep = sleep or time.sleep
        self._clock = clock or time.monotonic

    # -- clients and outputs ------------------------------------------------------------------------------------

    @cached_property
    def _cloudformation(self) -> CloudFormationClient:
        with aws_errors("create a cloudformation client"):
            return self._session.client("cloudformation")

    @cached_property
    def _dynamodb(self) -> DynamoDBClient:
        with aws_errors("create a dynamodb client"):
            return self._session.client("dynamodb")

    @cached_property
    def _s3(self) -> S3Client:
        with aws_errors("create a s3 client"):
            return self._session.client("s3")

    @cached_property
    def _sfn(self) -> SFNClient:
        with aws_errors("create a stepfunctions client"):
            return self._session.client("stepfunctions")

    def _service_quotas(self) -> ServiceQuotasClient:
        with aws_errors("create a service-quotas client"):
            return self._session.client("service-quotas")

    @cached_property
    def outputs(self) -> StackOutputs:
        cloudformation = self._cloudformation
        with aws_errors(f"describe CloudFormation stack {self.stack_name!r}"):
            try:
                response = cloudformation.describe_stacks(StackName=self.stack_name)
            except ClientError as err:
                if "does not exist" not in str(err):
                    raise
                raise StackNotFoundError(
                    f"no CloudFormation stack named {self.stack_name!r} in {cloudformation.meta.region_name}: "
                    "deploy with `npx cdk deploy` or pass --stack-name (and check AWS_DEFAULT_REGION / AWS_PROFILE)"
                ) from err
        stacks = response.get("Stacks", [])
        if not stacks:
            raise StackNotFoundError(
                f"no CloudFormation stack named {self.stack_name!r}: deploy with `npx cdk deploy` or pass --stack-name"
            )
        stack = stacks[0]
        outputs = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", []) if "OutputValue" in o}
        missing = [name for name in REQUIRED_OUTPUTS if name not in outputs]
        if missing:
            status = stack.get("StackStatus", "unknown status")
            raise StackNotFoundError(
                f"stack {self.stack_name!r} ({status}) has no output(s) {', '.join(missing)}: it is not a gpuscout "
                "stack or was deployed by an older version; deploy with `npx cdk deploy` or pass --stack-name"
            )
        return StackOutputs(
            stack_name=self.stack_name,
            region=str(cloudformation.meta.region_name),
            data_bucket=outputs[OUTPUT_DATA_BUCKET],
            artifacts_bucket=outputs[OUTPUT_ARTIFACTS_BUCKET],
            table_name=outputs[OUTPUT_TABLE],
            state_machine_arn=outputs[OUTPUT_STATE_MACHINE],
            canary_instance_type=(
                None if outputs.get("CanaryInstanceType", "none") == "none" else outputs["CanaryInstanceType"]
            ),
            map_max_concurrency=int(outputs["MapMaxConcurrency"]) if outputs.get("MapMaxConcurrency") else None,
        )

    @cached_property
    def store(self) -> DynamoDbStore:
        """The stack's results table as a ResultStore (the same rows the Lambdas write)."""
        return DynamoDbStore(self.outputs.table_name, client=self._dynamodb)

    # -- submit -------------------------------------------------------------------------------------------------

    def _job_code_upload(
        self, manifest: Manifest, path: Path, body: bytes, *, catalog: Catalog | None
    ) -> tuple[Manifest, bytes, list[tuple[str, bytes]]]:
        """The manifest as it will be submitted (job.source_dir = the code's S3 folder, gpuscout.cloud.job_code),
        its bytes, and the (key, file) uploads of the code folder."""
        assert manifest.job is not None
        folder = Path(manifest.job.source_dir)
        try:
            files = code_files(folder)
            digest = code_digest(files)
        except (OSError, ValueError) as err:
            raise ManifestError(str(path), [folder_problem(folder, err)]) from err
        prefix = code_prefix(manifest.name, digest)
        uri = f"s3://{self.outputs.data_bucket}/{prefix}"
        body = with_source_dir(body, json_format=path.suffix.lower() == ".json", source_dir=uri, source=str(path))
        submitted = parse_manifest(body, str(path), catalog or load_catalog())  # what is uploaded is what was checked
        return submitted, body, [(prefix + f.relative, f.data) for f in files]

    def submit(
        self,
        manifest_path: Path | str,
        *,
        catalog: Catalog | None = None,
        wait_seconds: float = DEFAULT_EXECUTION_WAIT_S,
    ) -> Submission:
        """Validate locally, upload, return the run id and where to watch the execution.

        Raises ManifestError before anything is uploaded, and AlreadySubmittedError when this exact content was
        already submitted under the same key (the control plane refuses duplicates; change the manifest to rerun).
        """
        path = Path(manifest_path)
        manifest = load_manifest(path, catalog=catalog or load_catalog())
        problems = (
            target_problems(manifest)
            + tracking_problems(manifest)
            + hyperparameter_problems(manifest)
            + search_problems(manifest)
        )
        if problems:
            raise ManifestError(str(path), problems)
        try:
            body = path.read_bytes()  # the bytes just validated are the bytes uploaded
        except OSError as err:
            raise ManifestError(str(path), [Problem("", f"cannot read file: {err.strerror or err}")]) from err
        outputs = self.outputs
        uploads: list[tuple[str, bytes]] = []
        if manifest.job is not None and not manifest.job.in_s3:  # the user's code folder goes up first
            manifest, body, uploads = self._job_code_upload(manifest, path, body, catalog=catalog)
        problems = source_problems(manifest, data_bucket=outputs.data_bucket)  # what the stack's role can read
        if problems:
            raise ManifestError(str(path), problems)
        key = manifest_key(manifest, path)
        expected_run_id = make_run_id(manifest.name, key=key, etag=local_etag(body))
        # the control plane's plan step, here: what `gpuscout plan` refuses is refused before anything is uploaded
        the_plan = plan(manifest, catalog or load_catalog(), run_id=expected_run_id)
        # the control plane's budget check counts the canaries it will run (plan_step.plan_jobs): so does this one
        canaries = cloud_canaries(the_plan.jobs, manifest, catalog or load_catalog(), outputs.canary_instance_type)
        the_plan.check_budget(predicted_canary_cost_usd(canaries))
        problems = request_count_problems(
            the_plan.jobs,
            search_targets=len(the_plan.search.targets) if the_plan.search else None,
            canaries=len(canaries),
        )
        if problems:
            raise ManifestError(str(path), problems)
        warnings = self.quota_preflight(
            path,
            the_plan.jobs,
            the_plan.search.max_parallel_trials if the_plan.search else None,
            canaries=[c.spec for c in canaries],
        )
        # The control plane plans a new attempt (<run id>-r2, ...) after a FAILED or REFUSED run of this exact
        # object, and refuses it otherwise: the same rule here, so the printed run id is the one that will run.
        try:
            expected_run_id = run_id_to_plan(self.store, expected_run_id, f"s3://{outputs.data_bucket}/{key}")
        except PlanRefused as err:
            raise AlreadySubmittedError(
                f"this exact manifest was already submitted: {err}; see `gpuscout status <run id>`, or change the "
                "manifest (e.g. training.seed) to run again"
            ) from err

        for object_key, data in uploads:
            with aws_errors(f"upload s3://{outputs.data_bucket}/{object_key}"):
                self._s3.put_object(Bucket=outputs.data_bucket, Key=object_key, Body=data)
        started_after = datetime.now().astimezone() - CLOCK_SKEW
        with aws_errors(f"upload {path} to s3://{outputs.data_bucket}/{key}"):
            response = self._s3.put_object(
                Bucket=outputs.data_bucket,
                Key=key,
                Body=body,
                ContentType="application/json" if key.endswith(".json") else "application/yaml",
            )
        etag = str(response.get("ETag", "")).strip('"')
        run_id = make_run_id(manifest.name, key=key, etag=etag)
        if etag == local_etag(body):  # the id (or the next attempt's) computed before the upload
            run_id = expected_run_id
        execution_arn = self.find_execution(key, etag, started_after=started_after, wait_seconds=wait_seconds)
        console_url = (
            execution_console_url(outputs.region, execution_arn)
            if execution_arn
            else state_machine_console_url(outputs.region, outputs.state_machine_arn)
        )
        return Submission(
            run_id=run_id,
            manifest_name=manifest.name,
            bucket=outputs.data_bucket,
            key=key,
            etag=etag,
            job_count=len(the_plan.jobs) if the_plan.search is None else the_plan.search.trial_budget,
            search=the_plan.search is not None,
            execution_arn=execution_arn,
            console_url=console_url,
            tracked=manifest.tracking is not None,
            warnings=tuple(warnings),
        )

    def quota_preflight(
        self,
        path: Path,
        jobs: list[JobSpec],
        max_parallel_trials: int | None = None,
        *,
        canaries: list[JobSpec],
    ) -> list[str]:
        """The account's SageMaker training quotas against the plan (quotas.py) and its ``canaries`` where they will
        run (plan.canary.cloud_canaries: a canary too large for the canary type runs on its job's): raises
        ManifestError naming the quota and where to raise it when a job could never start; returns the warnings."""
        outputs = self.outputs
        needs = plan_needs(
            jobs,
            concurrency=outputs.map_max_concurrency or DEFAULT_MAP_CONCURRENCY,
            canary_instance_type=outputs.canary_instance_type,
            max_parallel_trials=max_parallel_trials,
            canaries=canaries,
        )
        problems, warnings = check_quotas(needs, QuotaBook(self._service_quotas()))
        if problems:
            raise ManifestError(str(path), problems)
        return warnings

    def find_execution(
        self, key: str, etag: str, *, started_after: datetime, wait_seconds: float = DEFAULT_EXECUTION_WAIT_S
    ) -> str | None:
        """The ARN of the execution whose input names this object (key + ETag); None if none started in time."""
        deadline = self._clock() + wait_seconds
        seen: set[str] = set()
        while True:
            found = self._match_execution(key, etag, started_after, seen)
            if found or self._clock() >= deadline:
                return found
            self._sleep(EXECUTION_POLL_INTERVAL_S)

    def _match_execution(self, key: str, etag: str, started_after: datetime, seen: set[str]) -> str | None:
        arn = self.outputs.state_machine_arn
        with aws_errors(f"list executions of {arn}"):
            response = self._sfn.list_executions(stateMachineArn=arn, maxResults=MAX_EXECUTIONS_INSPECTED)
        for execution in response.get("executions", []):
            execution_arn = str(execution["executionArn"])
            start = execution.get("startDate")
            if execution_arn in seen or (isinstance(start, datetime) and start < started_after):
                continue
            seen.add(execution_arn)
            with aws_errors(f"describe execution {execution_arn}"):
                described = self._sfn.describe_execution(executionArn=execution_arn)
            try:
                execution_input = json.loads(described.get("input") or "{}")
            except ValueError:
                continue
            if (
                isinstance(execution_input, dict)
                and execution_input.get("key") == key
                and str(execution_input.get("etag", "")).strip('"') == etag
            ):
                return execution_arn
        return None

    # -- runs, results, reports ---------------------------------------------------------------------------------

    def status(self, run_id: str) -> tuple[RunRecord, list[JobRecord]]:
        """The RUN row and its JOB rows (RunNotFoundError when the run is unknown, e.g. not planned yet)."""
        return self.store.get_run(run_id), self.store.list_jobs(run_id)

    def list_runs(self, limit: int = 50) -> list[RunRecord]:
        return self.store.list_runs(limit=limit)

    def result(self, run_id: str) -> tuple[RunRecord, list[JobRecord], ResultRecord | None]:
        run, jobs = self.status(run_id)
        return run, jobs, self.store.get_result(run_id)

    def _keys(self, bucket: str, prefix: str) -> list[str]:
        """Every object key under ``prefix`` (all pages of ListObjectsV2)."""
        keys: list[str] = []
        with aws_errors(f"list s3://{bucket}/{prefix}"):
            for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                keys += [str(obj["Key"]) for obj in page.get("Contents", [])]
        return keys

    def report_prefix(self, run_id: str) -> tuple[str, str]:
        """(bucket, prefix) of the run's report; GpuscoutError when the run has none yet."""
        run = self.store.get_run(run_id)
        result = self.store.get_result(run_id)
        if result is None or not result.report_uri:
            raise GpuscoutError(
                f"run {run_id} has no report yet (status {run.status.value}); it is written when the run ends"
            )
        uri = result.report_uri
        if not uri.startswith("s3://"):
            raise GpuscoutError(f"the report of run {run_id} is not in S3 ({uri}); use `gpuscout report {run_id}`")
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        return bucket, prefix if prefix.endswith("/") or not prefix else prefix + "/"

    def report_markdown(self, run_id: str) -> str:
        bucket, prefix = self.report_prefix(run_id)
        key = prefix + "report.md"
        with aws_errors(f"read s3://{bucket}/{key}"):
            body: bytes = self._s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        return body.decode("utf-8")

    def download_report(self, run_id: str, destination: Path | str) -> Path:
        """Every report file (pages, JSON, charts) into ``<destination>/<run_id>/``, keeping relative paths."""
        bucket, prefix = self.report_prefix(run_id)
        folder = Path(destination) / run_id
        keys = self._keys(bucket, prefix)
        if not keys:
            raise GpuscoutError(f"s3://{bucket}/{prefix} holds no report files")
        for key in keys:
            relative = PurePosixPath(key[len(prefix) :])
            if not relative.parts or ".." in relative.parts or relative.is_absolute():
                continue
            target = folder.joinpath(*relative.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with aws_errors(f"download s3://{bucket}/{key}"):
                self._s3.download_file(bucket, key, str(target))
        return folder

    def jobs_with_output(self, run_id: str) -> set[str]:
        """The names of the run's jobs that left an output.tar.gz (one listing of ``output/<run_id>/``)."""
        prefix = f"{OUTPUT_PREFIX}{run_id}/"
        names = set()
        for key in self._keys(self.outputs.artifacts_bucket, prefix):
            job_name, _, rest = key[len(prefix) :].partition("/")
            if rest == "output/output.tar.gz":
                names.add(job_name)
        return names

    def download_job_output(self, run_id: str, job_name: str, target: Path) -> None:
        """The job's output.tar.gz (its SM_OUTPUT_DATA_DIR, tarred by SageMaker) into the file ``target``."""
        bucket, key = self.outputs.artifacts_bucket, output_tar_key(run_id, job_name)
        with aws_errors(f"download s3://{bucket}/{key}"):
            self._s3.download_file(bucket, key, str(target))
