"""The benchmark state machine: Validate -> Plan -> Create run role -> [Prepare data] -> Map(canary) -> Map(train) ->
Map(tune) -> Analyze -> Delete run role.

SageMaker jobs run through Step Functions' optimized `.sync` integrations, so no Lambda ever polls. The SageMaker
states are raw ASL (CustomState) that copy each top-level field of the request plan_jobs built (docs/internals.md,
Cloud contract): the requests stay plain dicts owned by gpuscout.cloud.sagemaker_requests and tuning_requests. A
settings search has no training jobs of its own: its "Run searches" Map runs one hyperparameter tuning job per
target, whose trials reach the table through job_events and, once the tuning job ended, "Record trials".
The run's SNS notification is sent by analyze_run itself (NOTIFICATION_TOPIC_ARN), with the run summary.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from aws_cdk import Aws, Duration, RemovalPolicy
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_stepfunctions as sfn
from aws_cdk import aws_stepfunctions_tasks as tasks
from constructs import Construct

from gpuscout.domain.names import PLANS_PREFIX
from stacks.config import QUOTA_RETRY_MINUTES, VpcSettings

# The fields of plan_jobs' requests the SageMaker tasks copy. RoleArn is not among them: each task names its role
# itself (the run's own role, which the "Create run role" step returned, or data preparation's literal role), so a
# request, even a forged one, cannot choose another role.
TRAINING_REQUEST_FIELDS = (
    "TrainingJobName",
    "AlgorithmSpecification",
    "HyperParameters",
    "InputDataConfig",
    "OutputDataConfig",
    "ResourceConfig",
    "StoppingCondition",
    "CheckpointConfig",
    "EnableManagedSpotTraining",
    "EnableNetworkIsolation",
    "Environment",
    "Tags",
)
PROCESSING_REQUEST_FIELDS = (
    "ProcessingJobName",
    "ProcessingResources",
    "AppSpecification",
    "ProcessingInputs",
    "ProcessingOutputConfig",
    "StoppingCondition",
    "Environment",
    "Tags",
)
TUNING_REQUEST_FIELDS = ("HyperParameterTuningJobName", "HyperParameterTuningJobConfig", "Tags")
TUNING_DEFINITION_FIELDS = (
    "StaticHyperParameters",
    "AlgorithmSpecification",
    "InputDataConfig",
    "OutputDataConfig",
    "ResourceConfig",
    "StoppingCondition",
    "CheckpointConfig",
    "EnableManagedSpotTraining",
    "EnableNetworkIsolation",
    "Environment",
)
# The partition follows the stack (aws, aws-cn, aws-us-gov): CDK renders the pseudo-parameter into the definition.
TRAINING_RESOURCE = f"arn:{Aws.PARTITION}:states:::sagemaker:createTrainingJob.sync"
PROCESSING_RESOURCE = f"arn:{Aws.PARTITION}:states:::sagemaker:createProcessingJob.sync"
TUNING_RESOURCE = f"arn:{Aws.PARTITION}:states:::sagemaker:createHyperParameterTuningJob.sync"
# Error names Step Functions gives SageMaker API errors: throttling (and other unmodelled service errors, which
# include ValidationException: Retry cannot tell them apart by name, so a bad request costs at most these few short
# retries before the Catch records it) arrive as SageMaker.AmazonSageMakerException; an account quota hit (e.g.
# instances per type, on-demand and spot counted separately) as SageMaker.ResourceLimitExceededException.
THROTTLING_RETRY: dict[str, Any] = {
    "ErrorEquals": ["SageMaker.AmazonSageMakerException"],
    "IntervalSeconds": 5,
    "MaxAttempts": 6,
    "BackoffRate": 2.0,
    "MaxDelaySeconds": 120,
    "JitterStrategy": "FULL",
}
# Quotas free up only as sibling jobs finish (30+ minutes each): wait long and flat, not exponentially, every
# QUOTA_RETRY_MINUTES (stacks/config.py, which also bounds the retries by the execution history).


def quota_retry(quota_wait_hours: int) -> dict[str, Any]:
    """Retry ResourceLimitExceeded every QUOTA_RETRY_MINUTES for ``quota_wait_hours`` (0: do not retry)."""
    return {
        "ErrorEquals": ["SageMaker.ResourceLimitExceededException"],
        "IntervalSeconds": QUOTA_RETRY_MINUTES * 60,
        "MaxAttempts": quota_wait_hours * 60 // QUOTA_RETRY_MINUTES,
        "BackoffRate": 1.0,
    }


def sagemaker_retry(quota_wait_hours: int) -> list[dict[str, Any]]:
    return [THROTTLING_RETRY, quota_retry(quota_wait_hours)]


# Lambda's transient errors (throttling, service errors) as Step Functions names them; a function's own exceptions
# (ManifestRejected, PlanRefused, ...) are not retried.
LAMBDA_TRANSIENT_ERRORS = [
    "Lambda.TooManyRequestsException",
    "Lambda.ServiceException",
    "Lambda.AWSLambdaException",
    "Lambda.SdkClientException",
    "Lambda.ClientExecutionTimeoutException",
]
LAMBDA_RETRY: dict[str, Any] = {
    "errors": LAMBDA_TRANSIENT_ERRORS,
    "interval": Duration.seconds(2),
    "max_attempts": 6,
    "backoff_rate": 2.0,
    "max_delay": Duration.seconds(60),
    "jitter_strategy": sfn.JitterType.FULL,
}
# The run-status read inside the Map: throttling and DynamoDB's transient server errors.
DYNAMODB_RETRY: dict[str, Any] = {
    "errors": [
        "DynamoDB.ProvisionedThroughputExceededException",
        "DynamoDB.RequestLimitExceeded",
        "DynamoDB.ThrottlingException",
        "DynamoDB.InternalServerErrorException",
        "DynamoDB.AmazonDynamoDBException",
    ],
    "interval": Duration.seconds(1),
    "max_attempts": 5,
    "backoff_rate": 2.0,
    "jitter_strategy": sfn.JitterType.FULL,
}
# Run statuses after which no further training job may start (the budget guard, in job_events or budget_guard, sets
# STOPPED).
RUN_STATUSES_THAT_STOP_LAUNCHES = ("STOPPED", "FAILED")
REFUSAL_KEY = "refused"  # gpuscout.cloud.step_errors.REFUSAL_KEY: a Validate or Plan refusal
MANIFEST_REJECTED = "ManifestRejected"
CANARY_FAILED = "CanaryFailed"
PLAN_REFUSED = "PlanRefused"
RUN_FAILED = "RunFailed"


def _copy_fields(fields: tuple[str, ...], prefix: str) -> dict[str, str]:
    """{"X.$": "<prefix>.X"} for every field: pass the Lambda-built request through unchanged."""
    return {f"{field}.$": f"{prefix}.{field}" for field in fields}


# Where a Map iteration holds its run's own role (gpuscout.cloud.run_roles): the Map's ItemSelector copies it from
# the "Create run role" step's output, never from the item (a plan request).
RUN_ROLE_PATH = "$.role_arn"


def training_state_json(vpc: VpcSettings | None, quota_wait_hours: int = 24) -> dict[str, Any]:
    parameters: dict[str, Any] = {**_copy_fields(TRAINING_REQUEST_FIELDS, "$.request"), "RoleArn.$": RUN_ROLE_PATH}
    if vpc is not None:
        parameters["VpcConfig"] = {"Subnets": list(vpc.subnet_ids), "SecurityGroupIds": list(vpc.security_group_ids)}
    return {
        "Type": "Task",
        "Comment": "One benchmark job; waits for the job to end (.sync)",
        "Resource": TRAINING_RESOURCE,
        "Parameters": parameters,
        "Retry": sagemaker_retry(quota_wait_hours),
        # Only the job's ARN of the DescribeTrainingJob result stays in the state: "Record job result" describes the
        # job itself, so the state stays small whatever SageMaker returns.
        "ResultSelector": {"TrainingJobArn.$": "$.TrainingJobArn"},
        "ResultPath": "$.job",
    }


def tuning_state_json(vpc: VpcSettings | None, quota_wait_hours: int = 24) -> dict[str, Any]:
    """One search target's tuning job; waits for it to end (.sync). The training job definition is copied field by
    field (like a training job's request) so the stack's VPC can be added to it."""
    definition: dict[str, Any] = {
        **_copy_fields(TUNING_DEFINITION_FIELDS, "$.request.TrainingJobDefinition"),
        "RoleArn.$": RUN_ROLE_PATH,
    }
    if vpc is not None:
        definition["VpcConfig"] = {"Subnets": list(vpc.subnet_ids), "SecurityGroupIds": list(vpc.security_group_ids)}
    return {
        "Type": "Task",
        "Comment": "One search target: a hyperparameter tuning job over its candidates; waits for it to end (.sync)",
        "Resource": TUNING_RESOURCE,
        "Parameters": {**_copy_fields(TUNING_REQUEST_FIELDS, "$.request"), "TrainingJobDefinition": definition},
        "Retry": sagemaker_retry(quota_wait_hours),
        # The DescribeHyperParameterTuningJob result is large; "Record trials" lists the trials itself.
        "ResultSelector": {"HyperParameterTuningJobArn.$": "$.HyperParameterTuningJobArn"},
        "ResultPath": "$.tuning",
    }


def canary_state_json(vpc: VpcSettings | None) -> dict[str, Any]:
    """One canary: the training task with the canary's request; an hour of quota retries (the canary instance is
    cheap and usually has quota); any failure marks the run FAILED with the canary's cause and fails the Map."""
    state = training_state_json(vpc, quota_wait_hours=1)
    state["Comment"] = "A 2-step, 2-layer run of one configuration on the canary instance (.sync)"
    state["ResultPath"] = "$.job"
    # A Distributed Map gathers every child's output even when its ResultPath drops them (States.DataLimitExceeded
    # over 256 KiB, uncatchable): a child ends with its job name only, never its request.
    state["OutputPath"] = "$.job_name"
    return state


RESOURCE_IN_USE = "SageMaker.ResourceInUseException"
LAUNCHED_POLL_S = 60
# A Standard execution's history holds 25,000 events; one round of the lost-response loop (Wait, the describe Task,
# the Choice) adds 9. The poll interval grows with the execution's timeout so that the loop can follow its job for
# as long as the execution lives within 24,000 of them (the rest: the iteration's other states).
HISTORY_EVENTS_FOR_POLLING = 24_000
EVENTS_PER_POLL = 9


def launched_poll_seconds(timeout_s: float) -> int:
    """Seconds between two DescribeTrainingJob calls of the lost-response loop: LAUNCHED_POLL_S, or more when the
    execution may live long enough for a minute's polling to fill its history (60 s polls fill it in ~46 h)."""
    return max(LAUNCHED_POLL_S, math.ceil(timeout_s * EVENTS_PER_POLL / HISTORY_EVENTS_FOR_POLLING))


DESCRIBE_TRAINING_JOB_RESOURCE = f"arn:{Aws.PARTITION}:states:::aws-sdk:sagemaker:describeTrainingJob"


def describe_launched_job_json() -> dict[str, Any]:
    """DescribeTrainingJob of the iteration's job (the state machine role may describe gs-* jobs): its status only."""
    return {
        "Type": "Task",
        "Comment": "The job exists although its CreateTrainingJob failed (a lost response): follow it",
        "Resource": DESCRIBE_TRAINING_JOB_RESOURCE,
        "Parameters": {"TrainingJobName.$": "$.job_name"},
        "ResultSelector": {"status.$": "$.TrainingJobStatus"},
        "ResultPath": "$.launched",
        "Retry": [
            {**THROTTLING_RETRY, "ErrorEquals": ["SageMaker.SageMakerException", "SageMaker.AmazonSageMakerException"]}
        ],
    }


def processing_state_json(vpc: VpcSettings | None, *, role_arn: str) -> dict[str, Any]:
    parameters: dict[str, Any] = {**_copy_fields(PROCESSING_REQUEST_FIELDS, "$.prepare.request"), "RoleArn": role_arn}
    if vpc is not None:
        parameters["NetworkConfig"] = {
            "VpcConfig": {"Subnets": list(vpc.subnet_ids), "SecurityGroupIds": list(vpc.security_group_ids)}
        }
    return {
        "Type": "Task",
        "Comment": "Clean, tokenize and pack the dataset once on a CPU instance (.sync)",
        "Resource": PROCESSING_RESOURCE,
        "Parameters": parameters,
        # The processing instance (ml.m5.xlarge) has its own quota, rarely exhausted: an hour of quota retries.
        "Retry": sagemaker_retry(1),
        "ResultPath": "$.prepare.job",  # keeps run_id and jobs for the Map
    }


class PlanItemReader(sfn.S3JsonItemReader):
    """The JSON array at a key the state holds, in ``bucket``; the state machine may read only ``prefix`` there (CDK's
    own reader grants the whole bucket when the key is a JSONPath)."""

    def __init__(self, *, bucket: s3.IBucket, key: str, prefix: str) -> None:
        super().__init__(bucket=bucket, key=key)
        self._objects_arn = bucket.arn_for_objects(f"{prefix}*")

    def provide_policy_statements(self) -> list[iam.PolicyStatement]:
        return [iam.PolicyStatement(actions=["s3:GetObject"], resources=[self._objects_arn])]


class BenchmarkWorkflow(Construct):
    """`state_machine` and its `log_group`."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        functions: Mapping[str, lambda_.IFunction],
        table: dynamodb.ITable,
        plan_bucket: s3.IBucket,
        role: iam.IRole,
        processing_role_arn: str,
        map_max_concurrency: int,
        quota_wait_hours: int,
        vpc: VpcSettings | None,
        timeout: Duration,
        log_retention: logs.RetentionDays,
        removal_policy: RemovalPolicy,
    ) -> None:
        super().__init__(scope, construct_id)
        validate = self._lambda_step(
            "Validate manifest",
            function=functions["validate_manifest"],
            comment="Parse the manifest; a bad one is written to rejected/ and ends the run",
        )
        plan = self._lambda_step(
            "Plan jobs",
            function=functions["plan_jobs"],
            # validate's output plus the execution's ARN, recorded on the run so that mark_run_failed touches only
            # the run this execution planned.
            payload=sfn.TaskInput.from_object(
                {
                    "run_id": sfn.JsonPath.string_at("$.run_id"),
                    "bucket": sfn.JsonPath.string_at("$.bucket"),
                    "key": sfn.JsonPath.string_at("$.key"),
                    "manifest": sfn.JsonPath.object_at("$.manifest"),
                    "execution_arn": sfn.JsonPath.execution_id,
                }
            ),
            comment="Job requests, predicted cost; refuses a run over budget",
        )
        # Any failure after planning (data preparation, the Map, analysis) marks the run FAILED with the cause, then
        # fails the execution (RunFailed, with the original cause). What no Catch sees (timeout, abort,
        # DataLimitExceeded) is covered by the EventBridge rule on execution status changes (events.py), which
        # calls the same function.
        mark_failed = self._mark_failed_step(
            "Mark run failed",
            function=functions["mark_run_failed"],
            execution_arn=sfn.JsonPath.execution_id,
            comment="The run row ends FAILED with the error and cause; then the execution fails (RunFailed)",
        )
        # A fixed error name: the caught one may be a reserved States.* name, which a Fail state may not raise; the
        # run row keeps it ("<Error>: <reason>").
        mark_failed.next(sfn.Fail(self, "Run failed", error=RUN_FAILED, cause_path="$.error.Cause"))

        prepare = sfn.CustomState(
            self, "Prepare data", state_json=processing_state_json(vpc, role_arn=processing_role_arn)
        )
        prepare.add_catch(mark_failed, errors=["States.ALL"], result_path="$.error")

        train = sfn.CustomState(self, "Train", state_json=training_state_json(vpc, quota_wait_hours))
        record_failure = self._record_failure_step(
            "Record job failure",
            function=functions["record_job_failure"],
            output_path="$.job_name",
            comment="Capacity, quota or job failure: recorded, the benchmark goes on",
        )
        # A retried CreateTrainingJob whose first response was lost (the job was created) gets ResourceInUse for our
        # own job name: the job runs. Wait for it by describing it every minute, then record it like any other.
        describe = sfn.CustomState(self, "Describe launched job", state_json=describe_launched_job_json())
        poll_s = launched_poll_seconds(timeout.to_seconds())
        wait = sfn.Wait(self, "Wait for launched job", time=sfn.WaitTime.duration(Duration.seconds(poll_s)))
        train.add_catch(describe, errors=[RESOURCE_IN_USE], result_path="$.launch_error")
        train.add_catch(record_failure, errors=["States.ALL"], result_path="$.error")
        # The .sync task returns on the same SageMaker event that asynchronously triggers job_events: record the
        # finished job here (same conditional write as job_events), so Analyze never sees a finished job as
        # still running. If recording fails, job_events still records the job from SageMaker's event.
        record_result = self._lambda_step(
            "Record job result",
            function=functions["record_job_result"],
            payload=sfn.TaskInput.from_object(
                {"run_id": sfn.JsonPath.string_at("$.run_id"), "job_name": sfn.JsonPath.string_at("$.job_name")}
            ),
            result_path=sfn.JsonPath.DISCARD,
            output_path="$.job_name",
            comment="Final status, timings and benchmark of the finished job, before Analyze reads them",
        )
        record_result.add_catch(
            sfn.Pass(
                self,
                "Result left to job_events",
                comment="Recording failed; job_events records the job from SageMaker's own event",
                output_path="$.job_name",
            ),
            errors=["States.ALL"],
            result_path="$.record_error",
        )
        train.next(record_result)
        # A failure to record the failure must not fail the Map (and with it every other job): the job's row keeps
        # what job_events records from SageMaker's own event, and the error is in this iteration's output.
        record_failure.add_catch(
            sfn.Pass(
                self,
                "Failure left to job_events",
                comment="Recording the failure failed; job_events records the job from SageMaker's event, if any",
                output_path="$.job_name",
            ),
            errors=["States.ALL"],
            result_path="$.record_error",
        )
        describe.add_catch(record_failure, errors=["States.ALL"], result_path="$.error")
        describe.next(
            sfn.Choice(self, "Launched job still running?")
            .when(
                sfn.Condition.or_(
                    *(sfn.Condition.string_equals("$.launched.status", st) for st in ("InProgress", "Stopping"))
                ),
                wait.next(describe),
            )
            .otherwise(record_result)
        )

        launch_job = self._launch_unless_stopped(
            train, table=table, suffix="", skip_name="Skip job (run stopped)", noun="job",
            read_comment="A run stopped by the budget guard launches no further job", on_error=record_failure,
        )  # fmt: skip
        jobs = self._request_map(
            "Run jobs", kind="jobs", plan_bucket=plan_bucket, max_concurrency=map_max_concurrency,
            comment="The fan-out: one child workflow per benchmark job, instance types interleaved",
        )  # fmt: skip
        jobs.item_processor(launch_job)
        jobs.add_catch(mark_failed, errors=["States.ALL"], result_path="$.error")
        searches = self._search_map(
            functions=functions, table=table, vpc=vpc, map_max_concurrency=map_max_concurrency,
            quota_wait_hours=quota_wait_hours, plan_bucket=plan_bucket,
        )  # fmt: skip
        searches.add_catch(mark_failed, errors=["States.ALL"], result_path="$.error")

        analyze = self._lambda_step(
            "Analyze run",
            function=functions["analyze_run"],
            payload=sfn.TaskInput.from_object({"run_id": sfn.JsonPath.string_at("$.run_id")}),
            comment="Costs, ranking, recommendation, report",
        )
        analyze.add_catch(mark_failed, errors=["States.ALL"], result_path="$.error")
        # The canary: before any expensive job, each distinct configuration runs 2 steps of a 2-layer cut of its
        # model on the canary instance (plan_jobs builds the requests; gpuscout.plan.canary). A failure marks the run
        # FAILED with the canary's own cause (a Distributed Map reports only that a child failed) and fails the Map,
        # whose Catch then leaves the run as it is (mark_run_failed changes no final run).
        canary = sfn.CustomState(self, "Canary", state_json=canary_state_json(vpc))
        canary_failed = self._mark_failed_step(
            "Mark run failed (canary)",
            function=functions["mark_run_failed"],
            execution_arn=sfn.JsonPath.string_at("$.execution_arn"),  # the parent's, which its ItemSelector passed
            comment="The run row ends FAILED with the canary's error and cause",
        )
        canary_failed.next(sfn.Fail(self, "Canary failed", error=CANARY_FAILED, cause_path="$.error.Cause"))
        canary.add_catch(canary_failed, errors=["States.ALL"], result_path="$.error")
        canaries = self._request_map(
            "Run canaries", kind="canaries", plan_bucket=plan_bucket, max_concurrency=map_max_concurrency,
            comment="Every configuration must survive 2 steps on a cheap instance before the fan-out",
            with_execution=True,
        )  # fmt: skip
        canaries.item_processor(canary)
        canaries.add_catch(mark_failed, errors=["States.ALL"], result_path="$.error")
        done = sfn.Succeed(self, "Done")
        # The run has ended: its jobs' own role goes (mark_run_failed deletes it on every other ending). A role
        # left behind (this step failed after its retries) grants no more than its boundary; the run stays analysed.
        delete_role = self._run_role_step(
            "Delete run role", function=functions["run_role"], action="delete", result_path=sfn.JsonPath.DISCARD,
            comment="The run's own SageMaker role is deleted now that its jobs have ended",
        )  # fmt: skip
        left = sfn.Pass(self, "Run role left", comment="The role could not be deleted; the run stays analysed")
        delete_role.add_catch(left.next(done), errors=["States.ALL"], result_path="$.role_error")
        analyze.next(delete_role.next(done))
        after_jobs = self._when_any("tunings", searches, analyze)
        after_canaries = self._when_any("jobs", jobs, after_jobs)
        start_fan_out = self._when_any("canaries", canaries, after_canaries)
        prepare_needed = (
            sfn.Choice(self, "Processed data cached?")
            .when(sfn.Condition.boolean_equals("$.prepare.skip", True), start_fan_out)
            .otherwise(prepare.next(start_fan_out))
        )
        # A refusal is the handler's result, not an error (gpuscout.cloud.step_errors): the run row already says
        # REJECTED or REFUSED and why; the execution ends failed with that cause, and no Lambda error alarm fires.
        definition = validate.next(
            self._unless_refused("Manifest valid?", "Manifest rejected", MANIFEST_REJECTED, then=plan)
        )
        # The run's own role for its SageMaker jobs (gpuscout.cloud.run_roles): every Map iteration passes it to its
        # job, canary or tuning job; it writes only this run's output and checkpoints.
        create_role = self._run_role_step(
            "Create run role", function=functions["run_role"], action="create", result_path="$.run_role",
            comment="A SageMaker role of the run's own: its jobs write only its output and checkpoints",
        )  # fmt: skip
        create_role.add_catch(mark_failed, errors=["States.ALL"], result_path="$.error")
        plan.next(
            self._unless_refused("Plan accepted?", "Plan refused", PLAN_REFUSED, then=create_role.next(prepare_needed))
        )

        self.log_group = logs.LogGroup(self, "Logs", retention=log_retention, removal_policy=removal_policy)
        self.state_machine = sfn.StateMachine(
            self,
            "StateMachine",
            definition_body=sfn.DefinitionBody.from_chainable(definition),
            state_machine_type=sfn.StateMachineType.STANDARD,
            role=role,
            timeout=timeout,
            tracing_enabled=True,
            # Execution data (bucket/key, parsed manifest, job requests, errors) holds no credentials and is
            # what one needs to debug a run; it stays in this log group for the configured retention.
            logs=sfn.LogOptions(destination=self.log_group, level=sfn.LogLevel.ALL, include_execution_data=True),
            comment="gpuscout benchmark: validate, plan, prepare data, train on every target, analyze",
        )

    def _search_map(
        self,
        *,
        functions: Mapping[str, lambda_.IFunction],
        table: dynamodb.ITable,
        vpc: VpcSettings | None,
        map_max_concurrency: int,
        quota_wait_hours: int,
        plan_bucket: s3.IBucket,
    ) -> sfn.DistributedMap:
        """A Map over plan_jobs' tunings (empty unless the manifest has a search section): per target, read the run
        status (a stopped run launches nothing more), run the tuning job, then record every trial it ran. A failed
        tuning job is recorded (its own row, why) and its trials are recorded all the same."""
        tune = sfn.CustomState(self, "Tune", state_json=tuning_state_json(vpc, quota_wait_hours))
        record_trials = self._lambda_step(
            "Record trials",
            function=functions["record_job_result"],
            payload=sfn.TaskInput.from_object(
                {
                    "run_id": sfn.JsonPath.string_at("$.run_id"),
                    "tuning_job_name": sfn.JsonPath.string_at("$.job_name"),
                }
            ),
            result_path=sfn.JsonPath.DISCARD,
            output_path="$.job_name",
            comment="Final status, timings and benchmark of every trial, before Analyze reads them",
        )
        record_trials.add_catch(
            sfn.Pass(
                self,
                "Trials left to job_events",
                comment="Recording failed; job_events records each trial from SageMaker's own events",
                output_path="$.job_name",
            ),
            errors=["States.ALL"],
            result_path="$.record_error",
        )
        record_failure = self._record_failure_step(
            "Record search failure",
            function=functions["record_job_failure"],
            comment="Capacity, quota or tuning job failure: recorded, the benchmark goes on",
        )
        tune.add_catch(record_failure, errors=["States.ALL"], result_path="$.error")
        record_failure.add_catch(
            sfn.Pass(self, "Search failure left to job_events", comment="Recording the failure failed; trials next"),
            errors=["States.ALL"],
            result_path="$.record_error",
        )
        record_failure.next(record_trials)
        tune.next(record_trials)
        launch_tuning = self._launch_unless_stopped(
            tune, table=table, suffix=" (search)", skip_name="Skip search (run stopped)", noun="tuning job",
            read_comment="A run stopped by the budget guard starts no further tuning job", on_error=record_failure,
        )  # fmt: skip
        searches = self._request_map(
            "Run searches",
            kind="tunings",
            plan_bucket=plan_bucket,
            max_concurrency=map_max_concurrency,
            comment="A settings search: one SageMaker tuning job per target; trials run inside it",
        )
        searches.item_processor(launch_tuning)
        return searches

    def _launch_unless_stopped(
        self, launch: sfn.IChainable, *, table: dynamodb.ITable, suffix: str, skip_name: str, noun: str,
        read_comment: str, on_error: tasks.LambdaInvoke,
    ) -> sfn.IChainable:  # fmt: skip
        """Budget guard, launch side: job_events (measured spend) or the scheduled budget_guard (projected spend)
        stops running jobs and marks the run STOPPED once the spend crosses the budget; each Map iteration reads the
        run's status right before ``launch``, so what has not started yet is skipped instead of launched. A status
        that cannot be read (after the retries) launches nothing: ``on_error`` records the job as failed with the
        reason, and the other jobs go on."""
        check_run = tasks.DynamoGetItem(
            self,
            f"Read run status{suffix}",
            table=table,
            key={
                "pk": tasks.DynamoAttributeValue.from_string(
                    sfn.JsonPath.format("RUN#{}", sfn.JsonPath.string_at("$.run_id"))
                ),
                "sk": tasks.DynamoAttributeValue.from_string("RUN"),
            },
            # "status" is a DynamoDB reserved word: project it through an expression attribute name.
            expression_attribute_names={"#status": "status"},
            projection_expression=[tasks.DynamoProjectionExpression().with_attribute("#status")],
            consistent_read=True,
            result_selector={"status": sfn.JsonPath.string_at("$.Item.status.S")},
            result_path="$.run",
            comment=read_comment,
        )
        check_run.add_retry(**DYNAMODB_RETRY)
        check_run.add_catch(on_error, errors=["States.ALL"], result_path="$.error")
        skipped = sfn.Pass(
            self,
            skip_name,
            comment=f"The run was stopped (budget) before this {noun} started: nothing is launched",
            output_path="$.job_name",
        )
        launch_or_skip = (
            sfn.Choice(self, f"Run still going?{suffix}")
            .when(
                sfn.Condition.or_(
                    *(sfn.Condition.string_equals("$.run.status", s) for s in RUN_STATUSES_THAT_STOP_LAUNCHES)
                ),
                skipped,
            )
            .otherwise(launch)
        )
        return check_run.next(launch_or_skip)

    def _request_map(
        self,
        construct_id: str,
        *,
        kind: str,
        plan_bucket: s3.IBucket,
        max_concurrency: int,
        comment: str,
        with_execution: bool = False,
    ) -> sfn.DistributedMap:
        """A Distributed Map over the request list ``kind`` plan_jobs wrote to S3 (gpuscout.cloud.plan_items): each
        child workflow (a Standard execution with its own history) gets the run id, its job name and its request, and
        with ``with_execution`` this execution's ARN (a child's own ARN is another); nothing of the children's output
        stays in the state (each child ends with its job name only: the Map gathers their outputs even so). Items
        start about in the file's order (not guaranteed), ``max_concurrency`` at a time."""
        selector: dict[str, Any] = {
            "run_id": sfn.JsonPath.string_at("$.run_id"),
            "job_name": sfn.JsonPath.string_at("$$.Map.Item.Value.job_name"),
            "request": sfn.JsonPath.object_at("$$.Map.Item.Value.request"),
            "role_arn": sfn.JsonPath.string_at("$.run_role.role_arn"),  # the run's own role, not an item's field
        }
        if with_execution:
            selector["execution_arn"] = sfn.JsonPath.execution_id
        return sfn.DistributedMap(
            self,
            construct_id,
            item_reader=PlanItemReader(
                bucket=plan_bucket, key=sfn.JsonPath.string_at(f"$.plan.{kind}.key"), prefix=PLANS_PREFIX
            ),
            item_selector=selector,
            max_concurrency=max_concurrency,
            map_execution_type=sfn.StateMachineType.STANDARD,  # .sync integrations run only in Standard workflows
            # No ToleratedFailure*: AWS's default tolerates none, so a child that fails fails the Map (its Catch marks
            # the run FAILED). Children catch their job's failures themselves (a failed job is a result): only a
            # canary, or an error of the workflow's own, fails one.
            result_path=sfn.JsonPath.DISCARD,
            comment=comment,
        )

    def _unless_refused(self, name: str, fail_name: str, error: str, *, then: sfn.IChainable) -> sfn.Choice:
        """``then``, unless the step's output is a refusal (``$.refused``): then fail with its error and cause."""
        refused = sfn.Fail(self, fail_name, error=error, cause_path=f"$.{REFUSAL_KEY}.Cause")
        return sfn.Choice(self, name).when(sfn.Condition.is_present(f"$.{REFUSAL_KEY}"), refused).otherwise(then)

    def _when_any(self, kind: str, fan_out: sfn.DistributedMap, then: sfn.IChainable) -> sfn.Choice:
        """``fan_out`` then ``then`` when the plan has any ``kind``; straight to ``then`` otherwise (no Map Run)."""
        fan_out.next(then)
        return (
            sfn.Choice(self, f"Any {kind}?")
            .when(sfn.Condition.number_greater_than(f"$.plan.{kind}.count", 0), fan_out)
            .otherwise(then)
        )

    def _record_failure_step(
        self, construct_id: str, *, function: lambda_.IFunction, **kwargs: Any
    ) -> tasks.LambdaInvoke:
        """record_job_failure with the caught error ($.error) of the job or tuning job $.job_name of run $.run_id;
        its result discarded (the state's input goes on)."""
        job_name = sfn.JsonPath.string_at("$.job_name")
        return self._caught_error_step(construct_id, function=function, fields={"job_name": job_name}, **kwargs)

    def _mark_failed_step(
        self, construct_id: str, *, function: lambda_.IFunction, execution_arn: str, comment: str
    ) -> tasks.LambdaInvoke:
        """mark_run_failed with the caught error ($.error) of run $.run_id, planned by ``execution_arn``; its result
        discarded (the state's input goes on)."""
        fields = {"execution_arn": execution_arn}
        return self._caught_error_step(construct_id, function=function, fields=fields, comment=comment)

    def _caught_error_step(
        self, construct_id: str, *, function: lambda_.IFunction, fields: dict[str, Any], **kwargs: Any
    ) -> tasks.LambdaInvoke:
        """``function`` called with $.run_id, ``fields`` and the caught error $.error, in that order; its result
        discarded (the state's input goes on)."""
        payload = {
            "run_id": sfn.JsonPath.string_at("$.run_id"),
            **fields,
            "error": sfn.JsonPath.object_at("$.error"),
        }
        return self._lambda_step(
            construct_id,
            function=function,
            payload=sfn.TaskInput.from_object(payload),
            result_path=sfn.JsonPath.DISCARD,
            **kwargs,
        )

    def _run_role_step(self, name: str, *, function: lambda_.IFunction, action: str, **kw: Any) -> tasks.LambdaInvoke:
        """The run_role function with the run's id and ``action`` (create, delete)."""
        payload = sfn.TaskInput.from_object({"run_id": sfn.JsonPath.string_at("$.run_id"), "action": action})
        return self._lambda_step(name, function=function, payload=payload, **kw)

    def _lambda_step(self, construct_id: str, *, function: lambda_.IFunction, **kwargs: Any) -> tasks.LambdaInvoke:
        """A Lambda Task returning the function's payload, retried on Lambda's own transient errors (throttling
        included, which CDK's default retry leaves out); the function's own errors are not retried."""
        step = tasks.LambdaInvoke(
            self,
            construct_id,
            lambda_function=function,
            payload_response_only=True,
            retry_on_service_exceptions=False,
            **kwargs,
        )
        step.add_retry(**LAMBDA_RETRY)
        return step
