"""Lambda: record a training job (or a search's tuning job) the Map's Catch caught (Cloud contract:
record_job_failure).

Classifies the error (QUOTA / CAPACITY / OOM / FAILED) into the JOB row and returns normally, so one missing
instance type never fails the whole benchmark. A tuning job's failure gets a row of its own (control_plane).
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from gpuscout.cloud import control_plane
from gpuscout.cloud.contract import JobFailure
from gpuscout.cloud.lambda_runtime import lambda_handler, logger, metrics


@lambda_handler()
@event_parser(model=JobFailure)
def handler(event: JobFailure, context: LambdaContext) -> dict[str, Any]:
    services = control_plane.services()
    logger.append_keys(run_id=event.run_id, job_name=event.job_name)
    result = control_plane.record_job_failure(
        event,
        store=services.store,
        s3=services.s3,
        artifacts_bucket=services.settings.artifacts_bucket,
    )
    metrics.add_dimension(name="Status", value=result.status)
    metrics.add_metric(name="JobFailures", unit=MetricUnit.Count, value=1)
    logger.warning("job failed", extra={"status": result.status, "error": event.error.error})
    return result.dump()
