"""The errors the workflow's Lambda steps raise, and the refusal a step's handler returns instead of raising one.

A rejected manifest or a refused plan is the user's input, not a failure of the system: the Validate and Plan
handlers return ``{"run_id", "refused": {"Error", "Cause"}}`` (the run row already says REJECTED or REFUSED, with why),
and the state machine's "Manifest valid?" / "Plan accepted?" Choice ends the execution in a Fail state with that
error and cause. So a refusal is not a Lambda error (the functions' error alarms stay for unexpected ones)."""

from __future__ import annotations

from typing import Any

from gpuscout.errors import GpuscoutError


class ManifestRejected(GpuscoutError):  # noqa: N818 - the state machine's Catch matches this exact name
    """The manifest is invalid; nothing was launched. The message is the cause the execution fails with."""

    exit_code = 2

    def __init__(self, run_id: str | None, message: str) -> None:
        super().__init__(message)
        self.run_id = run_id


class PlanRefused(GpuscoutError):  # noqa: N818 - the state machine's Catch matches this exact name
    """The manifest is valid but the run was not launched (over budget, or already planned)."""


class CloudStepError(GpuscoutError):
    """An AWS call of a workflow step failed."""


REFUSAL_KEY = "refused"


def refusal(run_id: str | None, error: ManifestRejected | PlanRefused) -> dict[str, Any]:
    """What a Validate or Plan handler returns for ``error``."""
    return {"run_id": run_id, REFUSAL_KEY: {"Error": type(error).__name__, "Cause": str(error)}}
