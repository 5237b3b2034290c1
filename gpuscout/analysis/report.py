"""Report of a RunAnalysis: Markdown, self-contained HTML (charts inlined), JSON and PNG charts (report_charts.py).

Tables show a column only where some row has a value for it (no MFU column for a CPU run, no spot column where
nothing has a spot price), and the price snapshot lists only the instance types the run measured.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuscout.analysis.recommend import duration_text, usd_text
from gpuscout.analysis.report_charts import write_charts
from gpuscout.analysis.settings_table import settings_table
from gpuscout.domain.catalog import LOCAL
from gpuscout.domain.config_files import write_whole
from gpuscout.domain.run_analysis import JobAnalysis, RunAnalysis
from gpuscout.errors import GpuscoutError
from gpuscout.plan.job_section import rate_text


class ReportError(GpuscoutError):
    """The report could not be written."""


# -- formatting ---------------------------------------------------------------------------------------------------
def _num(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _usd(value: float | None) -> str:
    return "–" if value is None else usd_text(value)


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
    return "–" if hours is None else f"{duration_text(hours)} / {_usd(usd)}"


def _loss_target(job: JobAnalysis) -> str:
    if job.target_loss is None or job.tokens_per_s is None:
        return "–"
    if job.target_loss_hours is None:
        return f"{job.target_loss_method or 'not projected'}"
    return f"{_hours_usd(job.target_loss_hours, job.target_loss_usd)} ({job.target_loss_method})"


def _memory(allocated: float | None, reserved: float | None) -> str:
    """Peak allocated, and the allocator's peak reserved beside it where the job reported one (CUDA)."""
    text = _num(allocated, 1)
    return f"{text} ({reserved:.1f})" if allocated is not None and reserved is not None else text


# A ranked-table column: header, the cell of each job, right-aligned in HTML, shown even when no row has a value
_Column = tuple[str, Any, bool, bool]
EMPTY_CELLS = frozenset({"", "–", "-"})


def _table_rows(analysis: RunAnalysis) -> tuple[list[str], list[list[str]], frozenset[int]]:
    """The ranked table: header, rows and the numeric columns' indices; an optional column no row has a value for
    (MFU on a CPU, spot on a local machine, memory without a GPU, an empty note) is left out."""
    unit = analysis.unit
    target = analysis.constraints.target_loss
    samples = unit == "samples"
    # an adapter run's MFU counts less work than a full fine-tune's (docs/metrics.md "Adapters"): marked, never bare
    mixed = len({j.method for j in analysis.jobs}) > 1
    adapters = any(j.method != "full" for j in analysis.jobs)
    columns: list[_Column] = [
        ("rank", lambda j: str(j.rank) if j.rank is not None else "–", True, True),
        ("instance / variant", lambda j: j.label, False, True),
        ("trains", lambda j: j.trains_text if mixed or j.method != "full" else "", False, False),
        ("reps", lambda j: f"{j.repetitions}/{j.repetitions_planned}", True, True),
        (f"{unit}/s ± 95 % CI", _tps, True, True),
        ("tokens/s per GPU", lambda j: _num(j.tokens_per_s_per_gpu), True, False),
        ("MFU", lambda j: _pct(j.mfu) + (f" ({j.method} FLOPs)" if mixed and j.mfu is not None else ""), True,
         False),
        (f"$/1M {unit} on-demand",
         lambda j: _usd(j.usd_per_million_samples if samples else j.usd_per_million_tokens), True, True),
        (f"$/1M {unit} spot",
         lambda j: _usd(j.usd_per_million_samples_spot if samples else j.usd_per_million_tokens_spot), True, False),
        ("one epoch, training only",
         lambda j: _hours_usd(j.epoch_hours, j.epoch_usd_spot if j.spot else j.epoch_usd), True, True),
        *([(f"to loss {target:g}, training only", _loss_target, False, True)] if target is not None else []),
        ("benchmark billed", lambda j: _usd(j.billed_usd), True, True),
        ("peak mem GB (reserved)", lambda j: _memory(j.peak_memory_gb, j.peak_reserved_gb), True, False),
        # on a CPU, where methods are compared: the job process's peak resident memory (weights, states and all)
        ("host peak RSS GB", lambda j: _num(j.host_rss_peak_gb, 2) if adapters and j.peak_memory_gb is None else "",
         True, False),
        ("stop", lambda j: ("⚠ " if j.tolerance_reached is False else "") + j.stop_text if j.rate is not None else "–",
         False, True),
        ("Pareto", lambda j: "yes" if j.on_pareto_front else "", False, False),
        ("note", lambda j: ("⚠ " if j.disturbed or j.contention_note or j.validation_note else "")
         + j.measurement_note, False, False),
    ]  # fmt: skip
    rows = [[cell(job) for _, cell, _, _ in columns] for job in analysis.jobs]
    always = {i for i, column in enumerate(columns) if column[3]}
    header, rows, kept = _kept_columns([c[0] for c in columns], rows, always)
    return header, rows, frozenset(n for n, i in enumerate(kept) if columns[i][2])


def _kept_columns(
    header: Sequence[str], rows: Sequence[Sequence[str]], always: set[int]
) -> tuple[list[str], list[list[str]], list[int]]:
    """The table without the columns (other than ``always``) that no row has a value in, and the kept columns'
    indices in the original."""
    kept = [i for i in range(len(header)) if i in always or any(row[i] not in EMPTY_CELLS for row in rows)]
    return [header[i] for i in kept], [[row[i] for i in kept] for row in rows], kept


def _filled(header: Sequence[str], rows: Sequence[Sequence[str]]) -> tuple[list[str], list[list[str]]]:
    """The table without the columns (after the first) that no row has a value in (GPUs and CUDA on a CPU run, the
    time to a target loss without one)."""
    kept_header, kept_rows, _ = _kept_columns(header, rows, {0})
    return kept_header, kept_rows


# -- documents ----------------------------------------------------------------------------------------------------
def _prediction_text(job: JobAnalysis) -> str:
    """``20,000 samples/s (user's estimate ...); measured 0.41x`` : what was predicted, how, and how it compares."""
    if job.predicted_rate is None or not job.prediction_method:
        return "–"
    unit = "samples" if job.unit == "samples" else "tokens"
    measured = job.samples_per_s if job.unit == "samples" else job.tokens_per_s
    ratio = f"; measured {measured / job.predicted_rate:.2g}x of it" if measured else ""
    return f"{rate_text(job.predicted_rate)} {unit}/s ({job.prediction_method}){ratio}"


def _md_text(text: str) -> str:
    """Text from a run (a job's failure output, a variant's settings) as Markdown shows it, never as HTML a viewer
    would render: every < escaped, so no tag can open ("4.9 % > 2.0 %" stays as written)."""
    return text.replace("<", "&lt;")


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def cell(text: str) -> str:
        return _md_text(text).replace("|", "\\|").replace("\n", " ")

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
    measured = {j.instance_type for j in analysis.jobs}
    return {
        "prices_header": [
            "instance",
            "on-demand $/h",
            "spot $/h",
            "kind",
            "on-demand source",
            "spot source",
            "date",
            "region",
        ],
        "prices_rows": [
            [
                p.instance_type,
                _usd(p.on_demand_usd_per_hour),
                "–" if p.instance_type == LOCAL else _usd(p.spot_usd_per_hour),
                p.kind_text(analysis.generated_at),
                p.on_demand_source,
                "a local machine has no spot price" if p.instance_type == LOCAL else p.spot_source,
                p.date or "–",
                p.region or "–",
            ]
            for p in prices.values()
            if p.instance_type in measured  # the snapshot holds the catalog's types; the run's are the ones read
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


def recommendation_notes(analysis: RunAnalysis) -> list[str]:
    """The diagnostics behind the verdict, shown under it (the incomplete-run note is a banner already)."""
    return [n for n in analysis.recommendation.notes if n != analysis.incomplete]


def banners(analysis: RunAnalysis) -> list[str]:
    """What a reader must know beside the recommendation (shown right after it): a run that did not finish
    everything, and measurements taken while other processes competed for the machine (which more repetitions do
    not fix)."""
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
    header, rows, _ = _table_rows(analysis)
    settings_header, settings_rows, common = settings_table(analysis.jobs)
    s = _sections(analysis)
    parts = [f"# gpuscout report: {analysis.run_name or analysis.run_id}", ""]
    if note:
        parts += [f"> **{note}**", ""]
    if analysis.description:
        parts += [_md_text(analysis.description), ""]
    notes = recommendation_notes(analysis)
    parts += [
        f"Run `{analysis.run_id}` · {' · '.join(_constraints_text(analysis))} · "
        f"benchmark billed {_usd(analysis.total_billed_usd)} · generated {analysis.generated_at:%Y-%m-%d %H:%M UTC}",
        "",
        "## Recommendation",
        "",
        _md_text(analysis.recommendation.summary),
        "",
        *[f"- {_md_text(n)}" for n in notes],
        *([""] if notes else []),
        *[f"> **{_md_text(banner)}**\n" for banner in banners(analysis)],
        "## Ranked results",
        "",
        _md_table(header, rows),
        "",
    ]
    if settings_rows or common:
        parts += ["## Settings of each variant", ""]
        parts += [_md_table(settings_header, settings_rows), ""] if settings_rows else []
        parts += [f"{'Common to all' if settings_rows else 'Settings'}: {_md_text(common)}", ""] if common else []
    if s["excluded_rows"]:
        parts += ["## Excluded", "", _md_table(s["excluded_header"], s["excluded_rows"]), ""]
    if analysis.search is not None:
        parts += ["## Settings search", ""]
        for text, search_rows in _search_blocks(analysis):
            parts += [_md_text(text), "", _md_table(SEARCH_HEADER, search_rows), ""]
    if charts:
        parts += ["## Charts", ""]
        parts += [f"![{title}]({path.name})\n" for title, path in charts]
    if analysis.machines:
        parts += ["## Machines", "", _md_table(*_filled(MACHINE_HEADER, _machine_rows(analysis))), ""]
    parts += ["## How the numbers were obtained", "", _md_table(*_filled(s["method_header"], s["method_rows"])), ""]
    parts += ["## Prices used (snapshot)", "", _md_table(s["prices_header"], s["prices_rows"]), ""]
    parts += ["## Assumptions", ""] + [f"- {_md_text(a)}" for a in analysis.assumptions] + [""]
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
    header, rows, numeric = _table_rows(analysis)
    settings_header, settings_rows, common = settings_table(analysis.jobs)
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
    if analysis.description:
        out.append(f"<p class='description'>{esc(analysis.description)}</p>")
    out.append(
        f"<p class='meta'>Run <code>{esc(analysis.run_id)}</code> · {esc(' · '.join(_constraints_text(analysis)))}"
        f" · benchmark billed {esc(_usd(analysis.total_billed_usd))}"
        f" · generated {analysis.generated_at:%Y-%m-%d %H:%M UTC}</p>"
    )
    out.append(f"<h2>Recommendation</h2><p class='{rec_class}'>{esc(analysis.recommendation.summary)}</p>")
    if notes := recommendation_notes(analysis):
        out.append("<ul class='notes'>" + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>")
    out.extend(f"<p class='note'><strong>{esc(banner)}</strong></p>" for banner in banners(analysis))
    out.append("<h2>Ranked results</h2>" + _html_table(header, rows, numeric))
    if settings_rows or common:
        out.append("<h2>Settings of each variant</h2>")
        out.append(_html_table(settings_header, settings_rows) if settings_rows else "")
        out.append(f"<p>{'Common to all' if settings_rows else 'Settings'}: {esc(common)}</p>" if common else "")
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
        out.append("<h2>Machines</h2>" + _html_table(*_filled(MACHINE_HEADER, _machine_rows(analysis))))
    out.append("<h2>How the numbers were obtained</h2>" + _html_table(*_filled(s["method_header"], s["method_rows"])))
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
    md, page, js = out / "report.md", out / "report.html", out / "report.json"
    try:
        out.mkdir(parents=True, exist_ok=True)
        charts = write_charts(analysis, out)
        texts = {
            md: render_markdown(analysis, charts, note=note),
            page: render_html(analysis, charts, note=note),
            js: analysis.model_dump_json(indent=2) + "\n",
        }
        for path, text in texts.items():  # each whole or not at all: a full disk leaves no half report
            write_whole(path, text)
    except OSError as err:
        raise ReportError(f"cannot write the report to {out}: {err}") from err
    return {"md": md, "html": page, "json": js, "charts": [p for _, p in charts]}
