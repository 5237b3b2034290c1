"""Cloud commands of the ``gpuscout`` CLI: ``submit`` a manifest to the deployed stack, ``status`` of a run.

``register(app)`` adds them to the main typer app (gpuscout/cli/app.py), whose command group turns every GpuscoutError
into one red line and an exit code. This module does not import gpuscout.cli.app, so either may be imported first, and
it imports gpuscout.cloud.client (boto3, the manifest model) only when a cloud command runs, so registering the commands
costs the other commands nothing at start-up.
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gpuscout.cli.console_style import fit_piped_width, status_markup
from gpuscout.errors import GpuscoutError, RunNotFoundError
from gpuscout.store.base import JobRecord, RunRecord

# The same values as gpuscout.cloud.client's (tests check); repeated so that importing this module stays light.
DEFAULT_STACK_NAME = "Gpuscout"
DEFAULT_EXECUTION_WAIT_S = 15.0

StackNameOption = Annotated[
    str,
    typer.Option(
        "--stack-name",
        envvar="GPUSCOUT_STACK_NAME",
        help="CloudFormation stack deployed with `npx cdk deploy` (region and credentials: the AWS CLI's).",
    ),
]


class StatusFormat(StrEnum):
    TABLE = "table"
    JSON = "json"


def _console() -> Console:
    return fit_piped_width(Console())


def _tokens_per_s(job: JobRecord) -> float | None:
    throughput = job.benchmark.throughput if job.benchmark else None
    return throughput.tokens_per_s if throughput else None


def _job_row(job: JobRecord) -> dict[str, Any]:
    return {
        "job_name": job.job_name,
        "instance_type": job.instance_type,
        "instance_count": job.instance_count,
        "variant": job.variant_name,
        "canary_for": job.canary_for,  # a canary: the jobs whose configuration it runs first
        "repetition": job.repetition,
        "spot": job.spot,
        "status": job.status.value,
        "billable_seconds": job.billable_seconds,
        "tokens_per_s": _tokens_per_s(job),
        "failure_reason": job.failure_reason,
        "last_event_time": job.last_event_time.isoformat() if job.last_event_time else None,
    }


def status_payload(run: RunRecord, jobs: list[JobRecord]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for job in jobs:
        counts[job.status.value] = counts.get(job.status.value, 0) + 1
    return {
        "run_id": run.run_id,
        "name": run.name,
        "status": run.status.value,
        "created_at": run.created_at.isoformat(),
        "updated_at": run.updated_at.isoformat(),
        "manifest_source": run.manifest_source,
        "predicted_cost_usd": run.predicted_cost_usd,
        "error": run.error,
        "problems": run.problems,
        "job_counts": counts,
        "jobs": [_job_row(job) for job in jobs],
    }


def _printstatus_markup(console: Console, run: RunRecord, jobs: list[JobRecord]) -> None:
    console.print(f"run [bold]{escape(run.run_id)}[/] ({escape(run.name)}): {status_markup(run.status.value)}")
    predicted = f"${run.predicted_cost_usd:,.2f}" if run.predicted_cost_usd is not None else "-"
    console.print(
        f"  manifest {escape(run.manifest_source)}  created {run.created_at:%Y-%m-%d %H:%M:%S} UTC  "
        f"predicted cost {predicted}",
        soft_wrap=True,
    )
    if run.error:
        console.print(f"  [red]{escape(run.error)}[/]", soft_wrap=True)
    for problem in run.problems:
        console.print(f"  [red]-[/] {escape(problem.get('path', ''))}: {escape(problem.get('message', ''))}")
    if not jobs:
        return
    table = Table(title=f"Jobs ({len(jobs)})", title_justify="left")
    for column, justify in (
        ("job", "left"),
        ("instance", "left"),
        ("variant", "left"),
        ("rep", "right"),
        ("spot", "left"),
        ("status", "left"),
        ("billable s", "right"),
        ("tokens/s", "right"),
        ("reason", "left"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for job in jobs:
        tokens = _tokens_per_s(job)
        instance = job.instance_type + (f" x{job.instance_count}" if job.instance_count > 1 else "")
        table.add_row(
            job.job_name,
            instance,
            escape(job.variant_name) + (f" (canary of {len(job.canary_for or [])})" if job.is_canary else ""),
            str(job.repetition),
            "yes" if job.spot else "no",
            status_markup(job.status.value),
            "-" if job.billable_seconds is None else str(job.billable_seconds),
            "-" if tokens is None else f"{tokens:,.0f}",
            escape(job.failure_reason or ""),
        )
    console.print(table)


def submit(
    file: Annotated[Path, typer.Argument(help="Manifest file (YAML or JSON).", dir_okay=False)],
    stack_name: StackNameOption = DEFAULT_STACK_NAME,
    wait: Annotated[
        float,
        typer.Option("--wait", min=0, help="Seconds to wait for the execution to start, to print its console link."),
    ] = DEFAULT_EXECUTION_WAIT_S,
) -> None:
    """Validate a manifest here, upload it to the stack's bucket (which starts the run), print the run id and link."""
    from gpuscout.cloud.client import CloudStack

    console = _console()
    submission = CloudStack(stack_name).submit(file, wait_seconds=wait)
    console.print(
        f"[green]submitted[/] {escape(str(file))} -> {escape(submission.manifest_uri)} "
        + (
            f"(a search: up to {submission.job_count} trial(s))"
            if submission.search
            else f"({submission.job_count} job(s))"
        ),
        soft_wrap=True,
    )
    console.print(f"run id:    [bold]{escape(submission.run_id)}[/]", soft_wrap=True)
    for warning in submission.warnings:  # the quota pre-flight's: jobs that will wait, quotas that were not read
        console.print(f"[yellow]quota:[/] {escape(warning)}", soft_wrap=True)
    if submission.execution_arn:
        console.print(f"execution: {escape(submission.console_url)}", soft_wrap=True)
    else:
        console.print(
            f"execution: not started after {wait:g} s; the state machine: {escape(submission.console_url)}",
            soft_wrap=True,
        )
    suffix = "" if stack_name == DEFAULT_STACK_NAME else f" --stack-name {stack_name}"
    console.print(f"follow it: gpuscout status {escape(submission.run_id)}{escape(suffix)}", soft_wrap=True)
    if submission.tracked:
        console.print(
            f"when it has ended: gpuscout track {escape(submission.run_id)} --stack-name {escape(stack_name)} "
            "(the run's results to its experiment trackers)",
            soft_wrap=True,
        )


def status(
    run_id: Annotated[str, typer.Argument(help="Run id printed by `gpuscout submit`.")],
    stack_name: StackNameOption = DEFAULT_STACK_NAME,
    fmt: Annotated[StatusFormat, typer.Option("--format", "-f", help="Output format.")] = StatusFormat.TABLE,
) -> None:
    """Show a cloud run's state and every job's status from the stack's results table."""
    from gpuscout.cloud.client import CloudStack

    try:
        run, jobs = CloudStack(stack_name).status(run_id)
    except RunNotFoundError as err:
        raise GpuscoutError(
            f"no run {run_id!r} in stack {stack_name}'s table yet: a run's row is written by its Validate step, "
            "within about a minute of `gpuscout submit`; try again shortly. If it never appears, the execution "
            f"link submit printed says why (or `gpuscout runs --stack-name {stack_name}` lists the runs)"
        ) from err
    if fmt is StatusFormat.JSON:
        sys.stdout.write(json.dumps(status_payload(run, jobs), indent=2, default=str) + "\n")
        return
    _printstatus_markup(_console(), run, jobs)


def register(app: typer.Typer) -> None:
    """Add the cloud commands to the gpuscout app."""
    app.command("submit")(submit)
    app.command("status")(status)
