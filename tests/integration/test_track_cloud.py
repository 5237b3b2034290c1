"""`gpuscout track RUN_ID --stack-name`: a cloud run's results logged to its trackers from the user's machine.

The run is made the way production makes it: the manifest goes through the Validate and Plan handlers (moto), each
completed job's tracker is training/gpuscout_train/tracking.py's JobTracker configured from the planned request's own
GPUSCOUT_TRACKING variable (only W&B's folder moved from /opt/ml/output/data into the test's folder) and fed the
planned HyperParameters, its SM_OUTPUT_DATA_DIR is tarred into output.tar.gz where SageMaker puts it, the job events
and the Analyze handler store the analysis and upload the report. MLflow is MLflow's own tracking server over HTTP
in a child process (tests/mlflow_http_server.py); W&B is offline, read back record by record.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from typer.testing import CliRunner

from gpuscout.cli import app as cli
from gpuscout.cloud.sagemaker_requests import output_tar_key
from gpuscout.domain.benchmark import BenchmarkResult
from gpuscout.domain.tracking import JOB_NAME_TAG, LEVEL_TAG, MLFLOW_PARENT_TAG, RUN_ID_TAG, TRACKING_ENV, JobTracking
from lambdas.analyze_run import handler as analyze_handler
from lambdas.job_events import handler as job_events_handler
from lambdas.plan_jobs import handler as plan_handler
from lambdas.record_job_failure import handler as failure_handler
from lambdas.validate_manifest import handler as validate_handler
from tests import wandb_offline_reader as wb
from tests.integration.cloud_world import (
    ARTIFACTS_BUCKET,
    DATA_BUCKET,
    REGION,
    TABLE,
    Cloud,
    benchmark_for,
    cloud_manifest,
    job_event,
)
from tests.mlflow_http_server import mlflow_server

EXPERIMENT = "tracked-cloud"
STEPS = 3
runner = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as url:
        yield url


@pytest.fixture(autouse=True)
def _offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B's folders in the test's folder, nothing inherited that would send anything anywhere."""
    for name in ("MLFLOW_TRACKING_URI", "WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("CONFIG", "DATA", "CACHE"):
        monkeypatch.setenv(f"WANDB_{name}_DIR", str(tmp_path / f"wandb-{name.lower()}"))


def _deploy_stack() -> None:
    """The CloudFormation stack whose outputs `gpuscout --stack-name Gpuscout` reads (moto)."""
    outputs = {
        "DataBucketName": DATA_BUCKET,
        "ArtifactsBucketName": ARTIFACTS_BUCKET,
        "ResultsTableName": TABLE,
        "StateMachineArn": f"arn:aws:states:{REGION}:123456789012:stateMachine:Gpuscout",
    }
    template = {
        "Resources": {"Queue": {"Type": "AWS::SQS::Queue", "Properties": {"QueueName": "gpuscout-test"}}},
        "Outputs": {name: {"Value": value} for name, value in outputs.items()},
    }
    boto3.client("cloudformation", region_name=REGION).create_stack(
        StackName="Gpuscout", TemplateBody=json.dumps(template)
    )


def _plan(cloud: Cloud, text: str, name: str) -> dict[str, Any]:
    validated = validate_handler.handler(cloud.submit(text, name), cloud.context)
    planned: dict[str, Any] = plan_handler.handler(validated, cloud.context)
    return planned


def _run_tracked_job(cloud: Cloud, run_id: str, job: dict[str, Any], folder: Path) -> None:
    """One SageMaker job as far as tracking goes: its tracker (from its request's environment) logs the job's
    parameters, STEPS steps and the benchmark; SageMaker then tars SM_OUTPUT_DATA_DIR into output.tar.gz."""
    from gpuscout_train.tracking import JobTracker

    request = job["request"]
    config = JobTracking.model_validate_json(request["Environment"][TRACKING_ENV])
    assert config.wandb is not None and config.wandb.dir == "/opt/ml/output/data"
    data_dir = folder / job["job_name"] / "output" / "data"  # SM_OUTPUT_DATA_DIR
    data_dir.mkdir(parents=True)
    config = config.model_copy(update={"wandb": config.wandb.model_copy(update={"dir": str(data_dir)})})
    instance_type = request["ResourceConfig"]["InstanceType"]
    tracker = JobTracker(config)
    tracker.start({**request["HyperParameters"], "device": "cuda", "world_size": 4})
    for step in range(1, STEPS + 1):
        tracker.log_step(step, {"step": step, "loss": 4.0 / step, "tokens_per_s": 30000.0 + step})
    benchmark = benchmark_for(job["job_name"], run_id, instance_type, "g5-12xl-bs4-ckpt-r0")
    (data_dir / "benchmark.json").write_text(json.dumps(benchmark))
    tracker.finish(BenchmarkResult.model_validate(benchmark), data_dir / "benchmark.json")
    _process_exit()  # SageMaker tars the output after the job's process has ended
    tar_path = folder / job["job_name"] / "output.tar.gz"
    with tarfile.open(tar_path, "w:gz") as archive:
        for path in sorted(data_dir.rglob("*")):
            archive.add(path, arcname=path.relative_to(data_dir).as_posix(), recursive=False)
    cloud.s3.upload_file(str(tar_path), ARTIFACTS_BUCKET, output_tar_key(run_id, job["job_name"]))
    job_events_handler.handler(job_event("training_completed", run_id=run_id, job_name=job["job_name"]), cloud.context)


def _finished_run(cloud: Cloud, tmp_path: Path, tracking: str, name: str) -> tuple[str, list[str], list[str]]:
    """A cloud run through the handlers: the g5 jobs complete (tracked), the p4d jobs fail for capacity without
    output; analysed. Returns the run id and the g5 and p4d job names."""
    planned = _plan(cloud, cloud_manifest(name=name) + tracking, name)
    run_id = planned["run_id"]
    g5 = [j for j in cloud.items(planned) if j["request"]["ResourceConfig"]["InstanceType"] == "ml.g5.8xlarge"]
    p4d = sorted(j["job_name"] for j in cloud.items(planned) if j not in g5)
    for job in g5:
        if TRACKING_ENV in job["request"]["Environment"]:
            _run_tracked_job(cloud, run_id, job, tmp_path / "sagemaker")
        else:
            name = job["job_name"]
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
    analyze_handler.handler({"run_id": run_id}, cloud.context)
    return run_id, sorted(j["job_name"] for j in g5), p4d


def _process_exit() -> None:
    """What the end of a process does for W&B (its atexit hook): the service ends and every run file is complete.
    The trackers run inside this test process, so the test does it before it tars or reads their files."""
    import wandb

    wandb.teardown()


def _track(run_id: str, download_dir: Path) -> Any:
    done = runner.invoke(cli.app, ["track", run_id, "--stack-name", "Gpuscout", "--download-dir", str(download_dir)])
    _process_exit()  # the command's process ends here
    return done


@pytest.mark.slow(seconds=14)
def test_track_logs_a_cloud_run_to_its_mlflow_server_and_wandb_beside_its_jobs(
    cloud: Cloud, server: str, tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    # Given a finished cloud run whose manifest tracks with an MLflow server and W&B (offline), whose tracked jobs
    # logged themselves, and a deployed stack
    tracking = f"tracking:\n  mlflow:\n    tracking_uri: {server}\n    experiment: {EXPERIMENT}\n"
    tracking += "  wandb:\n    project: gpuscout-test\n"
    run_id, g5, p4d = _finished_run(cloud, tmp_path, tracking, "tracked")
    _deploy_stack()
    client = MlflowClient(tracking_uri=server)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None
    of_run = f"tags.`{RUN_ID_TAG}` = '{run_id}'"
    job_runs = client.search_runs([experiment.experiment_id], f"{of_run} and tags.`{LEVEL_TAG}` = 'job'")
    assert sorted(r.data.tags[JOB_NAME_TAG] for r in job_runs) == g5  # what the jobs logged, before track
    analysis = cloud.services.store.get_result(run_id)
    assert analysis is not None

    # When the user tracks the run
    download = tmp_path / "downloads"
    done = _track(run_id, download)

    # Then it says where everything went
    assert done.exit_code == 0, done.output
    assert f"MLflow: run {run_id} (2 job run(s) nested) in experiment '{EXPERIMENT}' at {server}" in done.stdout
    assert f"W&B: run {run_id}-analysis in project 'gpuscout-test', group {run_id}" in done.stdout
    assert f"W&B: 2 job run(s) extracted to {download / 'wandb'}; no W&B run from {', '.join(p4d)} (no output" in (
        done.stdout.replace("\n", "")
    )
    assert (download / run_id / "report.md").is_file()  # the report, downloaded as `gpuscout report` does

    # MLflow (over HTTP): the run's parent run with the ranked results, the report and the recommendation; the job
    # runs nested under it with their analysed figures
    (parent,) = client.search_runs([experiment.experiment_id], f"{of_run} and tags.`{LEVEL_TAG}` = 'run'")
    recommended = analysis.analysis.model_dump(mode="json")["recommendation"]["job_name"]
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["gpuscout.recommended_job"] == recommended
    best = next(j for j in analysis.analysis.model_dump(mode="json")["jobs"] if j["job_name"] == recommended)
    assert parent.data.metrics["best/tokens_per_s"] == pytest.approx(best["tokens_per_s"])
    assert parent.data.metrics["jobs"] == len(analysis.analysis.model_dump(mode="json")["jobs"])
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"ranked_results.json", "ranked_results.csv", "analysis.json", "report"} <= artifacts
    report_files = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert {"report/report.md", "report/report.html", "report/report.json"} <= report_files
    ranked = json.loads(
        Path(client.download_artifacts(parent.info.run_id, "ranked_results.json", str(tmp_path))).read_text()
    )
    assert [row["job_name"] for row in ranked if row["rank"] == 1] == [recommended]
    for job_run in client.search_runs([experiment.experiment_id], f"{of_run} and tags.`{LEVEL_TAG}` = 'job'"):
        assert job_run.data.tags[MLFLOW_PARENT_TAG] == parent.info.run_id
        assert "analysis/rank" in job_run.data.metrics
        assert [m.step for m in client.get_metric_history(job_run.info.run_id, "loss")] == list(range(1, STEPS + 1))

    # W&B: the jobs' offline runs (from their output.tar.gz, links left out) beside the run's analysis run, ready
    # for one `wandb sync`
    files = wb.run_files(download)
    assert len(files) == 3
    by_job: dict[str, list[Any]] = {}
    files_by_name: dict[str, Path] = {}
    for path in files:
        records = wb.read_records(path)
        name = wb.run_info(records).display_name.removesuffix("-analysis")  # the job's name, or the run's id
        by_job[name], files_by_name[name] = records, path
    assert sorted(by_job) == sorted([*g5, run_id])
    for name in g5:
        assert [row["loss"] for row in wb.history(by_job[name])] == pytest.approx([4.0 / s for s in range(1, 4)])
    analysis_run = by_job[run_id]
    (row,) = [row for row in wb.history(analysis_run) if "ranked_results/_type" in row]
    assert row["ranked_results/_type"] == "table-file" and row["ranked_results/nrows"] == len(
        analysis.analysis.model_dump(mode="json")["jobs"]
    )
    assert "report/report.md" in wb.saved_files(analysis_run)
    assert wb.summary(analysis_run)["best/tokens_per_s"] == pytest.approx(best["tokens_per_s"])
    # the jobs' archives hold wandb's links (`latest-run`, ...), which are not extracted: the links there are the
    # analysis run's, made by wandb (latest-run is its folder)
    with tarfile.open(tmp_path / "sagemaker" / g5[0] / "output.tar.gz") as archive:
        assert archive.getmember("wandb/latest-run").issym()
    for name in g5:
        assert not [p for p in files_by_name[name].parent.rglob("*") if p.is_symlink()]
    assert (download / "wandb" / "latest-run").resolve() == files_by_name[run_id].parent.resolve()

    # When tracked again, the same MLflow run is reused
    again = _track(run_id, download)
    assert again.exit_code == 0, again.output
    parents = client.search_runs([experiment.experiment_id], f"{of_run} and tags.`{LEVEL_TAG}` = 'run'")
    assert [r.info.run_id for r in parents] == [parent.info.run_id]


def test_track_refuses_a_run_without_tracking_or_without_an_analysis(cloud: Cloud, tmp_path: Path) -> None:
    # Given a finished cloud run whose manifest tracks nothing, and a deployed stack
    run_id, _, _ = _finished_run(cloud, tmp_path, "", "untracked")
    _deploy_stack()
    # When it is tracked: one message, exit 1, nothing downloaded
    done = _track(run_id, tmp_path / "downloads")
    assert done.exit_code == 1
    assert f"the manifest of run {run_id}" in done.stderr and "has no tracking section" in done.stderr
    assert not (tmp_path / "downloads").exists()

    # Given a run that has not been analysed yet
    planned = _plan(cloud, cloud_manifest(name="running") + "tracking:\n  wandb:\n    project: p\n", "running")
    done = _track(planned["run_id"], tmp_path / "downloads")
    assert done.exit_code == 1
    assert f"run {planned['run_id']} has no analysis yet (status PLANNED)" in done.stderr


@pytest.mark.slow(seconds=10)
def test_a_job_output_that_cannot_be_read_is_one_problem_and_the_rest_is_still_logged(
    cloud: Cloud, tmp_path: Path
) -> None:
    # Given a finished run tracked with W&B whose first job's output.tar.gz is damaged
    run_id, g5, _ = _finished_run(cloud, tmp_path, "tracking:\n  wandb:\n    project: gpuscout-test\n", "damaged")
    _deploy_stack()
    cloud.s3.put_object(Bucket=ARTIFACTS_BUCKET, Key=output_tar_key(run_id, g5[0]), Body=b"not a tar archive")
    # When the run is tracked
    download = tmp_path / "downloads"
    done = _track(run_id, download)
    # Then the damaged job is the one error (exit 1), and the other job's run and the analysis run are there
    assert done.exit_code == 1
    assert f"W&B: the runs of job {g5[0]} were not extracted (cannot read the W&B runs in" in done.stderr
    assert "W&B: 1 job run(s) extracted" in done.stdout
    assert f"tracking: W&B: run {run_id}-analysis" in done.stdout
    names = {wb.run_info(wb.read_records(f)).display_name for f in wb.run_files(download)}
    assert names == {g5[1], f"{run_id}-analysis"}
