"""write_report: Markdown, self-contained HTML, JSON and PNG charts from the fixture run and from edge cases."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest
from example_run import load_example_run
from matplotlib.container import ErrorbarContainer

from gpuscout.analysis import report, report_charts
from gpuscout.analysis.analyze import analyze_run
from gpuscout.analysis.terms import RunTerms
from gpuscout.domain.run_analysis import RunAnalysis

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"
NOTE = "Example from fixture data, not a measurement."


@pytest.fixture(scope="module")
def analysis() -> RunAnalysis:
    run, jobs, catalog = load_example_run()
    return analyze_run(run, jobs, terms=RunTerms.stored(run.manifest), catalog=catalog)


@pytest.fixture(scope="module")
def written(analysis: RunAnalysis, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return report.write_report(analysis, tmp_path_factory.mktemp("report"), note=NOTE)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_every_file_is_written(written: dict[str, Any]) -> None:
    assert {k for k in written} == {"md", "html", "json", "charts"}
    names = sorted(p.name for p in written["charts"])
    assert names == sorted(
        [
            "tokens_per_s.png",
            "cost_per_million_tokens.png",
            "loss_vs_time.png",
            "loss_vs_cost.png",
            "pareto.png",
            "time_breakdown.png",
            "loss_per_step.png",  # the fixtures' benchmark.json files predate steps[]: no per-step throughput chart
        ]
    )
    for chart in written["charts"]:
        width, height = _png_size(chart)
        assert width >= 1000 and height >= 250  # 10 in x 110 dpi wide


def test_html_is_self_contained(written: dict[str, Any], analysis: RunAnalysis) -> None:
    page = written["html"].read_text()
    sources = re.findall(r"src='([^']*)'", page)
    assert len(sources) == len(written["charts"])
    assert all(s.startswith("data:image/png;base64,") for s in sources)
    # nothing is fetched from elsewhere: no stylesheets, scripts, links or CSS urls (source URLs appear as text)
    assert not re.search(r"<link|<script|href=|url\(", page)
    assert NOTE in page
    assert "ml.g5.12xlarge / bs4-ckpt (spot)" in page
    assert "out of GPU memory" in page


def test_markdown_has_every_section(written: dict[str, Any], analysis: RunAnalysis) -> None:
    md = written["md"].read_text()
    for heading in (
        "## Recommendation",
        "## Ranked results",
        "## Excluded",
        "## Charts",
        "## How the numbers were obtained",
        "## Prices used (snapshot)",
        "## Assumptions",
    ):
        assert heading in md
    assert analysis.recommendation.summary in md
    assert f"> **{NOTE}**" in md
    assert "![Pareto front](pareto.png)" in md
    assert "misses the deadline" in md
    # every ranked row is in the table, best first
    ranked_rows = [line for line in md.splitlines() if re.match(r"^\| \d+ \|", line)]
    assert [int(r.split("|")[1]) for r in ranked_rows] == list(range(1, len(ranked_rows) + 1))
    assert "| 1 | ml.g5.12xlarge / bs4-ckpt (spot) |" in md


def test_json_round_trips(written: dict[str, Any], analysis: RunAnalysis) -> None:
    again = RunAnalysis.model_validate_json(written["json"].read_text())
    assert again == analysis


def test_many_jobs_stay_readable(analysis: RunAnalysis) -> None:
    ranked = [j for j in analysis.jobs if j.rank is not None]
    many = [
        j.model_copy(update={"job_name": f"{j.job_name}-{i}", "variant_name": f"v{i}", "rank": i + 1})
        for i, j in enumerate(ranked * 10)
    ]
    big = analysis.model_copy(update={"jobs": many})
    fig = report_charts._chart_tokens_per_s(big)
    assert fig is not None
    ax = fig.axes[0]
    assert len(ax.get_yticklabels()) == report_charts.MAX_BARS
    assert (
        f"best {report_charts.MAX_BARS} shown; {len(many) - report_charts.MAX_BARS} more in the table" in ax.get_title()
    )
    assert fig.get_figheight() >= 0.36 * report_charts.MAX_BARS  # a bar height per label, not squeezed
    assert ax.get_xlabel().startswith("training throughput (non-padding tokens/s")


def test_charts_label_axes_with_units(analysis: RunAnalysis) -> None:
    for name, (_, make) in report_charts.CHARTS.items():
        if name == "step_rates.png":  # the fixture's benchmark.json files predate steps[]: give each job some
            rates = [(s, 1000.0 * (1 + (s > 3)), s > 3) for s in range(1, 20)]
            jobs = [j.model_copy(update={"step_rates": rates}) for j in analysis.jobs]
            fig = make(analysis.model_copy(update={"jobs": jobs}))
            assert fig is not None and fig.axes[0].get_ylabel() == "that step's tokens/s"
            assert fig.axes[0].get_xlabel() == "optimizer step"
            legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
            assert legend.count("warm-up step (not measured)") == 1
            continue
        fig = make(analysis)
        assert fig is not None, name
        ax = fig.axes[0]
        assert ax.get_xlabel(), name
        assert ax.get_title(), name
        # every x axis states its unit in brackets; y axes too where they carry numbers
        units = r"\((non-padding tokens/s|USD|minutes|cost per|training cost|a step is|seconds|hours)"
        assert re.search(units, ax.get_xlabel()), name
        if name.startswith("loss"):
            assert ax.get_ylabel() == "train loss (cross-entropy, nats/token)"
        if name == "pareto.png":
            assert ax.get_ylabel().startswith("throughput (tokens/s")


def test_report_without_results(tmp_path: Path) -> None:
    run, jobs, catalog = load_example_run()
    failed = [j for j in jobs if j.status.value in ("OOM", "CAPACITY")]
    empty = analyze_run(run, failed, terms=RunTerms.stored(run.manifest), catalog=catalog)
    out = report.write_report(empty, tmp_path)
    assert out["charts"] == []  # nothing measured, nothing to draw
    assert "No pick: every target x variant was excluded" in out["md"].read_text()
    assert "<img" not in out["html"].read_text()


def test_text_is_escaped(analysis: RunAnalysis, tmp_path: Path) -> None:
    hostile = analysis.model_copy(
        update={"jobs": [analysis.jobs[0].model_copy(update={"variant_name": "<script>alert(1)</script>|x"})]}
    )
    out = report.write_report(hostile, tmp_path)
    assert "<script>" not in out["html"].read_text()
    assert "&lt;script&gt;" in out["html"].read_text()
    assert "\\|x" in out["md"].read_text()  # a pipe would break the Markdown table
    # a job's failure output is run data too: in Markdown it is text, never HTML a viewer renders
    failed = analysis.model_copy(update={"jobs": [analysis.jobs[0].model_copy(
        update={"excluded_reason": 'failed: <img src=x onerror="alert(1)"> & more'}
    )]})  # fmt: skip
    markdown = report.write_report(failed, tmp_path / "failed")["md"].read_text()
    assert "<img" not in markdown and '&lt;img src=x onerror="alert(1)"> & more' in markdown


def test_a_report_is_written_whole_or_not_at_all(
    analysis: RunAnalysis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a disk that fills up halfway through report.html
    real = Path.write_text

    def half_then_full(self: Path, text: str, *args: Any, **kwargs: Any) -> int:
        if self.name == ".report.html.tmp":
            real(self, text[: len(text) // 2], *args, **kwargs)
            raise OSError(28, "No space left on device")
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", half_then_full)
    with pytest.raises(report.ReportError, match="No space left"):
        report.write_report(analysis, tmp_path)
    # Then no half report.html is left to open (nor its temporary file), and the run says why it has no report
    assert not (tmp_path / "report.html").exists() and not (tmp_path / ".report.html.tmp").exists()
    assert (tmp_path / "report.md").exists()  # written whole before the disk filled


def test_unwritable_folder_is_a_report_error(analysis: RunAnalysis, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(report.ReportError, match="cannot write the report"):
        report.write_report(analysis, blocker / "sub")


def test_estimate_outside_its_interval_does_not_crash(analysis: RunAnalysis, tmp_path: Path) -> None:
    # An estimator once put the point outside its own interval; matplotlib then raised "'xerr' must not contain
    # negative values". The whisker on the wrong side is clamped to zero and the report is written.
    ranked = [j for j in analysis.jobs if j.tokens_per_s is not None][:2]
    above, below = (
        ranked[0].model_copy(update={"tokens_per_s": 1000.0, "tokens_per_s_ci95": (1100.0, 1200.0)}),
        ranked[1].model_copy(update={"tokens_per_s": 1000.0, "tokens_per_s_ci95": (800.0, 900.0)}),
    )
    odd = analysis.model_copy(update={"jobs": [above, below]})
    fig = report_charts._chart_tokens_per_s(odd)
    assert fig is not None
    (whiskers,) = [c for c in fig.axes[0].containers if isinstance(c, ErrorbarContainer)]
    lows, highs = [], []
    for segment in whiskers.lines[2][0].get_segments():  # one horizontal whisker per bar: (x_low, x_high)
        lows.append(float(segment[0][0]))
        highs.append(float(segment[1][0]))
    # bottom bar = last job ("below": 800-900 under 1000): whisker 800..1000; top bar ("above"): 1000..1200
    assert (lows, highs) == ([800.0, 1000.0], [1000.0, 1200.0])
    out = report.write_report(odd, tmp_path)
    assert tmp_path / "tokens_per_s.png" in out["charts"]


def test_a_failed_final_validation_and_reserved_memory_are_shown_wherever_the_job_is(tmp_path: Path) -> None:
    """train.py keeps a measurement whose final validation failed (loss.validation_error): the row says so in the
    note of report.md, report.html and `results` (measurement_note), and the peak reserved stands beside allocated."""
    run, jobs, catalog = load_example_run()
    bench = jobs[0].benchmark
    assert bench is not None and bench.loss is not None
    memory = bench.memory.model_copy(update={"peak_allocated_gb": 61.24, "peak_reserved_gb": 66.5})
    loss = bench.loss.model_copy(update={"validation_error": "IndexError: index 0 is out of bounds"})
    bench = bench.model_copy(update={"loss": loss, "memory": memory})
    jobs[0] = jobs[0].model_copy(update={"benchmark": bench})
    result = analyze_run(run, jobs, terms=RunTerms.stored(run.manifest), catalog=catalog)
    [job] = [j for j in result.jobs if jobs[0].job_name in j.job_names]
    assert job.validation_note and "IndexError" in job.validation_note and "throughput stands" in job.validation_note
    assert job.validation_note in job.measurement_note
    assert job.peak_reserved_gb == pytest.approx(66.5)
    others = [j for j in result.jobs if j is not job]
    assert all(j.validation_note is None for j in others)
    files = report.write_report(result, tmp_path, note=NOTE)
    markdown = Path(files["md"]).read_text()
    assert "61.2 (66.5)" in markdown and "final validation failed" in markdown
    assert "final validation failed" in Path(files["html"]).read_text()


def test_the_report_says_what_the_numbers_were_measured_on(written: dict[str, Any], analysis: RunAnalysis) -> None:
    """A machine section (item 7 of the off-the-happy-path issue): model, GPUs, cores, library versions, from each
    completed job's benchmark.json."""
    assert [m.instance_type for m in analysis.machines][:2] == ["ml.g5.2xlarge", "ml.g5.12xlarge"]
    h100 = [m for m in analysis.machines if m.model == "NVIDIA H100 SXM5 80GB"]
    assert {m.gpus for m in h100} == {8, 16} and all(m.torch == "2.5.1" for m in h100)
    markdown = written["md"].read_text()
    section = markdown[markdown.index("## Machines") : markdown.index("## How the numbers were obtained")]
    assert (
        "| ml.p5.48xlarge | cuda | NVIDIA H100 SXM5 80GB | 16 | 64 | python 3.11.10, torch 2.5.1, transformers 4.46.3 |"
        in section
    )
    assert "12.4 / 550.127.05" in section
    assert "<h2>Machines</h2>" in written["html"].read_text()


def test_a_local_run_has_no_spot_bars_no_empty_phases_and_no_prices_it_did_not_use(analysis: RunAnalysis) -> None:
    """Item 7: legends and price rows only where the run has data for them."""
    from gpuscout.domain.run_analysis import TimeBreakdown

    first = analysis.jobs[0]
    local = first.model_copy(
        update={"instance_type": "local", "usd_per_million_tokens_spot": None, "spot_usd_per_hour": None,
                "time_breakdown": TimeBreakdown(startup=5.0, training=60.0, source="wall time")}
    )  # fmt: skip
    run = analysis.model_copy(update={"jobs": [local]})
    cost = report_charts._chart_cost(run)
    assert cost is not None and not cost.legends and "spot" not in cost.axes[0].get_title()
    breakdown = report_charts._chart_time_breakdown(run)
    assert breakdown is not None
    (legend,) = breakdown.legends
    assert [t.get_text() for t in legend.get_texts()] == ["startup", "training"]
    markdown = report.render_markdown(run, [])
    prices = markdown.split("## Prices used (snapshot)", 1)[1].split("## Assumptions", 1)[0]
    assert "ml." not in prices
    # the fixture's own runs keep their spot bars and every type they measured
    full = report_charts._chart_cost(analysis)
    assert full is not None and [t.get_text() for t in full.legends[0].get_texts()][1].startswith("spot")
    full_prices = report.render_markdown(analysis, []).split("## Prices used (snapshot)", 1)[1]
    assert {j.instance_type for j in analysis.jobs} == {
        t for t in analysis.price_snapshot.prices if f"| {t} |" in full_prices
    }


def test_the_settings_table_shows_what_differs_and_says_what_is_shared(analysis: RunAnalysis) -> None:
    from gpuscout.analysis.settings_table import settings_table

    def key(batch: int, hyper: dict[str, str]) -> str:
        hps = {"per_device_train_batch_size": str(batch), "learning_rate": "0.001", "canary_layers": "0",
               "ci_tolerance": "0.02", "stop_rule": "fixed", "job_name": "x", **hyper}  # fmt: skip
        return json.dumps(["local", 1, False, "fp32", None, hps])

    a, b, c = (analysis.jobs[i].model_copy(update={"variant_name": n}) for i, n in enumerate(("a", "b", "c")))
    a = a.model_copy(update={"settings_key": key(4, {})})
    b = b.model_copy(update={"settings_key": key(8, {"packing": "false"})})
    c = c.model_copy(update={"settings_key": None})  # never ran: no settings known, no row
    header, rows, common = settings_table([a, b, c])
    assert header == ["instance / variant", "micro-batch", "packing"]
    assert rows == [[a.label, "4", "–"], [b.label, "8", "false"]]
    assert common == "instances 1; spot no; precision fp32; learning rate 0.001; stop rule fixed"  # no internals
    # one variant: nothing differs, so no table, only the line
    assert settings_table([a]) == ([], [], "instances 1; spot no; micro-batch 4; precision fp32; learning rate 0.001; "
                                           "stop rule fixed")  # fmt: skip


def test_money_is_never_written_in_scientific_notation() -> None:
    from gpuscout.analysis.recommend import usd_text

    assert [usd_text(v) for v in (2.171e-05, 0.0008501, 0.5, 1234.5, 0.0)] == [
        "$0.00002171", "$0.0008501", "$0.5", "$1,234.50", "$0.00"
    ]  # fmt: skip


def test_the_bar_charts_mark_measurements_not_to_be_trusted(analysis: RunAnalysis) -> None:
    # Given one disturbed, one contended and one interval-less measurement beside trusted ones
    first, second, third, *rest = analysis.jobs
    jobs = [
        first.model_copy(update={"disturbed": True, "disturbance_note": "3 of 27 steps ran 4x slower"}),
        second.model_copy(update={"contention_note": "measured under competition (1.8 other cores busy)"}),
        third.model_copy(update={"ci_kind": "unreliable", "tokens_per_s_ci95": None}),
        *rest,
    ]
    run = analysis.model_copy(update={"jobs": jobs})
    for make in (report_charts._chart_tokens_per_s, report_charts._chart_cost):
        fig = make(run)
        assert fig is not None
        ax = fig.axes[0]
        # Then their bars are hatched and their labels say why; every other bar is plain
        labels = [t.get_text() for t in ax.get_yticklabels()]
        marks = {label.split("  [")[0]: label.split("  [")[1].rstrip("]") for label in labels if "  [" in label}
        assert marks == {first.label: "disturbed", second.label: "contended", third.label: "CI unreliable"}
        hatched = {p.get_hatch() for p in ax.patches}
        assert hatched == {report_charts.UNTRUSTED_HATCH, None}
        assert sum(1 for p in ax.patches if p.get_hatch()) == 3 * (1 + (make is report_charts._chart_cost))
        assert any("hatched: a measurement not to be trusted" in t.get_text() for t in fig.texts)
    # and the measurement without an interval is said to have none, not drawn with a zero-width whisker
    throughput = report_charts._chart_tokens_per_s(run)
    assert throughput is not None
    assert [t.get_text() for t in throughput.axes[0].texts].count("  no CI (unreliable)") == 1


def test_the_manifests_description_heads_the_report(analysis: RunAnalysis, tmp_path: Path) -> None:
    described = analysis.model_copy(update={"description": "Qwen 0.5B on Hebrew <b>text</b>: g5 vs p4d vs p5"})
    files = report.write_report(described, tmp_path)
    markdown = Path(files["md"]).read_text()
    assert markdown.index("Qwen 0.5B on Hebrew") < markdown.index("## Recommendation")
    assert "&lt;b&gt;text&lt;/b&gt;" in Path(files["html"]).read_text()
    run, jobs, catalog = load_example_run()
    manifest = {**run.manifest, "description": "what this run compares"}
    described = analyze_run(run, jobs, terms=RunTerms.stored(manifest), catalog=catalog)
    assert described.description == "what this run compares"
