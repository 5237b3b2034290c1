"""Terminal output that holds at any width: `runs` and `results` rendered
at 60, 80 and 120 columns keep every status, id and number whole; notes wrap below the table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_cli import RUN_ID, _stored_run
from typer.testing import CliRunner

from gpuscout.cli import app as cli
from gpuscout.store.base import RunStatus
from gpuscout.store.sqlite import SqliteStore

WIDTHS = [60, 80, 120]


def _run(width: int, *args: str) -> str:
    result = CliRunner(env={"COLUMNS": str(width)}).invoke(cli.app, list(args))
    assert result.exit_code == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert all(len(line) <= width for line in lines), f"a line wider than {width} columns"
    return result.stdout


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "gpuscout.db"
    _stored_run(path)
    store = SqliteStore(path)
    run = store.get_run(RUN_ID)
    # the case seen: a long note squeezed status, name, jobs and cost to width 0, and ABANDONED never showed
    store.put_run(run.model_copy(update={"status": RunStatus.STOPPED, "error": "interrupted by Ctrl-C " * 12}))
    store.put_run(run.model_copy(update={"run_id": "other-20250302-080000-def456", "status": RunStatus.RUNNING,
                                         "pid": 2**22 + 7, "host": "this-host-name", "error": None}))  # fmt: skip
    return path


@pytest.mark.parametrize("width", WIDTHS)
def test_runs_shows_every_runs_status_id_and_numbers_whole(db: Path, width: int, monkeypatch) -> None:
    import gpuscout.local.closing as closing

    monkeypatch.setattr(closing, "is_abandoned", lambda run: run.run_id.startswith("other"))
    out = _run(width, "runs", "--db", str(db))
    for whole in (RUN_ID, "other-20250302-080000-def456", "STOPPED", "ABANDONED", "0.0010"):
        assert whole in out, f"{whole!r} is cut or missing at {width} columns:\n{out}"
    assert len(re.findall(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", out)) == 2  # each creation time whole
    assert "interrupted by Ctrl-C" in out and "is gone; close it with" in " ".join(out.split())
    assert "…" not in out


@pytest.mark.parametrize("width", WIDTHS)
def test_results_keeps_rates_costs_and_statuses_whole(db: Path, width: int) -> None:
    out = _run(width, "results", RUN_ID, "--db", str(db))
    assert re.search(r"9,000(?: ± [\d,]+)?", out) and re.search(r"6,000(?: ± [\d,]+)?", out)
    assert "completed" in out.lower() and "failed" in out.lower()
    assert re.search(r"0\.00\d\d", out)  # $ per 1M tokens, four decimals, whole
    assert "…" not in out and "24,…" not in out
    assert "per_device_train_batch_size must be >= 1" in " ".join(out.split())  # the failed job's note, whole


def test_a_pruned_trials_clock_stops_when_it_ends() -> None:
    """A trial stopped short of its last step (pruned) keeps its short bar, but its elapsed time no longer runs."""
    import io

    from rich.console import Console

    from gpuscout.cli.local_view import RichRunObserver
    from gpuscout.domain.jobspec import JobSpec
    from gpuscout.store.base import JobStatus
    from gpuscout.workflow.ports import JobOutcome

    spec = JobSpec.model_construct(job_name="gs-t0v1", variant_name="b4")
    observer = RichRunObserver(Console(file=io.StringIO(), width=80))
    with observer.jobs_running():
        observer.job_started(1, 6, spec, 20)
        progress = observer._progress
        assert progress is not None
        task = progress.tasks[0]
        observer.job_finished(spec, JobOutcome(JobStatus.PRUNED, None, "pruned after 4 timed steps", 1.0))
        assert task.stop_time is not None and not task.finished  # stopped at its step, not drawn as complete
        assert task.description.startswith("job 1/6 b4")


@pytest.mark.parametrize("width", WIDTHS)
def test_plan_keeps_job_names_precisions_and_numbers_whole(width: int) -> None:
    # the case seen at 80 columns: job names folded over four lines and the header cut to "precisi…"
    from test_cli import QUICKSTART

    out = _run(width, "plan", str(QUICKSTART))
    assert len(re.findall(r"gs-[0-9a-f]{10}-t0v\dr0-local-b\d-a\d(?:-nopack)?\b", out)) == 3  # each job name whole
    assert out.count("fp32") == 3 and "precision" in out
    assert re.search(r"total \(3 jobs\)", out) and re.search(r"\b0\.000\d\b", out)
    assert "…" not in out


def test_the_closing_next_line_offers_only_what_the_run_has(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from gpuscout.cli.local_view import RichRunObserver

    store = _stored_run(tmp_path / "g.db")
    run = store.get_run(RUN_ID)
    for report, status, expected in ((tmp_path / "report.md", RunStatus.SUCCEEDED, f"gpuscout report {RUN_ID}"),
                                     (None, RunStatus.FAILED, f"gpuscout delete {RUN_ID}")):  # fmt: skip
        out = io.StringIO()
        RichRunObserver(Console(file=out, width=200)).finished(
            run.model_copy(update={"status": status}), None, store.list_jobs(RUN_ID), report
        )
        (line,) = [line for line in out.getvalue().splitlines() if line.startswith("next:")]
        assert line == f"next: gpuscout results {RUN_ID}   {expected}"  # a failed run has no report to offer


def test_mfu_says_why_it_is_missing() -> None:
    from gpuscout.cli.local_view import _mfu_text

    assert _mfu_text({"mfu": 0.4213, "gpus": 8}) == "42.1 %"
    assert _mfu_text({"mfu": None, "gpus": 0, "status": "completed"}) == "n/a (CPU)"
    # a failed A10G job measured nothing: not "unknown GPU" (its GPU is known)
    assert _mfu_text({"mfu": None, "gpus": 1, "status": "FAILED", "gpu_sku": None}) == "–"
    assert _mfu_text({"mfu": None, "gpus": 1, "status": "completed", "gpu_sku": "A10G-24GB"}).startswith(
        "n/a (A10G-24GB: no dense peak"
    )
    assert _mfu_text({"mfu": None, "gpus": 1, "status": "completed", "gpu_sku": None}) == "n/a (unknown GPU)"


def test_outside_a_terminal_a_running_job_says_where_it_is_every_30_seconds() -> None:
    import io

    from rich.console import Console

    from gpuscout.cli import local_view
    from gpuscout.cli.local_view import RichRunObserver
    from gpuscout.domain.jobspec import JobSpec
    from gpuscout.local.job_process import JobProgress

    now = [0.0]
    out = io.StringIO()  # a file, not a terminal: a progress bar would show only when it ends
    observer = RichRunObserver(Console(file=out, width=120), clock=lambda: now[0])
    spec = JobSpec.model_construct(job_name="gs-t0v1", variant_name="b4")
    with observer.jobs_running():
        observer.job_started(1, 3, spec, 100)
        for second in range(0, 95, 5):  # a metric line every 5 s for 95 s
            now[0] = float(second)
            observer.job_progress(spec, JobProgress(step=second, tokens_per_s=1234.0), 100)
    lines = [line for line in out.getvalue().splitlines() if line.startswith("job 1/3 b4")]
    assert lines[0] == "job 1/3 b4 started (gs-t0v1)"
    progress = [line for line in lines[1:] if "step" in line and "━" not in line]  # not the bar drawn at the end
    assert len(progress) == 3 and local_view.PLAIN_PROGRESS_EVERY_S == 30.0  # at 30, 60 and 90 s
    assert "step 30" in progress[0] and "step 90" in progress[2]
