"""Lambda: leave a run whose workflow failed in a final state (Cloud contract: mark_run_failed).

Two callers, one rule (gpuscout.cloud.control_plane.mark_run_failed: only a non-final run of this execution moves to
FAILED, idempotently); each run it moves to FAILED gets the same run summary on the stack's SNS topic as an analysed
run (control_plane.tell_run_failed), and counts in the RunsMarkedFailed metric (the FailedRuns alarm). The run's own
role (gpuscout.cloud.run_roles) is deleted, as the success path's "Delete run role" step does:

- the state machine's Catch after planning: ``{"run_id", "execution_arn", "error": {"Error", "Cause"}}``;
- EventBridge "Step Functions Execution Status Change" (FAILED, TIMED_OUT, ABORTED) for what no Catch sees
  (execution timeout, abort, States.DataLimitExceeded, a failing Catch step).
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import envelopes, parse
from aws_lambda_powertools.utilities.typing import LambdaContext

from gpuscout.cloud import control_plane
from gpuscout.cloud.contract import CaughtRunFailure, ExecutionStatusChange, RunFailed
from gpuscout.cloud.lambda_runtime import lambda_handler, logger, metrics


@lambda_handler()
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    services = control_plane.services()
    if "detail-type" in event:
        change = parse(event=event, model=ExecutionStatusChange, envelope=envelopes.EventBridgeEnvelope)
        if not isinstance(change, ExecutionStatusChange):
            raise TypeError(f"not a single execution status change: {type(change).__name__}")
        logger.append_keys(execution_arn=change.execution_arn, execution_status=change.status)
        if change.status not in {"FAILED", "TIMED_OUT", "ABORTED"}:
            outcomes: list[RunFailed] = []
        else:
            outcomes = control_plane.fail_run_of_execution(
                change.execution_arn, change.status, store=services.store, error=change.error, cause=change.cause
            )
    else:
        caught = parse(event=event, model=CaughtRunFailure)
        logger.append_keys(run_id=caught.run_id, execution_arn=caught.execution_arn)
        reason = control_plane.caught_failure_reason(caught.error.error, caught.error.cause)
        outcomes = [
            control_plane.mark_run_failed(
                caught.run_id, reason, store=services.store, execution_arn=caught.execution_arn
            )
        ]
    # the run has ended: its jobs' own role goes (the success path's "Delete run role" step does the same)
    control_plane.delete_run_roles(outcomes, iam=services.iam, settings=services.settings)
    applied = sum(1 for o in outcomes if o.applied)
    metrics.add_metric(name="RunsMarkedFailed", unit=MetricUnit.Count, value=applied)  # the FailedRuns alarm's metric
    for outcome in outcomes:  # each run this call ended is told, once (a second call applies nothing)
        if outcome.applied:
            outcome.notified = control_plane.tell_run_failed(
                outcome.run_id,
                store=services.store,
                sns=services.sns,
                topic_arn=services.settings.notification_topic_arn,
            )
    runs = [o.dump() for o in outcomes]
    logger.info("run failure recorded", extra={"outcomes": runs})
    return {"runs": runs}
