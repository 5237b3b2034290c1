"""Lambda: analyze a finished run (Cloud contract: analyze_run): RESULT row + reports/<run_id>/ in S3."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from gpuscout.cloud import control_plane
from gpuscout.cloud.contract import AnalyzeRequest
from gpuscout.cloud.lambda_runtime import lambda_handler, logger, metrics


@lambda_handler()
@event_parser(model=AnalyzeRequest)
def handler(event: AnalyzeRequest, context: LambdaContext) -> dict[str, Any]:
    services = control_plane.services()
    logger.append_keys(run_id=event.run_id)
    result = control_plane.analyze(
        event.run_id,
        store=services.store,
        s3=services.s3,
        settings=services.settings,
        pricing_client=services.pricing,
        sns=services.sns,
    )
    metrics.add_metric(name="RunsAnalyzed", unit=MetricUnit.Count, value=1)
    if isinstance(result.notified, str):  # the run is analysed either way; a lost e-mail is worth an error log
        logger.error("run summary not published", extra={"reason": result.notified})
    logger.info("run analyzed", extra={"report_uri": result.report_uri})
    return result.dump()
