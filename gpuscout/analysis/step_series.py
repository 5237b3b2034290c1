"""Per-step series of one repetition for the report's charts: each step's own rate (warm-up included, so warm-up and
contention spikes show at a glance), each step's train loss, and the timed steps' times; long series are thinned to
a fixed number of evenly spaced points.

May import: nothing of gpuscout's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

SERIES_POINTS = 120  # points kept per series (a chart line, not the measurement: the figures use every step)


def downsample(points: Sequence[Any], limit: int = SERIES_POINTS) -> list[Any]:
    """At most ``limit`` evenly spaced points, the first and the last kept."""
    if len(points) <= limit:
        return list(points)
    step = (len(points) - 1) / (limit - 1)
    return [points[round(i * step)] for i in range(limit)]


def step_times(steps: Sequence[Mapping[str, Any]]) -> list[tuple[int, float]]:
    """(step, seconds) of the timed steps."""
    return downsample([(int(s["step"]), float(s["seconds"])) for s in steps if s.get("timed", True)])


def step_rates(steps: Sequence[Mapping[str, Any]], unit: str) -> list[tuple[int, float, bool]]:
    """(step, that step's tokens/s (samples/s when ``unit`` is samples), timed) of every step with a duration."""
    rates = []
    for s in steps:
        seconds = float(s.get("seconds") or 0.0)
        amount = s.get("samples" if unit == "samples" else "tokens")
        if seconds > 0 and isinstance(amount, int | float) and amount > 0:
            rates.append((int(s["step"]), float(amount) / seconds, bool(s.get("timed", True))))
    return downsample(rates)


def step_losses(points: Sequence[Mapping[str, Any]]) -> list[tuple[int, float]]:
    """(step, train loss) of benchmark.json's ``loss.train`` points that name their step."""
    return downsample([(int(p["step"]), float(p["loss"])) for p in points if p.get("step") is not None])
