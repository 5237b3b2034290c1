"""A run that compares training methods (full, LoRA, QLoRA) is ranked and recommended at equal quality: by the cost or
time to the target loss, never a clear winner on $ per token, and no pick without a target loss."""

from __future__ import annotations

from typing import Any

from gpuscout.analysis.recommend import decide
from gpuscout.domain.run_analysis import Constraints, JobAnalysis


def _job(name: str, method: str, *, usd_per_m: float, to_target_usd: float | None, hours: float | None) -> JobAnalysis:
    fields: dict[str, Any] = dict(
        job_name=f"gs-{name}", job_names=[f"gs-{name}"], instance_type="ml.g6e.xlarge", variant_name=name,
        repetitions=1, repetitions_planned=1, status="completed", tokens_per_s=1000.0,
        tokens_per_s_ci95=(990.0, 1010.0), ci_kind="within_run", usd_per_hour=2.61, usd_per_million_tokens=usd_per_m,
        usd_per_million_tokens_ci95=(usd_per_m * 0.99, usd_per_m * 1.01), method=method,
        adapter="LoRA r=16" if method == "lora" else None, target_loss=1.6 if to_target_usd is not None else None,
        target_loss_usd=to_target_usd, target_loss_hours=hours, target_loss_method="measured",
    )  # fmt: skip
    return JobAnalysis(**fields)


def test_methods_are_ranked_by_the_cost_to_the_target_loss_and_never_a_clear_winner() -> None:
    # LoRA is far cheaper per token, but needs more tokens to the same loss: full reaches it for less
    jobs = [_job("lora", "lora", usd_per_m=0.2, to_target_usd=30.0, hours=11.0),
            _job("full", "full", usd_per_m=0.4, to_target_usd=20.0, hours=7.0)]  # fmt: skip
    ranked, recommendation, _ = decide(jobs, "cheapest_per_token", Constraints(target_loss=1.6))
    assert [j.variant_name for j in ranked] == ["full", "lora"]
    assert recommendation.variant_name == "full" and recommendation.verdict == "provisional"
    assert not recommendation.clear_winner and recommendation.margin_fraction is None
    assert "full on ml.g6e.xlarge / full reaches it for $20.00 in 7.0 h" in recommendation.summary
    assert "LoRA r=16 on ml.g6e.xlarge / lora reaches it for $30.00 in 11.0 h" in recommendation.summary
    # a speed objective ranks by the time to the loss
    ranked, _, _ = decide(jobs, "fastest", Constraints(target_loss=1.6))
    assert [j.variant_name for j in ranked] == ["full", "lora"]


def test_without_a_target_loss_methods_get_no_pick() -> None:
    jobs = [_job("lora", "lora", usd_per_m=0.2, to_target_usd=None, hours=None),
            _job("full", "full", usd_per_m=0.4, to_target_usd=None, hours=None)]  # fmt: skip
    _, recommendation, _ = decide(jobs, "cheapest_per_token", Constraints())
    assert recommendation.verdict == "cannot_tell" and not recommendation.clear_winner
    assert recommendation.summary.startswith("No pick (methods differ): Methods differ (full, lora): tokens/s and")
    assert "set constraints.target_loss" in recommendation.summary
