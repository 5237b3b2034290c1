"""Metric lines on stdout and the regexes SageMaker uses to turn them into CloudWatch metrics.

training/gpuscout_train/train.py prints one line per logged optimizer step (and one summary line at the end)::

    gpuscout_metric step=12 loss=4.1234 tokens_per_s=12345.6 step_time_s=0.0812 lr=0.0003

A job given its price (a settings search's tuning trial) adds ``usd_per_mtok``, the running $ per 1M tokens of the
timed steps so far, to its step lines: the objective SageMaker's tuning job minimizes (``OBJECTIVE_METRIC``).

``METRIC_DEFINITIONS`` is the ``AlgorithmSpecification.MetricDefinitions`` list of a CreateTrainingJob request:
one ``{"Name", "Regex"}`` per metric, the first capture group being the value. Every key is preceded by a space
in the line, and every regex anchors on that space, so ``loss`` never matches inside ``val_loss``.
Stdlib only: the Lambdas import this module.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

PREFIX = "gpuscout_metric"
SUMMARY_PREFIX = "gpuscout_summary"

_NUMBER = r"([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_KEY_RE = re.compile(r"^[a-z][a-z0-9_]*$")

# key in the metric line -> CloudWatch metric name. Step lines carry the first group, the summary line the second.
STEP_METRICS: dict[str, str] = {
    "loss": "train:loss",
    "val_loss": "validation:loss",
    "tokens_per_s": "train:tokens_per_s",
    "samples_per_s": "train:samples_per_s",
    "step_time_s": "train:step_time_s",
    "lr": "train:learning_rate",
    "grad_norm": "train:grad_norm",
    "gpu_mem_gb": "train:gpu_memory_gb",
    # $ per 1M tokens over the timed (post-warm-up) steps so far at the job's price: a tuning job's objective
    "usd_per_mtok": "train:usd_per_1m_tokens",
}
SUMMARY_METRICS: dict[str, str] = {
    "tokens_per_s": "summary:tokens_per_s",
    "mfu": "summary:mfu",
    "hfu": "summary:hfu",
    "step_time_p50_s": "summary:step_time_p50_s",
    "step_time_p90_s": "summary:step_time_p90_s",
    "peak_gpu_mem_gb": "summary:peak_gpu_memory_gb",
    "final_loss": "summary:final_train_loss",
    "final_val_loss": "summary:final_validation_loss",
}


def _definition(prefix: str, key: str, name: str) -> dict[str, str]:
    return {"Name": name, "Regex": rf"{prefix}\b.*? {key}={_NUMBER}"}


OBJECTIVE_KEY = "usd_per_mtok"
OBJECTIVE_METRIC = STEP_METRICS[OBJECTIVE_KEY]

METRIC_DEFINITIONS: list[dict[str, str]] = [
    *(_definition(PREFIX, key, name) for key, name in STEP_METRICS.items()),
    *(_definition(SUMMARY_PREFIX, key, name) for key, name in SUMMARY_METRICS.items()),
]


def _format_value(value: float | int) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    return format(value, ".8g")


def format_metric_line(values: Mapping[str, float | int | None], *, summary: bool = False) -> str:
    """One metric line: ``gpuscout_metric key=value ...`` (keys in the given order; None and non-finite skipped)."""
    parts = [SUMMARY_PREFIX if summary else PREFIX]
    for key, value in values.items():
        if not _KEY_RE.match(key):
            raise ValueError(f"metric key {key!r} must be lower-case letters, digits and underscores")
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            continue
        parts.append(f"{key}={_format_value(value)}")
    return " ".join(parts)


def usd_per_million_tokens(price_per_hour_usd: float, tokens_per_s: float) -> float | None:
    """$ per 1M tokens at ``price_per_hour_usd`` (the whole job's, all instances) and ``tokens_per_s``; None
    without throughput."""
    if tokens_per_s <= 0:
        return None
    return price_per_hour_usd / 3600.0 / tokens_per_s * 1e6


def parse_metric_line(line: str) -> dict[str, float] | None:
    """The values of a metric or summary line, or None for any other line."""
    text = line.strip()
    head, _, rest = text.partition(" ")
    if head not in (PREFIX, SUMMARY_PREFIX):
        return None
    values: dict[str, float] = {}
    for item in rest.split():
        key, sep, raw = item.partition("=")
        if not sep:
            continue
        try:
            values[key] = float(raw)
        except ValueError:
            continue
    return values
