"""Lambda: the scheduled budget check (Cloud contract: budget_guard).

An EventBridge schedule (stacks/events.py, every BUDGET_CHECK_INTERVAL_MINUTES) invokes it with a "Scheduled Event";
it projects every running run's spend to now and stops the jobs of a run whose projection crossed its budget,
marking the run STOPPED (gpuscout.cloud.budget_guard.check_budgets; idempotent: a stopped run is not read again).
Emits RunsStoppedOverBudget (Count: the runs this check stopped) and logs each stop. A run whose jobs could not be
stopped fails the invocation after every other run was checked, so it is retried and the error alarm fires.
It then deletes the run roles runs left behind (gpuscout.cloud.run_roles.sweep_run_roles): ``swept_run_roles`` lists
their runs, ``sweep_errors`` what could not be swept (logged as errors; retried at the next check).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.parser.models import EventBridgeModel
from aws_lambda_powertools.utilities.typing import LambdaContext
from pydantic import Field

from gpuscout.cloud import control_plane, run_roles
from gpuscout.cloud.budget_guard import BudgetCheckError, check_budgets
from gpuscout.cloud.lambda_runtime import lambda_handler, logger, metrics


class ScheduledEvent(EventBridgeModel):
    """What an EventBridge schedule rule sends (no detail)."""

    source: Literal["aws.events"]
    detail_type: Literal["Scheduled Event"] = Field(alias="detail-type")


@lambda_handler()
@event_parser(model=ScheduledEvent)
def handler(event: ScheduledEvent, context: LambdaContext) -> dict[str, Any]:
    services = control_plane.services()
    now = datetime.now(UTC)  # not the event's time: a retried delivery projects to when it runs
    logger.append_keys(scheduled_time=event.time.isoformat())
    outcome = check_budgets(
        services.store,
        services.sagemaker,
        now=now,
        default_budget_usd=services.settings.default_budget_usd,
    )
    stopped = outcome.stopped_runs
    metrics.add_metric(name="RunsStoppedOverBudget", unit=MetricUnit.Count, value=len(stopped))
    for run in stopped:
        logger.warning("budget guard stopped a run over budget", extra=run.model_dump(mode="json"))
    logger.info("budget check done", extra={"runs_checked": len(outcome.runs), "runs_stopped": len(stopped)})
    # the run roles runs left behind (run_roles.sweep_run_roles); what failed is retried at the next check
    sweep = run_roles.sweep_run_roles(services.iam, services.store, services.settings, now=now)
    if sweep.swept:
        logger.warning("deleted run roles left behind", extra={"runs": sweep.swept})
    for error in sweep.errors:
        logger.error("run role not swept", extra={"reason": error})
    if outcome.errors:
        raise BudgetCheckError("; ".join(outcome.errors))
    return {**outcome.model_dump(mode="json"), "swept_run_roles": sweep.swept, "sweep_errors": sweep.errors}
