"""How the CLI shows things in a terminal: status colours and the width of piped output (rich only)."""

from __future__ import annotations

import os

from rich.console import Console

PIPED_WIDTH = 160  # tables piped to a file or a test would otherwise wrap at 80 columns

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
