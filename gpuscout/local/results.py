"""A local run's results: the ranked result rows the CLI and tracking show, the analysis and report written at the
end of a run, and an old run's analysis repriced.

May import: gpuscout.domain, gpuscout.store, gpuscout.analysis (lazily: numpy and matplotlib load only here) and
gpuscout.local.observer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gpuscout.domain.catalog import load_catalog
from gpuscout.errors import GpuscoutError
from gpuscout.store.base import (
    JobRecord,
    JobStatus,
    ResultRecord,
    RunRecord,
)

if TYPE_CHECKING:
    pass


def _stop_text(a: Mapping[str, Any]) -> str | None:
    from gpuscout.analysis.results import JobAnalysis

    if a.get("tokens_per_s") is None and a.get("samples_per_s") is None:
        return None
    return JobAnalysis.model_validate(a).stop_text


def _note(a: Mapping[str, Any]) -> str | None:
    """Exclusion or failure first; else what makes the row's number weaker than it looks."""
    if a.get("excluded_reason") or a.get("failure"):
        return a.get("excluded_reason") or a.get("failure")
    from gpuscout.analysis.results import JobAnalysis  # the stop rule's outcome has a column of its own ("stop")

    return JobAnalysis.model_validate(a).measurement_note or None


def result_rows(analysis: Mapping[str, Any] | None, jobs: Sequence[JobRecord]) -> list[dict[str, Any]]:
    """Flat rows, best first: from the stored analysis, or from the job rows when the run was not analyzed."""
    if analysis and analysis.get("jobs") is not None:
        rows = []
        for a in analysis["jobs"]:
            ci = a.get("tokens_per_s_ci95") or (None, None)
            samples_ci = a.get("samples_per_s_ci95") or (None, None)
            rows.append(
                {
                    "unit": a.get("unit", "tokens"),
                    "samples_per_s": a.get("samples_per_s"),
                    "samples_per_s_ci95_low": samples_ci[0],
                    "samples_per_s_ci95_high": samples_ci[1],
                    "usd_per_million_samples": a.get("usd_per_million_samples"),
                    "usd_per_million_samples_spot": a.get("usd_per_million_samples_spot"),
                    "rank": a.get("rank"),
                    "job_name": a.get("job_name"),
                    "variant": a.get("variant_name"),
                    "instance_type": a.get("instance_type"),
                    "instance_count": a.get("instance_count", 1),
                    "gpus": a.get("gpus", 0),
                    "gpu_sku": a.get("gpu_sku"),
                    "spot": a.get("spot", False),
                    "status": a.get("status"),
                    "repetitions": a.get("repetitions"),
                    "tokens_per_s": a.get("tokens_per_s"),
                    "tokens_per_s_ci95_low": ci[0],
                    "tokens_per_s_ci95_high": ci[1],
                    "mfu": a.get("mfu"),
                    "usd_per_hour": a.get("usd_per_hour"),
                    "usd_per_million_tokens": a.get("usd_per_million_tokens"),
                    "usd_per_million_tokens_spot": a.get("usd_per_million_tokens_spot"),
                    "final_train_loss": a.get("final_train_loss"),
                    "ci_kind": a.get("ci_kind"),
                    "ci_method": a.get("ci_method"),
                    "timed_steps": a.get("timed_steps"),
                    "stop_rule": a.get("stop_rule"),
                    "stop_reason": a.get("stop_reason"),
                    "tolerance_reached": a.get("tolerance_reached"),
                    "stop": _stop_text(a),
                    "contention": a.get("contention_note"),
                    "disturbed": bool(a.get("disturbed")),
                    "disturbance": a.get("disturbance_note"),
                    "note": _note(a),
                }
            )
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
                "gpus": job.spec.get("gpus_per_instance", 0) * job.instance_count,
                "gpu_sku": bench.hardware.gpu_sku if bench else None,
                "spot": job.spot,
                "status": job.status.value,
                "repetitions": 1 if job.status is JobStatus.COMPLETED else 0,
                "tokens_per_s": throughput.tokens_per_s if throughput else None,
                "tokens_per_s_ci95_low": ci[0],
                "tokens_per_s_ci95_high": ci[1],
                "mfu": bench.efficiency.mfu if bench and bench.efficiency else None,
                "usd_per_hour": job.spec.get("price_per_hour_usd"),
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
                "contention": (job.contention or {}).get("note"),
                "disturbed": bool(disturbance and disturbance.disturbed),
                "disturbance": disturbance.evidence if disturbance else None,
                "note": job.failure_reason,
            }
        )
    return rows


def repriced_analysis(run: RunRecord, result: ResultRecord | None) -> dict[str, Any]:
    """The stored analysis re-priced with today's catalog prices (and the manifest's overrides)."""
    from gpuscout.analysis.analyze import reprice
    from gpuscout.analysis.pricing import PriceBook
    from gpuscout.analysis.terms import RunTerms

    if result is None:
        raise GpuscoutError(f"run {run.run_id} has no stored analysis to re-price (status {run.status.value})")
    prices = PriceBook.from_catalog(load_catalog()).with_manifest_overrides(RunTerms.stored(run.manifest))
    return reprice(result.analysis, prices).model_dump(mode="json")
