"""Analyze (state "Analyze run"): the run's measured jobs (never its canaries) -> tokens/s, MFU, costs, exclusions,
the ranking and the recommendation (gpuscout.analysis), stored as the RESULT row; the report (``report.py``) and the
run's closing (``close.py``) follow. The drivers choose the prices: the local one the catalog's with the manifest's
overrides, the cloud one today's SageMaker list prices where the Price List API answers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuscout.store.base import JobRecord, ResultRecord, ResultStore, RunRecord

if TYPE_CHECKING:
    from gpuscout.analysis.pricing import PriceBook
    from gpuscout.analysis.terms import RunTerms
    from gpuscout.domain.catalog import Catalog
    from gpuscout.domain.run_analysis import RunAnalysis


def measured_jobs(store: ResultStore, run_id: str) -> list[JobRecord]:
    """The run's jobs the analysis reads: every one but the canaries (a canary is not a measurement)."""
    return [j for j in store.list_jobs(run_id) if not j.is_canary]


def result_record(analysis: RunAnalysis, *, report_uri: str | None = None) -> ResultRecord:
    return ResultRecord(
        run_id=analysis.run_id,
        analysis=analysis,
        report_uri=report_uri,
        price_snapshot=analysis.price_snapshot,
    )


def analyze_run(
    run: RunRecord,
    store: ResultStore,
    *,
    catalog: Catalog,
    terms: RunTerms | None = None,
    prices: PriceBook | None = None,
    jobs: list[JobRecord] | None = None,
) -> tuple[RunAnalysis, list[JobRecord]]:
    """The run's analysis, stored (without a report yet), and the jobs it analysed. ``terms`` default to the
    manifest stored on the run, ``prices`` to the catalog's with its overrides (analysis.analyze.analyze_run);
    ``jobs`` to the run's measured jobs in the store (a driver that read them to price them passes them)."""
    from gpuscout.analysis.analyze import analyze_run as analyze_jobs  # numpy: only where a run is analysed

    jobs = measured_jobs(store, run.run_id) if jobs is None else jobs
    analysis = analyze_jobs(run, jobs, terms=terms, catalog=catalog, prices=prices)
    store.put_result(result_record(analysis))
    return analysis, jobs
