"""Report of a RunAnalysis: Markdown, self-contained HTML (charts inlined), JSON and PNG charts (matplotlib Agg).

Charts use horizontal bars so labels stay readable with many targets x variants; at most MAX_BARS of them (best
ranked first, then excluded ones) are drawn, and a chart says so when it leaves some out.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure  # drawn without pyplot: no global state, the Agg canvas by default
from matplotlib.ticker import FuncFormatter

from gpuscout.analysis.results import JobAnalysis, RunAnalysis
from gpuscout.errors import GpuscoutError
from gpuscout.plan.job_section import rate_text

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


class ReportError(GpuscoutError):
    """The report could not be written."""


# -- formatting ---------------------------------------------------------------------------------------------------
def _num(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _usd(value: float | None) -> str:
    if value is None:
        return "–"
    return f"${value:,.4f}" if abs(value) < 1 else f"${value:,.2f}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.1f} %"


def _tps(job: JobAnalysis) -> str:
    """The ranked rate (tokens/s, or samples/s for a samples job) and its interval."""
    rate, ci = job.rate, job.rate_ci95
    if rate is None:
        return "–"
    if job.ci_kind == "unreliable":
        return f"{_num(rate)} (CI unreliable)"
    if ci is None:
        return _num(rate)
    low, high = ci
    return f"{rate:,.0f} ± {max(high - rate, rate - low):,.0f}"


def _hours_usd(hours: float | None, usd: float | None) -> str:
    return "–" if hours is None else f"{hours:,.2f} h / {_usd(usd)}"


def _loss_target(job: JobAnalysis) -> str:
    if job.target_loss is None or job.tokens_per_s is None:
        return "–"
    if job.target_loss_hours is None:
        return f"{job.target_loss_method or 'not projected'}"
    return f"{_hours_usd(job.target_loss_hours, job.target_loss_usd)} ({job.target_loss_method})"


def _shown(analysis: RunAnalysis) -> tuple[list[JobAnalysis], int]:
    jobs = analysis.jobs[:MAX_BARS]
    return jobs, len(analysis.jobs) - len(jobs)


def _memory(allocated: float | None, reserved: float | None) -> str:
    """Peak allocated, and the allocator's peak reserved beside it where the job reported one (CUDA)."""
    text = _num(allocated, 1)
    return f"{text} ({reserved:.1f})" if allocated is not None and reserved is not None else text


def _table_rows(analysis: RunAnalysis) -> tuple[list[str], list[list[str]]]:
    target_col = (
        f"to loss {analysis.constraints.target_loss:g}" if analysis.constraints.target_loss is not None else None
    )
    unit = analysis.unit
    header = [
        "rank",
        "instance / variant",
        "reps",
        f"{unit}/s ± 95 % CI",
        "tokens/s per GPU",
        "MFU",
        f"$/1M {unit} on-demand",
        f"$/1M {unit} spot",
        "one epoch",
        *([target_col] if target_col else []),
        "benchmark billed",
        "peak mem GB (reserved)",
        "stop",
        "Pareto",
        "note",
    ]
    rows = []
    for job in analysis.jobs:
        rows.append(
            [
                str(job.rank) if job.rank is not None else "–",
                job.label,
                f"{job.repetitions}/{job.repetitions_planned}",
                _tps(job),
                _num(job.tokens_per_s_per_gpu),
                _pct(job.mfu),
                _usd(job.usd_per_million_samples if unit == "samples" else job.usd_per_million_tokens),
                _usd(job.usd_per_million_samples_spot if unit == "samples" else job.usd_per_million_tokens_spot),
                _hours_usd(job.epoch_hours, job.epoch_usd_spot if job.spot else job.epoch_usd),
                *([_loss_target(job)] if target_col else []),
                _usd(job.billed_usd),
                _memory(job.peak_memory_gb, job.peak_reserved_gb),
                ("⚠ " if job.tolerance_reached is False else "") + job.stop_text if job.rate is not None else "–",
                "yes" if job.on_pareto_front else "",
                ("⚠ " if job.disturbed or job.contention_note or job.validation_note else "") + job.measurement_note,
            ]
        )
    return header, rows


# -- charts -------------------------------------------------------------------------------------------------------
def _bar_figure(count: int) -> tuple[Figure, Any]:
    fig = Figure(figsize=(10, max(2.8, 0.36 * count + 1.6)), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    return fig, ax


def _finish(fig: Figure, ax: Any, title: str, left_out: int) -> None:
    if left_out:
        title += f"\n(best {MAX_BARS} shown; {left_out} more in the table)"
    ax.set_title(title, fontsize=11)
    ax.grid(axis="x", alpha=0.3)


def _chart_tokens_per_s(analysis: RunAnalysis) -> Figure | None:
    jobs = [j for j in analysis.jobs if j.tokens_per_s is not None][:MAX_BARS]
    if not jobs:
        return None
    left_out = sum(1 for j in analysis.jobs if j.tokens_per_s is not None) - len(jobs)
    jobs = jobs[::-1]  # best at the top
    fig, ax = _bar_figure(len(jobs))
    values = [j.tokens_per_s or 0.0 for j in jobs]
    # a point estimate outside its own interval draws no whisker on that side (matplotlib rejects negative xerr)
    errors = [
        [max(0.0, v - (j.tokens_per_s_ci95 or (v, v))[0]) for v, j in zip(values, jobs, strict=True)],
        [max(0.0, (j.tokens_per_s_ci95 or (v, v))[1] - v) for v, j in zip(values, jobs, strict=True)],
    ]
    ax.barh(range(len(jobs)), values, xerr=errors, color=ON_DEMAND_COLOUR, capsize=3, error_kw={"elinewidth": 1})
    ax.set_yticks(range(len(jobs)), [j.label for j in jobs], fontsize=9)
    ax.set_xlabel("training throughput (non-padding tokens/s, all GPUs; bars: 95 % CI)")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    _finish(fig, ax, "Throughput per instance / variant", left_out)
    return fig


def _chart_cost(analysis: RunAnalysis) -> Figure | None:
    jobs = [j for j in analysis.jobs if j.usd_per_million_tokens is not None][:MAX_BARS]
    if not jobs:
        return None
    left_out = sum(1 for j in analysis.jobs if j.usd_per_million_tokens is not None) - len(jobs)
    jobs = jobs[::-1]
    fig, ax = _bar_figure(len(jobs))
    ys = list(range(len(jobs)))
    height = 0.38
    ax.barh([y + height / 2 for y in ys], [j.usd_per_million_tokens or 0 for j in jobs], height, label="on-demand")
    ax.barh(
        [y - height / 2 for y in ys],
        [j.usd_per_million_tokens_spot or 0 for j in jobs],
        height,
        color=SPOT_COLOUR,
        label="spot (see price assumptions)",
    )
    for y, j in zip(ys, jobs, strict=True):
        for value, offset in ((j.usd_per_million_tokens, height / 2), (j.usd_per_million_tokens_spot, -height / 2)):
            ax.text(value or 0, y + offset, f" {_usd(value)}", va="center", fontsize=7)
    ax.set_yticks(ys, [j.label for j in jobs], fontsize=9)
    ax.set_xlabel("cost per 1M training tokens (USD)")
    fig.legend(loc="outside lower center", ncols=2, fontsize=9)
    ax.margins(x=0.15)
    _finish(fig, ax, "Cost per 1M tokens, on-demand and spot", left_out)
    return fig


def _curve_jobs(analysis: RunAnalysis) -> list[JobAnalysis]:
    return [j for j in analysis.jobs if j.loss_curve][:MAX_CURVES]


def _chart_loss(analysis: RunAnalysis, *, dollars: bool) -> Figure | None:
    jobs = _curve_jobs(analysis)
    if not jobs or (dollars and all(j.effective_usd_per_hour is None for j in jobs)):
        return None
    fig = Figure(figsize=(10, 5.2), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    for job in jobs:
        rate = job.effective_usd_per_hour
        if dollars and rate is None:
            continue
        xs = [
            elapsed / 3600 * (rate or 0.0) * job.instance_count if dollars else elapsed / 60
            for _, elapsed, _ in job.loss_curve
        ]
        ax.plot(xs, [loss for _, _, loss in job.loss_curve], label=job.label, linewidth=1.4)
    if analysis.constraints.target_loss is not None:
        ax.axhline(analysis.constraints.target_loss, color="black", linestyle="--", linewidth=1, label="target loss")
    ax.set_xscale("log")
    ax.set_xlabel(
        "training cost so far (USD, price the target pays, log scale)"
        if dollars
        else "training time (minutes, log scale; overheads excluded)"
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


def _chart_step_times(analysis: RunAnalysis) -> Figure | None:
    """Each job's timed steps against their step number: a disturbed measurement shows as a slow phase or a scatter
    of slow steps (drawn in red, and named so in the legend)."""
    jobs = [j for j in analysis.jobs if j.step_times][:MAX_CURVES]
    if not jobs:
        return None
    fig = Figure(figsize=(10, 4.6), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    for job in jobs:
        steps = [step for step, _ in job.step_times]
        millis = [1000 * seconds for _, seconds in job.step_times]
        if job.disturbed:
            ax.plot(steps, millis, color=FRONT_COLOUR, marker="x", linewidth=1.4, label=f"{job.label} (disturbed)")
        else:
            ax.plot(steps, millis, marker=".", linewidth=1.0, label=job.label)
    ax.set_xlabel("optimizer step (timed steps only; warm-up excluded)")
    ax.set_ylabel("step time (ms)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    left_out = sum(1 for j in analysis.jobs if j.step_times) - len(jobs)
    title = "Step times: one speed, or disturbed?" + (f" (best {MAX_CURVES} shown)" if left_out else "")
    ax.set_title(title, fontsize=11)
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
    jobs = [j for j in analysis.jobs if j.time_breakdown is not None][:MAX_BARS]
    if not jobs:
        return None
    left_out = sum(1 for j in analysis.jobs if j.time_breakdown is not None) - len(jobs)
    jobs = jobs[::-1]
    fig, ax = _bar_figure(len(jobs))
    lefts = [0.0] * len(jobs)
    for phase, colour in PHASE_COLOURS.items():
        widths = [getattr(j.time_breakdown, phase) / 60 for j in jobs]
        ax.barh(range(len(jobs)), widths, left=lefts, color=colour, label=phase.replace("_", " "))
        lefts = [a + b for a, b in zip(lefts, widths, strict=True)]
    ax.set_yticks(range(len(jobs)), [j.label for j in jobs], fontsize=9)
    ax.set_xlabel("time per benchmark job (minutes, mean over repetitions)")
    fig.legend(fontsize=8, loc="outside lower center", ncols=6)
    _finish(fig, ax, "Where the benchmark time went: overheads against training", left_out)
    return fig


CHARTS: dict[str, tuple[str, Callable[[RunAnalysis], Figure | None]]] = {
    "tokens_per_s.png": ("Throughput", _chart_tokens_per_s),
    "cost_per_million_tokens.png": ("Cost per 1M tokens", _chart_cost),
    "loss_vs_time.png": ("Loss against time", lambda a: _chart_loss(a, dollars=False)),
    "loss_vs_cost.png": ("Loss against cost", lambda a: _chart_loss(a, dollars=True)),
    "pareto.png": ("Pareto front", _chart_pareto),
    "time_breakdown.png": ("Time breakdown", _chart_time_breakdown),
    "step_times.png": ("Step times", _chart_step_times),
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


# -- documents ----------------------------------------------------------------------------------------------------
def _prediction_text(job: JobAnalysis) -> str:
    """``20,000 samples/s (user's estimate ...); measured 0.41x`` : what was predicted, how, and how it compares."""
    if job.predicted_rate is None or not job.prediction_method:
        return "–"
    unit = "samples" if job.unit == "samples" else "tokens"
    measured = job.samples_per_s if job.unit == "samples" else job.tokens_per_s
    ratio = f"; measured {measured / job.predicted_rate:.2g}x of it" if measured else ""
    return f"{rate_text(job.predicted_rate)} {unit}/s ({job.prediction_method}){ratio}"


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _constraints_text(analysis: RunAnalysis) -> list[str]:
    c = analysis.constraints
    items = [f"objective: {analysis.objective.replace('_', ' ')}"]
    if c.budget_usd is not None:
        items.append(f"budget ${c.budget_usd:,.2f}")
    if c.deadline_hours is not None:
        items.append(f"deadline {c.deadline_hours:g} h")
    if c.target_loss is not None:
        items.append(f"target loss {c.target_loss:g}")
    if analysis.dataset_tokens:
        items.append(f"dataset {analysis.dataset_tokens:,} tokens")
    return items


def _sections(analysis: RunAnalysis) -> dict[str, Any]:
    prices = analysis.price_snapshot.prices
    return {
        "prices_header": ["instance", "on-demand $/h", "spot $/h", "on-demand source", "spot source", "date", "region"],
        "prices_rows": [
            [
                p.instance_type,
                _usd(p.on_demand_usd_per_hour),
                _usd(p.spot_usd_per_hour),
                p.on_demand_source,
                p.spot_source,
                p.date or "–",
                p.region or "–",
            ]
            for p in prices.values()
        ],
        "excluded_header": ["instance / variant", "reason"],
        "excluded_rows": [[j.label, j.excluded_reason or ""] for j in analysis.jobs if j.excluded_reason],
        "method_rows": [
            [
                j.label,
                j.ci_method or "–",
                j.stop_reason or "–",
                j.target_loss_detail or "–",
                j.workload_basis or "–",
                _prediction_text(j),
                j.host_allocator or "–",
            ]
            for j in analysis.jobs
            if j.tokens_per_s is not None or j.samples_per_s is not None
        ],
        "method_header": [
            "instance / variant",
            "95 % CI",
            "stop reason",
            "time to target loss",
            "workload",
            "planner's prediction",
            "host allocator",
        ],
    }


SEARCH_HEADER = ["candidate", "outcome", "why"]


def _search_blocks(analysis: RunAnalysis) -> list[tuple[str, list[list[str]]]]:
    """Per searched target: one line of what the search did, and a row per candidate (launched first)."""
    search = analysis.search
    if search is None:
        return []
    rule = (
        f"pruning: successive halving from {search.min_timed_steps} timed steps, keeping 1/{search.reduction_factor} "
        "per rung, a trial stopped only when its 95 % interval is clearly worse than the best finished trial's"
        if search.pruning
        else "pruning off: every launched trial ran to its stop rule"
    )
    blocks = []
    for t in search.targets:
        dims = "; ".join(f"{k} {', '.join(map(str, v))}" for k, v in t.dimensions.items()) or "no searched dimension"
        pruned = sum(1 for trial in t.trials if trial.status == "PRUNED")
        text = (
            f"{t.instance_type}: {dims}. {t.candidates} candidate(s) could run, {len(t.skipped)} skipped before "
            f"launch, {len(t.trials)} launched, {pruned} pruned; best: {t.best or 'none finished'}. {rule}; "
            f"spend cap ${search.max_cost_usd:g}."
        )
        rows = [[trial.variant, trial.status, trial.reason or ""] for trial in t.trials]
        rows += [[name, "NOT LAUNCHED", "trial budget or spend cap reached"] for name in t.not_launched]
        rows += [[c.variant, c.status, c.reason or ""] for c in t.skipped]
        blocks.append((text, rows))
    return blocks


MACHINE_HEADER = ["instance", "device", "model", "GPUs", "CPU cores", "software", "CUDA / driver"]


def _machine_rows(analysis: RunAnalysis) -> list[list[str]]:
    """What each measurement ran on, from the jobs' benchmark.json (analysis/machines.py)."""
    return [
        [
            m.instance_type,
            m.device,
            m.model or "-",
            str(m.gpus) if m.gpus else "-",
            str(m.cpu_count) if m.cpu_count else "-",
            m.software,
            " / ".join(v for v in (m.cuda, m.driver) if v) or "-",
        ]
        for m in analysis.machines
    ]


def banners(analysis: RunAnalysis) -> list[str]:
    """What a reader must know before the recommendation: a run that did not finish everything, and measurements
    taken while other processes competed for the machine (which more repetitions do not fix)."""
    out = [analysis.incomplete] if analysis.incomplete else []
    crowded = [j for j in analysis.jobs if j.contention_note]
    if crowded:
        measured = [j for j in analysis.jobs if j.rate is not None]
        out.append(
            f"Measured under competition: {len(crowded)} of {len(measured)} measurements were taken while other "
            "processes competed for this machine (see the note column); their numbers vary with that load. Run "
            "again on a quiet machine: more repetitions on a busy one do not fix it."
        )
    return out


def render_markdown(analysis: RunAnalysis, charts: Sequence[tuple[str, Path]], *, note: str | None = None) -> str:
    header, rows = _table_rows(analysis)
    s = _sections(analysis)
    parts = [f"# gpuscout report: {analysis.run_name or analysis.run_id}", ""]
    if note:
        parts += [f"> **{note}**", ""]
    parts += [
        f"Run `{analysis.run_id}` · {' · '.join(_constraints_text(analysis))} · "
        f"benchmark billed {_usd(analysis.total_billed_usd)} · generated {analysis.generated_at:%Y-%m-%d %H:%M UTC}",
        "",
        *[f"> **{banner}**\n" for banner in banners(analysis)],
        "## Recommendation",
        "",
        analysis.recommendation.summary,
        "",
        "## Ranked results",
        "",
        _md_table(header, rows),
        "",
    ]
    if s["excluded_rows"]:
        parts += ["## Excluded", "", _md_table(s["excluded_header"], s["excluded_rows"]), ""]
    if analysis.search is not None:
        parts += ["## Settings search", ""]
        for text, search_rows in _search_blocks(analysis):
            parts += [text, "", _md_table(SEARCH_HEADER, search_rows), ""]
    if charts:
        parts += ["## Charts", ""]
        parts += [f"![{title}]({path.name})\n" for title, path in charts]
    if analysis.machines:
        parts += ["## Machines", "", _md_table(MACHINE_HEADER, _machine_rows(analysis)), ""]
    parts += ["## How the numbers were obtained", "", _md_table(s["method_header"], s["method_rows"]), ""]
    parts += ["## Prices used (snapshot)", "", _md_table(s["prices_header"], s["prices_rows"]), ""]
    parts += ["## Assumptions", ""] + [f"- {a}" for a in analysis.assumptions] + [""]
    return "\n".join(parts)


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:2rem auto;max-width:1320px;
padding:0 1rem;color:#1d1d1f;line-height:1.45}
h1{font-size:1.6rem;margin-bottom:.2rem}h2{font-size:1.2rem;margin-top:2rem;border-bottom:1px solid #ddd}
.meta{color:#555;font-size:.9rem}.note{background:#fff4d6;border-left:4px solid #e0a800;padding:.6rem 1rem}
.rec{background:#eef6ee;border-left:4px solid #3a8a3a;padding:.8rem 1rem;font-size:1.05rem}
.rec.unclear{background:#fff4e5;border-left-color:#e07b00}
table{border-collapse:collapse;font-size:.82rem;width:100%;margin:.5rem 0}
th,td{border:1px solid #ddd;padding:.3rem .45rem;text-align:left;vertical-align:top}
th{background:#f3f4f6}tr:nth-child(even) td{background:#fafafa}td.num{text-align:right;white-space:nowrap}
.wrap{overflow-x:auto}img{max-width:100%;height:auto;display:block;margin:1rem 0;border:1px solid #eee}
"""


def _html_table(header: Sequence[str], rows: Sequence[Sequence[str]], numeric: frozenset[int] = frozenset()) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{html.escape(c)}</td>' if i in numeric else f"<td>{html.escape(c)}</td>"
            for i, c in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f'<div class="wrap"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def render_html(analysis: RunAnalysis, charts: Sequence[tuple[str, Path]], *, note: str | None = None) -> str:
    header, rows = _table_rows(analysis)
    s = _sections(analysis)
    esc = html.escape
    rec_class = "rec" if analysis.recommendation.clear_winner else "rec unclear"
    out = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>gpuscout report: {esc(analysis.run_name or analysis.run_id)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>gpuscout report: {esc(analysis.run_name or analysis.run_id)}</h1>",
    ]
    if note:
        out.append(f"<p class='note'><strong>{esc(note)}</strong></p>")
    out.append(
        f"<p class='meta'>Run <code>{esc(analysis.run_id)}</code> · {esc(' · '.join(_constraints_text(analysis)))}"
        f" · benchmark billed {esc(_usd(analysis.total_billed_usd))}"
        f" · generated {analysis.generated_at:%Y-%m-%d %H:%M UTC}</p>"
    )
    out.extend(f"<p class='note'><strong>{esc(banner)}</strong></p>" for banner in banners(analysis))
    out.append(f"<h2>Recommendation</h2><p class='{rec_class}'>{esc(analysis.recommendation.summary)}</p>")
    out.append("<h2>Ranked results</h2>" + _html_table(header, rows, frozenset({0, 2, 3, 4, 5, 6, 7, 8})))
    if s["excluded_rows"]:
        out.append("<h2>Excluded</h2>" + _html_table(s["excluded_header"], s["excluded_rows"]))
    if analysis.search is not None:
        out.append("<h2>Settings search</h2>")
        for text, search_rows in _search_blocks(analysis):
            out.append(f"<p>{esc(text)}</p>" + _html_table(SEARCH_HEADER, search_rows))
    if charts:
        out.append("<h2>Charts</h2>")
        for title, path in charts:
            data = base64.b64encode(path.read_bytes()).decode("ascii")
            out.append(f"<img alt='{esc(title)}' src='data:image/png;base64,{data}'>")
    if analysis.machines:
        out.append("<h2>Machines</h2>" + _html_table(MACHINE_HEADER, _machine_rows(analysis)))
    out.append("<h2>How the numbers were obtained</h2>" + _html_table(s["method_header"], s["method_rows"]))
    out.append("<h2>Prices used (snapshot)</h2>" + _html_table(s["prices_header"], s["prices_rows"], frozenset({1, 2})))
    out.append("<h2>Assumptions</h2><ul>" + "".join(f"<li>{esc(a)}</li>" for a in analysis.assumptions) + "</ul>")
    out.append("</body></html>")
    return "\n".join(out)


def write_report(analysis: RunAnalysis, out_dir: Path | str, *, note: str | None = None) -> dict[str, Any]:
    """Write report.md, report.html (self-contained), report.json and the PNG charts into ``out_dir``.

    Returns {"md": path, "html": path, "json": path, "charts": [paths]}. ``note`` is shown at the top of the
    report (e.g. "example from fixture data, not a measurement").
    """
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        charts = write_charts(analysis, out)
        md = out / "report.md"
        md.write_text(render_markdown(analysis, charts, note=note), encoding="utf-8")
        page = out / "report.html"
        page.write_text(render_html(analysis, charts, note=note), encoding="utf-8")
        js = out / "report.json"
        js.write_text(analysis.model_dump_json(indent=2) + "\n", encoding="utf-8")
    except OSError as err:
        raise ReportError(f"cannot write the report to {out}: {err}") from err
    return {"md": md, "html": page, "json": js, "charts": [p for _, p in charts]}
