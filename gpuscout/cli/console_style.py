"""How the CLI shows things in a terminal: status colours and the width of piped output (rich only)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

PIPED_WIDTH = 160  # tables piped to a file or a test would otherwise wrap at 80 columns
FOLDED_MIN_WIDTH = 4  # the narrowest a folding column of a responsive_table is counted at

STATUS_COLOURS = {
    "SUCCEEDED": "green",
    "COMPLETED": "green",
    "FAILED": "red",
    "OOM": "red",
    "REJECTED": "red",
    "REFUSED": "yellow",
    "STOPPED": "yellow",
    "ABANDONED": "magenta",
    "CAPACITY": "yellow",
    "QUOTA": "yellow",
    "TRAINING": "cyan",
    "RUNNING": "cyan",
}


def number_cell(value: float | None, fmt: str) -> str:
    """A table cell for a number that may be missing: ``fmt`` applied, or "-"."""
    return "-" if value is None else fmt.format(value)


def status_markup(status: str) -> str:
    """A run or job status in its colour (rich markup)."""
    colour = STATUS_COLOURS.get(status)
    return f"[{colour}]{status}[/]" if colour else status


def fit_piped_width(console: Console) -> Console:
    """Piped to a file or a test: use COLUMNS if stated, else a width the tables fit in."""
    if not console.is_terminal:
        columns = os.environ.get("COLUMNS", "")
        console.width = int(columns) if columns.isdigit() else PIPED_WIDTH
    return console


@dataclass(frozen=True)
class Column:
    """One column of a :func:`responsive_table`: ``whole`` columns (ids, statuses, numbers) are never shortened;
    the others fold onto more lines; ``notes`` columns leave the table and print below it, one line per row."""

    header: str
    justify: str = "left"
    whole: bool = False
    notes: bool = False


def _cell_width(cell: str) -> int:
    return max((Text.from_markup(line).cell_len for line in cell.splitlines()), default=0)


def responsive_table(
    console: Console, title: str, columns: Sequence[Column], rows: Sequence[Sequence[str]], *, key: int = 0
) -> None:
    """Print ``rows`` (rich markup cells) as a table whose whole columns keep every character at any terminal width.

    Note columns print below the table (``<key cell>: note``), wrapped at the terminal's width. When even the whole
    columns do not fit side by side, each row prints as a short block instead: its key cell, then ``header: value``
    pairs, so a status or a number is never cut to ``24,…``."""
    table_columns = [c for c in columns if not c.notes]
    at = [i for i, c in enumerate(columns) if not c.notes]
    # a whole column needs its widest cell or header; a folding one gives way down to FOLDED_MIN_WIDTH
    widths = [
        max([len(c.header)] + [_cell_width(r[i]) for r in rows]) if c.whole else FOLDED_MIN_WIDTH
        for i, c in zip(at, table_columns, strict=True)
    ]
    need = sum(widths) + 3 * len(table_columns) + 1  # + the borders and padding between columns
    notes = [(row[key], i, row[i]) for row in rows for i, c in enumerate(columns) if c.notes and row[i]]
    if need <= console.width:
        table = Table(title=title, title_justify="left")
        for c, width in zip(table_columns, widths, strict=True):
            table.add_column(
                c.header, justify=c.justify, no_wrap=c.whole, min_width=width if c.whole else None,  # type: ignore[arg-type]
                overflow="fold",
            )  # fmt: skip
        for row in rows:
            table.add_row(*(row[i] for i in at))
        console.print(table)
        for who, i, text in notes:
            console.print(Text.from_markup(f"{who} {columns[i].header}: {text}"))
        return
    console.print(Text(title, style="italic"))
    for row in rows:
        console.print(Text.from_markup(row[key], style="bold"))
        pairs = [f"{c.header}: {row[i]}" for i, c in enumerate(columns) if i != key and row[i] and not c.notes]
        joined = Text.from_markup(" · ".join(pairs))
        if joined.cell_len + 2 <= console.width:
            console.print(Padding(joined, (0, 0, 0, 2)))
        else:  # one pair per line: a value never splits across lines between its words
            for pair in pairs:
                console.print(Padding(Text.from_markup(pair), (0, 0, 0, 2)))
        for i, c in enumerate(columns):
            if c.notes and row[i]:
                console.print(Padding(Text.from_markup(f"{c.header}: {row[i]}"), (0, 0, 0, 2)))
