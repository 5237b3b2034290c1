"""Lambda: SageMaker "Training Job State Change" events -> JOB rows, benchmark results, budget guard.

Idempotent and order-safe (see gpuscout.cloud.events). Emits, each as its own metric (so dimensions do not mix;
Powertools adds "service" to both): TrainingJobStatus (dimension Status, SageMaker's status) for every event, and
TokensPerSecond (dimension InstanceType) when a job ends with a benchmark. stacks/monitoring.py graphs exactly these.
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit, single_metric
from aws_lambda_powertools.utilities.parser import envelopes, parse
from aws_lambda_powertools.utilities.parser.models import EventBridgeModel
from aws_lambda_powertools.utilities.typing import LambdaContext

from gpuscout.cloud import control_plane
from gpuscout.cloud.events import EventError, TrainingJobStateChange, handle_training_job_event
from gpuscout.cloud.lambda_runtime import lambda_handler, logger
from gpuscout.domain.names import METRIC_NAMESPACE


@lambda_handler(flush_metrics=False)  # each metric is a single_metric: a Metrics flush would warn on every event
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    detail = parse(event=event, model=TrainingJobStateChange, envelope=envelopes.EventBridgeEnvelope)
    if not isinstance(detail, TrainingJobStateChange):
        raise EventError(f"not a single training job state change: {type(detail).__name__}")
    envelope = EventBridgeModel.model_validate(event)
    own_account = context.invoked_function_arn.split(":")[4]
    if envelope.account != own_account:  # the rule filters on the account too; this holds whatever routed it here
        logger.warning("event from another account ignored", extra={"account": envelope.account})
        return {"applied": False, "job_name": detail.training_job_name,
                "ignored_reason": f"event from account {envelope.account}, not this stack's {own_account}"}  # fmt: skip
    services = control_plane.services()
    logger.append_keys(job_name=detail.training_job_name, training_job_status=detail.training_job_status)
    outcome = handle_training_job_event(
        detail,
        envelope.time,
        store=services.store,
        s3=services.s3,
        sagemaker=services.sagemaker,
        artifacts_bucket=services.settings.artifacts_bucket,
        default_budget_usd=services.settings.default_budget_usd,
    )
    with single_metric(name="TrainingJobStatus", unit=MetricUnit.Count, value=1, namespace=METRIC_NAMESPACE) as metric:
        metric.add_dimension(name="Status", value=detail.training_job_status)
    if outcome.tokens_per_s is not None and outcome.instance_type:
        with single_metric(
            name="TokensPerSecond",
            unit=MetricUnit.CountPerSecond,
            value=outcome.tokens_per_s,
            namespace=METRIC_NAMESPACE,
        ) as metric:
            metric.add_dimension(name="InstanceType", value=outcome.instance_type)
    if outcome.stopped_jobs:
        logger.warning(
            "budget guard stopped running jobs",
            extra={"stopped": outcome.stopped_jobs, "spend_usd": outcome.measured_spend_usd},
        )
    logger.info("job event processed", extra=outcome.model_dump(mode="json", exclude={"stopped_jobs"}))
    return outcome.model_dump(mode="json")
