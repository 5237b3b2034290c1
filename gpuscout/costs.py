"""Cost and time formulas for one benchmarked job and for repetitions of it (docs/costs.md has the maths).

Everything here is a pure function of numbers; gpuscout.analysis feeds it JobRecords and prices. Seconds are
kept separately from dollars so a stored analysis can be re-priced without the raw results.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, Literal

import numpy as np  # a matplotlib dependency, so always present where gpuscout's core runs
from pydantic import BaseModel, ConfigDict

from gpuscout.errors import GpuscoutError

SECONDS_PER_HOUR = 3600.0
MAX_EXTRAPOLATION = 10.0  # never project a loss curve past 10x the tokens it measured
FIT_FROM_FRACTION = 0.25  # loss fits use the points past 25 % of the measured tokens


# -- statistics -------------------------------------------------------------------------------------------------
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz, Numerical Recipes 6.4)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    if not 0.0 <= x <= 1.0:
        raise ValueError("x must be in [0, 1]")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    front = math.exp(log_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError("df must be positive")
    tail = 0.5 * regularized_incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


@lru_cache(maxsize=256)
def student_t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p (bisection on the CDF to 1e-12; e.g. p=0.975, df=4 -> 2.7764)."""
    if not 0.0 < p < 1.0:
        raise ValueError("p must be in (0, 1)")
    if p < 0.5:
        return -student_t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if student_t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return (lo + hi) / 2.0


def mean_ci95(values: Sequence[float]) -> tuple[float, tuple[float, float] | None]:
    """Mean and two-sided 95 % t confidence interval of the mean (None with fewer than two values)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = math.fsum(values) / n
    if n < 2:
        return mean, None
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = student_t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    return mean, (mean - half, mean + half)


# -- money and time ---------------------------------------------------------------------------------------------
def usd_per_million_tokens(usd_per_instance_hour: float, instance_count: int, tokens_per_s: float) -> float:
    """price/h x instances / 3600 / tokens_per_s x 1e6 (tokens_per_s = all instances together)."""
    if tokens_per_s <= 0:
        raise ValueError("tokens_per_s must be positive")
    return usd_per_instance_hour * instance_count / SECONDS_PER_HOUR / tokens_per_s * 1e6


def usd_for_seconds(seconds: float, usd_per_instance_hour: float, instance_count: int) -> float:
    return seconds / SECONDS_PER_HOUR * usd_per_instance_hour * instance_count


def epoch_seconds(dataset_tokens: int, tokens_per_s: float) -> float:
    """Seconds of training for one pass over the dataset's non-padding tokens (overheads excluded)."""
    if tokens_per_s <= 0:
        raise ValueError("tokens_per_s must be positive")
    return dataset_tokens / tokens_per_s


# -- loss curve -------------------------------------------------------------------------------------------------
LossMethod = Literal["measured", "power-law fit", "log-linear fit", "not projected", "not reached"]


class LossTarget(BaseModel):
    """Tokens and training seconds to reach a target loss, and how they were obtained."""

    model_config = ConfigDict(extra="forbid")

    method: LossMethod
    detail: str
    tokens: float | None = None
    seconds: float | None = None


def time_to_target_loss(curve: Sequence[tuple[float, float, float]], target: float, tokens_per_s: float) -> LossTarget:
    """``curve`` = (cumulative tokens, elapsed training s, train loss) points in step order.

    Measured when the curve reaches ``target``: the first point at or below it. Otherwise fit, on the points past
    FIT_FROM_FRACTION of the measured tokens, L(x) = a + b x^-c (x = tokens; b > 0, a >= 0; grid over c, least
    squares for a, b) and, when that does not fit (optimum at the grid's edge), the
    log-linear L(x) = a + b ln x; solve for x and refuse answers beyond MAX_EXTRAPOLATION x the measured tokens.
    Projected seconds = elapsed at the last point + remaining tokens / tokens_per_s.
    """
    points = [(float(x), float(s), float(loss)) for x, s, loss in curve if x > 0 and math.isfinite(loss)]
    if not points:
        return LossTarget(method="not projected", detail="no loss curve")
    for x, s, loss in points:
        if loss <= target:
            return LossTarget(
                method="measured", detail=f"loss {loss:.4g} <= {target:g} at {x:,.0f} tokens", tokens=x, seconds=s
            )
    if len(points) < 4:
        return LossTarget(method="not projected", detail=f"only {len(points)} loss points, need 4 to fit")
    x_last, s_last, _ = points[-1]
    tail = [p for p in points if p[0] >= FIT_FROM_FRACTION * x_last]  # skip the early transient
    if len(tail) < 4:
        tail = points[-4:]
    fit = _fit_power_law(tail) or _fit_log_linear(tail)
    if fit is None:
        return LossTarget(method="not projected", detail="the loss is not falling; no curve fits")
    method, needed, formula = fit(target)
    if needed is None:
        return LossTarget(method="not projected", detail=f"{formula}: never reaches {target:g}")
    if needed > MAX_EXTRAPOLATION * x_last:
        return LossTarget(
            method="not projected",
            detail=f"{formula} needs {needed:,.3g} tokens, > {MAX_EXTRAPOLATION:g}x the {x_last:,.0f} measured",
        )
    needed = max(needed, x_last)
    seconds = s_last + (needed - x_last) / tokens_per_s
    return LossTarget(method=method, detail=formula, tokens=needed, seconds=seconds)


_C_GRID = np.geomspace(0.02, 3.0, 400)


def _fit_power_law(points: Sequence[tuple[float, float, float]]) -> Any:
    x = np.array([p[0] for p in points])
    y = np.array([p[2] for p in points])
    scale = x[-1]
    u = x / scale  # tokens in units of the last measured point: keeps x^-c well conditioned
    basis = u[None, :] ** -_C_GRID[:, None]  # (grid, n)
    bm = basis.mean(axis=1)
    ym = y.mean()
    cov = ((basis - bm[:, None]) * (y - ym)[None, :]).sum(axis=1)
    var = ((basis - bm[:, None]) ** 2).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        b = np.where(var > 0, cov / var, np.nan)
    a = ym - b * bm
    residual = ((y[None, :] - a[:, None] - b[:, None] * basis) ** 2).sum(axis=1)
    residual = np.where((b > 0) & (a >= 0), residual, np.inf)  # falls with tokens, towards a loss >= 0
    best = int(np.argmin(residual))
    if not math.isfinite(float(residual[best])):
        return None
    a_b, b_b, c_b = float(a[best]), float(b[best]), float(_C_GRID[best])
    if c_b in (float(_C_GRID[0]), float(_C_GRID[-1])):
        return None  # optimum on the grid's edge: the power law does not describe this curve

    def solve(target: float) -> tuple[LossMethod, float | None, str]:
        formula = f"power-law fit L = {a_b:.4g} + {b_b:.4g} (tokens/{scale:,.0f})^-{c_b:.3g}"
        if target <= a_b:
            return "power-law fit", None, formula
        return "power-law fit", scale * ((target - a_b) / b_b) ** (-1.0 / c_b), formula

    return solve


def _fit_log_linear(points: Sequence[tuple[float, float, float]]) -> Any:
    lx = np.log(np.array([p[0] for p in points]))
    y = np.array([p[2] for p in points])
    var = float(((lx - lx.mean()) ** 2).sum())
    if var <= 0:
        return None
    slope = float(((lx - lx.mean()) * (y - y.mean())).sum()) / var
    intercept = float(y.mean()) - slope * float(lx.mean())
    if slope >= 0:
        return None

    def solve(target: float) -> tuple[LossMethod, float | None, str]:
        formula = f"log-linear fit L = {intercept:.4g} {slope:+.4g} ln(tokens)"
        return "log-linear fit", math.exp((target - intercept) / slope), formula

    return solve


# -- SageMaker time breakdown -----------------------------------------------------------------------------------
# SecondaryStatus values (DescribeTrainingJob) -> the phase of the time split they belong to.
PHASE_OF_STATUS: dict[str, str] = {
    "Starting": "provisioning",
    "Pending": "provisioning",
    "LaunchingMLInstances": "provisioning",
    "PreparingTrainingStack": "provisioning",
    "Restarting": "provisioning",
    "Interrupted": "provisioning",
    "DownloadingTrainingImage": "image_pull",
    "Downloading": "data_download",
    "Training": "training",
    "Uploading": "upload",
}
PHASES = ("provisioning", "image_pull", "data_download", "startup", "training", "upload")


class TimeBreakdown(BaseModel):
    """Seconds per phase of one job (per instance; multiply by instance count for instance-seconds)."""

    model_config = ConfigDict(extra="forbid")

    provisioning: float = 0.0
    image_pull: float = 0.0
    data_download: float = 0.0
    startup: float = 0.0  # model build, data load, compile before step 1 (inside SageMaker's "Training")
    training: float = 0.0
    upload: float = 0.0
    source: str

    @property
    def overhead_seconds(self) -> float:
        return self.provisioning + self.image_pull + self.data_download + self.startup + self.upload


class TimeParseError(GpuscoutError):
    """A secondary status transition carries a time gpuscout cannot read."""


def _timestamp(value: Any) -> float:
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, int | float):
        return float(value) / 1000.0 if value > 1e11 else float(value)  # EventBridge sends epoch milliseconds
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError as err:
            raise TimeParseError(f"unreadable time {value!r} in SecondaryStatusTransitions") from err
    raise TimeParseError(f"unreadable time {value!r} in SecondaryStatusTransitions")


def time_breakdown(
    transitions: Iterable[Mapping[str, Any]],
    *,
    startup_s: float = 0.0,
    wall_time_s: float | None = None,
    train_time_s: float | None = None,
) -> TimeBreakdown:
    """Split a job's time into phases.

    With SageMaker's SecondaryStatusTransitions: each transition's EndTime - StartTime goes to its phase (the
    last open one ends at the next transition's start, or is dropped); the script's own ``startup_s`` is
    moved from training to startup. Without transitions (local runs): startup from benchmark.json, training =
    train_time_s, and the rest of wall_time_s is counted as startup too.
    """
    spans: dict[str, float] = dict.fromkeys(PHASES, 0.0)
    items = list(transitions)
    if items:
        for i, t in enumerate(items):
            phase = PHASE_OF_STATUS.get(str(t.get("Status", "")))
            if phase is None:
                continue
            start = t.get("StartTime")
            end = t.get("EndTime") or (items[i + 1].get("StartTime") if i + 1 < len(items) else None)
            if start is None or end is None:
                continue
            spans[phase] += max(0.0, _timestamp(end) - _timestamp(start))
        moved = min(startup_s, spans["training"])
        spans["training"] -= moved
        spans["startup"] += moved
        return TimeBreakdown(**spans, source="SageMaker SecondaryStatusTransitions")
    training = train_time_s or 0.0
    rest = max(0.0, (wall_time_s or 0.0) - training)
    return TimeBreakdown(startup=max(startup_s, rest), training=training, source="benchmark.json timing (local)")
