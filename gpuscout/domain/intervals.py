"""Confidence intervals: Student's t distribution, the mean of repetitions and the ratio estimator of a run.

One implementation for the whole project: gpuscout.analysis.analyze (mean of repetitions), the local search's pruner
and training/gpuscout_train/metrics.py (throughput over timed steps, the steady-state stop rule) all use it. Standard
library only, in the lowest layer, so the training container and the Lambdas import it without numpy or pydantic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache


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


def ratio_ci95(numerators: Sequence[float], denominators: Sequence[float]) -> tuple[float, float, float]:
    """Ratio estimator R = sum(x) / sum(t) and its 95 % interval (delta method): (R, low, high).

    Throughput is total tokens / total time, so its interval must be centred on that same estimate; the
    standard error is sqrt(sum((x_i - R t_i)^2) / (n - 1) / n) / mean(t), with the t quantile for n - 1 df.
    With one pair the interval is the point itself.
    """
    if len(numerators) != len(denominators) or not numerators:
        raise ValueError("need equally many, and at least one, numerators and denominators")
    total_t = sum(denominators)
    if total_t <= 0:
        raise ValueError("total time must be positive")
    n = len(numerators)
    ratio = sum(numerators) / total_t
    if n < 2:
        return ratio, ratio, ratio
    residual_var = sum((x - ratio * t) ** 2 for x, t in zip(numerators, denominators, strict=True)) / (n - 1)
    half = student_t_quantile(0.975, n - 1) * math.sqrt(residual_var / n) / (total_t / n)
    return ratio, ratio - half, ratio + half
