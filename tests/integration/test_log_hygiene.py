"""Issue 6, security: what the Lambdas log carries no credentials and no presigned URLs.

Every handler runs the whole flow against moto with distinctive fake credentials; every log record the handlers
emit (message and structured extras, plus anything written to stdout/stderr) is searched for the secrets and for
signed-URL query parameters.
"""

from __future__ import annotations

import logging
import re

import pytest

from gpuscout.cloud.step_errors import ManifestRejected
from lambdas.analyze_run import handler as analyze_handler
from lambdas.budget_guard import handler as budget_guard_handler
from lambdas.job_events import handler as job_events_handler
from lambdas.plan_jobs import handler as plan_handler
from lambdas.record_job_failure import handler as failure_handler
from lambdas.validate_manifest import handler as validate_handler
from tests.integration.cloud_world import Cloud, benchmark_for, cloud_manifest, job_event, load_event, raise_refusal

SECRET_KEY = "gpuscoutFAKEsecretKEY0123456789abcdefWXYZ"
SESSION_TOKEN = "gpuscoutFAKEsessionTOKEN/abc+def=="
# Query parameters of SigV4 and SigV2 presigned URLs.
SIGNED_URL = re.compile(r"X-Amz-(Signature|Credential|Security-Token)|[?&]Signature=|AWSAccessKeyId=")


def test_handler_logs_hold_no_credentials_or_presigned_urls(
    cloud: Cloud,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)  # the handlers' level in Lambda (POWERTOOLS_LOG_LEVEL defaults to INFO)
    # Given distinctive credentials in the Lambda environment,
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_SESSION_TOKEN", SESSION_TOKEN)

    # when every handler runs: a rejected manifest, a plan, job events up to a stored benchmark, a caught
    # failure, a scheduled budget check and the analysis,
    with pytest.raises(ManifestRejected):
        raise_refusal(validate_handler.handler(cloud.submit("name: x\nsequence_length: -1\n", "broken"), cloud.context))
    validated = validate_handler.handler(cloud.submit(cloud_manifest()), cloud.context)
    planned = plan_handler.handler(validated, cloud.context)
    run_id = planned["run_id"]
    first, second = (job["job_name"] for job in cloud.items(planned)[:2])
    job_events_handler.handler(job_event("training_inprogress_training", run_id=run_id, job_name=first), cloud.context)
    cloud.upload_benchmark(run_id, first, benchmark_for(first, run_id, "ml.g5.8xlarge"))
    job_events_handler.handler(job_event("training_completed", run_id=run_id, job_name=first), cloud.context)
    error = {"Error": "SageMaker.ResourceLimitExceededException", "Cause": "account quota for ml.p4d.24xlarge"}
    failure_handler.handler({"run_id": run_id, "job_name": second, "error": error}, cloud.context)
    budget_guard_handler.handler(load_event("scheduled_event"), cloud.context)
    analyze_handler.handler({"run_id": run_id}, cloud.context)

    captured = capfd.readouterr()
    logs = captured.out + captured.err + "\n".join(repr(vars(record)) for record in caplog.records)

    # then the handlers' log records were seen (so this search looks at real output) ...
    messages = {record.getMessage() for record in caplog.records}
    assert {"manifest valid", "job event processed", "job failed", "budget check done", "run analyzed"} <= messages
    # ... and hold neither the credentials nor any presigned URL.
    assert SECRET_KEY not in logs
    assert SESSION_TOKEN not in logs
    assert not SIGNED_URL.search(logs), SIGNED_URL.search(logs)
