"""What several commands share: the result-store options and opening the store, the output formats, CSV output.

Here, not in app.py, so command modules (run_commands.py) and app.py use one definition.
"""

from __future__ import annotations

import csv
import io
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from gpuscout.store.base import ResultStore
from gpuscout.store.sqlite import SqliteStore

DbOption = Annotated[
    Path | None,
    typer.Option(
        "--db",
        envvar="GPUSCOUT_DB",
        help="SQLite result database (default: $GPUSCOUT_HOME/gpuscout.db, i.e. ~/.gpuscout/gpuscout.db).",
        dir_okay=False,
    ),
]
ManifestArg = Annotated[Path, typer.Argument(help="Manifest file (YAML or JSON).", dir_okay=False, metavar="FILE")]
CloudStackOption = Annotated[
    str | None,
    typer.Option(
        "--stack-name",
        help="Read cloud runs from this deployed stack (its DynamoDB table and S3 reports) instead of --db.",
    ),
]


def open_store(db: Path | None, stack_name: str | None = None, *, read_only: bool = False) -> ResultStore:
    """The result store: a deployed stack's, or the SQLite file. Read-only commands never create the file."""
    if stack_name:
        from gpuscout.cloud.client import CloudStack

        return CloudStack(stack_name).store
    return SqliteStore(db, create=not read_only)


class OutputFormat(StrEnum):
    TABLE = "table"
    JSON = "json"
    CSV = "csv"


def write_csv(rows: list[dict[str, Any]], *, fields: list[str]) -> None:
    """``rows`` as CSV on stdout, a header line first (booleans, lists and dicts as JSON spells them, None as
    empty)."""
    from gpuscout.analysis.tracking import csv_cell

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: csv_cell(v) for k, v in row.items()})
    sys.stdout.write(buffer.getvalue())
