"""The ``gpuscout`` command line (typer + rich).

Every GpuscoutError becomes one red line (a manifest error lists each problem with its field path) and the
error's exit code; anything else is a bug and prints one line plus a hint to rerun with ``--debug``.
Heavy modules (the local runner, analysis, planner) are imported inside the commands that need them.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import webbrowser
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from typer import _click  # the click copy typer 0.29 ships; its Context is what commands receive
from typer.core import TyperGroup
from typer.exceptions import TyperException

from gpuscout import __version__
from gpuscout.cli.catalog_commands import register as register_catalog_command
from gpuscout.cli.cloud_commands import register as register_cloud_commands
from gpuscout.cli.console_style import Column, fit_piped_width, number_cell, responsive_table, status_markup
from gpuscout.cli.options import (
    CloudStackOption,
    DbOption,
    ManifestArg,
    OutputFormat,
    open_store,
    write_csv,
)
from gpuscout.cli.run_commands import register as register_run_commands
from gpuscout.errors import (
    BudgetExceededError,
    DiskFullError,
    GpuscoutError,
    ManifestError,
    disk_full_file,
    is_disk_full,
)
from gpuscout.store.base import ResultRecord, RunRecord, RunStatus

if TYPE_CHECKING:
    from gpuscout.domain.catalog import Catalog
    from gpuscout.domain.manifest import Manifest
    from gpuscout.domain.run_analysis import RunAnalysis

BUDGET_EXIT_CODE = 3
INTERRUPTED_EXIT_CODE = 130

console = Console()
err_console = Console(stderr=True)


def exit_code_for(err: GpuscoutError) -> int:
    """Plan refusals (over budget, does not fit, unsupported here) are exit 3; every domain error carries its code."""
    return BUDGET_EXIT_CODE if isinstance(err, BudgetExceededError) else err.exit_code


def print_error(err: GpuscoutError) -> None:
    if isinstance(err, ManifestError):
        err_console.print(f"[bold red]error:[/] {escape(err.source)}: {len(err.problems)} problem(s)", soft_wrap=True)
        for problem in err.problems:
            err_console.print(f"  [red]-[/] {escape(str(problem))}", soft_wrap=True)
    else:
        err_console.print(f"[bold red]error:[/] {escape(str(err))}", soft_wrap=True)


class _GuardedGroup(TyperGroup):
    """Turns exceptions from any command into one message and an exit code (tracebacks only with --debug)."""

    def invoke(self, ctx: _click.Context) -> object:
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, TyperException):
            raise
        except GpuscoutError as err:
            if _debug(ctx):
                traceback.print_exc()  # the traceback, and still the error's own exit code
            print_error(err)
            raise typer.Exit(exit_code_for(err)) from err
        except KeyboardInterrupt as err:
            err_console.print("[yellow]interrupted[/]")
            raise typer.Exit(INTERRUPTED_EXIT_CODE) from err
        except Exception as err:
            if _debug(ctx):
                raise
            if is_disk_full(err):  # wherever it struck: the disk, not a bug
                where = disk_full_file(err)
                print_error(DiskFullError(where, "writing it") if where else GpuscoutError(f"no space left: {err}"))
                raise typer.Exit(1) from err
            err_console.print(
                f"[bold red]unexpected error:[/] {type(err).__name__}: {escape(str(err))} "
                "(run with --debug for the traceback)",
                soft_wrap=True,
            )
            raise typer.Exit(1) from err


def _debug(ctx: _click.Context) -> bool:
    return bool((ctx.obj or {}).get("debug")) or os.environ.get("GPUSCOUT_DEBUG") == "1"


app = typer.Typer(
    name="gpuscout",
    cls=_GuardedGroup,
    help="Which GPU instance (and which training settings on it) fine-tunes your model fastest per dollar.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: no "<bool>" beside flags, arguments in capitals
)


def _version(value: bool) -> None:
    if value:
        console.print(f"gpuscout {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    ctx: typer.Context,
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks of errors.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Benchmark one fine-tuning job across instance types and training settings; recommend the best per dollar."""
    ctx.obj = {"debug": debug}
    for c in (console, err_console):
        fit_piped_width(c)


# validate / plan / catalog


@app.command()
def validate(file: ManifestArg) -> None:
    """Check a manifest in one pass: every problem with its field path, then what this machine and the planner
    would refuse, and variants that repeat each other."""
    from gpuscout.domain.catalog import load_catalog
    from gpuscout.domain.manifest_loader import parse_document, read_manifest_file, resolve_paths
    from gpuscout.domain.manifest_review import review_manifest

    catalog = load_catalog()
    review = review_manifest(parse_document(read_manifest_file(file), str(file)), str(file), catalog)
    problems, manifest = [str(p) for p in review.problems], review.manifest
    if manifest is not None:
        try:
            manifest = resolve_paths(manifest, file)
        except ManifestError as err:
            problems += [str(p) for p in err.problems]
    refusals = _machine_refusals(manifest, catalog) if manifest is not None else []
    planned = manifest is not None and not problems and not refusals and not review.set_aside
    if planned and manifest is not None:
        refusals += _planner_refusals(manifest, catalog)
    if manifest is not None:
        _warn_duplicate_variants(manifest)
    if problems or refusals:
        _print_validation(file, problems, refusals, planner_skipped=not planned and manifest is not None)
        raise typer.Exit(2 if problems else BUDGET_EXIT_CODE)
    assert manifest is not None
    targets, variants, repetitions = len(manifest.targets), len(manifest.variants), manifest.repetitions
    if manifest.search is not None:
        console.print(
            f"[green]ok[/] {escape(str(file))}: a settings search on {targets} target(s), up to "
            f"{manifest.search.max_trials} trial(s) each (`gpuscout plan` lists the candidates)",
            soft_wrap=True,
        )
        return
    pairs = manifest.planned_pairs()
    limited = " (each variant on its instance_types)" if pairs != targets * variants else ""
    console.print(
        f"[green]ok[/] {escape(str(file))}: {targets} target(s) x {variants} variant(s){limited} x {repetitions} "
        f"repetition(s) = {pairs * repetitions} job(s)",
        soft_wrap=True,
    )


def _print_validation(file: Path, problems: list[str], refusals: list[str], *, planner_skipped: bool) -> None:
    """One report: the manifest's problems (exit 2), then what this machine or the planner refuses (exit 3)."""
    if problems:
        err_console.print(f"[bold red]error:[/] {escape(str(file))}: {len(problems)} problem(s)", soft_wrap=True)
        for problem in problems:
            err_console.print(f"  [red]-[/] {escape(problem)}", soft_wrap=True)
    if refusals:
        err_console.print(
            f"[bold red]error:[/] {escape(str(file))}: {len(refusals)} refusal(s): `gpuscout plan` and `gpuscout "
            "local` refuse them",
            soft_wrap=True,
        )
        for refusal in refusals:
            err_console.print(f"  [red]-[/] {escape(refusal)}", soft_wrap=True)
    if planner_skipped:
        err_console.print(
            "  (whether each job fits and is long enough to measure is checked once these are fixed)", soft_wrap=True
        )


def _planner_refusals(manifest: Manifest, catalog: Catalog) -> list[str]:
    """Every job the planner would refuse (does not fit, a GPU it cannot predict, max_tokens too short). A job
    section's plan may time the user's code, and a search's candidates are screened by the search itself:
    `gpuscout plan` checks those."""
    if manifest.job is not None or manifest.search is not None:
        return []
    from gpuscout.errors import JobsRefusedError, PlanError
    from gpuscout.plan.planner import plan

    try:
        plan(manifest, catalog, run_id="validate")
    except JobsRefusedError as err:
        return err.refusals
    except PlanError as err:  # one refusal the planner does not collect (a price it cannot find)
        return [str(err)]
    return []


def _warn_duplicate_variants(manifest: Manifest) -> None:
    for names in manifest.duplicate_variants():
        console.print(
            f"[yellow]warning:[/] variants {', '.join(repr(n) for n in names)} have the same settings: the same jobs, "
            "run and paid for once per name; drop all but one (use repetitions to repeat a measurement)",
            soft_wrap=True,
        )


def _machine_refusals(manifest: Manifest, catalog: Catalog) -> list[str]:
    """A ``local`` target is this machine: what it cannot run (a precision, flex attention or ZeRO on a CPU), with
    field paths, as `gpuscout plan` and `local` would refuse it, not after data preparation."""
    if not any(catalog.get(t.instance_type).is_local for t in manifest.targets):
        return []
    from gpuscout.domain.catalog import detect_local_hardware
    from gpuscout.plan.planner import local_refusals

    return [str(p) for p in local_refusals(manifest, catalog, detect_local_hardware())]


@app.command()
def plan(
    file: ManifestArg,
    stack_name: Annotated[
        str | None,
        typer.Option(
            "--stack-name",
            help="Also check the plan against the account's SageMaker training quotas in that stack's region.",
        ),
    ] = None,
) -> None:
    """Expand a manifest into training jobs and predict their time and cost; refuse (exit 3) over budget; with
    --stack-name, refuse a target whose training quota is 0 there (the check `gpuscout submit` makes)."""
    from gpuscout.cli.local_view import print_plan
    from gpuscout.domain.catalog import load_catalog
    from gpuscout.domain.manifest_loader import load_manifest
    from gpuscout.local.planning import plan_jobs
    from gpuscout.plan.search import describe_plan

    catalog = load_catalog()
    manifest = load_manifest(file, catalog)
    the_plan = plan_jobs(manifest, catalog, on_message=lambda text: err_console.print(text, markup=False))
    print_plan(console, the_plan, for_run=False)
    _warn_duplicate_variants(manifest)
    if the_plan.search is not None:
        for line in describe_plan(the_plan.search):
            console.print(line, markup=False, soft_wrap=True)
    budget = manifest.constraints.budget_usd if manifest.constraints else None
    the_plan.check_budget()
    note = f" (budget ${budget:,.2f})" if budget is not None else ""
    console.print(f"[green]within budget[/]{note}")
    if stack_name:
        from gpuscout.cloud.client import CloudStack
        from gpuscout.cloud.quotas import all_checked
        from gpuscout.plan.canary import canary_model_note, cloud_canaries, predicted_canary_cost_usd

        stack = CloudStack(stack_name)
        if catalog.prices is not None and catalog.prices.region != stack.outputs.region:
            console.print(
                f"[yellow]prices:[/] the plan used {catalog.prices.region} rates (the price snapshot); the stack runs "
                f"in {stack.outputs.region}, whose rates may differ: its analysis re-prices from the AWS Price List "
                f"(or refresh the snapshot: `gpuscout catalog --refresh --region {stack.outputs.region}`)",
                soft_wrap=True,
            )
        parallel = the_plan.search.max_parallel_trials if the_plan.search else None
        canaries = cloud_canaries(the_plan.jobs, manifest, catalog, stack.outputs.canary_instance_type)
        warnings = stack.quota_preflight(file, the_plan.jobs, parallel, canaries=[c.spec for c in canaries])
        for warning in warnings:
            console.print(f"[yellow]quota:[/] {escape(warning)}", soft_wrap=True)
        for canary in canaries:
            if canary.placement:  # too large for the canary type: on its job's type, bought as its job is
                console.print(f"[yellow]canary:[/] {canary.spec.job_name} {escape(canary.placement)}", soft_wrap=True)
        if canaries and (model_note := canary_model_note(manifest)):
            console.print(f"[yellow]canary:[/] {escape(model_note)}", soft_wrap=True)
        if canaries:
            cost = predicted_canary_cost_usd(canaries)
            console.print(
                f"{len(canaries)} canaries before the jobs, predicted ${cost:,.2f} (counted by submit's budget check)"
            )
        if all_checked(warnings):
            console.print(f"[green]quotas allow it[/] (account quotas in {stack.outputs.region})")
        else:
            console.print(f"[yellow]quotas not checked[/]: see the quota lines above ({stack.outputs.region})")


# local


@app.command()
def local(  # noqa: PLR0917 - typer passes the options by keyword; the signature is the command line
    file: ManifestArg,
    runs_dir: Annotated[Path, typer.Option("--runs-dir", help="Folder for run outputs.", file_okay=False)] = Path(
        "runs"
    ),
    db: DbOption = None,
    allow_concurrent: Annotated[
        bool,
        typer.Option(
            "--allow-concurrent",
            help="Run even if another gpuscout local uses the same --runs-dir (both measurements will suffer).",
        ),
    ] = False,
    canary: Annotated[
        bool,
        typer.Option(
            "--canary/--no-canary",
            help="First run each distinct configuration for 2 steps; a configuration that fails is not timed.",
        ),
    ] = True,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            metavar="RUN_ID",
            help="Go on with an interrupted settings search of this manifest: finished trials are kept, the rest run.",
        ),
    ] = None,
) -> None:
    """Run the benchmark on this machine: prepare data once, train every variant, analyze, report."""
    from gpuscout.cli.local_view import RichRunObserver
    from gpuscout.domain.catalog import load_catalog
    from gpuscout.local.planning import validate
    from gpuscout.local.runner import run_local

    catalog = load_catalog()
    # the manifest and the runs folder are checked once, before the database is created or anything planned
    validated = validate(file, runs_dir=runs_dir, catalog=catalog)
    store = open_store(db)
    run = run_local(
        validated,
        store=store,
        catalog=catalog,
        observer=RichRunObserver(console),
        allow_concurrent=allow_concurrent,
        canary=canary,
        resume=resume,
    )
    if run.status is RunStatus.STOPPED:
        raise typer.Exit(INTERRUPTED_EXIT_CODE)
    if run.status is not RunStatus.SUCCEEDED:
        raise typer.Exit(1)


# runs / results / report


@app.command()
def runs(
    db: DbOption = None,
    limit: Annotated[int, typer.Option(help="Show at most this many runs.", min=1)] = 50,
    stack_name: CloudStackOption = None,
    fmt: Annotated[
        OutputFormat, typer.Option("--format", "-f", help="Output format (table, json or csv).")
    ] = OutputFormat.TABLE,
) -> None:
    """List runs, newest first. A local run whose process is gone shows as ABANDONED."""
    from gpuscout.local.closing import is_abandoned

    store = open_store(db, stack_name, read_only=True)
    records = store.list_runs(limit=limit)
    rows: list[dict[str, Any]] = []
    for run in records:
        abandoned = is_abandoned(run)
        rows.append(
            {
                "run_id": run.run_id,
                "name": run.name,
                "status": "ABANDONED" if abandoned else run.status.value,
                "stored_status": run.status.value,
                "created_at": run.created_at.isoformat(),
                "jobs": sum(1 for j in store.list_jobs(run.run_id) if not j.is_canary),
                "predicted_cost_usd": run.predicted_cost_usd,
                "host": run.host,
                "pid": run.pid,
                "note": (
                    f"process {run.pid} on {run.host} is gone; close it with `gpuscout analyze {run.run_id}`"
                    if abandoned
                    else (run.error or "").splitlines()[0]
                    if run.error
                    else ""
                ),
            }
        )
    if fmt is OutputFormat.JSON:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    if fmt is OutputFormat.CSV:
        write_csv(rows, fields=list(rows[0]) if rows else ["run_id"])
        return
    if not rows:
        console.print("no runs yet; try `gpuscout local configs/manifests/quickstart.yaml`")
        return
    columns = [
        Column("run id", whole=True),
        Column("name"),
        Column("status", whole=True),
        Column("created (UTC)", whole=True),
        Column("jobs", justify="right", whole=True),
        Column("predicted $", justify="right", whole=True),
        Column("note", notes=True),
    ]
    cells = [
        [
            row["run_id"],
            escape(row["name"] or ""),
            status_markup(row["status"]),
            row["created_at"][:19].replace("T", " "),
            str(row["jobs"]),
            number_cell(row["predicted_cost_usd"], "{:.4f}"),
            escape(row["note"]),
        ]
        for row in rows
    ]
    responsive_table(console, "Runs (newest first)", columns, cells)


@app.command()
def results(
    run_id: Annotated[str, typer.Argument(help="Run id (see `gpuscout runs`).")],
    fmt: Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")] = OutputFormat.TABLE,
    reprice: Annotated[
        bool, typer.Option("--reprice", help="Recompute costs with today's prices instead of the stored snapshot.")
    ] = False,
    db: DbOption = None,
    stack_name: CloudStackOption = None,
) -> None:
    """Show a run's ranked results: tokens/s, MFU, $ per 1M tokens, status, and the recommendation."""
    from gpuscout.cli.local_view import analysis_price_lines, print_ranked, recommendation_text
    from gpuscout.local.results import result_rows

    store = open_store(db, stack_name, read_only=True)
    run = store.get_run(run_id)
    jobs = store.list_jobs(run_id)
    result = store.get_result(run_id)
    analysis = _analysis_for(run, result, reprice=reprice)
    rows = result_rows(analysis, jobs)
    if fmt is OutputFormat.JSON:
        payload = {
            "run_id": run.run_id,
            "name": run.name,
            "status": run.status.value,
            "created_at": run.created_at.isoformat(),
            "error": run.error,
            "report_uri": result.report_uri if result else None,
            "repriced": reprice,
            "recommendation": analysis.recommendation.model_dump(mode="json") if analysis else None,
            "jobs": rows,
        }
        sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
        return
    if fmt is OutputFormat.CSV:
        write_csv(rows, fields=list(rows[0]) if rows else ["job_name"])
        return
    console.print(f"run [bold]{escape(run.run_id)}[/] ({escape(run.name)}): {status_markup(run.status.value)}")
    if run.error:
        console.print(f"  {escape(run.error)}")
    print_ranked(console, rows, title="Ranked results" + (" (repriced with current prices)" if reprice else ""))
    for line in analysis_price_lines(analysis, [str(row["instance_type"]) for row in rows]):
        console.print(line)
    text = recommendation_text(analysis)
    if text:
        console.print(text)


def _why_no_browser() -> str:
    """Why Python's webbrowser found nothing to start: on Linux a graphical browser (Chromium, Firefox) needs a
    display, and without one only text browsers or $BROWSER are tried."""
    if sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        return (
            "no browser can be started here: there is no graphical display (DISPLAY and WAYLAND_DISPLAY are unset), "
            "so an installed Chromium or Firefox cannot open a window (set BROWSER to a command that can)"
        )
    return "no browser was found to start (set BROWSER to one)"


def _analysis_for(run: RunRecord, result: ResultRecord | None, *, reprice: bool) -> RunAnalysis | None:
    if not reprice:
        return result.analysis if result else None
    from gpuscout.local.results import repriced_analysis

    return repriced_analysis(run, result)


@app.command()
def report(
    run_id: Annotated[str, typer.Argument(help="Run id (see `gpuscout runs`).")],
    open_html: Annotated[bool, typer.Option("--open", help="Open report.html in a browser.")] = False,
    db: DbOption = None,
    stack_name: CloudStackOption = None,
    download_dir: Annotated[
        Path, typer.Option("--download-dir", help="Where a cloud run's report is downloaded.", file_okay=False)
    ] = Path("runs") / "cloud",
) -> None:
    """Print a run's report.md (and where the HTML, JSON and charts are), or open the HTML report."""
    store = open_store(db, stack_name, read_only=True)
    run = store.get_run(run_id)
    result = store.get_result(run_id)
    if result is None or not result.report_uri:
        raise GpuscoutError(f"run {run_id} has no report (status {run.status.value}); reports are written at the end")
    if result.report_uri.startswith("s3://"):
        if not stack_name:
            raise GpuscoutError(f"the report of run {run_id} is in S3 ({result.report_uri}); pass --stack-name")
        from gpuscout.cloud.client import CloudStack

        folder = CloudStack(stack_name).download_report(run_id, download_dir)
    else:
        folder = Path(result.report_uri)
    markdown, html = folder / "report.md", folder / "report.html"
    if open_html:
        if not html.is_file():
            raise GpuscoutError(f"{html} does not exist")
        if webbrowser.open(html.resolve().as_uri()):
            console.print(f"opened {html}")
        else:
            console.print(f"{_why_no_browser()}; open {html.resolve()} where you have one", soft_wrap=True)
        return
    if not markdown.is_file():
        raise GpuscoutError(f"{markdown} does not exist (was the run folder moved or deleted?)")
    sys.stdout.write(markdown.read_text(encoding="utf-8").rstrip("\n") + "\n\n")
    console.print(f"report: {markdown}  html: {html}  folder: {folder}", soft_wrap=True)


@app.command()
def analyze(
    run_id: Annotated[str, typer.Argument(help="Run id (see `gpuscout runs`).")],
    db: DbOption = None,
) -> None:
    """Close a local run from what its finished jobs left (analysis, report, final status); re-analyse a closed one.

    For a run whose `gpuscout local` process is gone (killed, a reboot, an OOM kill): `gpuscout runs` shows it as
    ABANDONED. Unfinished jobs become STOPPED; a run that is still running is refused.
    """
    from gpuscout.cli.local_view import RichRunObserver
    from gpuscout.local.closing import close_abandoned_run

    store = open_store(db, read_only=True)
    run = store.get_run(run_id)
    close_abandoned_run(run, store, observer=RichRunObserver(console))


@app.command()
def track(
    run_id: Annotated[str, typer.Argument(help="Run id (see `gpuscout runs`).")],
    db: DbOption = None,
    stack_name: CloudStackOption = None,
    download_dir: Annotated[
        Path,
        typer.Option(
            "--download-dir",
            help="Where a cloud run's report and its jobs' W&B offline runs are downloaded.",
            file_okay=False,
        ),
    ] = Path("runs") / "cloud",
) -> None:
    """Log a finished run's ranked results and report to its manifest's experiment trackers (MLflow, W&B).

    A cloud run (--stack-name): its jobs logged themselves from SageMaker; this logs the run level from here and
    nests the job runs under it, and downloads the jobs' W&B offline runs beside the analysis run for `wandb sync`.
    A local run: logs again what the end of `gpuscout local` logged (e.g. after a tracker was unreachable).
    """
    if stack_name:
        from gpuscout.cloud.client import CloudStack
        from gpuscout.cloud.run_tracking import track_cloud_run

        tracked = track_cloud_run(CloudStack(stack_name), run_id, download_dir)
        outcome, problems = tracked.outcome, tracked.all_problems
        console.print(f"report: {tracked.report_dir}", soft_wrap=True)
        if tracked.wandb_dir is not None:
            without = tracked.jobs_without_wandb
            console.print(
                f"W&B: {len(tracked.wandb_job_runs)} job run(s) extracted to {tracked.wandb_dir}"
                + (f"; no W&B run from {', '.join(without)} (no output, the job's own code, or stopped before its "
                   "tracker started)" if without else ""),
                soft_wrap=True,
            )  # fmt: skip
    else:
        from gpuscout.local.closing import track_local_run

        store = open_store(db, read_only=True)
        outcome = track_local_run(store.get_run(run_id), store)
        problems = outcome.problems
    for line in outcome.logged:
        console.print(f"tracking: {escape(line)}", soft_wrap=True)
    if problems:
        raise GpuscoutError("; ".join(problems))


register_catalog_command(app)  # catalog (gpuscout/cli/catalog_commands.py)
register_cloud_commands(app)  # submit, status (gpuscout/cli/cloud_commands.py)
register_run_commands(app)  # compare, delete (gpuscout/cli/run_commands.py)
