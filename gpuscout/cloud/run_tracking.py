"""A cloud run's results in its experiment trackers, logged from the user's machine: ``gpuscout track RUN_ID
--stack-name NAME``.

The training jobs log themselves from SageMaker (training/experiment_tracking.py): to the run's MLflow server, and
to W&B offline, each job's run folder coming back in its ``output.tar.gz``. The run level (ranked results, report,
nesting; gpuscout.analysis.tracking) is not logged by the analyze Lambda: its layer holds neither MLflow nor W&B (the
layer is near Lambda's 250 MB limit), and an online W&B run would need a secret in the stack. So after a run has
ended, ``gpuscout track``:

1. reads the run's manifest (its ``tracking`` section) and stored analysis from the stack's table;
2. downloads the report to ``<download dir>/<run id>/`` (as ``gpuscout report`` does);
3. with W&B: extracts each job's ``wandb/`` run folders from its output.tar.gz into ``<download dir>/wandb/``, so
   one ``wandb sync <download dir>/wandb/offline-run-*`` uploads the jobs and the analysis together;
4. logs the run level: MLflow on the run's server (the job runs are found there by their tags and nested under the
   run's), W&B under ``<download dir>/wandb/`` (an ``analysis`` run in the run's group).

Logging again reuses the MLflow run and writes another W&B analysis run; the job folders are re-extracted in place.
"""

from __future__ import annotations

import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from gpuscout.analysis.tracking import TrackingOutcome, log_run, run_to_track
from gpuscout.cloud.client import CloudStack
from gpuscout.errors import GpuscoutError
from gpuscout.spec.tracking import workstation_destinations

WANDB_FOLDER = "wandb"  # wandb's own folder name under its dir (run folders: offline-run-<time>-<id>, run-...)


@dataclass
class TrackedCloudRun:
    report_dir: Path
    outcome: TrackingOutcome
    wandb_dir: Path | None = None  # where the W&B runs (the jobs' and the analysis') are; None without W&B
    wandb_job_runs: list[Path] = field(default_factory=list)  # the jobs' run folders extracted there
    jobs_without_wandb: list[str] = field(default_factory=list)  # no output, or no W&B run in it (failed early)


def _wandb_members(archive: tarfile.TarFile) -> list[tuple[tarfile.TarInfo, PurePosixPath]]:
    """The archive's files and folders under ``wandb/`` with their safe relative paths; links and anything that
    would land outside the folder are left out."""
    members = []
    for member in archive.getmembers():
        path = PurePosixPath(member.name.removeprefix("./"))
        if not path.parts or path.parts[0] != WANDB_FOLDER or len(path.parts) < 2:
            continue
        if path.is_absolute() or ".." in path.parts or not (member.isfile() or member.isdir()):
            continue
        members.append((member, path))
    return members


def extract_wandb_runs(tar_path: Path, destination: Path) -> list[Path]:
    """The W&B run folders inside a job's output.tar.gz (``wandb/<run folder>/...``), written under
    ``destination/wandb/``; returns the run folders. GpuscoutError for an unreadable archive."""
    runs: set[Path] = set()
    try:
        with tarfile.open(tar_path, mode="r:*") as archive:
            for member, path in _wandb_members(archive):
                target = destination.joinpath(*path.parts)
                runs.add(destination.joinpath(*path.parts[:2]))
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                handle = archive.extractfile(member)
                if handle is None:
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with handle, target.open("wb") as out:
                    while chunk := handle.read(1 << 20):
                        out.write(chunk)
    except (tarfile.TarError, OSError) as err:
        raise GpuscoutError(f"cannot read the W&B runs in {tar_path}: {err}") from err
    return sorted(r for r in runs if r.is_dir())


def track_cloud_run(stack: CloudStack, run_id: str, download_dir: Path) -> TrackedCloudRun:
    """Log a finished cloud run's results to its manifest's trackers (module docstring). GpuscoutError (CloudError
    for AWS failures) when the run has no analysis or tracks nothing; a tracker that fails is in the outcome's
    problems, as for ``gpuscout local``."""
    run, jobs, result = stack.result(run_id)
    tracking, analysis = run_to_track(run, result)
    report_dir = stack.download_report(run_id, download_dir)
    tracked = TrackedCloudRun(report_dir=report_dir, outcome=TrackingOutcome())
    if tracking.wandb is not None:
        tracked.wandb_dir = download_dir / WANDB_FOLDER
        with tempfile.TemporaryDirectory(prefix="gpuscout-output-") as tmp:
            for job in jobs:
                tar_path = Path(tmp) / f"{job.job_name}.tar.gz"
                found = []
                if stack.download_job_output(run_id, job.job_name, tar_path):
                    found = extract_wandb_runs(tar_path, download_dir)
                    tar_path.unlink()
                if found:
                    tracked.wandb_job_runs += found
                else:
                    tracked.jobs_without_wandb.append(job.job_name)
    tracked.outcome = log_run(run_id, analysis, report_dir, workstation_destinations(tracking, download_dir))
    return tracked
