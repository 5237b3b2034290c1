"""Lambda: validate the submitted manifest (Cloud contract: execution input -> validated manifest).

A bad manifest is refused (after rejected/<name>.error.json and a REJECTED run are written): the handler returns
``{"run_id", "refused": {"Error": "ManifestRejected", "Cause"}}`` rather than raising (a refusal is not a Lambda
error), and the state machine's "Manifest valid?" Choice ends the execution with that cause.
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from gpuscout.cloud import control_plane
from gpuscout.cloud.contract import ExecutionInput
from gpuscout.cloud.lambda_runtime import lambda_handler, logger, metrics
from gpuscout.cloud.quotas import QuotaBook
from gpuscout.cloud.step_errors import ManifestRejected


@lambda_handler()
@event_parser(model=ExecutionInput)
def handler(event: ExecutionInput, context: LambdaContext) -> dict[str, Any]:
    services = control_plane.services()
    logger.append_keys(manifest_key=event.key)
    try:
        result = control_plane.validate_manifest(
            event,
            store=services.store,
            s3=services.s3,
            settings=services.settings,
            quota_book=QuotaBook(services.service_quotas),
        )
    except ManifestRejected as err:
        metrics.add_metric(name="ManifestsRejected", unit=MetricUnit.Count, value=1)
        refused, notified = control_plane.refuse(
            err.run_id, err, sns=services.sns, topic_arn=services.settings.notification_topic_arn
        )
        logger.info("manifest rejected", extra={"run_id": err.run_id, "reason": str(err), "notified": notified})
        return refused
    metrics.add_metric(name="ManifestsAccepted", unit=MetricUnit.Count, value=1)
    logger.info("manifest valid", extra={"run_id": result.run_id})
    return result.dump()
