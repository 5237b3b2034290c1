"""How a local run ends: closed (analyzed, reported, status SUCCEEDED, PARTIAL, FAILED or STOPPED) by its own
runner; or, when its runner died, found abandoned (its host's process is gone) and closed by ``gpuscout runs
--close``; and a finished run logged to its experiment trackers again (``gpuscout track``).

Analysis, report and final status are the workflow's steps (gpuscout.workflow.analyze, .report), driven here.

May import: gpuscout.domain, gpuscout.store, gpuscout.workflow, gpuscout.analysis (lazily) and gpuscout.local's
observer, process_control and job_process (the job folder's log names)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gpuscout.domain.catalog import Catalog, load_catalog
from gpuscout.domain.run_analysis import RunAnalysis
from gpuscout.domain.tracking import local_destinations
from gpuscout.errors import GpuscoutError
from gpuscout.local.job_process import STDERR_LOG, STDOUT_LOG
from gpuscout.local.observer import RunObserver, SilentObserver
from gpuscout.local.process_control import (
    process_alive,
    this_host,
)
from gpuscout.store.base import (
    FINAL_RUN_STATUSES,
    JobRecord,
    JobStatus,
    ResultStore,
    RunRecord,
    RunStatus,
)
from gpuscout.workflow import analyze as analyze_step
from gpuscout.workflow import close as close_step
from gpuscout.workflow import report as report_step

if TYPE_CHECKING:
    from gpuscout.analysis.tracking import RunExtras, TrackingOutcome
    from gpuscout.domain.manifest import Manifest


UNFINISHED_JOB_STATUSES = (JobStatus.PLANNED, JobStatus.STARTING, JobStatus.TRAINING, JobStatus.STOPPING)
# A resumed search keeps these trials (an interrupted one, STOPPED, runs again).
FINISHED_TRIAL_STATUSES = (JobStatus.COMPLETED, JobStatus.PRUNED, JobStatus.FAILED, JobStatus.OOM)


def close_run(
    run_id: str,
    store: ResultStore,
    manifest: Manifest,
    catalog: Catalog,
    *,
    run_dir: Path,
    observer: RunObserver,
    interrupted: str | None,
    current_job: str | None = None,
) -> tuple[RunRecord, RunAnalysis | None, list[JobRecord]]:
    """Bring a run to its final state: unfinished jobs STOPPED (with why), finished jobs analysed and reported,
    the run SUCCEEDED, STOPPED or FAILED. ``interrupted`` names what stopped it (Ctrl-C, SIGTERM, "abandoned ...").
    Used at the end of every ``run_local`` and by ``gpuscout analyze`` for a run whose process is gone."""
    why = interrupted or "run ended"
    stop_unfinished_jobs(
        store,
        run_id,
        f"run interrupted ({why})",
        current=(current_job, f"interrupted ({why})") if current_job else None,
    )
    jobs = store.list_jobs(run_id)
    completed = [j for j in jobs if j.status is JobStatus.COMPLETED]
    analysis: RunAnalysis | None = None
    if completed:
        store.update_run(run_id, status=RunStatus.ANALYZING)
        try:
            analysis = analyze_and_report(
                store.get_run(run_id), store, manifest, catalog, report_dir=run_dir / "report", observer=observer
            )
        except Exception as err:
            store.update_run(run_id, status=RunStatus.FAILED, error=f"analysis failed: {err}")
            raise
    tracking = manifest.resolved_tracking()
    if analysis is not None and tracking is not None:  # the run's results to its experiment trackers
        from gpuscout.analysis.tracking import log_run

        destinations = local_destinations(tracking, run_dir.parent)
        logged = log_run(run_id, analysis, run_dir / "report", destinations, _extras(store.get_run(run_id), run_dir))
        for line in logged.logged + logged.problems:
            observer.message(f"tracking: {line}", warning=line in logged.problems)
    final = close_step.close_status(store, run_id, jobs, interrupted=interrupted)
    return final, analysis, jobs


def analyze_and_report(
    run: RunRecord, store: ResultStore, manifest: Manifest, catalog: Catalog, *, report_dir: Path, observer: RunObserver
) -> RunAnalysis:
    """The workflow's analyze and report steps for a local run: its analysis stored, then its report written into
    the run folder. A report that cannot be written is a warning (the analysis is stored either way and
    ``gpuscout results`` shows it)."""
    from gpuscout.analysis.terms import RunTerms

    analysis, _jobs = analyze_step.analyze_run(run, store, catalog=catalog, terms=RunTerms.of(manifest))
    try:
        report_step.write_report(analysis, report_dir, store=store)
    except Exception as err:  # the measured results are stored; a broken chart must not hide them
        observer.message(
            f"the report could not be written ({type(err).__name__}: {err}); "
            "the results are stored, see `gpuscout results`",
            warning=True,
        )
    return analysis


def stop_unfinished_jobs(store: ResultStore, run_id: str, why: str, *, current: tuple[str, str] | None = None) -> None:
    """Every job of the run not yet finished is STOPPED, its reason saying whether it never started or did not finish
    and ``why`` (``"run interrupted (Ctrl-C)"``, ``"the run failed: ..."``); ``current`` is the running job's name and
    its own reason. No row keeps saying PLANNED or TRAINING after its run is over."""
    for job in store.list_jobs(run_id):
        if job.status in UNFINISHED_JOB_STATUSES:
            if current is not None and job.job_name == current[0]:
                reason = current[1]
            elif job.status is JobStatus.PLANNED:
                reason = f"not started: {why}"
            else:
                reason = f"not finished: {why}"
            store.put_job(job.model_copy(update={"status": JobStatus.STOPPED, "failure_reason": reason}))


def is_abandoned(run: RunRecord) -> bool:
    """A local run that is not final, started on this host by a process that no longer exists."""
    if run.status in FINAL_RUN_STATUSES or run.pid is None or run.host != this_host():
        return False
    return not process_alive(run.pid)


def track_local_run(run: RunRecord, store: ResultStore) -> TrackingOutcome:
    """``gpuscout track RUN_ID``: log a local run's stored analysis and report to its manifest's trackers again (as
    the end of ``gpuscout local`` did; e.g. after a tracker was unreachable then). The trackers' defaults are the run
    folder's (``<runs dir>/mlflow.db``, ``<runs dir>/wandb/``); a relative ``tracking_uri`` is taken from the current
    folder."""
    from gpuscout.analysis.tracking import log_run, run_to_track

    tracking, analysis = run_to_track(run, store.get_result(run.run_id))
    if run.run_dir is None:
        raise GpuscoutError(f"run {run.run_id} has no local run folder (a cloud run? pass --stack-name)")
    run_dir = Path(run.run_dir)
    destinations = local_destinations(tracking, run_dir.parent)
    return log_run(run.run_id, analysis, run_dir / "report", destinations, _extras(run, run_dir))


def _extras(run: RunRecord, run_dir: Path) -> RunExtras:
    """A local run's settings (its manifest as written), its jobs' logs, and ``tracking.log`` in its folder for what
    the tracker libraries print themselves."""
    from gpuscout.analysis.tracking import RunExtras

    return RunExtras(settings=run.manifest or {}, job_logs=local_job_logs(run_dir), output_log=run_dir / "tracking.log")


def local_job_logs(run_dir: Path) -> dict[str, list[Path]]:
    """A local run's job logs, per job folder: its stdout log and a non-empty stderr log (job_process's names)."""
    logs: dict[str, list[Path]] = {}
    for folder in sorted((run_dir / "jobs").glob("*")):
        stdout, stderr = folder / STDOUT_LOG, folder / STDERR_LOG
        found = [stdout] if stdout.is_file() else []
        if stderr.is_file() and stderr.stat().st_size:
            found.append(stderr)
        if found:
            logs[folder.name] = found
    return logs


QUIT_UNANALYSED = "quit before its analysis"  # a STOPPED run's error when Ctrl-C twice ended it unanalysed
QUIT_ANALYSED_LATER = "quit (Ctrl-C twice); analysed afterwards"


def close_abandoned_run(
    run: RunRecord, store: ResultStore, *, observer: RunObserver | None = None, catalog: Catalog | None = None
) -> RunRecord:
    """``gpuscout analyze RUN_ID``: close a run whose ``gpuscout local`` process is gone (SIGKILL, a reboot, an
    OOM kill) from what its finished jobs left: analysis, report and a final status. A final run is re-analysed and
    its report regenerated from the stored jobs; its status stays."""
    from gpuscout.domain.manifest_loader import validate_manifest_data

    observer = observer or SilentObserver()
    catalog = catalog or load_catalog()
    if run.run_dir is None or run.manifest is None:
        raise GpuscoutError(f"run {run.run_id} has no local run folder or manifest to analyse")
    running = run.status not in FINAL_RUN_STATUSES and run.pid is not None and run.host == this_host()
    if running and run.pid is not None and process_alive(run.pid):
        raise GpuscoutError(
            f"run {run.run_id} is still running (pid {run.pid} on {run.host}); stop it first (Ctrl-C or kill -TERM)"
        )
    manifest = validate_manifest_data(run.manifest, run.manifest_source, catalog)
    run_dir = Path(run.run_dir)
    if run.status in FINAL_RUN_STATUSES:
        analysis = None
        jobs = store.list_jobs(run.run_id)
        if any(j.status is JobStatus.COMPLETED for j in jobs):
            analysis = analyze_and_report(
                run, store, manifest, catalog, report_dir=run_dir / "report", observer=observer
            )
        if analysis is not None and (run.error or "").startswith(QUIT_UNANALYSED):  # not unanalysed any more
            store.update_run(run.run_id, error=f"{QUIT_ANALYSED_LATER} (`gpuscout analyze`)")
        final = store.get_run(run.run_id)
    else:
        where = f"pid {run.pid} on {run.host}" if run.pid is not None else "its process"
        final, analysis, jobs = close_run(
            run.run_id,
            store,
            manifest,
            catalog,
            run_dir=run_dir,
            observer=observer,
            interrupted=f"abandoned: {where} ended without closing the run",
        )
    report_md = run_dir / "report" / "report.md"
    observer.finished(final, analysis, jobs, report_md if report_md.is_file() else None)
    return final
