"""Report (state "Analyze run", after the analysis): the analysis as pages, charts and JSON in a folder, published
where the driver keeps reports (the cloud's data bucket under reports/<run_id>/; locally the run folder is the place)
and recorded on the RESULT row as its report_uri."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gpuscout.store.base import ResultStore
from gpuscout.workflow.analyze import result_record
from gpuscout.workflow.ports import ReportSink

if TYPE_CHECKING:
    from gpuscout.domain.run_analysis import RunAnalysis


def write_report(analysis: RunAnalysis, folder: Path, *, store: ResultStore, sink: ReportSink | None = None) -> str:
    """Write the report into ``folder``, publish it through ``sink`` (without one, ``folder`` is where it stays) and
    record where it is on the RESULT row; returns that place."""
    from gpuscout.analysis.report import write_report as write_pages  # matplotlib: only where a report is written

    write_pages(analysis, folder)
    uri = sink.publish(analysis.run_id, folder) if sink is not None else str(folder)
    store.put_result(result_record(analysis, report_uri=uri))
    return uri
