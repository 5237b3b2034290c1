"""The report's PNG charts (matplotlib Agg, drawn without pyplot: no global state). Bars are horizontal so labels stay
readable with many targets x variants; at most MAX_BARS of them (best ranked first, then excluded ones) are drawn, and
a chart says so when it leaves some out. A chart, a legend entry or a bar series is drawn only where the run has data
for it: no spot bars for a machine without a spot price, no legend for a phase that took no time.

May import: gpuscout.domain.run_analysis and gpuscout.analysis.recommend."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from gpuscout.analysis.recommend import usd_text
from gpuscout.domain.run_analysis import JobAnalysis, RunAnalysis

MAX_BARS = 40
MAX_CURVES = 10
DPI = 110
ON_DEMAND_COLOUR = "#1f6fb4"
SPOT_COLOUR = "#f28e2b"
FRONT_COLOUR = "#d62728"
PHASE_COLOURS = {
    "provisioning": "#9c9c9c",
    "image_pull": "#bab0ac",
    "data_download": "#76b7b2",
    "startup": "#edc948",
    "training": "#59a14f",
    "upload": "#b07aa1",
}


# -- charts -------------------------------------------------------------------------------------------------------
def _usd(value: float | None) -> str:
    return "–" if value is None else usd_text(value)


def _bar_figure(count: int) -> tuple[Figure, Any]:
    fig = Figure(figsize=(10, max(2.8, 0.36 * count + 1.6)), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    return fig, ax


def _bar_jobs(analysis: RunAnalysis, has: Callable[[JobAnalysis], bool]) -> tuple[list[JobAnalysis], int]:
    """The jobs a bar chart draws (those that ``has`` its value, at most MAX_BARS, best at the top: matplotlib draws
    the first bar at the bottom) and how many it leaves out."""
    jobs = [j for j in analysis.jobs if has(j)]
    return jobs[:MAX_BARS][::-1], max(0, len(jobs) - MAX_BARS)


UNTRUSTED_HATCH = "///"


def untrusted_mark(job: JobAnalysis) -> str | None:
    """Why a bar's figure is not to be trusted (drawn hatched and pale, the reason in its label), or None."""
    if job.disturbed:
        return "disturbed"
    if job.contention_note:
        return "contended"
    if job.ci_kind == "unreliable" or (job.rate is not None and job.rate_ci95 is None):
        return "CI unreliable"
    return None


def _labels(jobs: list[JobAnalysis]) -> list[str]:
    return [j.label + (f"  [{mark}]" if (mark := untrusted_mark(j)) else "") for j in jobs]


def _mark_untrusted(fig: Figure, bars: Any, jobs: list[JobAnalysis], *, explain: bool = True) -> None:
    """Hatch and pale the bars of untrusted measurements; say so under the chart (once: ``explain``)."""
    marked = 0
    for bar, job in zip(bars, jobs, strict=True):
        if untrusted_mark(job):
            bar.set_hatch(UNTRUSTED_HATCH)
            bar.set_alpha(0.45)
            marked += 1
    if marked and explain:
        fig.text(0.01, 0.005, "hatched: a measurement not to be trusted (its label says why; see the table's note)",
                 fontsize=8, style="italic")  # fmt: skip


def _finish(fig: Figure, ax: Any, title: str, left_out: int) -> None:
    if left_out:
        title += f"\n(best {MAX_BARS} shown; {left_out} more in the table)"
    ax.set_title(title, fontsize=11)
    ax.grid(axis="x", alpha=0.3)


def _chart_tokens_per_s(analysis: RunAnalysis) -> Figure | None:
    jobs, left_out = _bar_jobs(analysis, lambda j: j.tokens_per_s is not None)
    if not jobs:
        return None
    fig, ax = _bar_figure(len(jobs))
    values = [j.tokens_per_s or 0.0 for j in jobs]
    # a point estimate outside its own interval draws no whisker on that side (matplotlib rejects negative xerr)
    errors = [
        [max(0.0, v - (j.tokens_per_s_ci95 or (v, v))[0]) for v, j in zip(values, jobs, strict=True)],
        [max(0.0, (j.tokens_per_s_ci95 or (v, v))[1] - v) for v, j in zip(values, jobs, strict=True)],
    ]
    bars = ax.barh(range(len(jobs)), values, xerr=errors, color=ON_DEMAND_COLOUR, capsize=3,
                   error_kw={"elinewidth": 1})  # fmt: skip
    for y, (value, job) in enumerate(zip(values, jobs, strict=True)):
        if job.tokens_per_s_ci95 is None:  # no interval: say so, rather than draw a whisker of zero width
            ax.text(value, y, "  no CI (unreliable)", va="center", fontsize=7, style="italic")
    _mark_untrusted(fig, bars, jobs)
    ax.set_yticks(range(len(jobs)), _labels(jobs), fontsize=9)
    ax.margins(x=0.12)
    ax.set_xlabel("training throughput (non-padding tokens/s, all GPUs; bars: 95 % CI)")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    _finish(fig, ax, "Throughput per instance / variant", left_out)
    return fig


def _chart_cost(analysis: RunAnalysis) -> Figure | None:
    jobs, left_out = _bar_jobs(analysis, lambda j: j.usd_per_million_tokens is not None)
    if not jobs:
        return None
    fig, ax = _bar_figure(len(jobs))
    ys = list(range(len(jobs)))
    spot = any(j.usd_per_million_tokens_spot is not None for j in jobs)  # none on a local machine
    height = 0.38 if spot else 0.6
    series = [("on-demand", ON_DEMAND_COLOUR, height / 2 if spot else 0.0, [j.usd_per_million_tokens for j in jobs])]
    if spot:
        spot_values = [j.usd_per_million_tokens_spot for j in jobs]
        series.append(("spot (see price assumptions)", SPOT_COLOUR, -height / 2, spot_values))
    for label, colour, offset, values in series:
        bars = ax.barh([y + offset for y in ys], [v or 0 for v in values], height, color=colour, label=label)
        _mark_untrusted(fig, bars, jobs, explain=label == "on-demand")
        for y, value in zip(ys, values, strict=True):
            ax.text(value or 0, y + offset, f" {_usd(value)}", va="center", fontsize=7)
    ax.set_yticks(ys, _labels(jobs), fontsize=9)
    ax.set_xlabel("cost per 1M training tokens (USD)")
    if spot:
        fig.legend(loc="outside lower center", ncols=2, fontsize=9)
    ax.margins(x=0.15)
    _finish(fig, ax, "Cost per 1M tokens, on-demand and spot" if spot else "Cost per 1M tokens (on-demand)", left_out)
    return fig


def _time_unit(longest_seconds: float) -> tuple[float, str]:
    """Seconds per unit and its name for an axis whose longest value is ``longest_seconds``: a CPU demo's seconds
    read as seconds, not as 0.002 minutes."""
    if longest_seconds < 120:
        return 1.0, "seconds"
    if longest_seconds < 7200:
        return 60.0, "minutes"
    return 3600.0, "hours"


def _curve_jobs(analysis: RunAnalysis) -> list[JobAnalysis]:
    return [j for j in analysis.jobs if j.loss_curve][:MAX_CURVES]


def _chart_loss(analysis: RunAnalysis, *, dollars: bool) -> Figure | None:
    jobs = _curve_jobs(analysis)
    if not jobs or (dollars and all(j.effective_usd_per_hour is None for j in jobs)):
        return None
    fig = Figure(figsize=(10, 5.2), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    per_unit, unit = _time_unit(max(elapsed for j in jobs for _, elapsed, _ in j.loss_curve))
    for job in jobs:
        rate = job.effective_usd_per_hour
        if dollars and rate is None:
            continue
        xs = [
            elapsed / 3600 * (rate or 0.0) * job.instance_count if dollars else elapsed / per_unit
            for _, elapsed, _ in job.loss_curve
        ]
        ax.plot(xs, [loss for _, _, loss in job.loss_curve], label=job.label, linewidth=1.4)
    if analysis.constraints.target_loss is not None:
        ax.axhline(analysis.constraints.target_loss, color="black", linestyle="--", linewidth=1, label="target loss")
    ax.set_xscale("log")
    ax.set_xlabel(
        "training cost so far (USD, price the target pays, log scale)"
        if dollars
        else f"training time ({unit}, log scale; overheads excluded)"
    )
    ax.set_ylabel("train loss (cross-entropy, nats/token)")
    ax.grid(alpha=0.3, which="both")
    left_out = sum(1 for j in analysis.jobs if j.loss_curve) - len(jobs)
    title = "Train loss against cost" if dollars else "Train loss against time"
    if left_out:
        title += f" (best {MAX_CURVES} shown)"
    ax.set_title(title + " (first repetition of each)", fontsize=11)
    ax.legend(fontsize=8, loc="upper right")
    return fig


def _chart_step_rates(analysis: RunAnalysis) -> Figure | None:
    """Each job's every step's own rate against its step number: warm-up steps hollow (they are not measured), the
    timed ones filled; a disturbed measurement shows as a slow phase or a scatter of slow steps (drawn in red, and
    named so in the legend), contention as spikes."""
    jobs = [j for j in analysis.jobs if j.step_rates][:MAX_CURVES]
    if not jobs:
        return None
    fig = Figure(figsize=(10, 4.6), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    warmup_drawn = False
    for job in jobs:
        steps = [step for step, _, _ in job.step_rates]
        rates = [rate for _, rate, _ in job.step_rates]
        colour = FRONT_COLOUR if job.disturbed else None
        label = f"{job.label} (disturbed)" if job.disturbed else job.label
        (line,) = ax.plot(steps, rates, color=colour, linewidth=1.0, label=label)
        timed = [(step, rate) for step, rate, is_timed in job.step_rates if is_timed]
        warm = [(step, rate) for step, rate, is_timed in job.step_rates if not is_timed]
        drawn = to_hex(line.get_color())
        if timed:
            ax.plot(*zip(*timed, strict=True), linestyle="", marker="x" if job.disturbed else ".", color=drawn)
        if warm:
            ax.plot(*zip(*warm, strict=True), linestyle="", marker="o", markerfacecolor="none", color=drawn,
                    label=None if warmup_drawn else "warm-up step (not measured)")  # fmt: skip
            warmup_drawn = True
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"that step's {analysis.unit}/s")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    left_out = sum(1 for j in analysis.jobs if j.step_rates) - len(jobs)
    title = "Throughput of each step: steady, warming up, or disturbed?" + (
        f" (best {MAX_CURVES} shown)" if left_out else ""
    )
    ax.set_title(title, fontsize=11)
    ax.legend(fontsize=8, loc="lower right")
    return fig


def _chart_loss_per_step(analysis: RunAnalysis) -> Figure | None:
    jobs = [j for j in analysis.jobs if j.step_losses][:MAX_CURVES]
    if not jobs:
        return None
    fig = Figure(figsize=(10, 4.6), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    for job in jobs:
        ax.plot([s for s, _ in job.step_losses], [loss for _, loss in job.step_losses], linewidth=1.2, label=job.label)
    if analysis.constraints.target_loss is not None:
        ax.axhline(analysis.constraints.target_loss, color="black", linestyle="--", linewidth=1, label="target loss")
    ax.set_xlabel("optimizer step (a step is one global batch: variants with other batch sizes see other amounts)")
    ax.set_ylabel("train loss (cross-entropy, nats/token)")
    ax.grid(alpha=0.3)
    left_out = sum(1 for j in analysis.jobs if j.step_losses) - len(jobs)
    ax.set_title("Train loss per step" + (f" (best {MAX_CURVES} shown)" if left_out else ""), fontsize=11)
    ax.legend(fontsize=8, loc="upper right")
    return fig


def _chart_pareto(analysis: RunAnalysis) -> Figure | None:
    jobs = [j for j in analysis.jobs if j.tokens_per_s is not None and j.effective_usd_per_million_tokens is not None]
    if not jobs:
        return None
    fig = Figure(figsize=(10, 6), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    off = [j for j in jobs if not j.on_pareto_front]
    front = sorted((j for j in jobs if j.on_pareto_front), key=lambda j: j.effective_usd_per_million_tokens or 0)
    ax.scatter(
        [j.effective_usd_per_million_tokens or 0.0 for j in off],
        [j.tokens_per_s or 0.0 for j in off],
        color="#7f7f7f",
        label="dominated",
        zorder=2,
    )
    ax.plot(
        [j.effective_usd_per_million_tokens or 0.0 for j in front],
        [j.tokens_per_s or 0.0 for j in front],
        "-o",
        color=FRONT_COLOUR,
        label="Pareto front",
        zorder=3,
    )
    labelled = front if len(jobs) > MAX_BARS else jobs
    for j in labelled:
        ax.annotate(
            j.label,
            (j.effective_usd_per_million_tokens or 0, j.tokens_per_s or 0),
            textcoords="offset points",
            xytext=(6, 4),
            fontsize=8,
        )
    spread = max(j.tokens_per_s or 1 for j in jobs) / max(min(j.tokens_per_s or 1 for j in jobs), 1e-9)
    if spread > 20:
        ax.set_yscale("log")
    ax.set_xlabel("cost per 1M tokens (USD, price the target pays) — lower is better")
    ax.set_ylabel("throughput (tokens/s" + (", log scale" if spread > 20 else "") + ") — higher is better")
    ax.set_title("Speed against cost: the Pareto front (nothing is both faster and cheaper)", fontsize=11)
    ax.grid(alpha=0.3, which="both")
    ax.margins(x=0.25, y=0.1)
    ax.legend(fontsize=9)
    return fig


def _chart_time_breakdown(analysis: RunAnalysis) -> Figure | None:
    jobs, left_out = _bar_jobs(analysis, lambda j: j.time_breakdown is not None)
    if not jobs:
        return None
    fig, ax = _bar_figure(len(jobs))
    lefts = [0.0] * len(jobs)
    per_unit, unit = _time_unit(max(sum(getattr(j.time_breakdown, p) for p in PHASE_COLOURS) for j in jobs))
    for phase, colour in PHASE_COLOURS.items():
        widths = [getattr(j.time_breakdown, phase) / per_unit for j in jobs]
        if not any(widths):  # a phase this run did not have (no provisioning on a local machine): no legend entry
            continue
        ax.barh(range(len(jobs)), widths, left=lefts, color=colour, label=phase.replace("_", " "))
        lefts = [a + b for a, b in zip(lefts, widths, strict=True)]
    ax.set_yticks(range(len(jobs)), [j.label for j in jobs], fontsize=9)
    ax.set_xlabel(f"time per benchmark job ({unit}, mean over repetitions)")
    if any(lefts):  # no phase had any time (jobs that reported none): no legend to draw
        fig.legend(fontsize=8, loc="outside lower center", ncols=len(PHASE_COLOURS))
    _finish(fig, ax, "Where the benchmark time went: overheads against training", left_out)
    return fig


CHARTS: dict[str, tuple[str, Callable[[RunAnalysis], Figure | None]]] = {
    "tokens_per_s.png": ("Throughput", _chart_tokens_per_s),
    "cost_per_million_tokens.png": ("Cost per 1M tokens", _chart_cost),
    "loss_vs_time.png": ("Loss against time", lambda a: _chart_loss(a, dollars=False)),
    "loss_vs_cost.png": ("Loss against cost", lambda a: _chart_loss(a, dollars=True)),
    "pareto.png": ("Pareto front", _chart_pareto),
    "time_breakdown.png": ("Time breakdown", _chart_time_breakdown),
    "step_rates.png": ("Throughput of each step", _chart_step_rates),
    "loss_per_step.png": ("Loss per step", _chart_loss_per_step),
}


def write_charts(analysis: RunAnalysis, out_dir: Path) -> list[tuple[str, Path]]:
    written = []
    for name, (title, make) in CHARTS.items():
        fig = make(analysis)
        if fig is None:
            continue
        path = out_dir / name
        fig.savefig(path)
        written.append((title, path))
    return written
