"""The errors the workflow's Lambda steps raise (their names are what the state machine's Catch and Choice states and
the Lambda handlers match)."""

from __future__ import annotations

from gpuscout.errors import GpuscoutError


class ManifestRejected(GpuscoutError):  # noqa: N818 - the state machine's Catch matches this exact name
    """The manifest is invalid; nothing was launched. The message is the cause the execution fails with."""

    exit_code = 2


class PlanRefused(GpuscoutError):  # noqa: N818 - the state machine's Catch matches this exact name
    """The manifest is valid but the run was not launched (over budget, or already planned)."""


class CloudStepError(GpuscoutError):
    """An AWS call of a workflow step failed."""
