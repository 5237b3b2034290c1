"""A run's results in its experiment trackers (gpuscout.analysis.tracking), offline: MLflow in a SQLite file with
job runs as train.py leaves them, W&B in offline mode (read back with tests/wandb_offline_reader.py)."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuscout.analysis.tracking import RANKED_COLUMNS, log_run, ranked_rows
from gpuscout.domain.manifest_search import TrackingSection
from gpuscout.domain.run_analysis import RunAnalysis
from gpuscout.domain.tracking import (
    JOB_NAME_TAG,
    LEVEL_TAG,
    MLFLOW_PARENT_TAG,
    PRESIGNED_UPLOAD_ENV,
    RUN_ID_TAG,
    Destinations,
    MlflowDestination,
    local_destinations,
    prepare_mlflow_uri,
)
from tests import wandb_offline_reader as wb
from tests.prepared_data import prepared_data

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "analysis" / "expected-example_run.json"
ANALYSIS: dict[str, Any] = json.loads(FIXTURE.read_text())
TAKEN_AT = "2026-11-21T12:00:00Z"  # the fixture leaves clock readings out (test_analysis_regression.py)


def _analysed(analysis: dict[str, Any]) -> RunAnalysis:
    """What log_run takes: the stored RESULT row's model."""
    return RunAnalysis.model_validate(
        {**analysis, "price_snapshot": {**analysis["price_snapshot"], "taken_at": TAKEN_AT}}
    )


ANALYSED = _analysed(ANALYSIS)
RUN_ID = ANALYSIS["run_id"]
RECOMMENDED = ANALYSIS["recommendation"]["job_name"]  # gs-g5-12xl-bs4-ckpt-r0, rank 1
REPEATED = "gs-p4d-bs8-r1"  # a repetition of the rank-2 settings, whose row is gs-p4d-bs8-r0
TRACKING = TrackingSection.model_validate({"mlflow": {"experiment": "example"}, "wandb": {"project": "gpuscout-test"}})


@pytest.fixture(autouse=True)
def _offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """W&B's folders in the test's folder, nothing inherited that would send anything anywhere."""
    for name in ("MLFLOW_TRACKING_URI", "WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("CONFIG", "DATA", "CACHE"):
        monkeypatch.setenv(f"WANDB_{name}_DIR", str(tmp_path / f"wandb-{name.lower()}"))
    yield


def _report(folder: Path) -> Path:
    """A report folder as write_report leaves it (the content does not matter here)."""
    folder.mkdir(parents=True)
    for name, text in {"report.md": "# report\n", "report.html": "<html></html>\n", "report.json": "{}\n"}.items():
        (folder / name).write_text(text)
    (folder / "cost.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    return folder


def _job_runs(uri: str, experiment: str, artifacts: str, names: dict[str, str]) -> dict[str, str]:
    """Job runs as training/gpuscout_train/tracking.py leaves them (tags; FINISHED, or RUNNING when the process was
    stopped): job name -> MLflow run id."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment_id = client.create_experiment(experiment, artifact_location=artifacts)
    ids = {}
    for name, status in names.items():
        tags = {RUN_ID_TAG: RUN_ID, JOB_NAME_TAG: name, LEVEL_TAG: "job"}
        run = client.create_run(experiment_id, run_name=name, tags=tags)
        if status != "RUNNING":
            client.set_terminated(run.info.run_id, status)
        ids[name] = run.info.run_id
    return ids


@pytest.mark.slow(seconds=11)
def test_the_run_logs_its_ranked_results_and_report_to_mlflow_and_wandb(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    # Given a run folder's trackers (the local defaults), two finished job runs and one its process left RUNNING
    runs = tmp_path / "runs"
    destinations = local_destinations(TRACKING, runs)
    assert destinations.mlflow is not None and destinations.mlflow.artifact_location is not None
    uri = destinations.mlflow.tracking_uri
    jobs = {RECOMMENDED: "FINISHED", REPEATED: "FINISHED", "gs-p5e-bs16-r0": "RUNNING"}
    ids = _job_runs(uri, "example", destinations.mlflow.artifact_location, jobs)
    report = _report(runs / RUN_ID / "report")
    # When the run's analysis is logged
    outcome = log_run(RUN_ID, ANALYSED, report, destinations)
    # Then both trackers have it, and say where
    assert outcome.problems == []
    assert [line.split(":")[0] for line in outcome.logged] == ["MLflow", "W&B"]

    # MLflow: the run's own run, with the recommended job's figures, the ranked table and the report
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("example")
    assert experiment is not None
    (parent,) = client.search_runs([experiment.experiment_id], f"tags.`{LEVEL_TAG}` = 'run'")
    assert parent.info.run_name == RUN_ID and parent.info.status == "FINISHED"
    assert parent.data.tags[RUN_ID_TAG] == RUN_ID and parent.data.tags["gpuscout.recommended_job"] == RECOMMENDED
    assert parent.data.tags["gpuscout.recommendation"] == ANALYSIS["recommendation"]["summary"]
    best = next(j for j in ANALYSIS["jobs"] if j["job_name"] == RECOMMENDED)
    assert parent.data.metrics["best/usd_per_million_tokens"] == pytest.approx(best["usd_per_million_tokens"])
    assert parent.data.metrics["best/tokens_per_s"] == pytest.approx(best["tokens_per_s"])
    assert parent.data.metrics["jobs"] == len(ANALYSIS["jobs"]) and parent.data.metrics["jobs_ranked"] == 5
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert artifacts == {"ranked_results.json", "ranked_results.csv", "analysis.json", "report"}
    in_report = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert in_report == {"report/report.md", "report/report.html", "report/report.json", "report/cost.png"}
    ranked_file = Path(client.download_artifacts(parent.info.run_id, "ranked_results.json", str(tmp_path / "dl")))
    ranked = json.loads(ranked_file.read_text())
    assert [r["rank"] for r in ranked[:5]] == [1, 2, 3, 4, 5] and ranked[0]["job_name"] == RECOMMENDED
    assert all(r["rank"] is None for r in ranked[5:]) and list(ranked[0]) == list(RANKED_COLUMNS)
    # the job runs: nested under it, with their analysed figures; the one left RUNNING ended KILLED
    for name, run_id in ids.items():
        job = client.get_run(run_id)
        assert job.data.tags[MLFLOW_PARENT_TAG] == parent.info.run_id, name
    assert client.get_run(ids[RECOMMENDED]).data.metrics["analysis/rank"] == 1
    assert client.get_run(ids[REPEATED]).data.metrics["analysis/rank"] == 2  # its settings' row
    assert "analysis/rank" not in client.get_run(ids["gs-p5e-bs16-r0"]).data.metrics  # CAPACITY: not ranked
    assert client.get_run(ids["gs-p5e-bs16-r0"]).info.status == "KILLED"
    assert client.get_run(ids[RECOMMENDED]).info.status == "FINISHED"

    # W&B: an analysis run in the run's group, with the ranked table, the summary, the files and the Artifact
    (run_file,) = wb.run_files(runs)
    records = wb.read_records(run_file)
    info = wb.run_info(records)
    assert (info.display_name, info.run_group, info.job_type) == (f"{RUN_ID}-analysis", RUN_ID, "analysis")
    assert wb.config(records)["objective"] == ANALYSIS["objective"]
    (row,) = wb.history(records)  # the table, as W&B logs one: a file of the run folder
    assert row["ranked_results/_type"] == "table-file" and row["ranked_results/nrows"] == len(ANALYSIS["jobs"])
    table = json.loads((run_file.parent / "files" / row["ranked_results/path"]).read_text())
    assert table["columns"] == list(RANKED_COLUMNS) and table["data"][0][1] == RECOMMENDED
    summary = wb.summary(records)
    assert summary["best/usd_per_million_tokens"] == pytest.approx(best["usd_per_million_tokens"])
    assert summary["verdict"] == ANALYSIS["recommendation"]["verdict"]
    report_files = {"report/report.md", "report/report.html", "report/report.json", "report/cost.png"}
    assert {"ranked_results.json", "ranked_results.csv", "analysis.json"} | report_files <= wb.saved_files(records)
    files = wb.artifact_files(records)[f"report-{RUN_ID}"]
    assert set(files) == {"ranked_results.json", "ranked_results.csv", "analysis.json"} | report_files

    # And logging the run again (e.g. after more jobs) updates the same MLflow run instead of adding one
    again = log_run(RUN_ID, ANALYSED, report, Destinations(mlflow=destinations.mlflow))
    assert again.problems == []
    assert len(client.search_runs([experiment.experiment_id], f"tags.`{LEVEL_TAG}` = 'run'")) == 1


def test_a_tracker_that_fails_is_reported_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given an MLflow server nobody listens on (no retries)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    tracking = TrackingSection.model_validate(
        {"mlflow": {"tracking_uri": f"http://127.0.0.1:{port}", "experiment": "x"}}
    )
    # When the run is logged, Then the failure is one problem line, not an exception
    outcome = log_run(RUN_ID, ANALYSED, None, local_destinations(tracking, tmp_path))
    assert outcome.logged == []
    (problem,) = outcome.problems
    assert problem.startswith("MLflow: the run's results were not logged (")


@pytest.mark.slow(seconds=10)
def test_an_http_server_that_keeps_artifacts_in_s3_gets_the_run_s_artifacts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import boto3
    from moto import mock_aws

    from tests.mlflow_http_server import mlflow_server

    # Given an MLflow server (over HTTP) whose artifact root is an S3 bucket the client writes to itself, and the
    # sagemaker-mlflow plugin installed (it handles every s3:// artifact location)
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(PRESIGNED_UPLOAD_ENV, raising=False)
    with mock_aws(), mlflow_server(tmp_path / "server", artifact_root="s3://team-mlflow") as url:
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="team-mlflow")
        # When the run is logged there
        destinations = Destinations(mlflow=MlflowDestination(tracking_uri=url, experiment="s3-artifacts"))
        outcome = log_run(RUN_ID, ANALYSED, _report(tmp_path / "report"), destinations)
        # Then the artifacts are in the bucket: the plugin's presigned upload (ARN servers only) stayed off
        assert outcome.problems == [], outcome.problems
        keys = {obj["Key"].split("/artifacts/", 1)[1] for obj in s3.list_objects_v2(Bucket="team-mlflow")["Contents"]}
        assert {"ranked_results.json", "analysis.json", "report/report.md"} <= keys
        assert PRESIGNED_UPLOAD_ENV not in os.environ


def test_presigned_uploads_are_turned_on_for_a_sagemaker_server_only(monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeMlflow:
        uri = ""

        def set_tracking_uri(self, uri: str) -> None:
            self.uri = uri

    monkeypatch.delenv(PRESIGNED_UPLOAD_ENV, raising=False)
    mlflow = FakeMlflow()
    prepare_mlflow_uri("https://mlflow.example.com", mlflow)
    assert PRESIGNED_UPLOAD_ENV not in os.environ and mlflow.uri == ""
    arn = "arn:aws:sagemaker:us-east-1:123456789012:mlflow-tracking-server/team"
    prepare_mlflow_uri(arn, mlflow)
    assert os.environ[PRESIGNED_UPLOAD_ENV] == "true" and mlflow.uri == arn


def test_ranked_rows_put_the_ranked_first_and_flatten_intervals_and_repetitions() -> None:
    rows = ranked_rows(ANALYSIS)
    assert [r["rank"] for r in rows] == [1, 2, 3, 4, 5, None, None, None]
    p4d = rows[1]
    assert p4d["job_names"] == "gs-p4d-bs8-r0 gs-p4d-bs8-r1 gs-p4d-bs8-r2"
    low, high = next(j for j in ANALYSIS["jobs"] if j["job_name"] == p4d["job_name"])["tokens_per_s_ci95"]
    assert (p4d["tokens_per_s_ci95_low"], p4d["tokens_per_s_ci95_high"]) == (low, high)


def test_gpuscout_local_hands_each_job_its_tracking_and_logs_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuscout import paths
    from gpuscout.domain.jobspec import JobSpec
    from gpuscout.domain.tracking import TRACKING_ENV, JobTracking
    from gpuscout.local import job_process
    from gpuscout.local import runner as local
    from gpuscout.local.job_process import JobFolders
    from gpuscout.local.observer import SilentObserver
    from gpuscout.store.base import JobStatus, RunStatus
    from gpuscout.store.sqlite import SqliteStore
    from gpuscout.workflow.ports import JobOutcome

    # Given the quickstart manifest with W&B tracking; data preparation and the jobs stood in for (each job
    # "completes" with a fixture benchmark and records the tracking variable it was given)
    manifest = tmp_path / "tracked.yaml"
    text = (paths.MANIFESTS_DIR / "quickstart.yaml").read_text()
    manifest.write_text(text + "tracking:\n  wandb: {project: gpuscout-test}\n")
    data = prepared_data(tmp_path / "data", tokenizer={"kind": "bpe", "vocab_size": 1024})
    monkeypatch.setattr(local, "prepare_data", lambda *_args, **_kw: data)
    fixture = json.loads((FIXTURE.parents[1] / "benchmarks" / "g5-2xl-bs4-ckpt-r0.json").read_text())
    given: dict[str, str | None] = {}

    def run_job(spec: JobSpec, folders: JobFolders, **_: object) -> JobOutcome:
        given[spec.job_name] = folders.environment(spec).get(TRACKING_ENV)
        benchmark = fixture | {"job_name": spec.job_name, "run_id": spec.run_id, "instance_type": "local"}
        return JobOutcome(JobStatus.COMPLETED, benchmark, None, 1.0)

    monkeypatch.setattr(job_process, "run_job", run_job)
    messages: list[str] = []

    class Observer(SilentObserver):
        def message(self, text: str, *, warning: bool = False) -> None:
            messages.append(text)

    # When the run runs
    runs = tmp_path / "runs"
    store = SqliteStore(tmp_path / "g.db")
    run = local.run_local(manifest, store=store, runs_dir=runs, observer=Observer(), canary=False)
    # Then every job was told to track W&B offline into the runs folder
    assert run.status is RunStatus.SUCCEEDED and len(given) == 3
    for value in given.values():
        assert value is not None
        tracking = JobTracking.model_validate_json(value)
        assert tracking.wandb is not None and tracking.wandb.dir == str(runs.resolve())
    # and the run's results went to W&B as the run's analysis run, which the run's messages say
    assert any(m.startswith(f"tracking: W&B: run {run.run_id}-analysis") for m in messages), messages
    (run_file,) = wb.run_files(runs)
    info = wb.run_info(wb.read_records(run_file))
    assert (info.run_group, info.job_type) == (run.run_id, "analysis")

    # When the user logs the run again (`gpuscout track`, e.g. after a tracker was unreachable at the end of the run)
    from typer.testing import CliRunner

    from gpuscout.cli.app import app

    done = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["track", run.run_id, "--db", str(tmp_path / "g.db")])
    # Then the same destinations get the results again: a second analysis run in the run's group
    assert done.exit_code == 0, done.output
    assert f"tracking: W&B: run {run.run_id}-analysis in project 'gpuscout-test'" in done.stdout
    files = wb.run_files(runs)
    assert len(files) == 2
    assert {wb.run_info(wb.read_records(f)).run_group for f in files} == {run.run_id}


@pytest.mark.slow(seconds=12)
def test_the_run_level_mlflow_run_has_the_settings_the_job_logs_and_why_a_trial_was_pruned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from mlflow import MlflowClient

    from gpuscout.analysis.tracking import RunExtras
    from gpuscout.local.closing import local_job_logs

    monkeypatch.delenv("WANDB_SILENT")  # as a user's shell has it: W&B's own progress lines are on
    # Given a local run folder: one job whose trial the search pruned, one whose log the run keeps, a fresh MLflow
    # database (MLflow prints its set-up) and W&B offline
    runs = tmp_path / "runs"
    run_dir = runs / RUN_ID
    destinations = local_destinations(TRACKING, runs)
    assert destinations.mlflow is not None and destinations.mlflow.artifact_location is not None
    uri = destinations.mlflow.tracking_uri
    pruned = "gs-p5-bs16-x2-r0"
    ids = _job_runs(uri, "example", destinations.mlflow.artifact_location, {RECOMMENDED: "FINISHED", pruned: "RUNNING"})
    why = "pruned by the settings search: pruned after 3 timed steps: 1,000 tokens/s ... is clearly worse"
    analysis = json.loads(json.dumps(ANALYSIS))
    for job in analysis["jobs"]:
        if job["job_name"] == pruned:
            job |= {"status": "pruned", "rank": None, "failure": why, "excluded_reason": why}
    job_folder = run_dir / "jobs" / RECOMMENDED
    job_folder.mkdir(parents=True)
    (job_folder / "train.log").write_text("gpuscout_metric step=1 loss=6.5\n")
    (job_folder / "train.stderr.log").write_text("")  # empty: not logged
    manifest = {"name": "example", "model": {"preset": "qwen2-tiny"}, "training": {"max_steps": 20, "seed": None},
                "targets": [{"instance_type": "local", "price_per_hour_usd": 0.096}],
                "variants": [{"name": "b4-a1", "per_device_batch_size": 4}, {"name": "b1-a4"}],
                "description": "x" * 7000}  # fmt: skip
    extras = RunExtras(settings=manifest, job_logs=local_job_logs(run_dir), output_log=run_dir / "tracking.log")
    capfd.readouterr()
    # When the run is logged
    outcome = log_run(RUN_ID, _analysed(analysis), _report(run_dir / "report"), destinations, extras)
    # Then the terminal got nothing from the tracker libraries: their lines are in the run's tracking.log
    printed = capfd.readouterr()
    assert (printed.out, printed.err) == ("", ""), printed
    assert outcome.problems == [] and (run_dir / "tracking.log").is_file()
    # the run-level MLflow run has the run's settings as params (nothing internal, nothing unset)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("example")
    assert experiment is not None
    (parent,) = client.search_runs([experiment.experiment_id], f"tags.`{LEVEL_TAG}` = 'run'")
    assert {k: v for k, v in parent.data.params.items() if k != "description"} == {
        "name": "example", "model.preset": "qwen2-tiny", "training.max_steps": "20",
        "targets.0.instance_type": "local", "targets.0.price_per_hour_usd": "0.096",
        "variants.b4-a1.per_device_batch_size": "4", "variants.b1-a4": "{}",
    }  # fmt: skip
    assert parent.data.params["description"] == "x" * 6000  # MLflow's limit
    # the pruned trial's run says why, and the kept log is an artifact of its job's run
    tags = client.get_run(ids[pruned]).data.tags
    assert tags["gpuscout.pruned_reason"] == why and tags["gpuscout.excluded_reason"] == why
    assert "gpuscout.pruned_reason" not in client.get_run(ids[RECOMMENDED]).data.tags
    assert [a.path for a in client.list_artifacts(ids[RECOMMENDED], "logs")] == ["logs/train.log"]
    # W&B: the same settings in the analysis run's config
    (run_file,) = wb.run_files(runs)
    settings = wb.config(wb.read_records(run_file))["settings"]
    assert settings["variants"][0] == {"name": "b4-a1", "per_device_batch_size": 4}


def test_what_a_library_prints_goes_to_the_log_however_it_prints(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import subprocess
    import sys

    from gpuscout.analysis.tracking import library_output_to

    log = tmp_path / "run" / "tracking.log"
    capfd.readouterr()
    # When Python code, a raw write to the descriptors and a process started inside all print
    with library_output_to(log):
        print("python stdout")
        print("python stderr", file=sys.stderr)
        os.write(1, b"fd 1\n")
        os.write(2, b"fd 2\n")
        subprocess.run([sys.executable, "-c", "import sys; print('child out'); print('child err', file=sys.stderr)"],
                       check=True)  # fmt: skip
    print("after")
    # Then all of it is in the log, and the terminal has only what came after
    printed = capfd.readouterr()
    assert (printed.out, printed.err) == ("after\n", "")
    assert set(log.read_text().splitlines()) == {"python stdout", "python stderr", "fd 1", "fd 2", "child out",
                                                 "child err"}  # fmt: skip
    # and without a log nothing is redirected
    with library_output_to(None):
        print("shown")
    assert capfd.readouterr().out == "shown\n"
