"""A run's results as the CLI shows them: the ranked result rows (from the stored analysis, or from the job rows
of a run not analysed), and an old run's analysis repriced.

May import: gpuscout.domain, gpuscout.store and gpuscout.analysis (lazily: numpy loads only to reprice)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpuscout.domain.catalog import load_catalog
from gpuscout.domain.run_analysis import JobAnalysis, RunAnalysis
from gpuscout.errors import GpuscoutError
from gpuscout.store.base import (
    JobRecord,
    JobStatus,
    ResultRecord,
    RunRecord,
)


def _analysed_row(a: JobAnalysis) -> dict[str, Any]:
    """One target x variant of a stored analysis as a flat row."""
    ci = a.tokens_per_s_ci95 or (None, None)
    samples_ci = a.samples_per_s_ci95 or (None, None)
    measured = a.tokens_per_s is not None or a.samples_per_s is not None
    return {
        "unit": a.unit,
        "samples_per_s": a.samples_per_s,
        "samples_per_s_ci95_low": samples_ci[0],
        "samples_per_s_ci95_high": samples_ci[1],
        "usd_per_million_samples": a.usd_per_million_samples,
        "usd_per_million_samples_spot": a.usd_per_million_samples_spot,
        "rank": a.rank,
        "job_name": a.job_name,
        "variant": a.variant_name,
        "instance_type": a.instance_type,
        "instance_count": a.instance_count,
        "gpus": a.gpus,
        "gpu_sku": a.gpu_sku,
        "spot": a.spot,
        "status": a.status,
        "repetitions": a.repetitions,
        "tokens_per_s": a.tokens_per_s,
        "tokens_per_s_ci95_low": ci[0],
        "tokens_per_s_ci95_high": ci[1],
        "mfu": a.mfu,
        "usd_per_hour": a.usd_per_hour,
        "usd_per_million_tokens": a.usd_per_million_tokens,
        "usd_per_million_tokens_spot": a.usd_per_million_tokens_spot,
        "final_train_loss": a.final_train_loss,
        "ci_kind": a.ci_kind,
        "ci_method": a.ci_method,
        "timed_steps": a.timed_steps,
        "stop_rule": a.stop_rule,
        "stop_reason": a.stop_reason,
        "tolerance_reached": a.tolerance_reached,
        "stop": a.stop_text if measured else None,
        "contention": a.contention_note,
        "disturbed": a.disturbed,
        "disturbance": a.disturbance_note,
        # exclusion or failure first; else what makes the row's number weaker than it looks (the stop rule's
        # outcome has a column of its own, "stop")
        "note": a.excluded_reason or a.failure or a.measurement_note or None,
    }


def result_rows(analysis: RunAnalysis | None, jobs: Sequence[JobRecord]) -> list[dict[str, Any]]:
    """Flat rows, best first: from the stored analysis, or from the job rows when the run was not analyzed."""
    if analysis is not None:
        rows = [_analysed_row(a) for a in analysis.jobs]
        return sorted(rows, key=lambda r: (r["rank"] is None, r["rank"] or 0, r["job_name"] or ""))
    rows = []
    for job in (j for j in jobs if not j.is_canary):  # a canary is not a measurement
        bench = job.benchmark
        throughput = bench.throughput if bench else None
        ci = (throughput.tokens_per_s_ci95 if throughput else None) or (None, None)
        stop = bench.stop if bench else None
        disturbance = bench.disturbance if bench else None
        rows.append(
            {
                "rank": None,
                "job_name": job.job_name,
                "variant": job.variant_name,
                "instance_type": job.instance_type,
                "instance_count": job.instance_count,
                "gpus": job.spec.gpus_per_instance * job.instance_count,
                "gpu_sku": bench.hardware.gpu_sku if bench else None,
                "spot": job.spot,
                "status": job.status.value,
                "repetitions": 1 if job.status is JobStatus.COMPLETED else 0,
                "tokens_per_s": throughput.tokens_per_s if throughput else None,
                "tokens_per_s_ci95_low": ci[0],
                "tokens_per_s_ci95_high": ci[1],
                "mfu": bench.efficiency.mfu if bench and bench.efficiency else None,
                "usd_per_hour": job.spec.price_per_hour_usd,
                "usd_per_million_tokens": None,
                "usd_per_million_tokens_spot": None,
                "final_train_loss": bench.loss.final_train_loss if bench and bench.loss else None,
                "ci_kind": None,
                "ci_method": None,
                "timed_steps": bench.timing.timed_steps if bench and bench.timing else None,
                "stop_rule": stop.rule if stop else None,
                "stop_reason": stop.reason if stop else None,
                "tolerance_reached": None,
                "stop": stop.reason if stop else None,
                "contention": job.contention.note if job.contention else None,
                "disturbed": bool(disturbance and disturbance.disturbed),
                "disturbance": disturbance.evidence if disturbance else None,
                "note": job.failure_reason,
            }
        )
    return rows


def repriced_analysis(run: RunRecord, result: ResultRecord | None) -> RunAnalysis:
    """The stored analysis re-priced with today's catalog prices (and the manifest's overrides)."""
    from gpuscout.analysis.analyze import reprice
    from gpuscout.analysis.pricing import PriceBook
    from gpuscout.analysis.terms import RunTerms

    if result is None:
        raise GpuscoutError(f"run {run.run_id} has no stored analysis to re-price (status {run.status.value})")
    prices = PriceBook.from_catalog(load_catalog()).with_manifest_overrides(RunTerms.stored(run.manifest))
    return reprice(result.analysis, prices)
