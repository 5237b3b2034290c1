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
from pydantic import BaseModel, ConfigDict, Field

from gpuscout.cloud import control_plane, plan_step
from gpuscout.cloud.lambda_runtime import lambda_handler, logger, metrics
from gpuscout.cloud.step_errors import PlanRefused


class ValidatedManifest(BaseModel):
    """validate_manifest's output, plus the execution's ARN (recorded on the run, see mark_run_failed)."""

    model_config = ConfigDict(extra="forbid")

    run_id: str = Field(min_length=1)
    bucket: str
    key: str
    manifest: dict[str, Any]
    execution_arn: str | None = None
    quota_warnings: list[str] = Field(default_factory=list)  # Validate's quota pre-flight (logged there)


@lambda_handler()
@event_parser(model=ValidatedManifest)
def handler(event: ValidatedManifest, context: LambdaContext) -> dict[str, Any]:
    services = control_plane.services()
    logger.append_keys(run_id=event.run_id)
    try:
        result = plan_step.plan_jobs(
            event.model_dump(), store=services.store, s3=services.s3, settings=services.settings
        )
    except PlanRefused as err:
        metrics.add_metric(name="PlansRefused", unit=MetricUnit.Count, value=1)
        refused, notified = control_plane.refuse(
            event.run_id, err, sns=services.sns, topic_arn=services.settings.notification_topic_arn
        )
        logger.info("plan refused", extra={"reason": str(err), "notified": notified})
        return refused
    counts = {kind: result["plan"][kind]["count"] for kind in ("canaries", "jobs", "tunings")}
    metrics.add_metric(name="JobsPlanned", unit=MetricUnit.Count, value=counts["jobs"])
    logger.info(
        "run planned",
        extra={
            "canaries": counts["canaries"],
            "jobs": counts["jobs"],
            "tuning_jobs": counts["tunings"],
            "predicted_cost_usd": result["predicted_cost_usd"],
            "prepare_skipped": result["prepare"]["skip"],
        },
    )
    return result
