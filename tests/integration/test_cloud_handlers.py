"""The Lambda handlers against moto: validate, plan, job events (+ budget guard), job failures, analyze."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from gpuscout.analysis.pricing import PRICE_LIST_REGION
from gpuscout.cloud import control_plane, plan_step
from gpuscout.cloud.contract import ValidatedManifest
from gpuscout.cloud.step_errors import CloudStepError, ManifestRejected, PlanRefused
from gpuscout.errors import RunNotFoundError
from gpuscout.store.base import JobStatus, RunStatus
from lambdas.analyze_run import handler as analyze_handler
from lambdas.job_events import handler as job_events_handler
from lambdas.mark_run_failed import handler as mark_failed_handler
from lambdas.plan_jobs import handler as plan_handler
from lambdas.record_job_failure import handler as failure_handler
from lambdas.run_role import handler as run_role_handler
from lambdas.validate_manifest import handler as validate_handler
from tests.integration.cloud_world import (
    ARTIFACTS_BUCKET,
    DATA_BUCKET,
    IMAGE_URI,
    QUOTAS,
    REGION,
    Cloud,
    benchmark_for,
    cloud_manifest,
    job_event,
    load_event,
    metric_directives,
    raise_refusal,
    run_role_arn,
    wide_manifest,
)
from tests.unit.test_pricing import _expected_params, _product

BAD_MANIFEST = """\
name: Bad Name
model:
  preset: qwen2-tiny
dataset:
  source: bundled:no-such-data
sequence_length: 256
training:
  max_steps: 30
targets:
  - instance_type: ml.g5.8xlarge
variants:
  - name: b4
    per_device_batch_sise: 4
constraints:
  budget_usd: 10
"""


def _validate_and_plan(cloud: Cloud, text: str, name: str = "cloud-smoke") -> dict[str, Any]:
    validated = validate_handler.handler(cloud.submit(text, name), cloud.context)
    planned: dict[str, Any] = plan_handler.handler(validated, cloud.context)
    return planned


def test_valid_manifest_passes_validation(cloud: Cloud) -> None:
    execution_input = cloud.submit(cloud_manifest())
    result = validate_handler.handler(execution_input, cloud.context)
    assert result["run_id"].startswith("cloud-smoke-")
    assert (result["bucket"], result["key"]) == (DATA_BUCKET, "manifests/cloud-smoke.yaml")
    assert result["manifest"]["name"] == "cloud-smoke"
    assert [t["instance_type"] for t in result["manifest"]["targets"]] == ["ml.g5.8xlarge", "ml.p4d.24xlarge"]
    with pytest.raises(RunNotFoundError):  # validation alone writes no run
        cloud.services.store.get_run(result["run_id"])


def test_invalid_manifest_is_rejected_with_every_problem(cloud: Cloud) -> None:
    execution_input = cloud.submit(BAD_MANIFEST, "bad")
    with pytest.raises(ManifestRejected) as info:
        raise_refusal(validate_handler.handler(execution_input, cloud.context))
    message = str(info.value)
    assert "s3://gpuscout-data-123456789012/manifests/bad.yaml is invalid" in message
    report = json.loads(cloud.s3.get_object(Bucket=DATA_BUCKET, Key="rejected/bad.error.json")["Body"].read())
    paths = {p["path"] for p in report["problems"]}
    assert {"name", "dataset.source", "variants[0].per_device_batch_sise"} <= paths
    for path in ("dataset.source", "variants[0].per_device_batch_sise"):
        assert path in message
    [run] = cloud.services.store.list_runs()
    assert run.status is RunStatus.REJECTED
    assert run.run_id == report["run_id"]
    assert {p["path"] for p in run.problems} == paths
    assert cloud.services.store.list_jobs(run.run_id) == []


def test_a_zero_training_quota_of_a_target_or_the_canary_type_is_rejected_at_validate(cloud: Cloud) -> None:
    # Given a new account: the spot training quota of the p4d target (spot: true) is 0
    QUOTAS["ml.p4d.24xlarge for spot training job usage"] = 0.0
    # When the manifest is validated
    with pytest.raises(ManifestRejected) as info:
        raise_refusal(validate_handler.handler(cloud.submit(cloud_manifest()), cloud.context))
    # Then it is rejected naming the quota, its code and where to raise it, and the run row says so
    message = " ".join(str(info.value).split())
    assert (
        "targets[1] ml.p4d.24xlarge (spot): the account's quota 'ml.p4d.24xlarge for spot training job usage' (L-"
        in (message)
    )
    assert "is 0 in us-east-1" in message and "servicequotas/home/services/sagemaker/quotas/L-" in message
    [run] = cloud.services.store.list_runs()
    assert run.status is RunStatus.REJECTED and [p["path"] for p in run.problems] == ["targets[1]"]
    # and with the quotas raised, a quota smaller than the run's concurrency is only a warning in the output
    QUOTAS.clear()
    result = validate_handler.handler(cloud.submit(cloud_manifest(name="second"), "second"), cloud.context)
    assert result["quota_warnings"] == []


def test_instance_types_the_stack_does_not_allow_are_rejected(cloud: Cloud) -> None:
    text = cloud_manifest().replace("ml.g5.8xlarge", "ml.p4de.24xlarge")
    with pytest.raises(ManifestRejected, match=r"targets\[0\]\.instance_type: ml\.p4de\.24xlarge is not allowed"):
        raise_refusal(validate_handler.handler(cloud.submit(text), cloud.context))


def test_an_mlflow_server_the_jobs_role_may_not_reach_is_rejected(cloud: Cloud) -> None:
    # Given a deployment that names no tracking server (cdk.json's default: the jobs' role has no MLflow grant)
    server = f"arn:aws:sagemaker:{REGION}:123456789012:mlflow-tracking-server/team"
    text = cloud_manifest() + f"tracking:\n  mlflow:\n    tracking_uri: {server}\n"
    # When a manifest logs to a SageMaker managed server, Then it is refused before any job, saying how to grant it
    with pytest.raises(ManifestRejected, match=r"tracking\.mlflow\.tracking_uri: .*'team'.*mlflow_tracking_servers"):
        raise_refusal(validate_handler.handler(cloud.submit(text, "mlflow"), cloud.context))


def test_sources_the_sagemaker_role_cannot_read_are_rejected(cloud: Cloud) -> None:
    # Given a manifest whose dataset lives in another bucket (the role reads only raw/ of the data bucket)
    text = cloud_manifest().replace("bundled:hebrew-bible", "s3://someone-elses-bucket/datasets/he/")
    assert "someone-elses-bucket" in text
    # When it is validated, Then it is rejected with the copy command, before any job row exists
    with pytest.raises(ManifestRejected, match=rf"dataset.source: .*s3://{DATA_BUCKET}/raw/he/"):
        raise_refusal(validate_handler.handler(cloud.submit(text, "elsewhere"), cloud.context))
    ok = cloud_manifest().replace("bundled:hebrew-bible", f"s3://{DATA_BUCKET}/raw/he/")
    assert validate_handler.handler(cloud.submit(ok, "raw-ok"), cloud.context)["run_id"]


def test_plan_writes_rows_and_returns_complete_requests(cloud: Cloud) -> None:
    planned = _validate_and_plan(cloud, cloud_manifest())
    run_id = planned["run_id"]
    store = cloud.services.store
    run = store.get_run(run_id)
    assert run.status is RunStatus.PLANNED
    assert run.predicted_cost_usd == pytest.approx(planned["predicted_cost_usd"])
    jobs = store.list_jobs(run_id)
    assert len(jobs) == len(cloud.items(planned)) == 4  # 2 targets x 2 variants
    assert {j.status for j in jobs} == {JobStatus.PLANNED}
    assert sorted(j["job_name"] for j in cloud.items(planned)) == [j.job_name for j in jobs]

    assert planned["prepare"]["skip"] is False
    prep = planned["prepare"]["request"]
    assert prep["ProcessingResources"]["ClusterConfig"]["InstanceType"] == "ml.m5.xlarge"
    assert prep["AppSpecification"]["ImageUri"] == IMAGE_URI
    output = prep["ProcessingOutputConfig"]["Outputs"][0]["S3Output"]["S3Uri"]
    assert output.startswith(f"s3://{DATA_BUCKET}/processed/")

    for item in cloud.items(planned):
        request = item["request"]
        assert request["TrainingJobName"] == item["job_name"]
        assert request["RoleArn"] == run_role_arn(run_id)  # the run's own role (gpuscout.cloud.run_roles)
        assert request["AlgorithmSpecification"]["TrainingImage"] == IMAGE_URI
        assert request["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3Uri"] == output
        assert request["OutputDataConfig"]["S3OutputPath"] == f"s3://{ARTIFACTS_BUCKET}/output/{run_id}/"
        assert {"Key": "gpuscout:run-id", "Value": run_id} in request["Tags"]
        stopping = request["StoppingCondition"]
        if request["ResourceConfig"]["InstanceType"] == "ml.p4d.24xlarge":
            assert request["EnableManagedSpotTraining"] is True
            assert stopping["MaxWaitTimeInSeconds"] > stopping["MaxRuntimeInSeconds"]
            assert request["CheckpointConfig"]["S3Uri"] == (
                f"s3://{ARTIFACTS_BUCKET}/checkpoints/{run_id}/{item['job_name']}/"
            )
        else:
            assert request["EnableManagedSpotTraining"] is False
            assert "MaxWaitTimeInSeconds" not in stopping
        assert request["EnableNetworkIsolation"] is False  # the manifest did not ask for it


def test_network_isolation_when_the_manifest_asks(cloud: Cloud) -> None:
    # Given a manifest with network_isolation: true, every training job runs without outbound network access.
    manifest = cloud_manifest().replace("constraints:", "network_isolation: true\nconstraints:")
    planned = _validate_and_plan(cloud, manifest)
    assert cloud.items(planned)
    assert all(item["request"]["EnableNetworkIsolation"] is True for item in cloud.items(planned))


def test_prepare_is_skipped_when_the_processed_data_exists(cloud: Cloud) -> None:
    first = _validate_and_plan(cloud, cloud_manifest(), "first")
    prefix = first["prepare"]["request"]["ProcessingOutputConfig"]["Outputs"][0]["S3Output"]["S3Uri"]
    key = prefix.removeprefix(f"s3://{DATA_BUCKET}/") + "dataset.json"
    cloud.s3.put_object(Bucket=DATA_BUCKET, Key=key, Body=b"{}")
    second = _validate_and_plan(cloud, cloud_manifest(name="second"), "second")
    assert second["prepare"]["skip"] is True


def test_over_budget_plan_is_refused_and_launches_nothing(cloud: Cloud) -> None:
    validated = validate_handler.handler(cloud.submit(cloud_manifest(budget=0.01)), cloud.context)
    with pytest.raises(PlanRefused, match="exceeds the budget"):
        raise_refusal(plan_handler.handler(validated, cloud.context))
    run = cloud.services.store.get_run(validated["run_id"])
    assert run.status is RunStatus.REFUSED
    assert run.predicted_cost_usd is not None and run.predicted_cost_usd > 0.01
    assert cloud.services.store.list_jobs(run.run_id) == []


def test_the_same_object_delivered_twice_is_one_run(cloud: Cloud) -> None:
    execution_input = cloud.submit(cloud_manifest())
    first = plan_handler.handler(validate_handler.handler(execution_input, cloud.context), cloud.context)
    jobs_before = cloud.services.store.list_jobs(first["run_id"])
    again = validate_handler.handler(dict(execution_input), cloud.context)
    assert again["run_id"] == first["run_id"]
    with pytest.raises(PlanRefused, match="already planned"):
        raise_refusal(plan_handler.handler(again, cloud.context))
    assert len(cloud.services.store.list_runs()) == 1
    assert cloud.services.store.list_jobs(first["run_id"]) == jobs_before
    assert cloud.services.store.get_run(first["run_id"]).status is RunStatus.PLANNED


def test_two_manifests_at_once_are_two_isolated_runs(cloud: Cloud) -> None:
    a = _validate_and_plan(cloud, cloud_manifest(name="team-a"), "team-a")
    b = _validate_and_plan(cloud, cloud_manifest(name="team-b"), "team-b")
    assert a["run_id"] != b["run_id"]
    names_a = {j["job_name"] for j in cloud.items(a)}
    names_b = {j["job_name"] for j in cloud.items(b)}
    assert not names_a & names_b  # SageMaker job names are account-global
    store = cloud.services.store
    assert {j.job_name for j in store.list_jobs(a["run_id"])} == names_a
    assert {j.job_name for j in store.list_jobs(b["run_id"])} == names_b
    job = sorted(names_a)[0]
    event = job_event("training_inprogress_training", run_id=a["run_id"], job_name=job)
    job_events_handler.handler(event, cloud.context)
    assert {j.status for j in store.list_jobs(b["run_id"])} == {JobStatus.PLANNED}
    assert store.get_run(b["run_id"]).status is RunStatus.PLANNED
    assert store.get_run(a["run_id"]).status is RunStatus.RUNNING


def test_job_events_update_the_row_and_store_the_benchmark(cloud: Cloud) -> None:
    planned = _validate_and_plan(cloud, cloud_manifest())
    run_id = planned["run_id"]
    job = cloud.items(planned)[0]["job_name"]
    store = cloud.services.store
    events = {
        name: job_event(name, run_id=run_id, job_name=job)
        for name in ("training_inprogress_starting", "training_inprogress_training", "training_completed")
    }
    out = job_events_handler.handler(events["training_inprogress_starting"], cloud.context)
    assert out["applied"] is True
    assert store.get_job(run_id, job).status is JobStatus.STARTING  # type: ignore[union-attr]

    job_events_handler.handler(events["training_inprogress_training"], cloud.context)
    cloud.upload_benchmark(run_id, job, benchmark_for(job, run_id, "ml.g5.8xlarge"))
    out = job_events_handler.handler(events["training_completed"], cloud.context)
    assert out["applied"] is True
    assert out["tokens_per_s"] == pytest.approx(328841.74358751986)
    row = store.get_job(run_id, job)
    assert row is not None
    assert row.status is JobStatus.COMPLETED
    assert row.billable_seconds == 705
    assert row.training_seconds == 705
    assert [t["Status"] for t in row.secondary_status_transitions] == [
        "Starting",
        "Downloading",
        "Training",
        "Uploading",
        "Completed",
    ]
    assert row.benchmark is not None and row.benchmark.job_name == job

    # An event from another account (a bus that accepts them) changes nothing, whatever its job name says.
    foreign = copy.deepcopy(events["training_inprogress_starting"])
    foreign["account"] = "210987654321"
    before = store.get_job(run_id, job)
    out = job_events_handler.handler(foreign, cloud.context)
    assert out["applied"] is False and "not this stack's 123456789012" in out["ignored_reason"]
    assert store.get_job(run_id, job) == before

    # Re-delivered and stale events change nothing.
    assert job_events_handler.handler(events["training_completed"], cloud.context)["applied"] is False
    assert job_events_handler.handler(events["training_inprogress_training"], cloud.context)["applied"] is False
    assert store.get_job(run_id, job) == row


def _emitted_metrics(output: str) -> dict[str, set[tuple[str, ...]]]:
    """Metric name -> the dimension sets of the CloudWatch embedded-metric-format lines a handler printed."""
    found: dict[str, set[tuple[str, ...]]] = {}
    for _record, directive in metric_directives(output):
        for metric in directive["Metrics"]:
            for dimensions in directive["Dimensions"]:
                found.setdefault(metric["Name"], set()).add(tuple(sorted(dimensions)))
    return found


def test_job_events_emit_the_metrics_the_dashboard_graphs(
    cloud: Cloud, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from stacks.monitoring import DASHBOARD_DIMENSIONS, JOB_STATUSES

    monkeypatch.setenv("POWERTOOLS_SERVICE_NAME", "gpuscout")  # as the stack sets it
    planned = _validate_and_plan(cloud, cloud_manifest())
    run_id, job = planned["run_id"], cloud.items(planned)[0]["job_name"]
    capsys.readouterr()
    # Given a job that trains and completes with a benchmark
    job_events_handler.handler(job_event("training_inprogress_training", run_id=run_id, job_name=job), cloud.context)
    cloud.upload_benchmark(run_id, job, benchmark_for(job, run_id, "ml.g5.8xlarge"))
    job_events_handler.handler(job_event("training_completed", run_id=run_id, job_name=job), cloud.context)
    # Then every metric the dashboard graphs is emitted with exactly the dimensions it queries
    emitted = _emitted_metrics(capsys.readouterr().out)
    for name, dimensions in DASHBOARD_DIMENSIONS.items():
        assert emitted.get(name) == {tuple(sorted(dimensions))}, (name, emitted.get(name))
    statuses = {e["detail"]["TrainingJobStatus"] for e in (load_event("training_inprogress_training"),
                                                            load_event("training_completed"))}  # fmt: skip
    assert statuses <= set(JOB_STATUSES)


@pytest.mark.parametrize(
    ("fixture", "status"),
    [
        ("training_failed_oom", JobStatus.OOM),
        ("training_failed_capacity", JobStatus.CAPACITY),
        ("training_stopped", JobStatus.STOPPED),
    ],
)
def test_terminal_failures_are_classified(cloud: Cloud, fixture: str, status: JobStatus) -> None:
    planned = _validate_and_plan(cloud, cloud_manifest())
    run_id, job = planned["run_id"], cloud.items(planned)[0]["job_name"]
    job_events_handler.handler(job_event(fixture, run_id=run_id, job_name=job), cloud.context)
    row = cloud.services.store.get_job(run_id, job)
    assert row is not None
    assert row.status is status
    assert row.benchmark is None  # no output.tar.gz was uploaded
    if status is not JobStatus.STOPPED:
        assert row.failure_reason == load_event(fixture)["detail"]["FailureReason"]


def test_events_of_other_jobs_are_ignored(cloud: Cloud) -> None:
    event = load_event("training_inprogress_training")
    del event["detail"]["Tags"]["gpuscout:run-id"]
    out = job_events_handler.handler(event, cloud.context)
    assert out["applied"] is False
    assert out["run_id"] is None


@pytest.mark.parametrize(
    ("error", "cause", "status"),
    [
        (
            "SageMaker.ResourceLimitExceededException",
            "The account-level service limit 'ml.p4d.24xlarge for "
            "training job usage' is 0 Instances (ResourceLimitExceeded)",
            JobStatus.QUOTA,
        ),
        (
            "States.TaskFailed",
            json.dumps(
                {
                    "TrainingJobStatus": "Failed",
                    "FailureReason": "CapacityError: Unable to provision requested ML compute capacity.",
                    "LastModifiedTime": 1741860065000,
                }
            ),
            JobStatus.CAPACITY,
        ),
        (
            "States.TaskFailed",
            json.dumps({"TrainingJobStatus": "Failed", "FailureReason": "InsufficientCapacityError: no capacity"}),
            JobStatus.CAPACITY,
        ),
        ("States.TaskFailed", json.dumps({"FailureReason": "AlgorithmError: exit code 1"}), JobStatus.FAILED),
    ],
)
def test_caught_job_failures_are_classified_and_return_normally(
    cloud: Cloud, error: str, cause: str, status: JobStatus
) -> None:
    planned = _validate_and_plan(cloud, cloud_manifest())
    run_id, job = planned["run_id"], cloud.items(planned)[2]["job_name"]
    out = failure_handler.handler(
        {"run_id": run_id, "job_name": job, "error": {"Error": error, "Cause": cause}}, cloud.context
    )
    assert out == {"run_id": run_id, "job_name": job, "status": status.value, "applied": True}
    row = cloud.services.store.get_job(run_id, job)
    assert row is not None and row.status is status
    assert row.failure_reason is not None and row.failure_reason.startswith(error)


def test_sagemakers_own_failure_event_still_lands_after_the_catch(cloud: Cloud) -> None:
    planned = _validate_and_plan(cloud, cloud_manifest())
    run_id, job = planned["run_id"], cloud.items(planned)[0]["job_name"]
    event = job_event("training_failed_oom", run_id=run_id, job_name=job)
    cause = dict(event["detail"])
    failure_handler.handler(
        {"run_id": run_id, "job_name": job, "error": {"Error": "States.TaskFailed", "Cause": json.dumps(cause)}},
        cloud.context,
    )
    assert job_events_handler.handler(event, cloud.context)["applied"] is True
    row = cloud.services.store.get_job(run_id, job)
    assert row is not None and (row.status, row.billable_seconds) == (JobStatus.OOM, 230)


def test_budget_guard_stops_the_runs_remaining_jobs(cloud: Cloud) -> None:
    planned = _validate_and_plan(cloud, cloud_manifest(budget=50.0))
    run_id = planned["run_id"]
    g5 = [j["job_name"] for j in cloud.items(planned) if "g5" in j["job_name"]]
    p4d = [j["job_name"] for j in cloud.items(planned) if "p4d" in j["job_name"]]
    for name in g5:
        job_events_handler.handler(
            job_event("training_inprogress_training", run_id=run_id, job_name=name), cloud.context
        )
    # One p4d job bills 2 h (about $64 at the on-demand rate): the run crosses its $50 budget.
    finished = job_event("training_completed", run_id=run_id, job_name=p4d[0])
    finished["detail"]["BillableTimeInSeconds"] = 7200
    with Stubber(cloud.services.sagemaker) as stub:
        for name in sorted(g5):
            stub.add_response("stop_training_job", {}, {"TrainingJobName": name})
        out = job_events_handler.handler(finished, cloud.context)
        stub.assert_no_pending_responses()
    assert sorted(out["stopped_jobs"]) == sorted(g5)
    assert out["measured_spend_usd"] > 50.0
    run = cloud.services.store.get_run(run_id)
    assert run.status is RunStatus.STOPPED
    assert run.error is not None and "budget guard" in run.error


def test_budget_guard_leaves_a_run_under_budget_alone(cloud: Cloud) -> None:
    planned = _validate_and_plan(cloud, cloud_manifest(budget=50.0))
    run_id = planned["run_id"]
    names = [j["job_name"] for j in cloud.items(planned)]
    job_events_handler.handler(
        job_event("training_inprogress_training", run_id=run_id, job_name=names[1]), cloud.context
    )
    with Stubber(cloud.services.sagemaker):  # no stop expected: any call would fail the stub
        out = job_events_handler.handler(
            job_event("training_completed", run_id=run_id, job_name=names[0]), cloud.context
        )
    assert out["stopped_jobs"] == []
    assert cloud.services.store.get_run(run_id).status is RunStatus.RUNNING


def test_analyze_covers_completed_jobs_when_others_lacked_capacity(cloud: Cloud) -> None:
    planned = _validate_and_plan(cloud, cloud_manifest())
    run_id = planned["run_id"]
    jobs = {j["job_name"]: j["request"]["ResourceConfig"]["InstanceType"] for j in cloud.items(planned)}
    g5 = sorted(n for n, t in jobs.items() if t == "ml.g5.8xlarge")
    p4d = sorted(n for n, t in jobs.items() if t == "ml.p4d.24xlarge")
    for name in g5:
        cloud.upload_benchmark(run_id, name, benchmark_for(name, run_id, "ml.g5.8xlarge", "g5-12xl-bs4-ckpt-r0"))
        job_events_handler.handler(job_event("training_completed", run_id=run_id, job_name=name), cloud.context)
    failure_handler.handler(
        {
            "run_id": run_id,
            "job_name": p4d[0],
            "error": {"Error": "SageMaker.ResourceLimitExceededException", "Cause": "ResourceLimitExceeded"},
        },
        cloud.context,
    )
    job_events_handler.handler(job_event("training_failed_capacity", run_id=run_id, job_name=p4d[1]), cloud.context)

    out = analyze_handler.handler({"run_id": run_id}, cloud.context)
    assert out["run_id"] == run_id
    assert out["report_uri"] == f"s3://{DATA_BUCKET}/reports/{run_id}/"
    assert out["recommendation"]
    keys = {o["Key"] for o in cloud.s3.list_objects_v2(Bucket=DATA_BUCKET, Prefix=f"reports/{run_id}/")["Contents"]}
    assert {f"reports/{run_id}/report.md", f"reports/{run_id}/report.json"} <= keys
    result = cloud.services.store.get_result(run_id)
    assert result is not None and result.report_uri == out["report_uri"]
    analysed = {j["job_name"]: j for j in result.analysis.model_dump(mode="json")["jobs"]}
    statuses = {name: j["status"] for name, j in analysed.items()}
    assert statuses[p4d[0]] == "QUOTA"
    assert statuses[p4d[1]] == "CAPACITY"
    assert result.analysis.model_dump(mode="json")["recommendation"]["job_name"] in g5
    assert cloud.services.store.get_run(run_id).status is RunStatus.SUCCEEDED


def test_analyze_prices_with_todays_aws_list_price_and_falls_back_per_instance(cloud: Cloud) -> None:
    # Given a run with completed g5.8xlarge jobs and p4d jobs, and a Price List API that knows g5.8xlarge's price
    # but is refused for p4d,
    planned = _validate_and_plan(cloud, cloud_manifest())
    run_id = planned["run_id"]
    for item in cloud.items(planned):
        if item["request"]["ResourceConfig"]["InstanceType"] == "ml.g5.8xlarge":
            name = item["job_name"]
            cloud.upload_benchmark(run_id, name, benchmark_for(name, run_id, "ml.g5.8xlarge", "g5-12xl-bs4-ckpt-r0"))
            job_events_handler.handler(job_event("training_completed", run_id=run_id, job_name=name), cloud.context)
    client = boto3.client("pricing", region_name=PRICE_LIST_REGION)
    with Stubber(client) as stub:
        stub.add_response(
            "get_products",
            {"FormatVersion": "aws_v1", "PriceList": [_product("ml.g5.8xlarge", "2.9000000000")]},
            _expected_params("ml.g5.8xlarge"),
        )
        stub.add_client_error("get_products", "AccessDeniedException", "not authorized to perform pricing:GetProducts")
        # when the analyze step runs,
        control_plane.analyze(
            run_id,
            store=cloud.services.store,
            s3=cloud.s3,
            settings=cloud.services.settings,
            pricing_client=client,
        )
        stub.assert_no_pending_responses()
    # then the stored price snapshot has the list price where the API answered and the table price (with the
    # reason) where it did not, and the costs use them.
    result = cloud.services.store.get_result(run_id)
    assert result is not None
    assert result.price_snapshot is not None
    snapshot = result.price_snapshot.model_dump(mode="json")
    prices = snapshot["prices"]
    assert prices["ml.g5.8xlarge"]["on_demand_usd_per_hour"] == 2.9
    assert prices["ml.g5.8xlarge"]["on_demand_source"] == "aws-price-list"
    assert prices["ml.p4d.24xlarge"]["on_demand_source"].startswith("catalog")
    assert any("ml.p4d.24xlarge" in note and "AccessDenied" in note for note in snapshot["notes"])
    g5 = next(
        j
        for j in result.analysis.model_dump(mode="json")["jobs"]
        if j["instance_type"] == "ml.g5.8xlarge" and j["tokens_per_s"]
    )
    assert g5["usd_per_million_tokens"] == pytest.approx(2.9 / 3600 / g5["tokens_per_s"] * 1e6)


def _topic_inbox(monkeypatch: pytest.MonkeyPatch | None = None) -> tuple[Any, Any, str, str]:
    """A notification topic with an SQS queue subscribed to read what was sent: (sns, sqs, topic ARN, queue URL).
    With ``monkeypatch``, the Lambdas' settings name the topic (NOTIFICATION_TOPIC_ARN), read afresh."""
    from gpuscout.cloud.control_plane import services
    from gpuscout.cloud.settings import get_settings

    sns = boto3.client("sns", region_name="us-east-1")
    sqs = boto3.client("sqs", region_name="us-east-1")
    topic = sns.create_topic(Name="gpuscout-notifications")["TopicArn"]
    queue = sqs.create_queue(QueueName="inbox")["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=queue_arn)
    if monkeypatch is not None:
        monkeypatch.setenv("NOTIFICATION_TOPIC_ARN", topic)
        get_settings.cache_clear()
        services.cache_clear()
    return sns, sqs, topic, queue


def test_analyze_publishes_the_run_summary_to_the_topic(cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a stack with a notification topic (an SQS queue subscribed to read what was sent) and a finished run
    sns, sqs, topic, queue = _topic_inbox()
    settings = cloud.services.settings.model_copy(update={"notification_topic_arn": topic})
    planned = _validate_and_plan(cloud, cloud_manifest())
    run_id = planned["run_id"]
    job = cloud.items(planned)[0]["job_name"]
    job_events_handler.handler(job_event("training_completed", run_id=run_id, job_name=job), cloud.context)
    # When the run is analysed
    result = control_plane.analyze(run_id, store=cloud.services.store, s3=cloud.s3, settings=settings, sns=sns).dump()
    # Then one summary went to the topic: the run, its status, the recommendation and the report
    assert result["notified"] is True
    [message] = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10)["Messages"]
    body = json.loads(message["Body"])
    assert body["Subject"].startswith("gpuscout: run cloud-smoke ") and len(body["Subject"]) < 100
    assert run_id in body["Message"] and result["report_uri"] in body["Message"]
    assert result["recommendation"] in body["Message"]


def test_a_failed_publish_does_not_fail_the_analysis(cloud: Cloud) -> None:
    planned = _validate_and_plan(cloud, cloud_manifest())
    settings = cloud.services.settings.model_copy(
        update={"notification_topic_arn": "arn:aws:sns:us-east-1:123456789012:no-such-topic"}
    )
    sns = boto3.client("sns", region_name="us-east-1")
    result = control_plane.analyze(
        planned["run_id"], store=cloud.services.store, s3=cloud.s3, settings=settings, sns=sns
    ).dump()
    assert isinstance(result["notified"], str) and "cannot publish the run summary" in result["notified"]
    assert cloud.services.store.get_result(planned["run_id"]) is not None


def test_the_plans_state_stays_small_and_its_requests_go_to_s3(cloud: Cloud) -> None:
    from gpuscout.cloud.plan_items import MAX_ITEM_BYTES, item_size

    # Given a deployed stack's real-length ARNs (a CDK asset image URI) and 4 targets x 25 variants x 3 repetitions
    settings = cloud.services.settings.model_copy(
        update={
            "training_image_uri": "123456789012.dkr.ecr.ap-southeast-2.amazonaws.com/cdk-hnb659fds-container-assets-"
            "123456789012-ap-southeast-2:" + "f" * 64,
            "run_role_path": "/gpuscout/ap-southeast-2/GpuscoutProductionEuWest1/",
        }
    )
    text = wide_manifest(variants=25, repetitions=3)
    validated = validate_handler.handler(cloud.submit(text, "wide"), cloud.context)
    # When it is planned
    planned = plan_step.plan_jobs(
        ValidatedManifest.model_validate(validated), store=cloud.services.store, s3=cloud.s3, settings=settings
    ).dump()
    # Then the 300 requests are in S3, each one small enough to be a child workflow's input with room for its error,
    jobs = cloud.items(planned)
    assert len(jobs) == planned["plan"]["jobs"]["count"] == 300
    assert planned["plan"]["jobs"]["key"] == f"plans/{planned['run_id']}/jobs.json"
    assert max(item_size(item) for item in jobs) < MAX_ITEM_BYTES / 20
    # and what the state carries does not grow with the run (the processing request and where the lists are)
    size = len(json.dumps(planned, separators=(",", ":")).encode())
    assert size < 8 * 1024, size


def test_a_plan_over_the_request_limit_is_rejected_before_any_row(cloud: Cloud) -> None:
    # Given 4 targets x 26 variants x 10 repetitions = 1,040 jobs (the limit is 1,000 SageMaker jobs)
    with pytest.raises(ManifestRejected, match=r"4 x 26 x 10 = 1040 jobs; a cloud run takes at most 1000"):
        raise_refusal(
            validate_handler.handler(
                cloud.submit(wide_manifest(variants=26, repetitions=10), "too-wide"), cloud.context
            )
        )
    [run] = cloud.services.store.list_runs()
    assert run.status is RunStatus.REJECTED and cloud.services.store.list_jobs(run.run_id) == []


def test_the_request_limit_counts_the_canaries(with_canary: Cloud) -> None:
    # Given exactly 1,000 jobs (4 targets x 25 variants x 10 repetitions) of 8 batch sizes: 32 configurations,
    # each with its canary on the canary instance
    manifest = wide_manifest(variants=25, repetitions=10)
    # Then validation refuses the 1,032 SageMaker jobs, naming the canaries
    with pytest.raises(ManifestRejected, match=r"start 1032 SageMaker jobs \(1000 benchmark jobs and 32 canaries"):
        raise_refusal(validate_handler.handler(with_canary.submit(manifest, "canaried-wide"), with_canary.context))


def test_an_oversized_request_is_refused_before_any_job_row(cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given requests larger than a Distributed Map item may be (with room for the child's own state)
    monkeypatch.setattr(plan_step, "MAX_ITEM_BYTES", 1024)
    validated = validate_handler.handler(cloud.submit(cloud_manifest()), cloud.context)
    with pytest.raises(PlanRefused, match=r"request\(s\) exceed 1 KiB, what one Distributed Map item may be"):
        raise_refusal(plan_handler.handler(validated, cloud.context))
    run = cloud.services.store.get_run(validated["run_id"])
    assert run.status is RunStatus.REFUSED and cloud.services.store.list_jobs(run.run_id) == []
    # and nothing was written for the state machine to read
    listed = cloud.s3.list_objects_v2(Bucket=ARTIFACTS_BUCKET, Prefix="plans/")
    assert listed.get("KeyCount", 0) == 0


def test_two_plans_of_one_object_launch_once(cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the same manifest event delivered twice, both plans past the "already planned?" read at once
    validated = validate_handler.handler(cloud.submit(cloud_manifest()), cloud.context)
    store = cloud.services.store
    real_get_run = store.get_run

    def nothing_yet(run_id: str) -> Any:
        raise RunNotFoundError(run_id)

    monkeypatch.setattr(store, "get_run", nothing_yet)
    first = plan_step.plan_jobs(
        ValidatedManifest.model_validate(validated), store=store, s3=cloud.s3, settings=cloud.services.settings
    ).dump()
    # When the second one writes its run row, Then it is refused: exactly one execution launches jobs
    with pytest.raises(PlanRefused, match="planned concurrently"):
        plan_step.plan_jobs(
            ValidatedManifest.model_validate(validated), store=store, s3=cloud.s3, settings=cloud.services.settings
        )
    monkeypatch.setattr(store, "get_run", real_get_run)
    assert store.get_run(first["run_id"]).status is RunStatus.PLANNED


def test_a_run_the_budget_guard_stops_during_analysis_stays_stopped(
    cloud: Cloud, monkeypatch: pytest.MonkeyPatch
) -> None:
    planned = _validate_and_plan(cloud, cloud_manifest())
    run_id, job = planned["run_id"], cloud.items(planned)[0]["job_name"]
    store = cloud.services.store
    store.update_run(run_id, status=RunStatus.RUNNING)
    cloud.upload_benchmark(run_id, job, benchmark_for(job, run_id, "ml.g5.8xlarge"))
    job_events_handler.handler(job_event("training_completed", run_id=run_id, job_name=job), cloud.context)
    real_list_jobs = store.list_jobs

    def guard_fires_meanwhile(rid: str) -> Any:  # the analysis read the run as RUNNING; now the guard stops it
        store.update_run(rid, status=RunStatus.STOPPED, error="budget guard")
        return real_list_jobs(rid)

    monkeypatch.setattr(store, "list_jobs", guard_fires_meanwhile)
    control_plane.analyze(run_id, store=store, s3=cloud.s3, settings=cloud.services.settings)
    monkeypatch.setattr(store, "list_jobs", real_list_jobs)
    run = store.get_run(run_id)
    assert run.status is RunStatus.STOPPED and run.error == "budget guard"


# ----------------------------------------------------------------- failed executions leave no run open (item 8)


def _planned_by(cloud: Cloud, execution_arn: str, text: str | None = None) -> dict[str, Any]:
    validated = validate_handler.handler(cloud.submit(text or cloud_manifest()), cloud.context)
    planned: dict[str, Any] = plan_handler.handler({**validated, "execution_arn": execution_arn}, cloud.context)
    return planned


def test_a_timed_out_execution_marks_its_run_failed_once(cloud: Cloud) -> None:
    # Given the EventBridge event AWS sends when an execution times out (documented shape, tests/fixtures/events),
    event = load_event("sfn_execution_timed_out")
    execution_arn = event["detail"]["executionArn"]
    run_id = _planned_by(cloud, execution_arn)["run_id"]
    store = cloud.services.store
    assert store.get_run(run_id).execution_arn == execution_arn
    created = run_role_handler.handler({"run_id": run_id, "action": "create"}, cloud.context)  # "Create run role"
    iam = boto3.client("iam", region_name=REGION)
    assert [r["Arn"] for r in iam.list_roles(PathPrefix="/gpuscout/")["Roles"]] == [created["role_arn"]]
    # when mark_run_failed receives it, the run that execution planned ends FAILED with the reason, and the run's own
    # role is deleted (the run's jobs have ended with the execution)
    outcome = mark_failed_handler.handler(event, cloud.context)
    applied = {"run_id": run_id, "applied": True, "status": "FAILED", "ignored_reason": None, "role_deleted": True,
               "notified": False}  # fmt: skip
    assert outcome == {"runs": [applied]}  # (no topic in this stack: nothing to tell)
    assert iam.list_roles(PathPrefix="/gpuscout/")["Roles"] == []
    run = store.get_run(run_id)
    assert run.status is RunStatus.FAILED and run.error is not None and "TIMED_OUT" in run.error
    # and a second delivery changes nothing.
    again = mark_failed_handler.handler(event, cloud.context)
    assert again["runs"][0]["applied"] is False and store.get_run(run_id).updated_at == run.updated_at


@pytest.mark.parametrize("status", ["FAILED", "TIMED_OUT", "ABORTED"])
def test_a_run_that_ends_without_analysis_is_told_like_a_finished_one_once(
    cloud: Cloud, monkeypatch: pytest.MonkeyPatch, status: str
) -> None:
    # Given a stack with a notification topic (an SQS queue subscribed to read what was sent) and a planned run,
    _, sqs, _, queue = _topic_inbox(monkeypatch)
    event = load_event("sfn_execution_timed_out")
    event["detail"]["status"] = status
    run_id = _planned_by(cloud, event["detail"]["executionArn"])["run_id"]
    # When its execution ends that way (EventBridge), twice (a redelivery)
    [outcome] = mark_failed_handler.handler(event, cloud.context)["runs"]
    [again] = mark_failed_handler.handler(event, cloud.context)["runs"]
    # Then the run summary an analysed run gets was published once: the run, FAILED, why, and no recommendation
    assert outcome["applied"] is True and outcome["notified"] is True and again["applied"] is False
    [message] = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10)["Messages"]
    body = json.loads(message["Body"])
    assert body["Subject"] == "gpuscout: run cloud-smoke FAILED"
    assert f"Run {run_id} (cloud-smoke) finished: FAILED." in body["Message"]
    assert f"the workflow execution ended {status}" in body["Message"]
    assert control_plane.NOT_ANALYSED_RECOMMENDATION in body["Message"]
    assert "Jobs: 4 (4 planned)." in body["Message"]


def test_a_run_analysed_whose_report_was_not_published_is_told_what_its_analysis_found(
    cloud: Cloud, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a stack with a topic and a finished run whose report cannot be uploaded (the analysis is stored first)
    _, sqs, _, queue = _topic_inbox(monkeypatch)
    execution_arn = load_event("sfn_execution_timed_out")["detail"]["executionArn"]
    planned = _planned_by(cloud, execution_arn)
    run_id = planned["run_id"]
    job = cloud.items(planned)[0]["job_name"]
    job_events_handler.handler(job_event("training_completed", run_id=run_id, job_name=job), cloud.context)

    def refuse(self: control_plane.S3ReportSink, run_id: str, folder: Path) -> str:
        raise CloudStepError(f"cannot upload report.md to s3://{self.bucket}/reports/{run_id}/: AccessDenied")

    monkeypatch.setattr(control_plane.S3ReportSink, "publish", refuse)
    with pytest.raises(CloudStepError):
        analyze_handler.handler({"run_id": run_id}, cloud.context)
    result = cloud.services.store.get_result(run_id)
    assert result is not None and result.report_uri is None
    # When the state machine's Catch marks the run failed
    caught = {"run_id": run_id, "execution_arn": execution_arn,
              "error": {"Error": "CloudStepError", "Cause": "cannot upload report.md"}}  # fmt: skip
    [outcome] = mark_failed_handler.handler(caught, cloud.context)["runs"]
    # Then the summary says FAILED, why, and what the analysis recommended, and that no report was published
    assert outcome["applied"] is True and outcome["notified"] is True
    [message] = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10)["Messages"]
    body = json.loads(message["Body"])["Message"]
    assert "finished: FAILED." in body and "cannot upload report.md" in body
    assert result.analysis.recommendation.summary in body and control_plane.NOT_PUBLISHED_REPORT in body
    assert control_plane.NOT_ANALYSED_RECOMMENDATION not in body


def test_a_failed_execution_never_touches_a_run_it_did_not_plan_or_a_final_run(cloud: Cloud) -> None:
    store = cloud.services.store
    event = load_event("sfn_execution_timed_out")
    # A duplicate delivery's execution fails with PlanRefused: the run belongs to the first execution.
    run_id = _planned_by(cloud, "arn:aws:states:us-east-1:123456789012:execution:sm:first")["run_id"]
    assert mark_failed_handler.handler(event, cloud.context) == {"runs": []}
    assert store.get_run(run_id).status is RunStatus.PLANNED
    # A run that already concluded keeps its status.
    other = _planned_by(cloud, event["detail"]["executionArn"], cloud_manifest(name="done"))["run_id"]
    store.update_run(other, status=RunStatus.SUCCEEDED)
    [outcome] = mark_failed_handler.handler(event, cloud.context)["runs"]
    assert outcome["applied"] is False and store.get_run(other).status is RunStatus.SUCCEEDED
    # A SUCCEEDED or RUNNING status change is no failure.
    for status in ("SUCCEEDED", "RUNNING"):
        event["detail"]["status"] = status
        assert mark_failed_handler.handler(event, cloud.context) == {"runs": []}


def test_the_catch_payload_marks_the_run_failed_with_the_jobs_reason(cloud: Cloud) -> None:
    execution_arn = "arn:aws:states:us-east-1:123456789012:execution:sm:run"
    run_id = _planned_by(cloud, execution_arn)["run_id"]
    cause = json.dumps({"ProcessingJobStatus": "Failed", "FailureReason": "AlgorithmError: exit code 2"})
    caught = {"run_id": run_id, "execution_arn": execution_arn, "error": {"Error": "States.TaskFailed", "Cause": cause}}
    [outcome] = mark_failed_handler.handler(caught, cloud.context)["runs"]
    assert outcome["applied"] is True
    assert cloud.services.store.get_run(run_id).error == "States.TaskFailed: AlgorithmError: exit code 2"


@pytest.mark.parametrize("ended", [RunStatus.FAILED, RunStatus.REFUSED])
def test_the_same_manifest_uploaded_again_after_a_failed_run_is_planned_again(cloud: Cloud, ended: RunStatus) -> None:
    # Given a run that ended FAILED (or REFUSED),
    execution_input = cloud.submit(cloud_manifest())
    first = plan_handler.handler(validate_handler.handler(dict(execution_input), cloud.context), cloud.context)
    store = cloud.services.store
    store.update_run(first["run_id"], status=ended, error="data preparation failed")
    # when the same object arrives again, it is planned as a new attempt with its own rows and job names
    again = validate_handler.handler(dict(execution_input), cloud.context)
    second = plan_handler.handler(again, cloud.context)
    assert second["run_id"] == f"{first['run_id']}-r2"
    assert store.get_run(second["run_id"]).status is RunStatus.PLANNED
    first_names = {j["job_name"] for j in cloud.items(first)}
    second_names = {j["job_name"] for j in cloud.items(second)}
    assert len(second_names) == len(first_names) and not first_names & second_names  # SageMaker names are unique
    assert second["prepare"]["request"]["ProcessingJobName"] != first["prepare"]["request"]["ProcessingJobName"]
    assert {j.job_name for j in store.list_jobs(second["run_id"])} == second_names
    # the failed attempt stays as it was,
    assert store.get_run(first["run_id"]).status is ended
    assert {j.job_name for j in store.list_jobs(first["run_id"])} == first_names
    # and a duplicate delivery while the new attempt is planned is still refused.
    with pytest.raises(PlanRefused, match=r"already planned as run .*-r2"):
        raise_refusal(
            plan_handler.handler(validate_handler.handler(dict(execution_input), cloud.context), cloud.context)
        )


def test_jobs_are_ordered_so_the_map_interleaves_instance_types(cloud: Cloud) -> None:
    # Quotas are per instance type (often 1-2): the Map's first slots must not all wait on one type's quota.
    planned = _validate_and_plan(cloud, cloud_manifest())
    types = [job["request"]["ResourceConfig"]["InstanceType"] for job in cloud.items(planned)]
    assert types == ["ml.g5.8xlarge", "ml.p4d.24xlarge", "ml.g5.8xlarge", "ml.p4d.24xlarge"]
    assert {j["job_name"] for j in cloud.items(planned)} == {
        j.job_name for j in cloud.services.store.list_jobs(planned["run_id"])
    }


def test_a_manifest_too_large_to_carry_between_states_is_rejected_at_validation(
    cloud: Cloud, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a stack whose state could carry only 1 KiB of a parsed manifest (the real limit is 224 KiB: 256 KiB less
    # room for the run id, key, quota warnings and execution ARN)
    assert control_plane.MAX_PARSED_MANIFEST_BYTES == 224 * 1024
    monkeypatch.setattr(control_plane, "MAX_PARSED_MANIFEST_BYTES", 1024)
    # Then a manifest whose parsed form is larger is rejected with its size, before anything is planned
    with pytest.raises(ManifestRejected, match=r"the parsed manifest is \d+ KiB .*at most 1 KiB of it between states"):
        raise_refusal(validate_handler.handler(cloud.submit(cloud_manifest(), "big"), cloud.context))
    [run] = cloud.services.store.list_runs()
    assert run.status is RunStatus.REJECTED


def test_a_url_encoded_key_in_the_event_reads_the_manifest_under_its_real_key(cloud: Cloud) -> None:
    # Given a manifest uploaded as "manifests/my run.yaml" and an event that carries the key URL-encoded
    cloud.s3.put_object(Bucket=DATA_BUCKET, Key="manifests/my run.yaml", Body=cloud_manifest().encode())
    event = {"bucket": DATA_BUCKET, "key": "manifests/my+run.yaml"}
    # Then validation reads it under its real key, which the run id and the plan carry
    validated = validate_handler.handler(event, cloud.context)
    assert validated["key"] == "manifests/my run.yaml" and "refused" not in validated
    planned = plan_handler.handler(validated, cloud.context)
    assert (
        cloud.services.store.get_run(planned["run_id"]).manifest_source == f"s3://{DATA_BUCKET}/manifests/my run.yaml"
    )


def test_the_canaries_cost_is_in_the_predicted_cost_and_the_budget(with_canary: Cloud) -> None:
    from gpuscout.domain.catalog import load_catalog
    from gpuscout.domain.manifest_loader import parse_manifest
    from gpuscout.plan.canary import cloud_canaries, predicted_canary_cost_usd
    from gpuscout.plan.planner import plan

    # Given a manifest whose jobs alone fit its budget but whose jobs and canaries do not
    catalog = load_catalog()
    manifest = parse_manifest(cloud_manifest().encode(), "m.yaml", catalog)
    probe = plan(manifest, catalog, run_id="probe")
    jobs, jobs_cost = probe.jobs, probe.predicted_cost_usd
    canaries_cost = predicted_canary_cost_usd(cloud_canaries(jobs, manifest, catalog, "ml.g5.8xlarge"))
    assert canaries_cost > 0
    budget = round(jobs_cost + canaries_cost / 2, 2)
    validated = validate_handler.handler(with_canary.submit(cloud_manifest(budget=budget)), with_canary.context)
    # Then the plan is refused with the total, canaries counted, and nothing is written
    with pytest.raises(PlanRefused, match="exceeds the budget"):
        raise_refusal(plan_handler.handler(validated, with_canary.context))
    run = with_canary.services.store.get_run(validated["run_id"])
    assert run.status is RunStatus.REFUSED
    assert run.predicted_cost_usd == pytest.approx(jobs_cost + canaries_cost, rel=1e-6)
    # and with room for both it is planned, its predicted cost the same total
    ok = validate_handler.handler(
        with_canary.submit(cloud_manifest(budget=round(jobs_cost + canaries_cost + 1, 2)), "roomy"), with_canary.context
    )
    planned = plan_handler.handler(ok, with_canary.context)
    assert planned["predicted_cost_usd"] == pytest.approx(jobs_cost + canaries_cost, rel=1e-6)


def test_a_canarys_row_bills_its_spend_to_the_budget_guard_and_is_never_read_as_a_benchmark(with_canary: Cloud) -> None:
    # Given a planned run with canaries (their rows written by Plan)
    planned = _validate_and_plan(with_canary, cloud_manifest())
    run_id = planned["run_id"]
    store = with_canary.services.store
    canaries = [j for j in store.list_jobs(run_id) if j.is_canary]
    assert canaries and all(j.status is JobStatus.PLANNED and j.canary_for for j in canaries)
    canary = canaries[0]
    # When SageMaker reports the canary completed (705 billable seconds) with a benchmark.json in its output
    with_canary.upload_benchmark(run_id, canary.job_name, benchmark_for(canary.job_name, run_id, canary.instance_type))
    event = job_event("training_completed", run_id=run_id, job_name=canary.job_name)
    outcome = job_events_handler.handler(event, with_canary.context)
    # Then its row is COMPLETED with its billed time, its spend is the run's measured spend, and no benchmark was read
    row = store.get_job(run_id, canary.job_name)
    assert row is not None and row.status is JobStatus.COMPLETED and row.billable_seconds == 705
    assert row.benchmark is None and outcome["tokens_per_s"] is None
    price = canary.spec.price_per_hour_usd
    assert outcome["measured_spend_usd"] == pytest.approx(705 / 3600 * price * canary.instance_count)
    # and the analysis leaves it out
    result = control_plane.analyze(
        run_id, store=store, s3=with_canary.s3, settings=with_canary.services.settings
    ).dump()
    assert not any(
        a["job_name"] == canary.job_name for a in store.get_result(run_id).analysis.model_dump(mode="json")["jobs"]
    )
    assert result["run_id"] == run_id


def test_a_rejected_manifest_and_a_refused_plan_are_told_on_the_topic(
    cloud: Cloud, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a stack with a notification topic (an SQS queue subscribed to read what was sent)
    _, sqs, _, queue = _topic_inbox(monkeypatch)
    # When a broken manifest is dropped into the bucket, and a valid one over its budget
    rejected = validate_handler.handler(cloud.submit("name: broken\nsequence_length: -1\n", "broken"), cloud.context)
    validated = validate_handler.handler(cloud.submit(cloud_manifest(budget=0.01), "poor"), cloud.context)
    refused = plan_handler.handler(validated, cloud.context)
    # Then each is told, once, with its run id, what happened and why
    messages = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10)["Messages"]
    bodies = sorted((json.loads(m["Body"]) for m in messages), key=lambda b: b["Subject"])
    assert [b["Subject"] for b in bodies] == [
        f"gpuscout: run {rejected['run_id']} REJECTED",
        f"gpuscout: run {refused['run_id']} REFUSED",
    ]
    assert "the manifest was rejected; nothing was launched" in bodies[0]["Message"]
    assert "sequence_length" in bodies[0]["Message"]
    assert "the plan was refused" in bodies[1]["Message"] and "exceeds the budget" in bodies[1]["Message"]
