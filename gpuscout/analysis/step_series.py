"""Per-step series of one repetition for the report's charts: each step's own rate (warm-up included, so warm-up and
contention spikes show at a glance), each step's train loss, and the timed steps' times; long series are thinned to
a fixed number of evenly spaced points.

May import: gpuscout.domain (benchmark.json's models)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpuscout.domain.benchmark import LossPoint, StepAccount

SERIES_POINTS = 120  # points kept per series (a chart line, not the measurement: the figures use every step)


def downsample(points: Sequence[Any], limit: int = SERIES_POINTS) -> list[Any]:
    """At most ``limit`` evenly spaced points, the first and the last kept."""
    if len(points) <= limit:
        return list(points)
    step = (len(points) - 1) / (limit - 1)
    return [points[round(i * step)] for i in range(limit)]


def step_times(steps: Sequence[StepAccount]) -> list[tuple[int, float]]:
    """(step, seconds) of the timed steps."""
    return downsample([(s.step, s.seconds) for s in steps if s.timed])


def step_rates(steps: Sequence[StepAccount], unit: str) -> list[tuple[int, float, bool]]:
    """(step, that step's tokens/s (samples/s when ``unit`` is samples), timed) of every step with a duration."""
    rates = []
    for s in steps:
        amount = s.samples if unit == "samples" else s.tokens
        if s.seconds > 0 and amount > 0:
            rates.append((s.step, amount / s.seconds, s.timed))
    return downsample(rates)


def step_losses(points: Sequence[LossPoint]) -> list[tuple[int, float]]:
    """(step, train loss) of benchmark.json's ``loss.train`` points."""
    return downsample([(p.step, p.loss) for p in points])
