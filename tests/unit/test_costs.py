"""Cost and time formulas (gpuscout.analysis.costs) against hand-computed numbers; the arithmetic is in the comments."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest

from gpuscout.analysis import costs


# -- money and time -------------------------------------------------------------------------------------------
def test_cost_per_million_tokens_on_demand() -> None:
    # $36/h = $0.01/s; at 10,000 tokens/s a token costs 1e-6 $ -> $1.00 per 1M tokens
    assert costs.usd_per_million_tokens(36.0, 1, 10_000.0) == pytest.approx(1.0)


def test_cost_per_million_tokens_spot() -> None:
    # spot at a 60 % discount: 36 x 0.4 = $14.40/h = $0.004/s; / 10,000 tokens/s x 1e6 = $0.40
    assert costs.usd_per_million_tokens(36.0 * (1 - 0.6), 1, 10_000.0) == pytest.approx(0.40)


def test_cost_per_million_tokens_multi_node() -> None:
    # 2 instances x $36/h = $0.02/s for the cluster; 18,000 tokens/s together -> 0.02 / 18,000 x 1e6 = $1.1111
    assert costs.usd_per_million_tokens(36.0, 2, 18_000.0) == pytest.approx(1.111111, rel=1e-6)
    with pytest.raises(ValueError):
        costs.usd_per_million_tokens(36.0, 1, 0.0)


def test_epoch_time_and_cost() -> None:
    # 250M tokens / 10,000 tokens/s = 25,000 s = 6.9444 h; x $36/h = $250.00
    seconds = costs.epoch_seconds(250_000_000, 10_000.0)
    assert seconds == 25_000.0
    assert costs.usd_for_seconds(seconds, 36.0, 1) == pytest.approx(250.0)


def test_billed_cost_from_billable_seconds_multi_node() -> None:
    # BillableTimeInSeconds is per instance: 1,800 s = 0.5 h x $36/h x 2 instances = $36
    assert costs.usd_for_seconds(1_800, 36.0, 2) == pytest.approx(36.0)


# -- time to target loss --------------------------------------------------------------------------------------
def _power_law_curve(a: float, b: float, c: float, tps: float) -> list[tuple[float, float, float]]:
    # tokens 1M..8M in 0.25M steps, elapsed = tokens / tps, loss = a + b (tokens / 1M)^-c exactly
    xs = [1e6 + 250_000 * i for i in range(29)]
    return [(x, x / tps, a + b * (x / 1e6) ** -c) for x in xs]


def test_time_to_loss_measured_when_reached() -> None:
    curve = [(1000, 1.0, 5.0), (2000, 2.0, 4.0), (3000, 3.5, 2.9), (4000, 4.5, 2.5)]
    result = costs.pooled_time_to_target_loss([curve], 3.0, [1000.0])
    # first point at or below 3.0 is (3000 tokens, 3.5 s)
    assert (result.method, result.tokens, result.seconds) == ("measured", 3000, 3.5)


def test_time_to_loss_projected_with_a_power_law() -> None:
    # L = 2 + 4 (x/1M)^-0.5: L = 3 at (1/4)^-2 = 16 -> 16M tokens, twice the 8M measured (within 10x).
    # seconds = 800 s at the last point + (16M - 8M) / 10,000 tokens/s = 800 + 800 = 1,600 s
    result = costs.pooled_time_to_target_loss([_power_law_curve(2.0, 4.0, 0.5, 10_000.0)], 3.0, [10_000.0])
    assert result.method == "power-law fit"
    assert result.tokens == pytest.approx(16e6, rel=0.02)
    assert result.seconds == pytest.approx(1_600, rel=0.02)
    assert "power-law" in result.detail


def test_time_to_loss_refuses_far_extrapolation() -> None:
    # L = 2.2 needs (0.2/4)^-2 = 400 -> 400M tokens, 50x the 8M measured: not projected
    result = costs.pooled_time_to_target_loss([_power_law_curve(2.0, 4.0, 0.5, 10_000.0)], 2.2, [10_000.0])
    assert result.method == "not projected"
    assert result.tokens is None and result.seconds is None
    assert "10x" in result.detail


def test_time_to_loss_below_the_asymptote_is_not_projected() -> None:
    # the fitted floor is a ~ 2, so a target of 1.5 is never reached
    result = costs.pooled_time_to_target_loss([_power_law_curve(2.0, 4.0, 0.5, 10_000.0)], 1.5, [10_000.0])
    assert result.method == "not projected"
    assert "never reaches" in result.detail


def test_time_to_loss_needs_a_falling_curve() -> None:
    flat = [(1000.0 * i, float(i), 3.0 + 0.01 * i) for i in range(1, 20)]
    assert costs.pooled_time_to_target_loss([flat], 2.0, [1000.0]).method == "not projected"
    assert costs.pooled_time_to_target_loss([flat[:3]], 2.0, [1000.0]).detail.startswith("only 3")
    assert costs.pooled_time_to_target_loss([[]], 2.0, [1000.0]).detail == "no loss curve"


def test_log_linear_fit_solves_exactly() -> None:
    # L = 10 - 0.5 ln x: L = 3 at x = e^14 = 1,202,604.28
    points = [(x, 0.0, 10 - 0.5 * math.log(x)) for x in (1e5, 2e5, 4e5, 8e5)]
    solve = costs._fit_log_linear(points)
    method, tokens, _ = solve(3.0)
    assert method == "log-linear fit"
    assert tokens == pytest.approx(math.exp(14), rel=1e-9)


# -- time breakdown -------------------------------------------------------------------------------------------
def test_time_breakdown_from_secondary_status_transitions() -> None:
    t0 = 1_763_700_000_000  # EventBridge sends epoch milliseconds
    spans = [
        ("Starting", 60),
        ("LaunchingMLInstances", 120),
        ("DownloadingTrainingImage", 90),
        ("Downloading", 30),
        ("Training", 600),
        ("Uploading", 10),
    ]
    transitions = []
    start = t0
    for status, seconds in spans:
        transitions.append({"Status": status, "StartTime": start, "EndTime": start + seconds * 1000})
        start += seconds * 1000
    transitions.append({"Status": "Completed", "StartTime": start})
    # provisioning = 60 + 120 = 180; the script's 50 s startup moves out of Training: 600 - 50 = 550
    b = costs.time_breakdown(transitions, startup_s=50.0)
    assert (b.provisioning, b.image_pull, b.data_download, b.startup, b.training, b.upload) == (
        180,
        90,
        30,
        50,
        550,
        10,
    )
    assert b.overhead_seconds == 180 + 90 + 30 + 50 + 10


def test_time_breakdown_reads_iso_times_and_open_ended_transitions() -> None:
    transitions = [
        {"Status": "Starting", "StartTime": "2026-11-21T10:00:00Z"},  # no EndTime: ends when the next starts
        {"Status": "Training", "StartTime": "2026-11-21T10:02:00+00:00", "EndTime": "2026-11-21T10:12:00+00:00"},
        {"Status": "Uploading", "StartTime": datetime(2026, 11, 21, 10, 12, tzinfo=UTC)},  # open, last: dropped
    ]
    b = costs.time_breakdown(transitions)
    assert (b.provisioning, b.training, b.upload) == (120, 600, 0)


def test_time_breakdown_rejects_unreadable_times() -> None:
    with pytest.raises(costs.TimeParseError):
        costs.time_breakdown([{"Status": "Training", "StartTime": "yesterday", "EndTime": "today"}])


def test_time_breakdown_local_run() -> None:
    # no transitions: training = train_time_s = 600, everything else of the 700 s wall time is startup (100)
    b = costs.time_breakdown([], startup_s=50.0, wall_time_s=700.0, train_time_s=600.0)
    assert (b.startup, b.training, b.provisioning) == (100.0, 600.0, 0.0)
    assert b.source.endswith("(local)")
