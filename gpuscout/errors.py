"""Domain exceptions. Every error gpuscout raises on purpose derives from GpuscoutError.

The CLI turns a GpuscoutError into one readable message and a non-zero exit code; anything else is a bug.
Chain the underlying cause with ``raise ... from err``.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path


class GpuscoutError(Exception):
    """Base class of every expected, user-facing error."""

    exit_code: int = 1


@dataclass(frozen=True)
class Problem:
    """One problem in an input file: where (dotted field path, e.g. ``targets[1].instance_type``) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ManifestError(GpuscoutError):
    """A manifest could not be read or is invalid. Carries every problem found, not just the first."""

    exit_code = 2

    def __init__(self, source: str, problems: list[Problem], *, manifest_name: str | None = None) -> None:
        self.source = source
        self.problems = list(problems)
        self.manifest_name = manifest_name  # a valid manifest's name, when a check of where it runs refused it
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source}: {len(self.problems)} problem(s)\n{lines}")

    def to_dict(self) -> dict[str, object]:
        return {
            "file": self.source,
            "problems": [{"path": p.path, "message": p.message} for p in self.problems],
        }


class CatalogError(GpuscoutError):
    """The instance catalog (configs/instances/*.json) is missing, malformed or inconsistent."""


class PlanError(GpuscoutError):
    """A manifest is valid but cannot be planned (e.g. the model does not fit the instance): a refusal, exit 3."""

    exit_code = 3


class JobsRefusedError(PlanError):
    """The planner refused one or more jobs; ``refusals`` holds each one's line (where, variant, why)."""

    def __init__(self, refusals: list[str]) -> None:
        self.refusals = refusals
        if len(refusals) == 1:
            super().__init__(refusals[0])
        else:
            super().__init__(f"{len(refusals)} jobs cannot be planned:\n" + "\n".join(f"  - {r}" for r in refusals))


class BudgetExceededError(PlanError):
    """The predicted cost of a plan exceeds the manifest's budget."""

    def __init__(self, predicted_usd: float, budget_usd: float) -> None:
        self.predicted_usd = predicted_usd
        self.budget_usd = budget_usd
        super().__init__(
            f"predicted cost ${predicted_usd:,.2f} exceeds the budget of ${budget_usd:,.2f}; "
            "lower max_steps, drop targets or variants, or raise constraints.budget_usd"
        )


class StoreError(GpuscoutError):
    """The result store could not be read or written."""


class RunNotFoundError(StoreError):
    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        super().__init__(f"no run with id {run_id!r}; `gpuscout runs` lists the known runs")


class RunExistsError(StoreError):
    def __init__(self, run_id: str, status: str) -> None:
        self.run_id = run_id
        self.status = status
        super().__init__(f"run {run_id!r} already exists ({status})")


class DataPreparationError(GpuscoutError):
    """Raw data could not be read, cleaned or tokenized."""


class TrainingError(GpuscoutError):
    """A training job failed."""


class PricingError(GpuscoutError):
    """No price could be found for an instance type."""


# ENOSPC (the disk is full) and EDQUOT (the user's quota on it is), as errno numbers and as text: the C library's
# words appear in Python's OSError, in Rust's io::Error (the tokenizers library: "No space left on device (os error
# 28)") and in a child process's log; SQLite says "database or disk is full".
_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_DISK_FULL_TEXTS = (*(os.strerror(n) for n in sorted(_DISK_FULL_ERRNOS)), "database or disk is full")


def _chain(err: BaseException) -> list[BaseException]:
    """The exception and those it was raised from or during, outermost first."""
    chain: list[BaseException] = []
    seen: BaseException | None = err
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    return chain


def is_disk_full(err: BaseException) -> bool:
    """Whether an exception, or one it was raised from, says that a disk (or the user's quota on it) is full."""
    return any((isinstance(e, OSError) and e.errno in _DISK_FULL_ERRNOS) or says_disk_full(str(e)) for e in _chain(err))


def disk_full_file(err: BaseException) -> str | None:
    """The file a full disk refused, as the OSError in the exception's chain names it (None when none does)."""
    return next((str(e.filename) for e in _chain(err) if isinstance(e, OSError) and e.filename), None)


def says_disk_full(text: str) -> bool:
    """Whether a message (an exception's, a child process's log line) says that a disk or quota is full."""
    return any(words in text for words in _DISK_FULL_TEXTS)


def free_space_text(path: str | Path) -> str:
    """``"12 KiB free"`` on the disk holding ``path`` (its nearest existing folder), or ``""`` when unknown."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        free = float(shutil.disk_usage(folder).free)
    except OSError:
        return ""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if free < 1024 or unit == "GiB":
            return f"{free:,.0f} {unit} free" if unit == "bytes" else f"{free:,.1f} {unit} free"
        free /= 1024
    return ""  # pragma: no cover - the loop returns


DISK_FULL = "no space left on the disk holding"  # how gpuscout's own messages begin, for those who read them back


def disk_full_at(path: str | Path) -> str:
    """``"no space left on the disk holding PATH (N free)"``: the head of every full-disk message gpuscout writes."""
    free = free_space_text(path)
    return f"{DISK_FULL} {path}{f' ({free})' if free else ''}"


class DiskFullError(GpuscoutError):
    """A disk (or the user's quota on it) filled up while gpuscout wrote ``path``."""

    def __init__(
        self, path: str | Path, doing: str, *, hint: str = "free space there or choose another folder"
    ) -> None:
        self.path = Path(path)
        super().__init__(f"{disk_full_at(path)} while {doing}; {hint}")
