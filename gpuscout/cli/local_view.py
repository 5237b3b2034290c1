"""Console rendering of ``gpuscout local`` and of stored results: the plan table, live job progress, the ranked
results table and the recommendation line. The runner (gpuscout.local.runner) reports through ``RunObserver``;
``RichRunObserver`` is its console implementation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from gpuscout.analysis.recommend import seconds_text
from gpuscout.cli.console_style import Column, number_cell, responsive_table
from gpuscout.domain.jobspec import JobSpec
from gpuscout.domain.prices import REFRESH_COMMAND
from gpuscout.domain.run_analysis import RunAnalysis
from gpuscout.local.job_process import JobProgress
from gpuscout.local.results import result_rows
from gpuscout.store.base import JobRecord, JobStatus, RunRecord
from gpuscout.workflow.ports import JobOutcome

if TYPE_CHECKING:
    from gpuscout.plan.jobs import Plan


def _fmt_duration(seconds: float | None) -> str:
    return "-" if seconds is None else seconds_text(seconds)


def print_plan(console: Console, the_plan: Plan, *, for_run: bool = True) -> None:
    """The job matrix of a plan with predicted throughput, time and cost, and the total (a search's: at most
    max_trials of its candidates run). ``for_run``: the plan of a run that starts now (its id in the title); else
    ``gpuscout plan``'s preview, whose ids are drawn again by the run. $/1M is the objective predicted (rate x
    billed price, start-up excluded): a job that costs more may cost less per token. Job names, precisions and
    numbers are never cut (console_style.responsive_table: a narrow terminal gets a block per job instead)."""
    jobs: list[JobSpec] = list(the_plan.jobs)
    title = f"Plan for run {the_plan.run_id}" if for_run else "Plan (a run draws its own run id and job names)"
    units = {spec.prediction.unit for spec in jobs} or {"tokens"}
    columns = [
        Column("job", whole=True),
        Column("instance"),
        Column("variant"),
        Column("precision", whole=True),
        Column(f"pred. {'/'.join(sorted(units))}/s", justify="right", whole=True),
        Column("pred. time", justify="right", whole=True),
        Column("pred. $", justify="right", whole=True),
        Column(f"pred. $/1M {'/'.join(sorted(units))}", justify="right", whole=True),
    ]
    cells = []
    for spec in jobs:
        p = spec.prediction
        count = f" x{spec.instance_count}" if spec.instance_count > 1 else ""
        cells.append(
            [
                escape(spec.job_name),
                escape(f"{spec.instance_type}{count}{' (spot)' if spec.spot else ''}"),
                escape(spec.variant_name),
                spec.precision,
                f"{p.rate:,.0f}",
                _fmt_duration(p.training_seconds + p.overhead_seconds),
                f"{p.cost_usd:,.4f}",
                number_cell(spec.predicted_usd_per_million, "{:,.4f}"),
            ]
        )
    total_s = the_plan.predicted_sequential_seconds
    if the_plan.search is None:
        label, at_most = f"total ({len(jobs)} jobs)", ""
    else:
        label, at_most = f"total: at most {the_plan.search.trial_budget} of these {len(jobs)} candidates run", "≤ "
    cells.append(
        [label, "", "", "", "", at_most + _fmt_duration(total_s), f"{at_most}{the_plan.predicted_cost_usd:,.4f}", ""]
    )
    responsive_table(console, title, columns, cells, key=0)
    for line in price_lines(jobs):
        console.print(line)  # wrapped at the terminal's width


def analysis_price_lines(analysis: RunAnalysis | None, instance_types: Sequence[str]) -> list[str]:
    """The prices a stored analysis used for ``instance_types``: rate, kind (snapshot / live / manifest), date,
    region; a snapshot price that was stale when the analysis was made says so."""
    if analysis is None:
        return []
    prices = analysis.price_snapshot.prices
    lines = []
    for instance_type in dict.fromkeys(instance_types):
        price = prices.get(instance_type)
        if price is None:
            continue
        kind = price.kind_text(analysis.generated_at)
        basis = ", ".join(part for part in (kind, price.date, price.region) if part)
        text = f"priced: {instance_type} ${price.on_demand_usd_per_hour:,.3f}/h on-demand ({basis})"
        lines.append(f"[yellow]{escape(text)}[/]" if "STALE" in kind else escape(text))
    return lines


def price_lines(jobs: list[JobSpec]) -> list[str]:
    """One line per instance type: the price the plan used, its kind (snapshot / manifest), date and region; a stale
    snapshot price in yellow with the command that refreshes it."""
    lines, seen = [], set()
    for spec in jobs:  # one line per distinct way of buying a type (two targets may price one type differently)
        key = (spec.instance_type, spec.price_per_hour_usd, spec.spot, spec.spot_price_per_hour_usd,
               spec.training_plan_arn)  # fmt: skip
        if key in seen:
            continue
        seen.add(key)
        price = spec.price
        stale = price is not None and price.stale()
        if price is None:
            basis = "price kind not recorded"
        elif price.kind == "manifest":
            basis = "manifest: the target's price_per_hour_usd"
        else:
            basis = price.label() + (f"; refresh: {REFRESH_COMMAND}" if stale else "")
        text = f"priced: {spec.instance_type} ${spec.price_per_hour_usd:,.3f}/h on-demand ({basis})"
        if spec.spot_price_per_hour_usd is not None:
            text += f", spot ${spec.spot_price_per_hour_usd:,.3f}/h (manifest)"
        elif spec.spot:
            text += ", spot planned at the on-demand price"
        if spec.training_plan_arn:
            text += ", on training plan " + spec.training_plan_arn.rsplit("/", 1)[-1]
        lines.append(f"[yellow]{escape(text)}[/]" if stale else escape(text))
    return lines


def _mfu_text(row: Mapping[str, Any]) -> str:
    """MFU, or why there is none: a CPU, a job that measured nothing, a GPU without a dense peak at the job's
    precision, or a GPU no SKU file describes."""
    if row.get("mfu") is not None:
        return f"{row['mfu'] * 100:.1f} %"
    if not row.get("gpus"):
        return "n/a (CPU)"
    if str(row.get("status") or "").lower() != "completed":
        return "–"
    if row.get("gpu_sku"):
        return f"n/a ({row['gpu_sku']}: no dense peak at this precision)"
    return "n/a (unknown GPU)"


def _tps_text(row: Mapping[str, Any]) -> str:
    unit = row.get("unit") or "tokens"
    tps = row.get(f"{unit}_per_s")
    if tps is None:
        return "-"
    low, high = row.get(f"{unit}_per_s_ci95_low"), row.get(f"{unit}_per_s_ci95_high")
    if row.get("ci_kind") == "unreliable":
        return f"{tps:,.0f} (CI unreliable)"
    if low is None or high is None:
        return f"{tps:,.0f}"
    return f"{tps:,.0f} ± {(high - low) / 2:,.0f}"


def _usd_text(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.4f}" if value < 10 else f"{value:,.2f}"


def print_ranked(console: Console, rows: Sequence[Mapping[str, Any]], *, title: str = "Ranked results") -> None:
    """Rank, variant, instance, tokens/s ± 95 % CI, MFU (or why not), $ per 1M tokens, status, stop rule outcome,
    and each row's note below the table; numbers and statuses are never cut (console_style.responsive_table)."""
    unit = "samples" if any(row.get("unit") == "samples" for row in rows) else "tokens"
    columns = [
        Column("rank", justify="right", whole=True),
        Column("variant"),
        Column("instance"),
        Column(f"{unit}/s ± CI95", justify="right", whole=True),
        Column("MFU", justify="right", whole=True),
        Column(f"$ / 1M {unit}", justify="right", whole=True),
        Column("status", whole=True),
        Column("stop"),
        Column("note", notes=True),
    ]
    cells = []
    for row in rows:
        status = str(row.get("status") or "")
        colour = "green" if status.lower() == "completed" else "red"
        count = f" x{row['instance_count']}" if (row.get("instance_count") or 1) > 1 else ""
        note = str(row.get("note") or "").splitlines()
        cells.append(
            [
                str(row["rank"]) if row.get("rank") is not None else "-",
                escape(str(row.get("variant") or "")),
                escape(f"{row.get('instance_type')}{count}{' (spot)' if row.get('spot') else ''}"),
                _tps_text(row),
                _mfu_text(row),
                _usd_text(
                    row.get(f"usd_per_million_{unit}_spot") if row.get("spot") else row.get(f"usd_per_million_{unit}")
                ),
                f"[{colour}]{escape(status)}[/]",
                ("[yellow]⚠[/] " if row.get("tolerance_reached") is False else "") + escape(str(row.get("stop") or "")),
                escape(note[-1] if note else ""),
            ]
        )
    responsive_table(console, title, columns, cells, key=1)


def recommendation_text(analysis: RunAnalysis | None) -> str:
    if analysis is None or not analysis.recommendation.summary:
        return ""
    recommendation = analysis.recommendation
    notes = "".join(f"\n  [dim]note:[/] {escape(str(note))}" for note in recommendation.notes)
    return f"[bold]Recommendation:[/] {escape(recommendation.summary)}{notes}"


PLAIN_PROGRESS_EVERY_S = 30.0  # outside a terminal (output to a file or a pipe): one progress line this often


class RichRunObserver:
    """Draws a local run on a rich console: plan table, one progress bar per job, ranked results. Outside a terminal,
    where a bar is drawn only when it ends, each job says where it is in a plain line every PLAIN_PROGRESS_EVERY_S."""

    def __init__(self, console: Console | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.console = console or Console()
        self._progress: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        self._labels: dict[str, str] = {}
        self._clock = clock
        self._last_line: dict[str, float] = {}

    def planned(self, the_plan: Plan) -> None:
        print_plan(self.console, the_plan)

    def message(self, text: str, *, warning: bool = False) -> None:
        prefix = "[yellow]warning:[/] " if warning else ""
        self.console.print(prefix + escape(text), soft_wrap=True)

    @contextmanager
    def jobs_running(self) -> Iterator[None]:
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        ) as progress:
            self._progress = progress
            try:
                yield
            finally:
                self._progress = None

    def job_started(self, index: int, total: int, spec: JobSpec, max_steps: int | None) -> None:
        label = f"job {index}/{total} {spec.variant_name}"
        self._labels[spec.job_name] = label
        if self._progress is not None:
            self._tasks[spec.job_name] = self._progress.add_task(label, total=max_steps)
        if not self.console.is_terminal:
            self._last_line[spec.job_name] = self._clock()
            self.console.print(f"{escape(label)} started ({escape(spec.job_name)})", soft_wrap=True)

    def job_progress(self, spec: JobSpec, progress: JobProgress, max_steps: int | None) -> None:
        task = self._tasks.get(spec.job_name)
        label = self._labels.get(spec.job_name, spec.job_name)
        if not self.console.is_terminal:
            now = self._clock()
            if now - self._last_line.get(spec.job_name, now) >= PLAIN_PROGRESS_EVERY_S:
                self._last_line[spec.job_name] = now
                console = self._progress.console if self._progress is not None else self.console
                console.print(f"{escape(label)}  {escape(progress.describe(max_steps))}", soft_wrap=True)
        if self._progress is None or task is None:
            return
        self._progress.update(
            task, completed=progress.step or 0, description=f"{label}  {progress.describe(max_steps)}"
        )

    def job_finished(self, spec: JobSpec, outcome: JobOutcome) -> None:
        task = self._tasks.get(spec.job_name)
        if self._progress is not None and task is not None:
            self._progress.stop_task(task)  # its clock stops with it (a pruned trial's bar stays short of the end)
        word = "[green]done[/]" if outcome.status is JobStatus.COMPLETED else f"[red]{outcome.status.value}[/]"
        reason = f": {escape(outcome.failure_reason.splitlines()[-1])}" if outcome.failure_reason else ""
        console = self._progress.console if self._progress is not None else self.console
        console.print(f"{escape(spec.job_name)} {word} in {outcome.wall_seconds:.1f} s{reason}")

    def interrupted(self) -> None:
        self.console.print("[yellow]interrupted: stopping; what was measured is kept[/]")

    def finished(
        self, run: RunRecord, analysis: RunAnalysis | None, jobs: Sequence[JobRecord], report_md: Path | None
    ) -> None:
        run_id = run.run_id
        print_ranked(self.console, result_rows(analysis, jobs), title=f"Ranked results: run {run_id}")
        text = recommendation_text(analysis)
        if text:
            self.console.print(text)
        where = f"report: {report_md}" if report_md is not None else f"jobs: {Path(run.run_dir or '') / 'jobs'}"
        self.console.print(f"run {run_id} {run.status.value}; {where}", soft_wrap=True)
        after = f"gpuscout report {run_id}" if report_md is not None else f"gpuscout delete {run_id}"
        self.console.print(f"next: gpuscout results {run_id}   {after}", soft_wrap=True)
