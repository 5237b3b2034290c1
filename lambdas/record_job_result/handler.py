"""Lambda: record a training job the Map saw end (Cloud contract: record_job_result).

Runs inside the Map right after the ``.sync`` training task succeeded, so the analysis never depends on job_events
having run first (both apply the same conditional write; see gpuscout.cloud.events.record_described_job). Emits
TokensPerSecond (dimension InstanceType) when this call is the one that recorded the benchmark.
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext
from pydantic import BaseModel, ConfigDict, Field

from gpuscout.cloud import control_plane
from gpuscout.cloud.events import record_described_job

logger = Logger()
tracer = Tracer()
metrics = Metrics(namespace="gpuscout")


class FinishedJob(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_id: str = Field(min_length=1)
    job_name: str = Field(min_length=1)


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
@event_parser(model=FinishedJob)
def handler(event: FinishedJob, context: LambdaContext) -> dict[str, Any]:
    services = control_plane.services()
    logger.append_keys(run_id=event.run_id, job_name=event.job_name)
    outcome = record_described_job(
        event.run_id,
        event.job_name,
        store=services.store,
        s3=services.s3,
        sagemaker=services.sagemaker,
        artifacts_bucket=services.settings.artifacts_bucket,
        default_budget_usd=services.settings.default_budget_usd,
    )
    if outcome.tokens_per_s is not None and outcome.instance_type:
        metrics.add_dimension(name="InstanceType", value=outcome.instance_type)
        metrics.add_metric(name="TokensPerSecond", unit=MetricUnit.CountPerSecond, value=outcome.tokens_per_s)
    if outcome.stopped_jobs:
        logger.warning(
            "budget guard stopped running jobs",
            extra={"stopped": outcome.stopped_jobs, "spend_usd": outcome.measured_spend_usd},
        )
    logger.info("job result recorded", extra=outcome.model_dump(mode="json", exclude={"stopped_jobs"}))
    return outcome.model_dump(mode="json")
