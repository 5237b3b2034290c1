"""write_report: Markdown, self-contained HTML, JSON and PNG charts from the fixture run and from edge cases."""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any

import pytest
from example_run import load_example_run
from matplotlib.container import ErrorbarContainer

from gpuscout.analysis import report
from gpuscout.analysis.analyze import analyze_run
from gpuscout.analysis.results import RunAnalysis

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"
NOTE = "Example from fixture data, not a measurement."


@pytest.fixture(scope="module")
def analysis() -> RunAnalysis:
    run, jobs, catalog = load_example_run()
    return analyze_run(run, jobs, manifest=run.manifest, catalog=catalog)


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
    fig = report._chart_tokens_per_s(big)
    assert fig is not None
    ax = fig.axes[0]
    assert len(ax.get_yticklabels()) == report.MAX_BARS
    assert f"best {report.MAX_BARS} shown; {len(many) - report.MAX_BARS} more in the table" in ax.get_title()
    assert fig.get_figheight() >= 0.36 * report.MAX_BARS  # a bar height per label, not squeezed
    assert ax.get_xlabel().startswith("training throughput (non-padding tokens/s")


def test_charts_label_axes_with_units(analysis: RunAnalysis) -> None:
    for name, (_, make) in report.CHARTS.items():
        if name == "step_times.png":  # the fixture's benchmark.json files predate steps[]: give each job some
            jobs = [j.model_copy(update={"step_times": [(s, 0.1) for s in range(4, 20)]}) for j in analysis.jobs]
            fig = make(analysis.model_copy(update={"jobs": jobs}))
            assert fig is not None and fig.axes[0].get_ylabel() == "step time (ms)"
            assert fig.axes[0].get_xlabel().startswith("optimizer step (timed steps only")
            continue
        fig = make(analysis)
        assert fig is not None, name
        ax = fig.axes[0]
        assert ax.get_xlabel(), name
        assert ax.get_title(), name
        # every x axis states its unit in brackets; y axes too where they carry numbers
        assert re.search(r"\((non-padding tokens/s|USD|minutes|cost per|training cost)", ax.get_xlabel()), name
        if name.startswith("loss"):
            assert ax.get_ylabel() == "train loss (cross-entropy, nats/token)"
        if name == "pareto.png":
            assert ax.get_ylabel().startswith("throughput (tokens/s")


def test_report_without_results(tmp_path: Path) -> None:
    run, jobs, catalog = load_example_run()
    failed = [j for j in jobs if j.status.value in ("OOM", "CAPACITY")]
    empty = analyze_run(run, failed, manifest=run.manifest, catalog=catalog)
    out = report.write_report(empty, tmp_path)
    assert out["charts"] == []  # nothing measured, nothing to draw
    assert "No recommendation" in out["md"].read_text()
    assert "<img" not in out["html"].read_text()


def test_text_is_escaped(analysis: RunAnalysis, tmp_path: Path) -> None:
    hostile = analysis.model_copy(
        update={"jobs": [analysis.jobs[0].model_copy(update={"variant_name": "<script>alert(1)</script>|x"})]}
    )
    out = report.write_report(hostile, tmp_path)
    assert "<script>" not in out["html"].read_text()
    assert "&lt;script&gt;" in out["html"].read_text()
    assert "\\|x" in out["md"].read_text()  # a pipe would break the Markdown table


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
    fig = report._chart_tokens_per_s(odd)
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
    assert bench is not None
    memory = {**(bench.get("memory") or {}), "peak_allocated_gb": 61.24, "peak_reserved_gb": 66.5}
    bench = {
        **bench,
        "loss": {**bench["loss"], "validation_error": "IndexError: index 0 is out of bounds"},
        "memory": memory,
    }
    jobs[0] = jobs[0].model_copy(update={"benchmark": bench})
    result = analyze_run(run, jobs, manifest=run.manifest, catalog=catalog)
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
