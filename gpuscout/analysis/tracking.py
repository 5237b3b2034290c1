"""A run's results in its experiment trackers: after the analysis, one tracker run per benchmark run holds the ranked
results and the report, beside the job runs training/gpuscout_train/tracking.py logged.

- MLflow: a run named after the run id (tags ``gpuscout.run_id``, ``gpuscout.level=run``) in the manifest's experiment,
  created once and reused when logged again. Its params are the run's settings (the manifest flattened:
  ``model.preset``, ``training.max_steps``, ``variants.<name>.<field>``, ``targets.<i>.<field>``, ...); its metrics are
  the recommended job's figures (``best/<name>``) and the job counts; tags the recommendation and its verdict; artifacts
  ``ranked_results.json``, ``ranked_results.csv``, ``analysis.json`` and the report folder under ``report/``. Every job
  run of the run (found by its tags) is nested under it (tag ``mlflow.parentRunId``; jobs run as separate processes, in
  the cloud on separate machines, so the parent is attached afterwards) and gets its analysed figures
  (``analysis/rank``, ``analysis/usd_per_million_tokens``, ...), a tag ``gpuscout.excluded_reason`` when it was not
  ranked (and ``gpuscout.pruned_reason`` for a trial the settings search pruned) and, for a local run, its ``train.log``
  (and a non-empty ``train.stderr.log``) as artifacts under ``logs/``; a job run still RUNNING (its process was stopped:
  Ctrl-C, a pruned trial) is ended KILLED.
- W&B: a run with job type ``analysis`` in group <run id> (the group of the job runs): config (run id, name, objective,
  unit, the run's settings under ``settings``), the ranked results as a ``ranked_results`` table, summary
  ``best/<name>``, the same files in the run folder, and, where the destination logs Artifacts, a ``report`` Artifact
  with them.

A tracker that fails is reported (``TrackingOutcome.problems``) and the others go on; nothing here raises for a
tracker's error. mlflow and wandb are imported only inside the functions that use them. What the libraries print
themselves (MLflow's database set-up, W&B's progress lines) goes to ``output_log`` when one is given (a local run's
``tracking.log``), not to the terminal gpuscout writes to."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gpuscout.domain.manifest_search import TrackingSection
from gpuscout.domain.run_analysis import RunAnalysis
from gpuscout.domain.tracking import (
    JOB_NAME_TAG,
    LEVEL_TAG,
    MLFLOW_PARENT_TAG,
    RUN_ID_TAG,
    Destinations,
    MlflowDestination,
    WandbDestination,
    bound_mlflow_retries,
    mlflow_experiment_id,
    prepare_mlflow_uri,
)
from gpuscout.errors import GpuscoutError
from gpuscout.store.base import ResultRecord, RunRecord

RANKED_COLUMNS = (
    "rank", "job_name", "job_names", "instance_type", "instance_count", "gpus", "variant_name", "spot", "status",
    "unit", "tokens_per_s", "tokens_per_s_ci95_low", "tokens_per_s_ci95_high", "samples_per_s", "mfu",
    "usd_per_hour", "usd_per_million_tokens", "usd_per_million_tokens_spot", "usd_per_million_samples",
    "usd_per_million_samples_spot", "final_train_loss", "on_pareto_front", "excluded_reason",
)  # fmt: skip
# A job's analysed figures, logged onto its own MLflow run as analysis/<name>
JOB_FIGURES = ("rank", "usd_per_million_tokens", "usd_per_million_tokens_spot", "usd_per_million_samples",
               "usd_per_million_samples_spot")  # fmt: skip
# The recommended job's figures, logged onto the run's tracker run as best/<name>
BEST_FIGURES = ("tokens_per_s", "samples_per_s", "mfu", "usd_per_hour", "usd_per_million_tokens",
                "usd_per_million_tokens_spot", "usd_per_million_samples", "usd_per_million_samples_spot")  # fmt: skip
MLFLOW_TAG_MAX_CHARS = 5000
MLFLOW_PARAM_MAX_CHARS = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
MLFLOW_KEY_MAX_CHARS = 250
MLFLOW_BATCH_PARAMS = 100  # params per log_batch call
_NOT_IN_KEYS = re.compile(r"[^A-Za-z0-9_\-. /]")  # what MLflow refuses in a param name
MLFLOW_MAX_RESULTS = 5000  # job runs searched per run (a cloud run has at most 40 jobs, a local one a few hundred)


@dataclass
class TrackingOutcome:
    logged: list[str] = field(default_factory=list)  # one line per tracker that has the results: where
    problems: list[str] = field(default_factory=list)  # one line per tracker that failed: why


def ranked_rows(analysis: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The analysis' jobs as flat rows of RANKED_COLUMNS: ranked ones best first, then the unranked by name."""
    rows = []
    for job in analysis.get("jobs") or []:
        low, high = job.get("tokens_per_s_ci95") or (None, None)
        row = {column: job.get(column) for column in RANKED_COLUMNS}
        row |= {"job_names": " ".join(job.get("job_names") or [job.get("job_name") or ""]),
                "tokens_per_s_ci95_low": low, "tokens_per_s_ci95_high": high}  # fmt: skip
        rows.append(row)
    return sorted(rows, key=lambda r: (r["rank"] is None, r["rank"] or 0, str(r["job_name"] or "")))


def _numbers(source: Mapping[str, Any], names: tuple[str, ...], prefix: str) -> dict[str, float]:
    return {
        f"{prefix}{name}": float(source[name])
        for name in names
        if isinstance(source.get(name), int | float) and not isinstance(source.get(name), bool)
    }


def best_figures(analysis: Mapping[str, Any]) -> dict[str, float]:
    """``best/<name>`` of the recommended job (none without a recommendation) and the job counts."""
    jobs = analysis.get("jobs") or []
    recommended = (analysis.get("recommendation") or {}).get("job_name")
    best = next((j for j in jobs if j.get("job_name") == recommended), None)
    figures = _numbers(best, BEST_FIGURES, "best/") if best else {}
    figures["jobs"] = float(len(jobs))
    figures["jobs_ranked"] = float(sum(1 for j in jobs if j.get("rank") is not None))
    if isinstance(analysis.get("total_billed_usd"), int | float):
        figures["total_billed_usd"] = float(analysis["total_billed_usd"])
    return figures


def run_settings(manifest: Mapping[str, Any]) -> dict[str, str]:
    """A manifest's settings as flat params: nested keys joined with dots (``training.max_steps``); a list of
    mappings that each have a distinct ``name`` keyed by it (``variants.b4-a1.per_device_batch_size``), another list
    of mappings by position (``targets.0.instance_type``); other lists as JSON; None left out; values cut to MLflow's
    6,000 characters."""
    out: dict[str, str] = {}

    def walk(key: str, value: Any) -> None:
        if value is None:
            return
        if isinstance(value, Mapping):
            if not value and key:
                out[key] = "{}"
            for name, item in value.items():
                walk(f"{key}.{name}" if key else str(name), item)
            return
        if isinstance(value, list) and value and all(isinstance(item, Mapping) for item in value):
            names = [item.get("name") for item in value]
            by_name = all(isinstance(n, str) and n for n in names) and len(set(names)) == len(names)
            for index, item in enumerate(value):
                rest = {k: v for k, v in item.items() if not (by_name and k == "name")}
                walk(f"{key}.{item['name'] if by_name else index}", rest)
            return
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        out[_NOT_IN_KEYS.sub("_", key)[:MLFLOW_KEY_MAX_CHARS]] = text[:MLFLOW_PARAM_MAX_CHARS]

    walk("", manifest)
    return out


@contextlib.contextmanager
def library_output_to(log: Path | None) -> Iterator[None]:
    """Everything printed while inside, by Python code or by a process started inside (W&B's service), appended to
    ``log`` instead of this process's stdout and stderr; nothing changes without a log."""
    if log is None:
        yield
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with log.open("a", encoding="utf-8") as out:
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                    yield
            finally:
                out.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    finally:
        for fd in saved:
            os.close(fd)


def csv_cell(value: object) -> object:
    """A CSV cell as JSON spells the value: true/false (not Python's True/False), lists and dicts as JSON, None
    empty. Used by every CSV gpuscout writes (ranked_results.csv, ``--format csv``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple | dict):
        return json.dumps(value)
    return "" if value is None else value


def _write_files(analysis: Mapping[str, Any], folder: Path) -> list[Path]:
    """ranked_results.json, ranked_results.csv and analysis.json in ``folder``."""
    rows = ranked_rows(analysis)
    ranked_json = folder / "ranked_results.json"
    ranked_json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    ranked_csv = folder / "ranked_results.csv"
    with ranked_csv.open("w", newline="", encoding="utf-8") as out:
        writer = csv.DictWriter(out, fieldnames=RANKED_COLUMNS)
        writer.writeheader()
        writer.writerows({k: csv_cell(v) for k, v in row.items()} for row in rows)
    full = folder / "analysis.json"
    full.write_text(json.dumps(analysis, indent=2, default=str) + "\n", encoding="utf-8")
    return [ranked_json, ranked_csv, full]


def run_to_track(run: RunRecord, result: ResultRecord | None) -> tuple[TrackingSection, RunAnalysis]:
    """What ``gpuscout track`` logs for a stored run: its manifest's tracking section (defaults filled in) and its
    analysis. GpuscoutError when the run has no analysis yet or its manifest tracks nothing."""
    if result is None:
        raise GpuscoutError(
            f"run {run.run_id} has no analysis yet (status {run.status.value}); its results can be tracked once it "
            "has ended and been analysed"
        )
    raw = (run.manifest or {}).get("tracking")
    if not raw:
        raise GpuscoutError(
            f"the manifest of run {run.run_id} ({run.manifest_source}) has no tracking section: nothing to log to "
            "(add `tracking:` to the manifest for the next run; docs/search.md)"
        )
    # only the tracking section: the rest of a stored manifest may predate this gpuscout's schema or catalog
    try:
        tracking = TrackingSection.model_validate(raw)
    except ValidationError as err:
        raise GpuscoutError(f"the stored tracking section of run {run.run_id} is not valid here: {err}") from err
    return tracking.resolved(str((run.manifest or {}).get("name") or run.name)), result.analysis


@dataclass(frozen=True)
class RunExtras:
    """What log_run adds beside the analysis: the run's settings (its manifest, as a mapping) and, for a local run,
    each job's log files (job name -> paths), and the file the tracker libraries' own output goes to."""

    settings: Mapping[str, Any] = field(default_factory=dict)
    job_logs: Mapping[str, list[Path]] = field(default_factory=dict)
    output_log: Path | None = None


def log_run(
    run_id: str,
    run_analysis: RunAnalysis,
    report_dir: Path | None,
    destinations: Destinations,
    extras: RunExtras | None = None,
) -> TrackingOutcome:
    """Log a run's analysis, its report folder (when it exists) and the ``extras`` to each destination (module
    docstring). The trackers take JSON: the analysis is dumped here, at their edge."""
    analysis = run_analysis.model_dump(mode="json")
    outcome = TrackingOutcome()
    extras = extras or RunExtras()
    report = report_dir if report_dir is not None and report_dir.is_dir() else None
    with tempfile.TemporaryDirectory(prefix="gpuscout-tracking-") as tmp, library_output_to(extras.output_log):
        files = _write_files(analysis, Path(tmp))
        if destinations.mlflow is not None:
            try:
                outcome.logged.append(_log_mlflow(run_id, analysis, files, report, destinations.mlflow, extras=extras))
            except Exception as err:  # a tracker's failure is reported, never raised
                outcome.problems.append(f"MLflow: the run's results were not logged ({type(err).__name__}: {err})")
        if destinations.wandb is not None:
            try:
                outcome.logged.append(_log_wandb(run_id, analysis, files, report, destinations.wandb, extras=extras))
            except Exception as err:
                outcome.problems.append(f"W&B: the run's results were not logged ({type(err).__name__}: {err})")
    return outcome


def _log_mlflow(
    run_id: str,
    analysis: Mapping[str, Any],
    files: list[Path],
    report: Path | None,
    dest: MlflowDestination,
    *,
    extras: RunExtras,
) -> str:
    bound_mlflow_retries()
    import mlflow
    from mlflow.entities import Metric, Param, RunTag

    prepare_mlflow_uri(dest.tracking_uri, mlflow)
    client = mlflow.MlflowClient(tracking_uri=dest.tracking_uri)
    experiment_id = mlflow_experiment_id(client, dest)
    of_run = f"tags.`{RUN_ID_TAG}` = '{run_id}'"
    found = client.search_runs([experiment_id], f"{of_run} and tags.`{LEVEL_TAG}` = 'run'", max_results=1)
    if found:
        parent = found[0].info.run_id
    else:
        parent = client.create_run(
            experiment_id, run_name=run_id, tags={RUN_ID_TAG: run_id, LEVEL_TAG: "run"}
        ).info.run_id
    now = int(time.time() * 1000)
    job_runs = client.search_runs(
        [experiment_id], f"{of_run} and tags.`{LEVEL_TAG}` = 'job'", max_results=MLFLOW_MAX_RESULTS
    )
    by_name = {r.data.tags.get(JOB_NAME_TAG): r for r in job_runs}
    for job in analysis.get("jobs") or []:
        figures = _numbers(job, JOB_FIGURES, "analysis/")
        job_tags = _job_tags(job)
        for name in job.get("job_names") or [job.get("job_name")]:
            if name in by_name and (figures or job_tags):
                metrics = [Metric(k, v, now, 0) for k, v in figures.items()]
                client.log_batch(by_name[name].info.run_id, metrics=metrics, tags=job_tags)
    for name, paths in extras.job_logs.items():
        if name in by_name:
            for path in paths:
                client.log_artifact(by_name[name].info.run_id, str(path), artifact_path="logs")
    params = [Param(k, v) for k, v in run_settings(extras.settings).items()]
    for start in range(0, len(params), MLFLOW_BATCH_PARAMS):
        client.log_batch(parent, params=params[start : start + MLFLOW_BATCH_PARAMS])
    for job_run in job_runs:
        client.set_tag(job_run.info.run_id, MLFLOW_PARENT_TAG, parent)
        if job_run.info.status == "RUNNING":  # its process was stopped before it could end the run
            client.set_terminated(job_run.info.run_id, "KILLED")
    recommendation = analysis.get("recommendation") or {}
    tags = [
        RunTag("gpuscout.objective", str(analysis.get("objective"))),
        RunTag("gpuscout.unit", str(analysis.get("unit"))),
    ]
    if recommendation:
        tags.append(RunTag("gpuscout.recommendation", str(recommendation.get("summary"))[:MLFLOW_TAG_MAX_CHARS]))
        tags.append(RunTag("gpuscout.verdict", str(recommendation.get("verdict"))))
        tags.append(RunTag("gpuscout.recommended_job", str(recommendation.get("job_name"))))
    metrics = [Metric(k, v, now, 0) for k, v in best_figures(analysis).items()]
    client.log_batch(parent, metrics=metrics, tags=tags)
    for path in files:
        client.log_artifact(parent, str(path))
    if report is not None:
        client.log_artifacts(parent, str(report), artifact_path="report")
    client.set_terminated(parent, "FINISHED")
    return (
        f"MLflow: run {run_id} ({len(job_runs)} job run(s) nested) in experiment {dest.experiment!r} at "
        f"{dest.tracking_uri}"
    )


def _job_tags(job: Mapping[str, Any]) -> list[Any]:
    """Why a job run was not ranked, as tags (a pruned trial's reason also under its own name)."""
    from mlflow.entities import RunTag

    reason = job.get("excluded_reason")
    if not reason:
        return []
    tags = [RunTag("gpuscout.excluded_reason", str(reason)[:MLFLOW_TAG_MAX_CHARS])]
    if job.get("status") == "pruned":
        tags.append(RunTag("gpuscout.pruned_reason", str(job.get("failure") or reason)[:MLFLOW_TAG_MAX_CHARS]))
    return tags


def _log_wandb(
    run_id: str,
    analysis: Mapping[str, Any],
    files: list[Path],
    report: Path | None,
    dest: WandbDestination,
    *,
    extras: RunExtras,
) -> str:
    import wandb

    Path(dest.dir).mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=dest.project,
        entity=dest.entity,
        name=f"{run_id}-analysis",
        group=run_id,
        job_type="analysis",
        dir=dest.dir,
        mode=dest.mode,
        config={
            "run_id": run_id,
            "run_name": analysis.get("run_name"),
            "objective": analysis.get("objective"),
            "unit": analysis.get("unit"),
            "settings": dict(extras.settings),
        },
        settings=wandb.Settings(silent=True, console="off", x_disable_stats=True, save_code=False),
    )
    try:
        rows = ranked_rows(analysis)
        table = wandb.Table(columns=list(RANKED_COLUMNS), data=[[row[c] for c in RANKED_COLUMNS] for row in rows])
        run.log({"ranked_results": table})
        recommendation = analysis.get("recommendation") or {}
        run.summary.update({**best_figures(analysis), "recommendation": recommendation.get("summary"),
                            "verdict": recommendation.get("verdict")})  # fmt: skip
        # copies inside the run folder: `wandb sync` uploads them from wherever the folder is
        copies = [(path, Path(run.dir) / path.name) for path in files]
        if report is not None:
            copies += [(f, Path(run.dir) / "report" / f.relative_to(report)) for f in report.rglob("*") if f.is_file()]
        for source, copy in copies:
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, copy)
            run.save(str(copy), base_path=run.dir, policy="now")
        if dest.log_artifacts:
            artifact = wandb.Artifact(f"report-{run_id}", type="report")
            for path in files:
                artifact.add_file(str(path), name=path.name)
            if report is not None:
                artifact.add_dir(str(report), name="report")
            run.log_artifact(artifact)
    except BaseException:
        run.finish(exit_code=1)
        raise
    run.finish()
    where = f"{Path(dest.dir) / 'wandb'} (upload: wandb sync)" if dest.mode == "offline" else "online"
    return f"W&B: run {run_id}-analysis in project {dest.project!r}, group {run_id}: {where}"
