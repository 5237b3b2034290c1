"""CloudWatch dashboard and alarms: runs, jobs, throughput per instance type, Lambda errors, dead letters."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_cloudwatch_actions as actions
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sqs as sqs
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from gpuscout.domain.names import METRIC_NAMESPACE
from stacks.roles import SERVICE_NAME

# Emitted by lambdas/job_events with Powertools Metrics (namespace "gpuscout"); Powertools adds the "service"
# dimension to every metric, so a widget that leaves it out shows nothing. The dashboard queries exactly these
# dimension sets (tests/integration/test_cloud_handlers.py compares them with what the handler emits).
THROUGHPUT_METRIC = "TokensPerSecond"
JOB_STATUS_METRIC = "TrainingJobStatus"
RUNS_FAILED_METRIC = "RunsMarkedFailed"  # emitted by lambdas/mark_run_failed for each run it moved to FAILED
JOB_STATUSES = ("InProgress", "Completed", "Failed", "Stopping", "Stopped")  # SageMaker's TrainingJobStatus values
INSTANCE_TYPE_DIMENSION = "InstanceType"
STATUS_DIMENSION = "Status"
DASHBOARD_DIMENSIONS = {
    THROUGHPUT_METRIC: ("service", INSTANCE_TYPE_DIMENSION),
    JOB_STATUS_METRIC: ("service", STATUS_DIMENSION),
}


def dashboard_dimensions(metric: str, value: str) -> dict[str, str]:
    """The dimensions a widget queries for one series of ``metric``: the service, and ``value`` for the metric's own
    dimension (DASHBOARD_DIMENSIONS, which the handler's emitted metrics are tested against)."""
    service, own = DASHBOARD_DIMENSIONS[metric]
    return {service: SERVICE_NAME, own: value}


class Monitoring(Construct):
    """`dashboard`, `failed_runs_alarm`, `ended_executions_alarms` (timed out, aborted), `dead_letter_alarms`,
    `lambda_error_alarms` (all -> topic)."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        state_machine: sfn.StateMachine,
        functions: Mapping[str, lambda_.Function],
        dead_letter_queues: Sequence[sqs.IQueue],
        topic: sns.ITopic,
        instance_types: Sequence[str],
    ) -> None:
        super().__init__(scope, construct_id)
        notify = actions.SnsAction(topic)
        five_minutes = Duration.minutes(5)

        # A run that failed after planning, however its execution ended (a caught error, a timeout, an abort, an
        # uncatchable data limit): mark_run_failed counts each run it moved to FAILED. Not the state machine's
        # ExecutionsFailed, which also counts rejected manifests and refused plans (the user's input, told in the
        # run row and the execution's cause, not an error of the stack).
        runs_failed = cloudwatch.Metric(
            namespace=METRIC_NAMESPACE,
            metric_name=RUNS_FAILED_METRIC,
            dimensions_map={"service": SERVICE_NAME},
            statistic=cloudwatch.Stats.SUM,
            period=five_minutes,
        )
        self.failed_runs_alarm = self._on_any(
            runs_failed,
            "FailedRuns",
            "A benchmark run failed after it was planned (error, timeout or abort; see the run row)",
            notify,
        )
        # Executions that timed out or were aborted, whether or not they had planned a run yet.
        self.ended_executions_alarms = [
            self._on_any(state_machine.metric_timed_out(period=five_minutes), "TimedOutExecutions",
                         "A benchmark execution timed out", notify),
            self._on_any(state_machine.metric_aborted(period=five_minutes), "AbortedExecutions",
                         "A benchmark execution was aborted", notify),
        ]  # fmt: skip
        self.dead_letter_alarms = []
        for index, queue in enumerate(dead_letter_queues):
            alarm = queue.metric_approximate_number_of_messages_visible(period=five_minutes).create_alarm(
                self,
                f"DeadLetters{index}",
                alarm_description=f"Undeliverable events or failed async invocations wait in {queue.node.path}",
                threshold=0,
                evaluation_periods=1,
                comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_THRESHOLD,
                treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
            )
            alarm.add_alarm_action(notify)
            self.dead_letter_alarms.append(alarm)
        self.lambda_error_alarms = [
            self._on_any(
                function.metric_errors(period=five_minutes),
                f"Errors-{name}",
                f"Lambda function {name} raised an unexpected error",
                notify,
            )
            for name, function in functions.items()
        ]

        hour = Duration.hours(1)
        self.dashboard = cloudwatch.Dashboard(self, "Dashboard", default_interval=Duration.days(7))
        self.dashboard.add_widgets(
            cloudwatch.GraphWidget(
                title="Benchmark executions",
                left=[
                    state_machine.metric_started(period=hour, label="started"),
                    state_machine.metric_succeeded(period=hour, label="succeeded"),
                    state_machine.metric_failed(period=hour, label="failed"),
                    state_machine.metric_timed_out(period=hour, label="timed out"),
                    state_machine.metric_aborted(period=hour, label="aborted"),
                ],
                width=12,
            ),
            cloudwatch.GraphWidget(
                title="Training job state changes",
                left=[
                    cloudwatch.Metric(
                        namespace=METRIC_NAMESPACE,
                        metric_name=JOB_STATUS_METRIC,
                        dimensions_map=dashboard_dimensions(JOB_STATUS_METRIC, status),
                        statistic=cloudwatch.Stats.SUM,
                        period=hour,
                        label=status,
                    )
                    for status in JOB_STATUSES
                ],
                width=12,
            ),
        )
        self.dashboard.add_widgets(
            cloudwatch.GraphWidget(
                title="Training throughput (tokens/s) per instance type",
                left=[
                    cloudwatch.Metric(
                        namespace=METRIC_NAMESPACE,
                        metric_name=THROUGHPUT_METRIC,
                        dimensions_map=dashboard_dimensions(THROUGHPUT_METRIC, instance_type),
                        statistic=cloudwatch.Stats.AVERAGE,
                        period=hour,
                        label=instance_type,
                    )
                    for instance_type in instance_types
                ],
                width=12,
            ),
            cloudwatch.GraphWidget(
                title="Lambda errors",
                left=[function.metric_errors(period=hour, label=name) for name, function in functions.items()],
                width=12,
            ),
        )
        self.dashboard.add_widgets(
            cloudwatch.AlarmStatusWidget(
                title="Alarms",
                alarms=[
                    self.failed_runs_alarm,
                    *self.ended_executions_alarms,
                    *self.dead_letter_alarms,
                    *self.lambda_error_alarms,
                ],
                width=24,
            )
        )

    def _on_any(
        self, metric: cloudwatch.Metric, construct_id: str, description: str, notify: actions.SnsAction
    ) -> cloudwatch.Alarm:
        """An alarm to the topic when ``metric`` counts at least one in a period (no data: not breaching)."""
        alarm = metric.create_alarm(
            self,
            construct_id,
            alarm_description=description,
            threshold=1,
            evaluation_periods=1,
            comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )
        alarm.add_alarm_action(notify)
        return alarm
