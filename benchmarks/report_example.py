"""Regenerate docs/report-example/ (the README's example report) from the fixture run, with the current code.

    .venv/bin/python -m benchmarks.report_example    (from the repository's root: it reads tests/unit's fixture run)

The numbers are synthetic (tests/fixtures/benchmarks): the page shows what a report looks like, not a measurement.
"""

from __future__ import annotations

from pathlib import Path

from gpuscout.analysis.analyze import analyze_run
from gpuscout.analysis.report import write_report
from gpuscout.analysis.terms import RunTerms
from tests.unit.example_run import load_example_run  # the fixture run the report tests use

ROOT = Path(__file__).resolve().parents[1]

NOTE = (
    "Example from fixture data, not a measurement: synthetic benchmark results and example prices "
    "(tests/fixtures/benchmarks)."
)


def main() -> None:
    run, jobs, catalog = load_example_run()
    analysis = analyze_run(run, jobs, terms=RunTerms.stored(run.manifest), catalog=catalog)
    out = ROOT / "docs" / "report-example"
    written = write_report(analysis, out, note=NOTE)
    print(f"wrote {out}: {len(written['charts'])} charts, report.md, report.html, report.json")


if __name__ == "__main__":
    main()
