"""Lambda: expand a validated manifest into SageMaker requests (Cloud contract: plan_jobs).

Over budget, over the request limit, when the planner cannot plan the manifest, or for a manifest object that was
already planned, it launches nothing and returns ``{"run_id", "refused": {"Error": "PlanRefused", "Cause"}}`` (not a
Lambda error; the "Plan accepted?" Choice ends the execution with that cause); an object whose run ended FAILED or
REFUSED is planned again as <run_id>-r<n>.
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from gpuscout.cloud import control_plane, plan_step
from gpuscout.cloud.contract import ValidatedManifest
from gpuscout.cloud.lambda_runtime import lambda_handler, logger, metrics
from gpuscout.cloud.step_errors import PlanRefused


@lambda_handler()
@event_parser(model=ValidatedManifest)
def handler(event: ValidatedManifest, context: LambdaContext) -> dict[str, Any]:
    services = control_plane.services()
    logger.append_keys(run_id=event.run_id)
    try:
        result = plan_step.plan_jobs(event, store=services.store, s3=services.s3, settings=services.settings)
    except PlanRefused as err:
        metrics.add_metric(name="PlansRefused", unit=MetricUnit.Count, value=1)
        refused, notified = control_plane.refuse(
            event.run_id, err, sns=services.sns, topic_arn=services.settings.notification_topic_arn
        )
        logger.info("plan refused", extra={"reason": str(err), "notified": notified})
        return refused
    planned = result.plan
    metrics.add_metric(name="JobsPlanned", unit=MetricUnit.Count, value=planned.jobs.count)
    logger.info(
        "run planned",
        extra={
            "canaries": planned.canaries.count,
            "jobs": planned.jobs.count,
            "tuning_jobs": planned.tunings.count,
            "predicted_cost_usd": result.predicted_cost_usd,
            "prepare_skipped": result.prepare.skip,
        },
    )
    return result.dump()
