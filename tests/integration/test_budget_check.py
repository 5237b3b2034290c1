"""The scheduled budget check (lambdas/budget_guard) against moto: a run whose one long job has not ended is stopped
once its projected spend crosses the budget.

moto's SageMaker has no StopTrainingJob: a botocore Stubber on the handlers' SageMaker client takes the stop and
fails the test on any call it was not told to expect."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber
from pydantic import ValidationError

from gpuscout.store.base import JobStatus, RunStatus
from lambdas.budget_guard import handler as budget_guard_handler
from lambdas.job_events import handler as job_events_handler
from lambdas.plan_jobs import handler as plan_handler
from lambdas.run_role import handler as run_role_handler
from lambdas.validate_manifest import handler as validate_handler
from tests.integration.cloud_world import REGION, Cloud, cloud_manifest, job_event, load_event, metric_directives


def _emitted(output: str, metric: str) -> list[float]:
    """The value of every CloudWatch embedded-metric-format record of ``metric`` a handler printed."""
    found = []
    for record, directive in metric_directives(output):
        if any(m["Name"] == metric for m in directive["Metrics"]):
            values = record[metric] if isinstance(record[metric], list) else [record[metric]]
            found.append(float(sum(values)))
    return found


def _started_hours_ago(cloud: Cloud, hours: float) -> tuple[str, str, float]:
    """A planned run ($50 budget) whose p4d job (on-demand price in its spec) has trained for ``hours`` by its
    SageMaker transitions, recorded by job_events; (run id, job name, price per hour)."""
    validated = validate_handler.handler(cloud.submit(cloud_manifest(budget=50.0)), cloud.context)
    planned: dict[str, Any] = plan_handler.handler(validated, cloud.context)
    run_id = planned["run_id"]
    name = sorted(j["job_name"] for j in cloud.items(planned) if "p4d" in j["job_name"])[0]
    # a long job: its MaxRuntime allows the hours it trains (the 30-step smoke plan's is 30 minutes, beyond which
    # SageMaker would have stopped it and the projection stops counting)
    store = cloud.services.store
    planned_row = store.get_job(run_id, name)
    assert planned_row is not None
    longer = planned_row.spec.model_copy(update={"max_runtime_seconds": 5 * 86400})
    store.put_job(planned_row.model_copy(update={"spec": longer}))
    event = job_event("training_inprogress_training", run_id=run_id, job_name=name, instance_type="ml.p4d.24xlarge")
    start = datetime.now(UTC) - timedelta(hours=hours)
    millis = [int((start + timedelta(minutes=m)).timestamp() * 1000) for m in (0, 2, 5)]
    steps = event["detail"]["SecondaryStatusTransitions"]
    for index, (transition, at) in enumerate(zip(steps, millis, strict=True)):
        transition["StartTime"] = at  # each ends where the next starts (the last one is the job's current status)
        transition.pop("EndTime", None)
        if index + 1 < len(millis):
            transition["EndTime"] = millis[index + 1]
    event["detail"]["LastModifiedTime"] = millis[-1]
    with Stubber(cloud.services.sagemaker):  # a live job's event stops nothing: any SageMaker call fails the stub
        out = job_events_handler.handler(event, cloud.context)
    assert out["applied"] is True and out["stopped_jobs"] == []
    row = cloud.services.store.get_job(run_id, name)
    assert row is not None and row.status is JobStatus.TRAINING and row.billable_seconds is None
    return run_id, name, row.spec.price_per_hour_usd


def test_the_scheduled_check_stops_a_long_job_over_budget_once(
    cloud: Cloud, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a RUNNING run whose p4d job has trained for 3 h (over $100 at the on-demand price) against a $50 budget,
    # which job_events' guard never saw: no job of the run has ended, so its measured spend is $0
    run_id, name, price = _started_hours_ago(cloud, hours=3)
    assert 3 * price > 50.0
    store = cloud.services.store
    assert store.get_run(run_id).status is RunStatus.RUNNING
    capsys.readouterr()
    # When EventBridge's schedule invokes the budget check
    with Stubber(cloud.services.sagemaker) as stub:
        stub.add_response("stop_training_job", {}, {"TrainingJobName": name})
        out = budget_guard_handler.handler(load_event("scheduled_event"), cloud.context)
        stub.assert_no_pending_responses()
    # Then the long job was stopped (the run's other jobs have not started) and the run is STOPPED, saying why
    [checked] = out["runs"]
    assert checked["run_id"] == run_id and checked["over_budget"] is True and checked["stopped_jobs"] == [name]
    assert checked["budget_usd"] == 50.0 and checked["projected_spend_usd"] == pytest.approx(
        (3 - 2 / 60) * price, rel=0.01
    )  # a spot target: its first 2 minutes in "Starting" (waiting for capacity) are not counted
    run = store.get_run(run_id)
    assert run.status is RunStatus.STOPPED
    assert run.error is not None and run.error.startswith("budget guard: spend projected to ")
    assert "over the budget of $50.00; stopped 1 running job(s)" in run.error
    # and RunsStoppedOverBudget counted it
    assert _emitted(capsys.readouterr().out, "RunsStoppedOverBudget") == [1.0]
    # When the next check runs (the job's Stopped event has not come yet: its row still says TRAINING)
    with Stubber(cloud.services.sagemaker):  # nothing may be stopped again
        again = budget_guard_handler.handler(load_event("scheduled_event"), cloud.context)
    # Then it stops nothing new and counts no run
    assert again["runs"] == [] and store.get_run(run_id).error == run.error
    assert _emitted(capsys.readouterr().out, "RunsStoppedOverBudget") == [0.0]


def test_the_scheduled_check_leaves_a_run_under_budget_alone(cloud: Cloud) -> None:
    # Given a RUNNING run whose p4d job has trained for 10 minutes (a few dollars of its $50)
    run_id, _, price = _started_hours_ago(cloud, hours=1 / 6)
    # When the check runs, Then it stops nothing (the stub fails on any call) and the run goes on
    with Stubber(cloud.services.sagemaker):
        out = budget_guard_handler.handler(load_event("scheduled_event"), cloud.context)
    [checked] = out["runs"]
    assert checked["over_budget"] is False and checked["stopped_jobs"] == []
    assert checked["projected_spend_usd"] == pytest.approx(price * 8 / 60, rel=0.05)  # 10 min, less 2 spot Starting
    assert cloud.services.store.get_run(run_id).status is RunStatus.RUNNING


def test_the_budget_check_takes_only_scheduled_events(cloud: Cloud) -> None:
    with pytest.raises(ValidationError):
        budget_guard_handler.handler(load_event("training_inprogress_training"), cloud.context)


def test_a_job_that_starts_after_its_run_was_stopped_is_stopped_when_it_is_seen(cloud: Cloud) -> None:
    # Given a run the budget guard stopped while one of its launches was still waiting (a quota retry)
    validated = validate_handler.handler(cloud.submit(cloud_manifest(budget=50.0)), cloud.context)
    planned: dict[str, Any] = plan_handler.handler(validated, cloud.context)
    run_id = planned["run_id"]
    store = cloud.services.store
    store.update_run(run_id, status=RunStatus.STOPPED, error="budget guard: over budget")
    name = sorted(j["job_name"] for j in cloud.items(planned))[0]
    # When that job's first event arrives (the launch went through once the stop freed the quota)
    event = job_event("training_inprogress_training", run_id=run_id, job_name=name)
    with Stubber(cloud.services.sagemaker) as stub:
        stub.add_response("stop_training_job", {}, {"TrainingJobName": name})
        out = job_events_handler.handler(event, cloud.context)
        stub.assert_no_pending_responses()
    # Then it is stopped (nothing else would: the scheduled check reads RUNNING runs only) and the run stays STOPPED
    assert out["applied"] is True and out["stopped_jobs"] == [name]
    assert store.get_run(run_id).status is RunStatus.STOPPED


def test_the_scheduled_check_deletes_the_role_a_run_left_behind(cloud: Cloud) -> None:
    # Given a run that ended over an hour ago whose "Delete run role" step failed: its role is still there
    run_id, _, _ = _started_hours_ago(cloud, hours=3)
    created = run_role_handler.handler({"run_id": run_id, "action": "create"}, cloud.context)
    store = cloud.services.store
    store.put_run(
        store.get_run(run_id).model_copy(
            update={"status": RunStatus.SUCCEEDED, "updated_at": datetime.now(UTC) - timedelta(hours=2)}
        )
    )
    iam = boto3.client("iam", region_name=REGION)
    assert [r["Arn"] for r in iam.list_roles(PathPrefix="/gpuscout/")["Roles"]] == [created["role_arn"]]
    # When EventBridge's schedule invokes the budget check
    out = budget_guard_handler.handler(load_event("scheduled_event"), cloud.context)
    # Then the run's role is gone, and the check says so
    assert out["swept_run_roles"] == [run_id] and out["runs"] == []
    assert iam.list_roles(PathPrefix="/gpuscout/")["Roles"] == []
