"""EventBridge: a manifest upload starts a run; SageMaker job-state changes of our jobs reach job_events; a failed
execution reaches mark_run_failed; a schedule runs the budget check (budget_guard) every few minutes.

Every target gets an encrypted, TLS-only SQS dead-letter queue and a bounded retry policy, so an event that
cannot be delivered is kept (and alarmed on, see monitoring.py) instead of silently dropped.
"""

from __future__ import annotations

from aws_cdk import Aws, Duration, RemovalPolicy
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_sqs as sqs
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from gpuscout.domain.names import JOB_NAME_PREFIX, MANIFESTS_PREFIX

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")  # what the Validate step parses
TRAINING_STATE_CHANGE = "SageMaker Training Job State Change"
EXECUTION_STATUS_CHANGE = "Step Functions Execution Status Change"
# Execution ends that leave a run to be closed (a Catch may have closed it already; marking is idempotent).
FAILED_EXECUTION_STATUSES = ("FAILED", "TIMED_OUT", "ABORTED")
# How often budget_guard projects running runs' spend (gpuscout/cloud/budget_guard.py): a run that crosses its budget
# is stopped within this interval, so it overspends by at most this long at its running jobs' hourly price.
BUDGET_CHECK_INTERVAL_MINUTES = 5


class EventRules(Construct):
    """`manifest_uploaded`, `job_state_changed`, `execution_failed` and `budget_check` rules, with
    `dead_letter_queues` (one per target)."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        data_bucket: s3.IBucket,
        state_machine: sfn.IStateMachine,
        job_events_function: lambda_.IFunction,
        mark_run_failed_function: lambda_.IFunction,
        budget_guard_function: lambda_.IFunction,
        removal_policy: RemovalPolicy,
    ) -> None:
        super().__init__(scope, construct_id)
        self.manifest_dead_letters = self._queue("ManifestDeadLetters", removal_policy)
        self.job_event_dead_letters = self._queue("JobEventDeadLetters", removal_policy)
        self.execution_failed_dead_letters = self._queue("ExecutionFailedDeadLetters", removal_policy)
        self.budget_check_dead_letters = self._queue("BudgetCheckDeadLetters", removal_policy)
        self.dead_letter_queues = (
            self.manifest_dead_letters,
            self.job_event_dead_letters,
            self.execution_failed_dead_letters,
            self.budget_check_dead_letters,
        )

        self.manifest_uploaded = events.Rule(
            self,
            "ManifestUploaded",
            description="A manifest (.yaml, .yml, .json) written under manifests/ starts a benchmark run",
            event_pattern=events.EventPattern(
                source=["aws.s3"],
                detail_type=["Object Created"],
                detail={
                    "bucket": {"name": [data_bucket.bucket_name]},
                    # only manifests: a folder marker or a README under manifests/ starts nothing
                    "object": {"key": [{"wildcard": f"{MANIFESTS_PREFIX}*{suffix}"} for suffix in MANIFEST_SUFFIXES]},
                },
            ),
        )
        # The role EventBridge assumes to start a run: StartExecution on this state machine only, and assumable by
        # EventBridge for this account's rules only (confused-deputy protection; CDK's default role has no condition)
        self.start_run_role = iam.Role(
            self,
            "StartRunRole",
            assumed_by=iam.ServicePrincipal(
                "events.amazonaws.com", conditions={"StringEquals": {"aws:SourceAccount": Aws.ACCOUNT_ID}}
            ),
            description="EventBridge starts a gpuscout run for a manifest written under manifests/",
        )
        state_machine.grant_start_execution(self.start_run_role)
        self.manifest_uploaded.add_target(
            targets.SfnStateMachine(
                state_machine,
                role=self.start_run_role,
                input=events.RuleTargetInput.from_object(
                    {
                        "bucket": events.EventField.from_path("$.detail.bucket.name"),
                        "key": events.EventField.from_path("$.detail.object.key"),
                        "etag": events.EventField.from_path("$.detail.object.etag"),
                    }
                ),
                dead_letter_queue=self.manifest_dead_letters,
                retry_attempts=8,
                max_event_age=Duration.hours(2),
            )
        )

        self.job_state_changed = events.Rule(
            self,
            "JobStateChanged",
            description=f"State changes of gpuscout's SageMaker training jobs (names start with {JOB_NAME_PREFIX})",
            event_pattern=events.EventPattern(
                source=["aws.sagemaker"],
                # this account's jobs only: a bus that accepts other accounts' events must not let them write rows
                account=[Aws.ACCOUNT_ID],
                detail_type=[TRAINING_STATE_CHANGE],
                detail={"TrainingJobName": [{"prefix": JOB_NAME_PREFIX}]},
            ),
        )
        self.job_state_changed.add_target(
            targets.LambdaFunction(
                job_events_function,
                dead_letter_queue=self.job_event_dead_letters,
                retry_attempts=8,
                max_event_age=Duration.hours(6),
            )
        )

        # Every way an execution ends without success (a Fail state, an uncaught error, the execution timeout, an
        # abort, States.DataLimitExceeded) must leave its run final: mark_run_failed closes it, idempotently.
        self.execution_failed = events.Rule(
            self,
            "ExecutionFailed",
            description="gpuscout executions that failed, timed out or were aborted: their run becomes FAILED",
            event_pattern=events.EventPattern(
                source=["aws.states"],
                detail_type=[EXECUTION_STATUS_CHANGE],
                detail={
                    "status": list(FAILED_EXECUTION_STATUSES),
                    "stateMachineArn": [state_machine.state_machine_arn],
                },
            ),
        )
        self.execution_failed.add_target(
            targets.LambdaFunction(
                mark_run_failed_function,
                dead_letter_queue=self.execution_failed_dead_letters,
                retry_attempts=8,
                max_event_age=Duration.hours(6),
            )
        )

        # The hard budget cap: job_events sees a run's spend only when one of its jobs ends, so a schedule projects
        # every running run's spend to now and stops a run over its budget within one interval. A check that
        # cannot be delivered before the next one is due is parked in the DLQ (and alarmed on), not retried later.
        interval = Duration.minutes(BUDGET_CHECK_INTERVAL_MINUTES)
        self.budget_check = events.Rule(
            self,
            "BudgetCheck",
            description=f"Every {BUDGET_CHECK_INTERVAL_MINUTES} minutes: stop the jobs of any running gpuscout run "
            "whose projected spend crossed its budget",
            schedule=events.Schedule.rate(interval),
        )
        self.budget_check.add_target(
            targets.LambdaFunction(
                budget_guard_function,
                dead_letter_queue=self.budget_check_dead_letters,
                retry_attempts=2,
                max_event_age=interval,
            )
        )

    def _queue(self, construct_id: str, removal_policy: RemovalPolicy) -> sqs.Queue:
        return sqs.Queue(
            self,
            construct_id,
            encryption=sqs.QueueEncryption.SQS_MANAGED,
            enforce_ssl=True,
            retention_period=Duration.days(14),
            removal_policy=removal_policy,
        )
