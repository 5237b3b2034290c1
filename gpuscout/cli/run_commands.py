"""``gpuscout compare`` (several runs' jobs in one ranking) and ``gpuscout delete`` (remove local runs).

``register(app)`` adds them to the main typer app (gpuscout/cli/app.py), whose command group turns every GpuscoutError
into one red line and an exit code.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from gpuscout.cli.console_style import Column, responsive_table
from gpuscout.cli.options import CloudStackOption, DbOption, OutputFormat, open_store, write_csv
from gpuscout.errors import GpuscoutError
from gpuscout.store.base import FINAL_RUN_STATUSES, RunRecord
from gpuscout.store.sqlite import SqliteStore

console = Console()
err_console = Console(stderr=True)


def compare_cmd(
    run_ids: Annotated[list[str], typer.Argument(help="Two or more run ids (see `gpuscout runs`).", metavar="RUN_ID")],
    db: DbOption = None,
    stack_name: CloudStackOption = None,
    fmt: Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")] = OutputFormat.TABLE,
) -> None:
    """Rank the jobs of several runs together by $ per 1M tokens: e.g. one run per sequence length. Untrusted
    measurements are listed, never ranked; a difference is quoted only where the 95 % intervals do not overlap."""
    from gpuscout.analysis.compare import compare_runs

    store = open_store(db, stack_name, read_only=True)
    runs = [(store.get_run(run_id), store.get_result(run_id)) for run_id in dict.fromkeys(run_ids)]
    comparison = compare_runs(runs)
    rows = [job.as_row() for job in comparison.jobs]
    if fmt is OutputFormat.JSON:
        sys.stdout.write(json.dumps({"unit": comparison.unit, "notes": comparison.notes, "jobs": rows}, indent=2))
        sys.stdout.write("\n")
        return
    if fmt is OutputFormat.CSV:
        write_csv(rows, fields=list(rows[0]) if rows else ["run_id"])
        return
    unit = comparison.unit
    columns = [
        Column("rank", justify="right", whole=True),
        Column("run", whole=True),
        Column("seq", justify="right", whole=True),
        Column("variant"),
        Column("instance"),
        Column(f"{unit}/s ± CI95", justify="right", whole=True),
        Column(f"$ / 1M {unit}", justify="right", whole=True),
        Column("vs best"),
        Column("not ranked because", notes=True),
    ]
    cells = []
    for job in comparison.jobs:
        row = job.as_row()
        rate, low, high = row["rate"], row["rate_ci95_low"], row["rate_ci95_high"]
        rate_text = "-" if rate is None else f"{rate:,.0f}"
        if rate is not None and low is not None and high is not None:
            rate_text += f" ± {(high - low) / 2:,.0f}"
        count = f" x{row['instance_count']}" if row["instance_count"] > 1 else ""
        cells.append(
            [
                str(row["rank"]) if row["rank"] is not None else "-",
                escape(job.run_id),
                "-" if row["sequence_length"] is None else str(row["sequence_length"]),
                escape(str(row["variant"])),
                escape(f"{row['instance_type']}{count}{' (spot)' if row['spot'] else ''}"),
                rate_text,
                "-" if row["usd_per_million"] is None else f"{row['usd_per_million']:,.4f}",
                escape(row["versus_best"] or ""),
                escape(row["not_ranked"] or ""),
            ]
        )
    for note in comparison.notes:
        console.print(f"[yellow]note:[/] {escape(note)}", soft_wrap=True)
    responsive_table(console, f"{len(runs)} runs compared", columns, cells, key=3)


def _live(run: RunRecord) -> bool:
    from gpuscout.local.closing import is_abandoned

    return run.status not in FINAL_RUN_STATUSES and not is_abandoned(run)


def _run_folder(run: RunRecord) -> Path | None:
    """The run's own folder, only where it is one: a directory named after the run (never a path a record could
    point anywhere else)."""
    if run.run_dir is None:
        return None
    folder = Path(run.run_dir)
    return folder if folder.is_dir() and folder.name == run.run_id and not folder.is_symlink() else None


def delete_cmd(
    run_ids: Annotated[list[str], typer.Argument(help="Run ids to delete (see `gpuscout runs`).", metavar="RUN_ID")],
    db: DbOption = None,
    keep_files: Annotated[
        bool, typer.Option("--keep-files", help="Delete the database rows only; keep each run's folder.")
    ] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Delete local runs: their rows in the result database and their folders (prepared data, job output,
    reports). A run still in progress is refused. Cloud runs stay in their stack's table."""
    store = SqliteStore(db, create=False)
    runs = [store.get_run(run_id) for run_id in dict.fromkeys(run_ids)]  # every id must exist before anything goes
    live = [run.run_id for run in runs if _live(run)]
    if live:
        raise GpuscoutError(
            f"{', '.join(live)} still running (its process is alive); stop it first (Ctrl-C in its terminal), then "
            "delete it"
        )
    folders = {run.run_id: None if keep_files else _run_folder(run) for run in runs}
    for run in runs:
        folder = folders[run.run_id]
        where = f" and {folder}" if folder is not None else ""
        console.print(f"delete {escape(run.run_id)} ({escape(run.name)}, {run.status.value}){escape(where)}")
    if not yes:
        if not sys.stdin.isatty():
            raise GpuscoutError("not a terminal, so nothing to confirm with: pass --yes to delete")
        typer.confirm(f"Delete {len(runs)} run(s)?", abort=True)
    for run in runs:
        store.delete_run(run.run_id)  # the rows first: a folder left behind is harmless, a row without it is not
        if (folder := folders[run.run_id]) is not None:
            shutil.rmtree(folder)
    console.print(f"[green]deleted[/] {len(runs)} run(s)")


def register(app: typer.Typer) -> None:
    app.command(name="compare")(compare_cmd)
    app.command(name="delete")(delete_cmd)
