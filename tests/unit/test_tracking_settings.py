"""Where tracking data goes (gpuscout.domain.tracking), which jobs are tracked, what a cloud run refuses
(gpuscout.cloud.sources.tracking_problems), and that nothing loads mlflow or wandb without a tracking section."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpuscout.cloud.sources import TrackingServers, cloud_problems, tracking_problems
from gpuscout.domain.catalog import LocalHardware, load_catalog
from gpuscout.domain.jobspec import JobCode, JobSpec
from gpuscout.domain.manifest import Manifest
from gpuscout.domain.manifest_loader import validate_manifest_data
from gpuscout.domain.manifest_search import TrackingSection
from gpuscout.domain.tracking import (
    CLOUD_WANDB_DIR,
    TRACKING_ENV,
    JobTracking,
    local_destinations,
    tracking_environment,
)
from gpuscout.paths import REPO_DIR
from gpuscout.plan.planner import plan
from gpuscout.store.base import JobStatus
from gpuscout.workflow.canary import run_canaries
from gpuscout.workflow.ports import JobOutcome

CATALOG = load_catalog()
CPU = LocalHardware(device="cpu", cpu_model="test cpu", cpu_count=2, memory_gib=16)
ARN = "arn:aws:sagemaker:us-east-1:123456789012:mlflow-tracking-server/team"
BUCKET = "gpuscout-data-123456789012"


def _manifest(tracking: dict[str, Any] | None, **over: Any) -> Manifest:
    data: dict[str, Any] = {
        "name": "tracked",
        "model": {"preset": "qwen2.5-0.5b"},
        "dataset": {"source": "bundled:hebrew-bible"},
        "sequence_length": 256,
        "training": {"max_steps": 20},
        "targets": [{"instance_type": "ml.g5.12xlarge", "spot": True}, {"instance_type": "ml.p4d.24xlarge"}],
        "variants": [{"name": "b4", "per_device_batch_size": 4}, {"name": "b8", "per_device_batch_size": 8}],
        "constraints": {"budget_usd": 500},
    }
    if tracking is not None:
        data["tracking"] = tracking
    return validate_manifest_data(data | over, "test", CATALOG)


def _section(data: dict[str, Any]) -> TrackingSection:
    return TrackingSection.model_validate(data)


# -- where tracking data goes ---------------------------------------------------------------------------------


def test_a_local_run_tracks_into_its_runs_folder_by_default(tmp_path: Path) -> None:
    destinations = local_destinations(_section({"mlflow": {"experiment": "e"}, "wandb": {"project": "p"}}), tmp_path)
    assert destinations.mlflow is not None and destinations.wandb is not None
    assert destinations.mlflow.tracking_uri == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert destinations.mlflow.artifact_location == (tmp_path.resolve() / "mlartifacts").as_uri()
    assert (destinations.wandb.dir, destinations.wandb.mode) == (str(tmp_path.resolve()), "offline")
    assert destinations.wandb.log_artifacts


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("sqlite:///mlflow.db", "sqlite:///{cwd}/mlflow.db"),
        ("sqlite:///runs/../m.db", "sqlite:///{cwd}/m.db"),
        ("sqlite:////abs/m.db", "sqlite:////abs/m.db"),
        ("file:./mlruns", "file://{cwd}/mlruns"),
        ("file:///abs/mlruns", "file:///abs/mlruns"),
        ("https://mlflow.example.com", "https://mlflow.example.com"),
        (ARN, ARN),
    ],
)
def test_a_given_uri_is_kept_and_relative_files_are_taken_from_the_current_folder(
    uri: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given `gpuscout local` started in tmp_path (every job then runs in its own folder)
    monkeypatch.chdir(tmp_path)
    destinations = local_destinations(_section({"mlflow": {"tracking_uri": uri, "experiment": "e"}}), tmp_path / "r")
    assert destinations.mlflow is not None
    assert destinations.mlflow.tracking_uri == expected.format(cwd=tmp_path.resolve())
    assert destinations.mlflow.artifact_location is None  # the user's store decides


def test_the_experiment_defaults_to_the_manifests_name() -> None:
    resolved = _manifest({"mlflow": {}, "wandb": {"project": "p"}}).resolved_tracking()
    assert resolved is not None and resolved.mlflow is not None and resolved.mlflow.experiment == "tracked"
    named = _manifest({"mlflow": {"experiment": "mine"}}).resolved_tracking()
    assert named is not None and named.mlflow is not None and named.mlflow.experiment == "mine"
    assert _manifest(None).resolved_tracking() is None


# -- which jobs are tracked, with what ------------------------------------------------------------------------


def test_every_planned_job_carries_the_tracking_and_its_variable_says_who_it_is(tmp_path: Path) -> None:
    # Given a tracked manifest, When it is planned
    specs = plan(_manifest({"mlflow": {}, "wandb": {"project": "p"}}), CATALOG, run_id="tracked-1").jobs
    # Then every job has the resolved section, and its variable names the job's variant, instances and price
    assert len(specs) == 4 and all(s.tracking is not None for s in specs)
    spot = next(s for s in specs if s.spot)
    value = JobTracking.model_validate_json(tracking_environment(spot, runs_dir=tmp_path)[TRACKING_ENV])
    assert value.mlflow is not None and value.mlflow.experiment == "tracked"
    assert (value.variant, value.instance_count, value.spot) == (spot.variant_name, 1, True)
    assert value.usd_per_hour == pytest.approx(spot.price_per_hour_usd)  # on-demand: the analysis prices spot
    assert all(s.tracking is None for s in plan(_manifest(None), CATALOG, run_id="plain-1").jobs)


def test_untracked_jobs_and_the_users_own_code_get_no_variable(tmp_path: Path) -> None:
    spec = plan(_manifest({"wandb": {"project": "p"}}), CATALOG, run_id="t-1").jobs[0]
    assert tracking_environment(spec.model_copy(update={"tracking": None}), runs_dir=tmp_path) == {}
    code = JobCode(source_dir="/code", entry_point="train.py", unit="samples")
    assert tracking_environment(spec.model_copy(update={"job_code": code}), runs_dir=tmp_path) == {}


def test_local_canaries_are_not_tracked(tmp_path: Path) -> None:
    # Given a tracked local plan, When its canaries run (a launcher that records what it was given)
    manifest = _manifest(
        {"wandb": {"project": "p"}},
        targets=[{"instance_type": "local", "price_per_hour_usd": 1.0}],
        variants=[{"name": "b1", "per_device_batch_size": 1}, {"name": "b2", "per_device_batch_size": 2}],
    )
    specs = plan(manifest, CATALOG, run_id="t-2", local_hardware=CPU).jobs
    given: list[JobSpec] = []

    class Recording:
        def run(self, spec: JobSpec, place: str) -> JobOutcome:
            given.append(spec)
            return JobOutcome(JobStatus.COMPLETED, None, None, 1.0, None)

    refused = run_canaries(specs, set(), launcher=Recording(), store=None, on_message=lambda *_: None)  # type: ignore[arg-type]
    # Then every canary ran without tracking (a canary is not a measurement)
    assert refused == set() and given and all(s.tracking is None for s in given)


def test_cloud_canaries_are_not_tracked_but_jobs_are() -> None:
    from gpuscout.cloud.plan_step import _canary_requests
    from gpuscout.cloud.sagemaker_requests import DataSource, RequestSettings, training_job_request
    from gpuscout.plan.canary import cloud_canaries

    manifest = _manifest({"mlflow": {"tracking_uri": ARN}, "wandb": {"project": "p"}})
    specs = plan(manifest, CATALOG, run_id="t-3").jobs
    settings = RequestSettings(
        role_arn="arn:aws:iam::123456789012:role/sm", training_image_uri="1.dkr.ecr.us-east-1.amazonaws.com/g:1",
        data_bucket="data-b", artifacts_bucket="art-b",
    )  # fmt: skip
    data = DataSource(source="bundled:hebrew-bible", tokenizer="qwen", sequence_length=256)
    planned = cloud_canaries(specs, manifest, CATALOG, "ml.g5.8xlarge")
    canaries = _canary_requests(planned, manifest=manifest, req_settings=settings, data=data)
    assert canaries and all(TRACKING_ENV not in c["request"]["Environment"] for c in canaries)
    job = training_job_request(specs[0], settings, data, enable_network_isolation=False)
    assert TRACKING_ENV in job["Environment"]


# -- what a cloud run refuses ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tracking", "isolation", "path", "says"),
    [
        ({"mlflow": {}}, False, "tracking.mlflow.tracking_uri", "exists only for `gpuscout local`"),
        ({"mlflow": {"tracking_uri": "sqlite:///m.db"}}, False, "tracking.mlflow.tracking_uri", "cannot reach"),
        ({"mlflow": {"tracking_uri": "file:./mlruns"}}, False, "tracking.mlflow.tracking_uri", "cannot reach"),
        ({"mlflow": {"tracking_uri": ARN}}, True, "tracking.mlflow.tracking_uri", "network_isolation: true"),
        ({"wandb": {"project": "p", "mode": "online"}}, False, "tracking.wandb.mode", "WANDB_API_KEY"),
        ({"mlflow": {"tracking_uri": ARN, "experiment": "x" * 500}}, False, "tracking", "512"),
    ],
)
def test_tracking_a_sagemaker_job_cannot_do_is_refused_with_the_field(
    tracking: dict[str, Any], isolation: bool, path: str, says: str
) -> None:
    manifest = _manifest(tracking, network_isolation=isolation)
    (problem,) = tracking_problems(manifest)
    assert problem.path == path and says in problem.message
    assert problem in cloud_problems(manifest, data_bucket=BUCKET)


@pytest.mark.parametrize(
    ("granted", "uri", "says"),
    [
        ((), ARN, "grants: none"),
        (("nightly",), ARN, "may not log to tracking server 'team' (this deployment grants: nightly)"),
        (("team",), ARN.replace("123456789012", "210987654321"), "only reach tracking servers of 123456789012"),
        (("team",), ARN.replace("us-east-1", "eu-west-1"), "us-east-1"),
    ],
)
def test_the_control_plane_refuses_a_tracking_server_the_jobs_may_not_reach(
    granted: tuple[str, ...], uri: str, says: str
) -> None:
    # Given a deployment whose jobs' role may log only to the servers in context mlflow_tracking_servers
    servers = TrackingServers(names=granted, account="123456789012", region="us-east-1")
    manifest = _manifest({"mlflow": {"tracking_uri": uri}})
    # Then a manifest naming another server is refused before any job starts, saying how to grant it
    (problem,) = cloud_problems(manifest, data_bucket=BUCKET, tracking_servers=servers)
    assert problem.path == "tracking.mlflow.tracking_uri" and says in problem.message
    # while the granted server, and a self-hosted http(s) server (no IAM), pass
    allowed = TrackingServers(names=("team",), account="123456789012", region="us-east-1")
    assert tracking_problems(_manifest({"mlflow": {"tracking_uri": ARN}}), servers=allowed) == []
    https = _manifest({"mlflow": {"tracking_uri": "https://mlflow.example.com"}})
    assert tracking_problems(https, servers=servers) == []


@pytest.mark.parametrize(
    "tracking",
    [
        {"mlflow": {"tracking_uri": ARN}},
        {"mlflow": {"tracking_uri": "https://mlflow.example.com", "experiment": "x" * 200}},
        {"wandb": {"project": "p", "entity": "team"}},
        {"mlflow": {"tracking_uri": ARN}, "wandb": {"project": "p"}},
    ],
)
def test_a_server_and_wandb_offline_are_fine_in_the_cloud(tracking: dict[str, Any]) -> None:
    manifest = _manifest(tracking)
    assert tracking_problems(manifest) == []
    # and what each job gets fits: W&B offline into the output folder, its Artifacts off (they would not sync)
    for spec in plan(manifest, CATALOG, run_id="t-4").jobs:
        value = tracking_environment(spec)[TRACKING_ENV]
        assert len(value) <= 512
        parsed = JobTracking.model_validate_json(value)
        if parsed.wandb is not None:
            assert (parsed.wandb.dir, parsed.wandb.log_artifacts) == (CLOUD_WANDB_DIR, False)


# -- nothing loaded without tracking --------------------------------------------------------------------------


def test_the_core_and_the_cli_load_neither_tracker() -> None:
    code = (
        "import sys, json, gpuscout.cli.app, gpuscout.local.runner, gpuscout.cloud.control_plane, "
        "gpuscout.analysis.tracking, gpuscout.domain.tracking; "
        "print(json.dumps([m for m in ('mlflow', 'wandb') if m in sys.modules]))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_DIR, capture_output=True, text=True, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_an_arn_tracking_uri_resolves_to_the_sagemaker_mlflow_plugin() -> None:
    # The image's packages (training/requirements.txt pins the same as this environment) turn a SageMaker managed
    # MLflow server's ARN into that plugin's store; building it contacts nothing (the endpoint is used per request).
    from mlflow.tracking._tracking_service.utils import _get_store

    assert type(_get_store(ARN)).__module__ == "sagemaker_mlflow.mlflow_sagemaker_store"


class _Experiments:
    """An MlflowClient's experiment calls: ``by_name`` answers lookups in turn; create_experiment raises ``error``."""

    def __init__(self, by_name: list[Any], error: Exception | None = None) -> None:
        self.by_name, self.error = by_name, error
        self.created: list[str] = []

    def get_experiment_by_name(self, name: str) -> Any:
        return self.by_name.pop(0)

    def create_experiment(self, name: str, artifact_location: str | None = None) -> str:
        if self.error is not None:
            raise self.error
        self.created.append(name)
        return "7"


def test_the_experiment_is_found_created_or_taken_from_a_job_that_created_it_first() -> None:
    from types import SimpleNamespace

    from gpuscout.domain.tracking import MlflowDestination, mlflow_experiment_id

    dest = MlflowDestination(tracking_uri="sqlite:////x.db", experiment="e")
    active = SimpleNamespace(experiment_id="3", lifecycle_stage="active")
    assert mlflow_experiment_id(_Experiments([active]), dest) == "3"
    fresh = _Experiments([None])
    assert mlflow_experiment_id(fresh, dest) == "7" and fresh.created == ["e"]
    # another job created it between the lookup and the create: its id
    assert mlflow_experiment_id(_Experiments([None, active], RuntimeError("already exists")), dest) == "3"
    with pytest.raises(RuntimeError, match="denied"):
        mlflow_experiment_id(_Experiments([None, None], RuntimeError("denied")), dest)
    deleted = SimpleNamespace(experiment_id="4", lifecycle_stage="deleted")
    with pytest.raises(ValueError, match="is deleted; restore it or name another one"):
        mlflow_experiment_id(_Experiments([deleted]), dest)
