"""Domain exceptions. Every error gpuscout raises on purpose derives from GpuscoutError.

The CLI turns a GpuscoutError into one readable message and a non-zero exit code; anything else is a bug.
Chain the underlying cause with ``raise ... from err``.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source = source
        self.problems = list(problems)
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
