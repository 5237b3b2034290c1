"""A small, valid RunAnalysis for tests that store or show one without analysing jobs (the stored RESULT row holds
the model, so a test's row must be one)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from gpuscout.domain.run_analysis import Constraints, PriceSnapshot, Recommendation, RunAnalysis

T0 = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)


def run_analysis(run_id: str = "run-a", *, summary: str = "No pick (nothing measured).", **fields: Any) -> RunAnalysis:
    """An analysis of no jobs whose recommendation says ``summary``; ``fields`` replace any of its fields."""
    base = RunAnalysis(
        run_id=run_id,
        objective="cheapest_per_token",
        constraints=Constraints(),
        jobs=[],
        recommendation=Recommendation(job_name=None, summary=summary),
        excluded=[],
        price_snapshot=PriceSnapshot(prices={}, spot_assumption="assumed 60 % discount", taken_at=T0),
        total_billed_usd=0.0,
        assumptions=[],
        generated_at=T0,
    )
    return base.model_copy(update=fields)
