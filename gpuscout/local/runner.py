"""``gpuscout local``: the whole benchmark on this machine, the workflow's steps (gpuscout.workflow) driven in the
state machine's order, with the same scripts the cloud runs:

- Validate: ``planning.validate`` (the manifest read once, the runs folder writable), before the store is opened;
- Plan: ``planning.plan_jobs`` (calibration of a job section's variants without an estimate, then the plan against
  this machine), refused over budget before anything runs (workflow.plan.within_budget);
- Prepare data: ``data_cache.prepare_data`` (training/gpuscout_data once per source, tokenizer and sequence length,
  cached under ``runs/.cache/data/<key>``), then workflow.prepare_data.check_prepared_data;
- Canary: workflow.canary.run_canaries, a few steps of each distinct configuration;
- Train and Record: for every job (or every trial of a settings search, ``search``), ``job_process.run_job``: a
  SageMaker-like ``opt/ml`` folder tree and ``gpuscout_train.train`` as a subprocess with the same SM_* variables
  SageMaker sets, its row recorded by workflow.train_and_record; a disturbed measurement measured once more;
- Analyze and Report: ``closing.close_run`` (workflow.analyze, workflow.report and the run's final status). The
  console tells how it ended, where the cloud publishes the run summary (workflow.close).

A failing job never stops the others. Ctrl-C stops the job in flight, marks the run STOPPED and keeps (and
analyzes) what was measured.

May import: gpuscout.domain, gpuscout.plan, gpuscout.store, gpuscout.workflow and the other gpuscout.local modules
(the search driver only for a search).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from gpuscout.domain.catalog import Catalog, load_catalog
from gpuscout.domain.jobspec import JobSpec
from gpuscout.errors import (
    DISK_FULL,
    BudgetExceededError,
    DiskFullError,
    GpuscoutError,
    is_disk_full,
)
from gpuscout.local.closing import (
    FINISHED_TRIAL_STATUSES,
    QUIT_UNANALYSED,
    close_run,
    is_abandoned,
    stop_unfinished_jobs,
)
from gpuscout.local.data_cache import prepare_data
from gpuscout.local.job_process import FolderLauncher, JobProgress, job_max_steps
from gpuscout.local.lock import RunsFolderLock
from gpuscout.local.observer import RunObserver, SilentObserver
from gpuscout.local.planning import Validated, plan_jobs, validate
from gpuscout.local.process_control import (
    QuitNow,
    SignalGuard,
    this_host,
)
from gpuscout.local.tracker_check import checked_tracking
from gpuscout.store.base import (
    FINAL_RUN_STATUSES,
    JobRecord,
    JobStatus,
    ResultStore,
    RunRecord,
    RunStatus,
)
from gpuscout.workflow import canary as canary_step
from gpuscout.workflow import plan as plan_step
from gpuscout.workflow import prepare_data as prepare_data_step
from gpuscout.workflow.ports import JobOutcome
from gpuscout.workflow.train_and_record import disturbance_to_measure_again, record_job, remeasure_spec

if TYPE_CHECKING:
    from gpuscout.domain.manifest import Manifest
    from gpuscout.plan.jobs import Plan


def run_local(
    manifest: Validated | Path | str,
    *,
    store: ResultStore,
    runs_dir: Path | None = None,
    observer: RunObserver | None = None,
    catalog: Catalog | None = None,
    data_cache_dir: Path | None = None,
    allow_concurrent: bool = False,
    canary: bool = True,
    resume: str | None = None,
) -> RunRecord:
    """Run a manifest's benchmark on this machine and return the final run row (see module docstring).

    ``manifest``: what ``planning.validate`` returned (the CLI validates before it opens the store; its runs folder
    is the one validated), or a manifest file, validated here with ``runs_dir`` (default ``runs``).

    ``resume``: the id of an earlier run of the same settings-search manifest that ended (interrupted, or abandoned
    by a process that is gone): it goes on under that id, its finished trials kept (docs/search.md).

    One run at a time per runs folder (``lock.RunsFolderLock``) unless ``allow_concurrent``. With ``canary``, each
    distinct configuration first runs a few steps (gpuscout.workflow.canary); a configuration whose canary fails is
    not timed."""
    observer = observer or SilentObserver()
    catalog = catalog or load_catalog()
    if isinstance(manifest, Validated):
        validated = manifest
        if runs_dir is not None and Path(runs_dir).resolve() != validated.runs_dir:
            raise GpuscoutError(f"--runs-dir {runs_dir}: the manifest was validated for {validated.runs_dir}")
    else:
        validated = validate(manifest, runs_dir=runs_dir or Path("runs"), catalog=catalog)
    manifest_path, runs_dir = validated.path, validated.runs_dir
    previous = _resumable(store, resume) if resume else None
    the_plan = plan_jobs(validated.manifest, catalog, run_id=resume, on_message=observer.message)
    if previous is not None:
        _check_resume(previous, validated.manifest, the_plan)
    run_id: str = the_plan.run_id
    run_dir = runs_dir / run_id
    run = RunRecord(
        run_id=run_id,
        name=validated.manifest.name,
        status=RunStatus.PLANNED,
        manifest_source=str(manifest_path),
        manifest=validated.manifest.model_dump(mode="json"),
        run_dir=str(run_dir),
        host=this_host(),
        pid=os.getpid(),
    )
    try:
        run = plan_step.within_budget(the_plan, run, store=store)
    except BudgetExceededError:  # refused: the plan says what costs; the runs folder is not touched
        observer.planned(the_plan)
        raise
    # the runs folder is taken before the plan is shown: a busy folder refuses before printing a run id that will
    # never exist
    lock = nullcontext() if allow_concurrent else RunsFolderLock(runs_dir, run_id=run_id, host=this_host())
    with lock:
        observer.planned(the_plan)
        return _run_planned(
            run, validated.manifest, the_plan, manifest_path, store=store, observer=observer, catalog=catalog,
            data_cache_dir=data_cache_dir or runs_dir / ".cache" / "data", canary=canary,
        )  # fmt: skip


def _resumable(store: ResultStore, run_id: str) -> RunRecord:
    run = store.get_run(run_id)
    if run.search is None:
        raise GpuscoutError(f"--resume {run_id}: not a settings search (only a search's trials can be resumed)")
    if run.status not in FINAL_RUN_STATUSES and not is_abandoned(run):
        raise GpuscoutError(
            f"--resume {run_id}: the run is {run.status.value} in process {run.pid} on {run.host}; "
            "stop it first (or close it with `gpuscout analyze`)"
        )
    if run.status in {RunStatus.REJECTED, RunStatus.REFUSED}:
        raise GpuscoutError(f"--resume {run_id}: the run was {run.status.value}; nothing ran")
    return run


def _check_resume(previous: RunRecord, manifest: Manifest, the_plan: Plan) -> None:
    """A resumed search must be the same search: same manifest, same candidates."""
    if previous.manifest != manifest.model_dump(mode="json"):
        raise GpuscoutError(
            f"--resume {previous.run_id}: the manifest differs from the one that run used "
            f"({previous.manifest_source}); resume with that manifest, or start a new run"
        )
    if the_plan.search is None or previous.search != the_plan.search:
        raise GpuscoutError(
            f"--resume {previous.run_id}: this machine plans other candidates than that run did "
            "(different hardware or memory); start a new run"
        )


def _run_planned(
    run: RunRecord,
    manifest: Manifest,
    the_plan: Plan,
    manifest_path: Path,
    *,
    store: ResultStore,
    observer: RunObserver,
    catalog: Catalog,
    data_cache_dir: Path,
    canary: bool = True,
) -> RunRecord:
    specs: list[JobSpec] = list(the_plan.jobs)
    run_id = run.run_id
    run_dir = Path(str(run.run_dir))
    _write_run_folder(run_dir, manifest_path, specs)
    store.put_run(run)
    store.put_jobs(plan_step.planned_rows(the_plan))

    current: JobSpec | None = None
    interrupted: str | None = None
    failure: Exception | None = None
    disk_full: DiskFullError | None = None
    with SignalGuard(on_deferred=partial(_finishing_first, observer, run_id)) as guard:
        try:
            # each tracking server asked once, now: one that is not there is off for the run (or refuses it)
            manifest, specs = checked_tracking(manifest, specs, on_message=lambda m: observer.message(m, warning=True))
            data_dir, refused = _prepare(manifest, specs, run_id, store=store, observer=observer,
                                         data_cache_dir=data_cache_dir)  # fmt: skip
            store.update_run(run_id, status=RunStatus.RUNNING)
            launcher = FolderLauncher(run_dir, data_dir)  # canary/<name>/ and jobs/<name>/ in the run folder
            if canary and data_dir is not None and the_plan.search is None:  # a failing trial fails alone
                refused |= canary_step.run_canaries(
                    specs, refused, launcher=launcher, store=store,
                    on_message=lambda text, warning: observer.message(text, warning=warning),
                )  # fmt: skip
            with observer.jobs_running():
                # a search's jobs are its trials: numbered against its trial budget, after a resumed one's earlier
                trials, total = 0, len(specs)
                finished: dict[str, JobRecord] = {}
                if the_plan.search is not None:
                    finished = {j.job_name: j for j in store.list_jobs(run_id) if j.status in FINISHED_TRIAL_STATUSES}
                    trials, total = len(finished), the_plan.search.trial_budget

                def run_one(spec: JobSpec, should_stop: Callable[[JobProgress], str | None] | None) -> JobRecord:
                    nonlocal current, trials
                    current, trials = spec, trials + 1
                    max_steps = job_max_steps(spec)
                    # a re-measurement joins specs as it starts: "job 4/4", never "job 4/3"
                    observer.job_started(trials if the_plan.search else specs.index(spec) + 1,
                                         total if the_plan.search else len(specs), spec, max_steps)  # fmt: skip
                    record_job(store, spec, JobStatus.TRAINING)
                    progress = partial(observer.job_progress, spec, max_steps=max_steps)
                    outcome = _run_job_in(launcher, spec, on_progress=progress, should_stop=should_stop)
                    record = record_job(store, spec, outcome.status, outcome)
                    observer.job_finished(spec, outcome)
                    current = None
                    if (outcome.failure_reason or "").startswith(DISK_FULL):  # the next job would fail the same way
                        raise DiskFullError(launcher.folder(spec, "jobs"), f"job {spec.job_name} ran")
                    return record

                if the_plan.search is not None:
                    _run_search(the_plan, [s for s in specs if s.job_name not in refused], finished=finished,
                                observer=observer, run_one=run_one)  # fmt: skip
                else:
                    records = [run_one(spec, None) for spec in list(specs) if spec.job_name not in refused]
                    _remeasure_disturbed(records, specs, store=store, observer=observer, run_one=run_one)
        except KeyboardInterrupt as err:
            guard.defer()
            interrupted = getattr(err, "signal_name", "Ctrl-C")
            observer.interrupted()
        except DiskFullError as err:  # what was measured before the disk filled is analysed; the run ends STOPPED
            guard.defer()
            interrupted, disk_full = f"{DISK_FULL} {err.path}", err
        except Exception as err:  # data preparation failed, or the run folder could not be written
            guard.defer()
            failure = err
        finally:
            # From here on a second Ctrl-C, SIGTERM or SIGHUP is recorded, not raised: the run always ends in a
            # final state with what was measured analysed.
            guard.defer()
        try:
            if failure is not None:
                _fail(store, run_id, failure)
            final, analysis, jobs = close_run(
                run_id,
                store,
                manifest,
                catalog,
                run_dir=run_dir,
                observer=observer,
                interrupted=interrupted,
                current_job=current.job_name if current else None,
            )
        except QuitNow:  # Ctrl-C pressed again after the guard said the analysis goes on first
            _quit_unanalysed(store, run_id, observer)
            raise
    report_md = run_dir / "report" / "report.md"
    observer.finished(final, analysis, jobs, report_md if report_md.is_file() else None)
    if interrupted and the_plan.search is not None:  # the finished trials are kept: say how to go on
        _say_how_to_resume(observer, manifest_path, run_id, run_dir)
    if disk_full is not None:  # the jobs that ran are stored and analysed; the error says why the rest did not run
        raise disk_full
    return final


def _prepare(
    manifest: Manifest,
    specs: Sequence[JobSpec],
    run_id: str,
    *,
    store: ResultStore,
    observer: RunObserver,
    data_cache_dir: Path,
) -> tuple[Path | None, set[str]]:
    """The built-in job's prepared data (cached) and the jobs its checks refuse; a user's own job prepares nothing
    (its requirements are the user's to install here)."""
    if manifest.job is None:
        store.update_run(run_id, status=RunStatus.PREPARING)
        data_dir = prepare_data(manifest, data_cache_dir, observer.message)
        refused = prepare_data_step.check_prepared_data(
            data_dir, manifest, specs, store=store, on_warning=lambda text: observer.message(text, warning=True)
        )
        return data_dir, refused
    if manifest.job.requirements:
        observer.message(
            f"job: {manifest.job.requirements} is not installed by `gpuscout local`; the job runs in this "
            f"environment ({sys.executable})",
            warning=True,
        )
    return None, set()


def _say_how_to_resume(observer: RunObserver, manifest_path: Path, run_id: str, run_dir: Path) -> None:
    observer.message(
        f"the search can go on where it stopped (finished trials kept, the rest run): gpuscout local "
        f"{manifest_path} --resume {run_id} --runs-dir {run_dir.parent} (and the same --db)"
    )


def _fail(store: ResultStore, run_id: str, failure: Exception) -> NoReturn:
    """The run FAILED with the failure's first line as its note, its jobs that did not run STOPPED; re-raised."""
    note = (str(failure).strip().splitlines() or [""])[0]  # the stored note is one line
    stop_unfinished_jobs(store, run_id, f"the run failed ({type(failure).__name__})")
    store.update_run(run_id, status=RunStatus.FAILED, error=f"{type(failure).__name__}: {note}")
    raise failure


def _finishing_first(observer: RunObserver, run_id: str, signal_name: str) -> None:
    """What a Ctrl-C (or SIGTERM) during the run's final bookkeeping is told, at once: it was heard, what goes on
    first, and how to quit anyway."""
    observer.message(
        f"{signal_name}: finishing the run's analysis and report of what was measured first; press Ctrl-C again to "
        f"quit now (then `gpuscout analyze {run_id}` finishes them)",
        warning=True,
    )


def _quit_unanalysed(store: ResultStore, run_id: str, observer: RunObserver) -> None:
    """The user quit during the final bookkeeping: the run is STOPPED (its jobs that did not finish too), saying
    that its analysis was not made and which command makes it."""
    stop_unfinished_jobs(store, run_id, "run interrupted (Ctrl-C)")
    how = f"`gpuscout analyze {run_id}` analyses what was measured and writes the report"
    store.update_run(run_id, status=RunStatus.STOPPED, error=f"{QUIT_UNANALYSED} (Ctrl-C twice); {how}")
    observer.message(f"quit: run {run_id} STOPPED before its analysis; {how}", warning=True)


def _write_run_folder(run_dir: Path, manifest_path: Path, specs: Sequence[JobSpec]) -> None:
    """The run folder with the manifest as given and plan.json, each file whole or absent (written aside, then
    renamed). A folder this call made is removed again when it cannot be written, a full disk included: nothing
    half-written is left behind, and the error says which folder and how much space is left."""
    made = not run_dir.exists()
    plan = json.dumps([s.model_dump(mode="json") for s in specs], indent=2) + "\n"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        writers: list[tuple[str, Callable[[Path], object]]] = [
            (f"manifest{manifest_path.suffix or '.yaml'}", lambda aside: shutil.copyfile(manifest_path, aside)),
            ("plan.json", lambda aside: aside.write_text(plan, encoding="utf-8")),
        ]
        for name, write in writers:
            aside = run_dir / f".{name}.tmp"
            try:
                write(aside)
                aside.replace(run_dir / name)
            finally:
                aside.unlink(missing_ok=True)
    except OSError as err:
        if made:
            shutil.rmtree(run_dir, ignore_errors=True)
        if is_disk_full(err):
            raise DiskFullError(
                run_dir, "writing the run folder", hint="free space there or choose another --runs-dir"
            ) from err
        raise GpuscoutError(f"cannot write the run folder {run_dir}: {err}") from err


def _run_job_in(
    launcher: FolderLauncher,
    spec: JobSpec,
    *,
    on_progress: Callable[[JobProgress], None],
    should_stop: Callable[[JobProgress], str | None] | None,
) -> JobOutcome:
    """One job in its folder under jobs/; a full disk while its folder or logs are written is a DiskFullError."""
    try:
        return launcher.run(spec, "jobs", on_progress=on_progress, should_stop=should_stop)
    except OSError as err:
        if is_disk_full(err):
            raise DiskFullError(launcher.folder(spec, "jobs"), f"starting job {spec.job_name}") from err
        raise


def _remeasure_disturbed(
    records: Sequence[JobRecord],
    specs: list[JobSpec],
    *,
    store: ResultStore,
    observer: RunObserver,
    run_one: Callable[[JobSpec, None], JobRecord],
) -> None:
    """Each job whose measurement was disturbed runs once more, after all the others (so the two are interleaved with
    the rest), under a name of its own; ``specs`` gains the new jobs. Not a job whose torch.compile compiles explain
    the disturbance: the same settings would compile again."""
    for record in records:
        # judged as the analysis judges it (this release's detector), not only as the job's own release did
        judged = disturbance_to_measure_again(record)
        if judged is None:
            continue
        disturbance, worth_it = judged
        evidence = disturbance.evidence
        if not worth_it:
            observer.message(
                f"{record.job_name}: disturbed measurement ({evidence}); not measured again: torch.compile compiled "
                "graphs in its slow steps, and the same settings compile them again in a second run",
                warning=True,
            )
            continue
        again = remeasure_spec(record, specs)
        observer.message(
            f"{record.job_name}: disturbed measurement ({evidence}); measuring it once more as {again.job_name} "
            "before ranking",
            warning=True,
        )
        specs.append(again)
        record_job(store, again, JobStatus.PLANNED)
        run_one(again, None)


def _run_search(
    the_plan: Plan,
    specs: Sequence[JobSpec],
    *,
    finished: Mapping[str, JobRecord],
    observer: RunObserver,
    run_one: Callable[[JobSpec, Callable[[JobProgress], str | None] | None], JobRecord],
) -> None:
    """A settings search (gpuscout.local.search): each trial is ``run_one`` with the search's pruner asked at every
    poll; ``finished``, the trials a resumed run's store holds as finished (by job name), are not run again."""
    from gpuscout.local.search import StopCheck, run_search
    from gpuscout.plan.search import describe_plan

    search = the_plan.search
    assert search is not None, "the runner starts a search only for a plan that has one"
    for line in describe_plan(search):
        observer.message(line)

    def run_trial(spec: JobSpec, check: StopCheck) -> JobRecord:
        seen = 0

        def should_stop(progress: JobProgress) -> str | None:
            nonlocal seen
            steps = progress.steps[seen:]
            seen += len(steps)
            for step, tokens, seconds in steps:
                if why := check(step, tokens, seconds):
                    return why
            return None

        return run_one(spec, should_stop)

    summary = run_search(search, specs, run_trial=run_trial, done=finished, on_message=observer.message)
    observer.message(
        f"search: {summary.launched} trial(s) launched, {len(summary.pruned)} pruned, "
        f"${summary.spent_usd:.4f} spent" + (f"; stopped: {summary.stopped_because}" if summary.stopped_because else "")
    )
