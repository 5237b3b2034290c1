"""Lambda: record a training job, or every trial of a search's tuning job, the Map saw end (Cloud contract:
record_job_result).

Runs inside the Map right after the ``.sync`` training (or tuning) task, so the analysis never depends on job_events
having run first (both apply the same conditional write; see gpuscout.cloud.events.record_described_job and
record_tuning_trials). Emits TokensPerSecond (dimension InstanceType) for each benchmark this call recorded (a
tuning job's trials share its one instance type).
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from gpuscout.cloud import control_plane
from gpuscout.cloud.contract import FinishedJob
from gpuscout.cloud.events import JobEventOutcome, record_described_job, record_tuning_trials
from gpuscout.cloud.lambda_runtime import lambda_handler, logger, metrics


@lambda_handler()
@event_parser(model=FinishedJob)
def handler(event: FinishedJob, context: LambdaContext) -> dict[str, Any]:
    services = control_plane.services()
    logger.append_keys(run_id=event.run_id, job_name=event.job_name or event.tuning_job_name)
    common: dict[str, Any] = {
        "store": services.store,
        "s3": services.s3,
        "sagemaker": services.sagemaker,
        "artifacts_bucket": services.settings.artifacts_bucket,
        "default_budget_usd": services.settings.default_budget_usd,
    }
    outcomes: list[JobEventOutcome]
    if event.tuning_job_name is not None:
        outcomes = record_tuning_trials(event.run_id, event.tuning_job_name, **common)
    else:
        assert event.job_name is not None
        outcomes = [record_described_job(event.run_id, event.job_name, **common)]
    measured = [(o.instance_type, o.tokens_per_s) for o in outcomes if o.tokens_per_s is not None and o.instance_type]
    if measured:  # one instance type: a training job's, or the tuning job's (one search target)
        metrics.add_dimension(name="InstanceType", value=str(measured[0][0]))
        for _, tokens_per_s in measured:
            metrics.add_metric(name="TokensPerSecond", unit=MetricUnit.CountPerSecond, value=tokens_per_s)
    for outcome in outcomes:
        if outcome.stopped_jobs:
            logger.warning(
                "budget guard stopped running jobs",
                extra={"stopped": outcome.stopped_jobs, "spend_usd": outcome.measured_spend_usd},
            )
        logger.info("job result recorded", extra=outcome.model_dump(mode="json", exclude={"stopped_jobs"}))
    if event.tuning_job_name is not None:
        return {"run_id": event.run_id, "tuning_job_name": event.tuning_job_name,
                "trials": [o.model_dump(mode="json") for o in outcomes]}  # fmt: skip
    return outcomes[0].model_dump(mode="json")
