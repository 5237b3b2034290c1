"""Ranking, exclusions, Pareto front and recommendation; analyze_run and reprice on the fixture run."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from example_run import load_example_run

from gpuscout.analysis.analyze import analyze_run, price_job, reprice
from gpuscout.analysis.pricing import PriceBook, SpotAssumption
from gpuscout.analysis.recommend import decide, pareto_front
from gpuscout.analysis.terms import RunTerms
from gpuscout.domain.run_analysis import Constraints, JobAnalysis

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"
SPOT = SpotAssumption(default_discount=0.6, assumption="test: 60 % off", source="test", date="2026-11-01")
PRICES = {"ml.a": 36.0, "ml.b": 72.0, "ml.c": 18.0, "ml.f": 37.0, "ml.g": 36.0}


def _book(prices: dict[str, float] = PRICES) -> PriceBook:
    table = {
        k: {"on_demand_usd_per_hour": v, "price_region": "us-east-1", "price_date": "2026-11-01", "price_source": "t"}
        for k, v in prices.items()
    }
    return PriceBook.from_catalog(table, spot=SPOT)


def _job(
    name: str,
    instance: str,
    tps: float | None,
    ci: tuple[float, float] | None = None,
    *,
    variant: str = "v",
    spot: bool = False,
    count: int = 1,
    epoch_s: float | None = None,
    status: str = "completed",
    failure: str | None = None,
    book: PriceBook | None = None,
    reps: int = 3,
) -> JobAnalysis:
    measured = JobAnalysis(
        job_name=name,
        job_names=[name],
        instance_type=instance,
        instance_count=count,
        variant_name=variant,
        spot=spot,
        repetitions=reps if tps else 0,
        repetitions_planned=reps,
        ci_kind=("between_repetitions" if reps >= 2 else "within_run") if ci else None,
        status=status,
        failure=failure,
        tokens_per_s=tps,
        tokens_per_s_ci95=ci,
        dataset_tokens=int(epoch_s * tps) if epoch_s and tps else None,
        epoch_seconds=epoch_s,
        overhead_seconds=0.0,
    )
    return price_job(measured, book or _book())


def _names(jobs: list[JobAnalysis]) -> list[str]:
    return [j.job_name for j in jobs if j.rank is not None]


# A: $36/h, 10,000 tok/s -> 36 / 3600 / 10,000 x 1e6 = $1.00 per 1M; CI 9,900-10,100 -> $0.9901-1.0101
# B: $72/h, 30,000 tok/s -> 72 / 3600 / 30,000 x 1e6 = $0.6667;       CI 29,700-30,300 -> $0.6601-0.6734
# C: $18/h,  4,000 tok/s -> 18 / 3600 /  4,000 x 1e6 = $1.25
def _abc() -> list[JobAnalysis]:
    return [
        _job("a", "ml.a", 10_000, (9_900, 10_100)),
        _job("b", "ml.b", 30_000, (29_700, 30_300)),
        _job("c", "ml.c", 4_000, (3_960, 4_040)),
    ]


def test_cheapest_per_token_ranking_and_margin() -> None:
    jobs, rec, excluded = decide(_abc(), "cheapest_per_token", Constraints())
    assert _names(jobs) == ["b", "a", "c"]
    assert [j.usd_per_million_tokens for j in jobs] == [pytest.approx(0.666667), pytest.approx(1.0), 1.25]
    # runner-up a costs 1.00 / 0.6667 - 1 = 50 % more per token
    assert rec.margin_fraction == pytest.approx(0.5)
    assert (rec.job_name, rec.instance_type, rec.variant_name, rec.runner_up_job_name) == ("b", "ml.b", "v", "a")
    assert rec.clear_winner and rec.summary.startswith("Pick ml.b / v (clear winner): ")
    assert "50.0% more" in rec.summary
    assert excluded == []


def test_fastest_ranking_and_margin() -> None:
    jobs, rec, _ = decide(_abc(), "fastest", Constraints())
    assert _names(jobs) == ["b", "a", "c"]
    # 30,000 / 10,000 - 1 = 200 % faster
    assert rec.margin_fraction == pytest.approx(2.0)
    assert "200.0% faster" in rec.summary


def test_spot_target_competes_at_the_spot_price() -> None:
    # a on spot: $36 x 0.4 = $14.40/h -> 14.4 / 3600 / 10,000 x 1e6 = $0.40 per 1M, cheaper than b's $0.6667
    jobs = [*_abc()[1:], _job("a-spot", "ml.a", 10_000, (9_900, 10_100), spot=True)]
    ranked, rec, _ = decide(jobs, "cheapest_per_token", Constraints())
    assert rec.job_name == "a-spot"
    assert ranked[0].effective_usd_per_million_tokens == pytest.approx(0.40)
    assert ranked[0].usd_per_million_tokens == pytest.approx(1.0)  # on-demand still reported


def test_ties_are_broken_deterministically() -> None:
    # d: $36/h at 10,000 tok/s and e: $72/h at 20,000 tok/s both cost $1.00 per 1M tokens -> faster e first
    d = _job("d", "ml.a", 10_000)
    e = _job("e", "ml.b", 20_000)
    assert _names(decide([d, e], "cheapest_per_token", Constraints())[0]) == ["e", "d"]
    assert _names(decide([e, d], "cheapest_per_token", Constraints())[0]) == ["e", "d"]
    # g is d on another (equally priced) instance type: same cost and speed -> instance type ascending
    g = _job("g", "ml.g", 10_000)
    assert _names(decide([g, d], "cheapest_per_token", Constraints())[0]) == ["d", "g"]
    # fastest: equal speed -> cheaper first; d ($1.00) before f ($37/h -> $1.0278)
    f = _job("f", "ml.f", 10_000)
    assert _names(decide([f, d], "fastest", Constraints())[0]) == ["d", "f"]


def test_overlapping_intervals_mean_no_clear_winner() -> None:
    # a: $1.00 (CI 9,000-11,000 tok/s -> $0.9091-1.1111); f: 37 / 3600 / 10,100 x 1e6 = $1.0176 (CI overlaps)
    a = _job("a", "ml.a", 10_000, (9_000, 11_000))
    f = _job("f", "ml.f", 10_100, (9_100, 11_100))
    _, rec, _ = decide([f, a], "cheapest_per_token", Constraints())
    assert rec.job_name == "a"
    assert not rec.clear_winner
    assert rec.summary.startswith("No pick (no clear winner): ml.a / v and ml.f / v are within noise")
    # no margin is quoted between measurements within noise of each other: "1.8 % more" would be noise
    assert rec.margin_fraction is None and "% more" not in rec.summary
    assert rec.summary.endswith("Next: more repetitions would separate them.")


def test_failed_jobs_are_excluded_with_their_reason() -> None:
    oom = _job("oom", "ml.a", None, status="OOM", failure="out of GPU memory")
    cap = _job("cap", "ml.b", None, status="CAPACITY", failure="no capacity for the instance type")
    quota = _job("quota", "ml.c", None, status="QUOTA", failure="account quota exceeded (ResourceLimitExceeded)")
    jobs, rec, excluded = decide([oom, cap, quota, *_abc()], "cheapest_per_token", Constraints())
    assert {e.job_name: e.reason for e in excluded} == {
        "oom": "out of GPU memory",
        "cap": "no capacity for the instance type",
        "quota": "account quota exceeded (ResourceLimitExceeded)",
    }
    assert [j.job_name for j in jobs[3:]] == ["oom", "cap", "quota"]  # excluded after ranked, by instance type
    assert rec.job_name == "b"


def test_deadline_excludes_under_every_objective() -> None:
    # a: one epoch 36,000 s = 10 h > 8 h; b: 18,000 s = 5 h
    a = _job("a", "ml.a", 10_000, epoch_s=36_000)
    b = _job("b", "ml.b", 30_000, epoch_s=18_000)
    for objective in ("cheapest_within_deadline", "cheapest_per_token", "fastest"):
        _, rec, excluded = decide([a, b], objective, Constraints(deadline_hours=8))
        assert rec.job_name == "b"
        assert excluded[0].reason.startswith("misses the deadline: 10.0 h > 8 h (one epoch of 360,000,000 tokens")


def test_budget_excludes_only_for_fastest_within_budget() -> None:
    # b: one epoch 25,000 s x $72/h = $500 > $300; a: 25,000 s x $36/h = $250 fits
    a = _job("a", "ml.a", 10_000, epoch_s=25_000)
    b = _job("b", "ml.b", 30_000, epoch_s=25_000)
    assert b.workload_usd == pytest.approx(500.0) and a.workload_usd == pytest.approx(250.0)
    _, rec, excluded = decide([a, b], "fastest_within_budget", Constraints(budget_usd=300))
    assert rec.job_name == "a"
    assert excluded[0].reason.startswith("over budget: $500.00 > $300.00")
    # the same budget under "fastest" caps the benchmark only: b stays and wins
    assert decide([a, b], "fastest", Constraints(budget_usd=300))[1].job_name == "b"


def test_nothing_left_means_no_recommendation() -> None:
    oom = _job("oom", "ml.a", None, status="OOM", failure="out of GPU memory")
    _, rec, excluded = decide([oom], "fastest", Constraints())
    assert rec.job_name is None and rec.summary.startswith("No pick: every target x variant was excluded")
    assert len(excluded) == 1


def test_single_candidate_has_no_runner_up() -> None:
    _, rec, _ = decide([_job("a", "ml.a", 10_000)], "fastest", Constraints())
    # measured, compared with nothing: never a firm (green) winner
    assert not rec.clear_winner and rec.verdict == "only_candidate" and rec.margin_fraction is None
    assert rec.summary.startswith("Pick ml.a / v (only candidate)") and "Nothing was compared with it" in rec.summary


def test_pareto_front() -> None:
    # (tok/s, $/1M): b (30,000, 0.667), g (20,000, 0.5), a (10,000, 1.0), c (4,000, 1.25)
    # g is faster and cheaper than a and c; b is the fastest; g2 duplicates g -> front {b, g, g2}
    jobs = [*_abc(), _job("g", "ml.g", 20_000), _job("g2", "ml.g", 20_000)]
    assert pareto_front(jobs) == {"b", "g", "g2"}
    ranked, _, _ = decide(jobs, "cheapest_per_token", Constraints())
    assert {j.job_name for j in ranked if j.on_pareto_front} == {"b", "g", "g2"}


# -- analyze_run on the fixture run ---------------------------------------------------------------------------
def _tps(name: str) -> float:
    return float(json.loads((FIXTURES / f"{name}.json").read_text())["throughput"]["tokens_per_s"])


@pytest.fixture(scope="module")
def fixture_analysis() -> Any:
    run, jobs, catalog = load_example_run()
    return analyze_run(run, jobs, terms=RunTerms.stored(run.manifest), catalog=catalog, prices=None), run, jobs, catalog


def _by_label(analysis: Any) -> dict[str, JobAnalysis]:
    return {j.label: j for j in analysis.jobs}


def test_analyze_run_aggregates_repetitions(fixture_analysis: Any) -> None:
    analysis = fixture_analysis[0]
    p4d = _by_label(analysis)["ml.p4d.24xlarge / bs8"]
    reps = [_tps(f"p4d-bs8-r{i}") for i in range(3)]
    mean = sum(reps) / 3
    sd = (sum((r - mean) ** 2 for r in reps) / 2) ** 0.5
    half = 4.302653 * sd / 3**0.5  # t(0.975, df=2)
    assert p4d.repetitions == 3 and p4d.job_names == ["gs-p4d-bs8-r0", "gs-p4d-bs8-r1", "gs-p4d-bs8-r2"]
    assert p4d.tokens_per_s == pytest.approx(mean)
    assert p4d.tokens_per_s_ci95 == (pytest.approx(mean - half, rel=1e-6), pytest.approx(mean + half, rel=1e-6))
    assert p4d.ci_method == "t-interval over 3 repetitions"
    assert p4d.tokens_per_s_per_gpu == pytest.approx(mean / 8)
    # $37.688/h / 3600 / mean x 1e6; epoch = 250M / mean seconds
    assert p4d.usd_per_million_tokens == pytest.approx(37.688 / 3600 / mean * 1e6)
    assert p4d.epoch_hours == pytest.approx(250_000_000 / mean / 3600)


def test_analyze_run_multi_node_and_billing(fixture_analysis: Any) -> None:
    analysis, _, jobs, _ = fixture_analysis
    x2 = _by_label(analysis)["ml.p5.48xlarge x2 / bs16"]
    tps = _tps("p5-bs16-x2-r0")
    assert x2.gpus == 16
    # two instances: 2 x $113.07/h / 3600 / tps x 1e6
    assert x2.usd_per_million_tokens == pytest.approx(2 * 113.07 / 3600 / tps * 1e6)
    billable = next(j.billable_seconds for j in jobs if j.job_name == "gs-p5-bs16-x2-r0")
    assert billable is not None
    assert x2.billed_usd == pytest.approx(billable / 3600 * 113.07 * 2)
    assert x2.billed_source == "SageMaker BillableTimeInSeconds"
    # a managed spot job's BillableTimeInSeconds already carries the spot saving (AWS: saving = 1 - billable /
    # training time), so it is billed at the on-demand $7.09/h, not at the assumed spot price (which would count
    # the discount twice); its cost per token still uses the spot price 7.09 x 0.4 (configs/pricing/spot.json)
    spot = _by_label(analysis)["ml.g5.12xlarge / bs4-ckpt (spot)"]
    spot_billable = next(j.billable_seconds for j in jobs if j.job_name == "gs-g5-12xl-bs4-ckpt-r0") or 0
    assert spot_billable > 0
    assert spot.billed_usd == pytest.approx(spot_billable / 3600 * 7.09)
    # the failed OOM job still cost its billable seconds: 402 s x $1.515/h
    oom = _by_label(analysis)["ml.g5.2xlarge / bs16"]
    assert oom.billed_usd == pytest.approx(402 / 3600 * 1.515)


def test_analyze_run_exclusions_and_recommendation(fixture_analysis: Any) -> None:
    analysis = fixture_analysis[0]
    reasons = {e.instance_type + "/" + e.variant_name: e.reason for e in analysis.excluded}
    assert reasons["ml.g5.2xlarge/bs16"] == "out of GPU memory"
    assert reasons["ml.p5e.48xlarge/bs16"].startswith("no capacity for the instance type")
    assert reasons["ml.g5.2xlarge/bs4-ckpt"].startswith("misses the deadline")  # 1.5 h deadline
    assert analysis.recommendation.job_name == "gs-g5-12xl-bs4-ckpt-r0"
    assert analysis.jobs[0].rank == 1
    assert analysis.objective == "cheapest_per_token"
    assert analysis.constraints.target_loss == 5.0
    methods = {j.target_loss_method for j in analysis.jobs if j.tokens_per_s}
    assert {"measured", "power-law fit"} <= methods


def test_analyze_run_is_deterministic_whatever_the_order(fixture_analysis: Any) -> None:
    analysis, run, jobs, catalog = fixture_analysis
    shuffled = list(jobs)
    random.Random(7).shuffle(shuffled)
    again = analyze_run(run, shuffled, terms=RunTerms.stored(run.manifest), catalog=catalog)
    assert [j.job_name for j in again.jobs] == [j.job_name for j in analysis.jobs]
    assert again.recommendation.summary == analysis.recommendation.summary


def test_reprice_from_the_stored_json(fixture_analysis: Any) -> None:
    analysis, _, _, catalog = fixture_analysis
    doubled = {k: {**v, "on_demand_usd_per_hour": 2 * v["on_demand_usd_per_hour"]} for k, v in catalog.items()}
    again = reprice(json.loads(analysis.model_dump_json()), PriceBook.from_catalog(doubled))
    before, after = _by_label(analysis), _by_label(again)
    for label, job in before.items():
        if job.usd_per_million_tokens is not None:
            assert after[label].usd_per_million_tokens == pytest.approx(2 * job.usd_per_million_tokens)
            assert after[label].tokens_per_s == job.tokens_per_s
    assert again.total_billed_usd == pytest.approx(2 * analysis.total_billed_usd)
    assert again.price_snapshot.prices["ml.p4d.24xlarge"].on_demand_usd_per_hour == 2 * 37.688
    assert again.recommendation.job_name == analysis.recommendation.job_name


def test_reprice_keeps_old_prices_for_types_the_new_book_lacks(fixture_analysis: Any) -> None:
    analysis = fixture_analysis[0]
    again = reprice(analysis, _book({"ml.p4d.24xlarge": 10.0}))
    assert _by_label(again)["ml.p4d.24xlarge / bs8"].usd_per_hour == 10.0
    assert _by_label(again)["ml.p5.48xlarge / bs16"].usd_per_hour == 113.07


def test_local_run_bills_wall_time(fixture_analysis: Any) -> None:
    run, jobs, catalog = load_example_run()
    local = [
        j.model_copy(update={"billable_seconds": None, "secondary_status_transitions": []})
        for j in jobs
        if j.job_name == "gs-p3-2xl-bs2-ckpt-r0"
    ]
    analysis = analyze_run(run, local, terms=RunTerms.stored(run.manifest), catalog=catalog)
    job = analysis.jobs[0]
    assert local[0].benchmark is not None and local[0].benchmark.timing is not None
    wall = local[0].benchmark.timing.wall_time_s
    assert job.billed_source == "wall time of the training script (local run)"
    assert job.billed_usd == pytest.approx(wall / 3600 * 3.825)
    assert job.time_breakdown is not None and job.time_breakdown.source.endswith("(local)")
