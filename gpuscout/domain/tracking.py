"""Experiment tracking: where a job's and a run's tracking data go, and the contract between the two levels.

A manifest's ``tracking`` section (``manifest.TrackingSection``) says which trackers to use; this module turns it
into concrete destinations (:class:`Destinations`) for where the run happens, and into the one environment
variable, ``GPUSCOUT_TRACKING`` (:class:`JobTracking` as JSON), through which training/gpuscout_train/tracking.py
in the job learns them. Without a tracking section a job gets no such variable and nothing imports mlflow or wandb.

- ``gpuscout local`` (:func:`local_destinations`): MLflow defaults to ``sqlite:///<runs_dir>/mlflow.db`` with
  artifacts under ``<runs_dir>/mlartifacts`` (relative ``sqlite:///`` and ``file:`` URIs are taken from the
  current folder, MLflow's own convention, and made absolute because every job runs in its own folder);
  W&B writes ``<runs_dir>/wandb/``.
- SageMaker (:func:`cloud_destinations`): MLflow needs a reachable server (a SageMaker managed MLflow tracking
  server ARN or an http(s) URI, gpuscout.cloud.sources refuses anything else); W&B writes offline runs to
  ``/opt/ml/output/data/wandb/``, which SageMaker returns in the job's output.tar.gz.
- ``gpuscout track`` of a cloud run (:func:`workstation_destinations`): the run level, logged from the user's
  machine: MLflow on the run's server, W&B under the download folder (gpuscout.cloud.run_tracking).

Both levels tag their MLflow runs with :data:`RUN_ID_TAG` and :data:`LEVEL_TAG` (``job`` or ``run``): the run level
(gpuscout.analysis.tracking) finds the run's job runs by those tags and nests them under its own run.

Nothing here imports mlflow or wandb: the functions that use an MLflow client take it as an argument.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gpuscout.domain.jobspec import JobSpec
from gpuscout.domain.manifest_search import TrackingSection

TRACKING_ENV = "GPUSCOUT_TRACKING"
SAGEMAKER_ENV_VALUE_MAX_CHARS = 512  # CreateTrainingJob Environment: each value at most 512 characters
LOCAL_MLFLOW_DB = "mlflow.db"
LOCAL_MLFLOW_ARTIFACTS = "mlartifacts"
CLOUD_WANDB_DIR = "/opt/ml/output/data"  # SM_OUTPUT_DATA_DIR: returned in output.tar.gz; wandb adds wandb/
RUN_ID_TAG = "gpuscout.run_id"
JOB_NAME_TAG = "gpuscout.job_name"
LEVEL_TAG = "gpuscout.level"  # "job" (one training job) or "run" (the run's results, the jobs' parent)
STATUS_TAG = "gpuscout.status"
MLFLOW_PARENT_TAG = "mlflow.parentRunId"  # what MLflow's UI and search read as nesting
REMOTE_MLFLOW_RE = re.compile(r"^(arn:|https?://)")


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MlflowDestination(_Frozen):
    tracking_uri: str
    experiment: str
    artifact_location: str | None = None  # the artifact root of an experiment gpuscout creates; None = the server's


class WandbDestination(_Frozen):
    project: str
    entity: str | None = None
    mode: Literal["offline", "online"]
    dir: str  # wandb writes its run folders under <dir>/wandb/
    # W&B Artifacts: an offline artifact's files are staged outside ``dir`` (wandb's data folder), so they sync only
    # on the machine that wrote them; off in SageMaker, where the run folder travels alone in output.tar.gz
    log_artifacts: bool = True


class Destinations(_Frozen):
    mlflow: MlflowDestination | None = None
    wandb: WandbDestination | None = None


class JobTracking(Destinations):
    """What ``GPUSCOUT_TRACKING`` holds: the destinations and what a job's tracker adds to its hyperparameters."""

    variant: str
    instance_count: int = Field(ge=1)
    spot: bool
    usd_per_hour: float | None = None  # the whole job's on-demand price (job_price_per_hour); None when unknown


def _experiment(tracking: TrackingSection) -> str:
    experiment = tracking.mlflow.experiment if tracking.mlflow else None
    if experiment is None:
        raise ValueError("tracking.mlflow.experiment is unset: pass Manifest.resolved_tracking()")
    return experiment


def absolute_local_uri(uri: str, cwd: Path) -> str:
    """A relative ``sqlite:///PATH`` or ``file:PATH`` tracking URI made absolute against ``cwd``; others unchanged."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str((cwd / uri.removeprefix("sqlite:///")).resolve())
    if uri.startswith("file:") and not uri.startswith("file:/"):
        return (cwd / uri.removeprefix("file:")).resolve().as_uri()
    return uri


def local_destinations(tracking: TrackingSection, runs_dir: Path) -> Destinations:
    """Where a ``gpuscout local`` run tracks (module docstring). ``tracking`` is resolved
    (``Manifest.resolved_tracking()``; a JobSpec's comes so from the planner)."""
    runs_dir = runs_dir.resolve()
    mlflow = None
    if tracking.mlflow is not None:
        uri = tracking.mlflow.tracking_uri
        mlflow = MlflowDestination(
            tracking_uri=absolute_local_uri(uri, Path.cwd()) if uri else f"sqlite:///{runs_dir / LOCAL_MLFLOW_DB}",
            experiment=_experiment(tracking),
            artifact_location=None if uri else (runs_dir / LOCAL_MLFLOW_ARTIFACTS).as_uri(),
        )
    wandb = None
    if tracking.wandb is not None:
        w = tracking.wandb
        wandb = WandbDestination(project=w.project, entity=w.entity, mode=w.mode, dir=str(runs_dir))
    return Destinations(mlflow=mlflow, wandb=wandb)


def cloud_destinations(tracking: TrackingSection) -> Destinations:
    """Where a SageMaker job tracks (module docstring); ``tracking`` is resolved as for local_destinations. Raises
    ValueError for an MLflow URI a SageMaker job cannot reach (gpuscout.cloud.sources.tracking_problems refuses such
    a manifest first)."""
    mlflow = None
    if tracking.mlflow is not None:
        uri = tracking.mlflow.tracking_uri
        if uri is None or not REMOTE_MLFLOW_RE.match(uri):
            raise ValueError(f"tracking.mlflow.tracking_uri {uri!r}: a SageMaker job needs an ARN or http(s) URI")
        mlflow = MlflowDestination(tracking_uri=uri, experiment=_experiment(tracking))
    wandb = None
    if tracking.wandb is not None:
        w = tracking.wandb
        wandb = WandbDestination(
            project=w.project, entity=w.entity, mode=w.mode, dir=CLOUD_WANDB_DIR, log_artifacts=False
        )
    return Destinations(mlflow=mlflow, wandb=wandb)


def workstation_destinations(tracking: TrackingSection, folder: Path) -> Destinations:
    """Where ``gpuscout track`` logs a cloud run's results from this machine: MLflow on the run's own server (where
    its jobs logged; an ARN or http(s) URI, as for cloud_destinations), W&B in the manifest's mode with its run
    folders under ``<folder>/wandb/``, beside the jobs' offline runs downloaded there, and a W&B Artifact (its staged
    files stay on this machine, where `wandb sync` runs)."""
    destinations = cloud_destinations(tracking)
    if destinations.wandb is None:
        return destinations
    wandb = destinations.wandb.model_copy(update={"dir": str(folder.resolve()), "log_artifacts": True})
    return destinations.model_copy(update={"wandb": wandb})


def job_price_per_hour(spec: JobSpec) -> float | None:
    """The whole job's on-demand price per hour (all instances), None when unknown (0). On-demand for spot jobs too:
    the run's analysis prices spot (gpuscout.analysis.tracking logs its figures onto each job's MLflow run)."""
    return spec.price_per_hour_usd * spec.instance_count or None


def job_tracking(spec: JobSpec, destinations: Destinations) -> JobTracking:
    return JobTracking(
        **destinations.model_dump(),
        variant=spec.variant_name,
        instance_count=spec.instance_count,
        spot=spec.spot,
        usd_per_hour=job_price_per_hour(spec),
    )


def encode(tracking: JobTracking) -> str:
    """The ``GPUSCOUT_TRACKING`` value: compact JSON without unset fields."""
    return json.dumps(tracking.model_dump(exclude_none=True), separators=(",", ":"))


def tracking_environment(spec: JobSpec, *, runs_dir: Path | None = None) -> dict[str, str]:
    """``{GPUSCOUT_TRACKING: ...}`` for a job of the built-in train.py whose spec has a tracking section, else {}
    (the user's own code, a job section, is not tracked per job). ``runs_dir`` for ``gpuscout local``; None for a
    SageMaker job, whose value must fit the 512 characters SageMaker allows (ValueError otherwise)."""
    if spec.tracking is None or spec.job_code is not None:
        return {}
    if runs_dir is not None:
        return {TRACKING_ENV: encode(job_tracking(spec, local_destinations(spec.tracking, runs_dir)))}
    value = encode(job_tracking(spec, cloud_destinations(spec.tracking)))
    if len(value) > SAGEMAKER_ENV_VALUE_MAX_CHARS:
        raise ValueError(
            f"job {spec.job_name}: {TRACKING_ENV} takes {len(value)} characters, SageMaker allows "
            f"{SAGEMAKER_ENV_VALUE_MAX_CHARS}; shorten tracking.mlflow.experiment or tracking.mlflow.tracking_uri"
        )
    return {TRACKING_ENV: value}


# An unreachable MLflow server costs one bounded wait (4 tries of at most 20 s, 1 + 2 + 4 s apart), not MLflow's
# default minutes of retries
MLFLOW_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}
# sagemaker-mlflow: artifacts through a SageMaker managed server's presigned URLs, so the job role needs only
# sagemaker-mlflow:* on the server (stacks/roles.py), not a grant on the server's artifact bucket. Set for ARN URIs
# only: the plugin handles every s3:// artifact location, and with this on it builds its upload request from the
# tracking URI as if it were an ARN, which fails for an http(s) server that keeps its artifacts in S3.
PRESIGNED_UPLOAD_ENV = "SAGEMAKER_PRESIGNED_URL_UPLOAD_ENABLED"


def bound_mlflow_retries() -> None:
    """Set MLFLOW_HTTP_DEFAULTS in this process's environment, where the user has not set them."""
    for key, value in MLFLOW_HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)


def prepare_mlflow_uri(uri: str, mlflow: Any) -> None:
    """Before an ``MlflowClient(tracking_uri=uri)`` (``mlflow`` is the imported module): an ARN is also set as the
    process's tracking URI, from which the sagemaker-mlflow plugin builds its request headers, and its artifacts go
    through the server's presigned URLs (PRESIGNED_UPLOAD_ENV, where not set); for any other URI that plugin
    (installed with gpuscout) logs a warning about the missing ARN on every request, which is silenced."""
    if uri.startswith("arn:"):
        os.environ.setdefault(PRESIGNED_UPLOAD_ENV, "true")
        mlflow.set_tracking_uri(uri)
    else:
        logging.getLogger("mlflow.tracking.request_header.registry").setLevel(logging.ERROR)


def mlflow_experiment_id(client: Any, destination: MlflowDestination) -> str:
    """The id of ``destination``'s experiment, created (with its artifact location) when it does not exist yet.
    ``client`` is an ``mlflow.MlflowClient``; two jobs that create the experiment at once both get its id."""
    found = client.get_experiment_by_name(destination.experiment)
    if found is not None:
        if found.lifecycle_stage != "active":
            raise ValueError(
                f"MLflow experiment {destination.experiment!r} is deleted; restore it or name another one "
                "(tracking.mlflow.experiment)"
            )
        return str(found.experiment_id)
    try:
        return str(client.create_experiment(destination.experiment, artifact_location=destination.artifact_location))
    except Exception:  # MlflowException "already exists" when another job created it meanwhile; else re-raised
        found = client.get_experiment_by_name(destination.experiment)
        if found is None:
            raise
        return str(found.experiment_id)
