"""A cloud run's results in its experiment trackers, logged from the user's machine: ``gpuscout track RUN_ID
--stack-name NAME``.

The training jobs log themselves from SageMaker (training/gpuscout_train/tracking.py): to the run's MLflow server, and
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

import re
import shutil
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from gpuscout.analysis.tracking import RunExtras, TrackingOutcome, log_run, run_to_track
from gpuscout.cloud.client import CloudStack
from gpuscout.domain.tracking import workstation_destinations
from gpuscout.errors import GpuscoutError
from gpuscout.store.base import JobRecord

WANDB_FOLDER = "wandb"  # wandb's own folder name under its dir
RUN_FOLDER_RE = re.compile(r"^(offline-)?run-[A-Za-z0-9_.-]+$")  # a run's folder there (not wandb's latest-run link)
MAX_WANDB_FILE_BYTES = 1 << 30  # a benchmark job's W&B files are KB to MB; anything this big is not extracted


@dataclass
class TrackedCloudRun:
    report_dir: Path
    outcome: TrackingOutcome
    wandb_dir: Path | None = None  # where the W&B runs (the jobs' and the analysis') are; None without W&B
    wandb_job_runs: list[Path] = field(default_factory=list)  # the jobs' run folders extracted there
    jobs_without_wandb: list[str] = field(default_factory=list)  # no output, or no W&B run in it (failed early)
    problems: list[str] = field(default_factory=list)  # a job's output that could not be read or extracted: why

    @property
    def all_problems(self) -> list[str]:
        return self.problems + self.outcome.problems


@dataclass
class Extracted:
    runs: list[Path]  # the W&B run folders written
    skipped: list[str]  # members not written, with why (a link on the way, too large)


def _run_members(archive: tarfile.TarFile) -> list[tuple[tarfile.TarInfo, PurePosixPath]]:
    """The archive's regular files and folders inside W&B run folders (``wandb/<run folder>/...``) with their
    relative paths; links, devices, wandb's top-level files and anything that would leave the folder are left out."""
    members = []
    for member in archive.getmembers():
        path = PurePosixPath(member.name.removeprefix("./"))
        if len(path.parts) < 2 or path.parts[0] != WANDB_FOLDER or not RUN_FOLDER_RE.match(path.parts[1]):
            continue
        if path.is_absolute() or ".." in path.parts or not (member.isfile() or member.isdir()):
            continue
        members.append((member, path))
    return members


def _through_link(destination: Path, target: Path) -> bool:
    """Whether a path between ``destination`` and ``target`` (included) is a symbolic link already on disk (wandb
    makes some, e.g. logs/debug-core.log into its cache): writing there would land elsewhere."""
    path = target
    while path != destination:
        if path.is_symlink():
            return True
        path = path.parent
    return False


def extract_wandb_runs(tar_path: Path, destination: Path) -> Extracted:
    """The W&B run folders inside a job's output.tar.gz (``wandb/<run folder>/...``), written under
    ``destination/wandb/``. GpuscoutError for an unreadable archive."""
    runs: set[Path] = set()
    skipped: list[str] = []
    try:
        with tarfile.open(tar_path, mode="r:*") as archive:
            for member, path in _run_members(archive):
                target = destination.joinpath(*path.parts)
                if _through_link(destination, target):
                    skipped.append(f"{path} (a link is on the way)")
                    continue
                if member.isfile() and member.size > MAX_WANDB_FILE_BYTES:
                    skipped.append(f"{path} ({member.size} bytes)")
                    continue
                runs.add(destination.joinpath(*path.parts[:2]))
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                handle = archive.extractfile(member)
                if handle is None:
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with handle, target.open("wb") as out:
                    shutil.copyfileobj(handle, out, 1 << 20)
    except (tarfile.TarError, OSError, EOFError) as err:
        raise GpuscoutError(f"cannot read the W&B runs in {tar_path}: {err}") from err
    return Extracted(runs=sorted(runs), skipped=skipped)


def _download_wandb_runs(stack: CloudStack, run_id: str, jobs: list[JobRecord], tracked: TrackedCloudRun) -> None:
    """Each job's W&B run folders into ``tracked.wandb_dir``; a job whose output cannot be read is a problem, and
    the others (and the run level) go on."""
    assert tracked.wandb_dir is not None
    with_output = stack.jobs_with_output(run_id)
    with tempfile.TemporaryDirectory(prefix="gpuscout-output-") as tmp:
        for job in jobs:
            if job.job_name not in with_output:
                tracked.jobs_without_wandb.append(job.job_name)
                continue
            tar_path = Path(tmp) / "output.tar.gz"
            try:
                stack.download_job_output(run_id, job.job_name, tar_path)
                extracted = extract_wandb_runs(tar_path, tracked.wandb_dir.parent)
            except GpuscoutError as err:
                tracked.problems.append(f"W&B: the runs of job {job.job_name} were not extracted ({err})")
                continue
            finally:
                tar_path.unlink(missing_ok=True)
            tracked.wandb_job_runs += extracted.runs
            if not extracted.runs:
                tracked.jobs_without_wandb.append(job.job_name)
            if extracted.skipped:
                tracked.problems.append(
                    f"W&B: job {job.job_name}: not extracted: {', '.join(extracted.skipped[:5])}"
                    + (f" and {len(extracted.skipped) - 5} more" if len(extracted.skipped) > 5 else "")
                )


def track_cloud_run(stack: CloudStack, run_id: str, download_dir: Path) -> TrackedCloudRun:
    """Log a finished cloud run's results to its manifest's trackers (module docstring). GpuscoutError (CloudError
    for AWS failures) when the run has no analysis or tracks nothing; a job output that cannot be read and a tracker
    that fails are in the result's problems, after everything else was done."""
    run, jobs, result = stack.result(run_id)
    tracking, analysis = run_to_track(run, result)
    report_dir = stack.download_report(run_id, download_dir)
    tracked = TrackedCloudRun(report_dir=report_dir, outcome=TrackingOutcome())
    if tracking.wandb is not None:
        tracked.wandb_dir = download_dir / WANDB_FOLDER
        if (run.manifest or {}).get("job"):  # the user's own code: its jobs are not tracked per job
            tracked.jobs_without_wandb = [j.job_name for j in jobs]
        else:
            _download_wandb_runs(stack, run_id, jobs, tracked)
    extras = RunExtras(settings=run.manifest or {}, output_log=download_dir / "tracking.log")
    tracked.outcome = log_run(run_id, analysis, report_dir, workstation_destinations(tracking, download_dir), extras)
    return tracked
