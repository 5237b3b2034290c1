"""Cost and time formulas for one benchmarked job and for repetitions of it (docs/costs.md has the maths).

Everything here is a pure function of numbers; gpuscout.analysis.analyze feeds it JobRecords and prices. Seconds are
kept separately from dollars so a stored analysis can be re-priced without the raw results.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, Literal

import numpy as np  # a matplotlib dependency, so always present where gpuscout's core runs
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict

from gpuscout.domain.run_analysis import TimeBreakdown
from gpuscout.errors import GpuscoutError

SECONDS_PER_HOUR = 3600.0
MAX_EXTRAPOLATION = 10.0  # never project a loss curve past 10x the tokens it measured
FIT_FROM_FRACTION = 0.25  # loss fits use the points past 25 % of the measured tokens
# confidence intervals (Student t over repetitions, the ratio estimator of a run) live in gpuscout.domain.intervals


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
# A fitted loss curve: the tokens at which it reaches a target loss (None: never), how it was found, its formula.
LossSolver = Callable[[float], tuple[LossMethod, float | None, str]]


class LossTarget(BaseModel):
    """Tokens and training seconds to reach a target loss, and how they were obtained."""

    model_config = ConfigDict(extra="forbid")

    method: LossMethod
    detail: str
    tokens: float | None = None
    seconds: float | None = None


def pooled_time_to_target_loss(
    curves: Sequence[Sequence[tuple[float, float, float]]], target: float, tokens_per_s: Sequence[float]
) -> LossTarget:
    """Tokens and training seconds to reach ``target`` for repetitions of one job (means over repetitions); each
    curve is one repetition's (cumulative tokens, elapsed training s, train loss) points in step order.

    Measured when every repetition's curve reaches ``target``: its first point at or below it. Otherwise one fit
    on the pooled points past FIT_FROM_FRACTION of each curve's measured tokens: L(x) = a + b x^-c (x = tokens;
    b > 0, a >= 0; coarse-to-fine grid over c, least squares for a and b) or, when the power law does not fit
    (optimum at the grid's edge), the log-linear L(x) = a + b ln x. Solve for x; refuse answers beyond
    MAX_EXTRAPOLATION x the measured tokens. Projected seconds = elapsed at a curve's last point + remaining
    tokens / that repetition's tokens_per_s.
    """
    return times_to_target_loss([(curves, target, tokens_per_s)])[0]


# (curves of the repetitions, target loss, tokens/s of each repetition); a curve is a sequence of (cumulative tokens,
# elapsed training s, train loss) points or a (points, 3) float array, which is used without a copy
LossRequest = tuple[Sequence[Any], float, Sequence[float]]


def times_to_target_loss(requests: Sequence[LossRequest]) -> list[LossTarget]:
    """``pooled_time_to_target_loss`` for many jobs at once, vectorized over every point of every curve.

    All curves are flattened into one (points, 3) array; cleaning, the first point at the target, each curve's last
    point and the fit's tail are array operations, and the power-law fits run batched (``_fit_power_law_rows``).
    Only the per-job bookkeeping (a few floats each) is a Python loop.
    """
    curve_first: list[int] = []  # index of each request's first curve
    curve_rate: list[float] = []  # tokens/s of each curve's repetition
    curve_target: list[float] = []
    lengths: list[int] = []
    arrays: list[Any] = []
    for curves, target, tokens_per_s in requests:
        curve_first.append(len(arrays))
        for curve, tps in zip(curves, tokens_per_s, strict=False):
            array = np.asarray(curve, dtype=float).reshape(-1, 3)  # no copy when it is one already
            arrays.append(array)
            curve_rate.append(tps)
            curve_target.append(target)
            lengths.append(array.shape[0])
    curve_first.append(len(arrays))
    n_curves, n_points = len(arrays), sum(lengths)
    # one extra row of zeros stands in for "no such point" (index n_points) in the per-curve lookups below
    points = np.concatenate([*arrays, np.zeros((1, 3))])
    x, s, loss = points[:, 0], points[:, 1], points[:, 2]
    curve_of = np.repeat(np.arange(n_curves), lengths)
    kept = np.flatnonzero((x[:n_points] > 0) & np.isfinite(loss[:n_points]))  # cleaned points, in (curve, step) order
    kept_curve = curve_of[kept]
    kept_count = np.bincount(kept_curve, minlength=n_curves).tolist()
    # each curve's last cleaned point, and its first cleaned point at or below the target (n_points: none)
    last = np.full(n_curves, n_points, dtype=np.intp)
    ends = np.flatnonzero(np.append(kept_curve[1:] != kept_curve[:-1], True)) if kept.size else kept
    last[kept_curve[ends]] = kept[ends]
    below = kept[loss[kept] <= np.asarray(curve_target, dtype=float)[kept_curve]]
    first_hit = np.full(n_curves, n_points, dtype=np.intp)
    if below.size:
        below_curve = curve_of[below]
        starts = np.flatnonzero(np.append(True, below_curve[1:] != below_curve[:-1]))
        first_hit[below_curve[starts]] = below[starts]
    hit_x, hit_s, hit_loss = x[first_hit].tolist(), s[first_hit].tolist(), loss[first_hit].tolist()
    hit_ok = (first_hit < n_points).tolist()
    last_x, last_s = x[last].tolist(), s[last].tolist()
    # the fit's tail: cleaned points past FIT_FROM_FRACTION of their curve's tokens (skips the transient), sorted by
    # request, then tokens; stable, so equal token counts keep their curve order
    tail = kept[x[kept] >= FIT_FROM_FRACTION * x[last[kept_curve]]]
    tail_request = np.repeat(np.arange(len(requests)), np.diff(curve_first))[curve_of[tail]]
    tail = tail[np.lexsort((x[tail], tail_request))]
    tail_count = np.bincount(tail_request, minlength=len(requests)).tolist()
    tail_start = np.concatenate(([0], np.cumsum(tail_count))).tolist()

    results: list[LossTarget | None] = []
    pending: list[tuple[int, list[int]]] = []
    for r, (_, target, _) in enumerate(requests):
        cleaned = [c for c in range(curve_first[r], curve_first[r + 1]) if kept_count[c]]
        if not cleaned:
            results.append(LossTarget(method="not projected", detail="no loss curve"))
        elif all(hit_ok[c] for c in cleaned):
            tokens = math.fsum(hit_x[c] for c in cleaned) / len(cleaned)
            results.append(
                LossTarget(
                    method="measured",
                    detail=f"loss {max(hit_loss[c] for c in cleaned):.4g} <= {target:g} at {tokens:,.0f} tokens",
                    tokens=tokens,
                    seconds=math.fsum(hit_s[c] for c in cleaned) / len(cleaned),
                )
            )
        elif tail_count[r] < 4:
            results.append(
                LossTarget(method="not projected", detail=f"only {tail_count[r]} loss points, need 4 to fit")
            )
        else:
            pending.append((r, cleaned))
            results.append(None)

    # one row per pending request: its tail thinned to MAX_FIT_POINTS, padded with its last (largest) point
    rows: list[int] = []
    for r, _ in pending:
        n, first = tail_count[r], tail_start[r]
        picked = [first + i for i in _thinned(n)] if n > MAX_FIT_POINTS else list(range(first, first + n))
        rows += picked + [picked[-1]] * (MAX_FIT_POINTS - len(picked))
    weight = np.zeros((len(pending), MAX_FIT_POINTS))
    for i, (r, _) in enumerate(pending):
        weight[i, : min(tail_count[r], MAX_FIT_POINTS)] = 1.0
    gathered = tail[np.asarray(rows, dtype=np.intp)].reshape(len(pending), MAX_FIT_POINTS)
    fit_x = x[gathered]
    fits = _fit_power_law_rows(fit_x, np.where(weight > 0, loss[gathered], 0.0), weight, fit_x[:, -1])
    for (r, cleaned), power_law in zip(pending, fits, strict=True):
        fit: LossSolver | None
        if power_law is not None:
            fit = power_law.solve
        else:
            rows_r = tail[tail_start[r] : tail_start[r] + tail_count[r]]
            fit = _fit_log_linear(np.column_stack((x[rows_r], s[rows_r], loss[rows_r])))
        ends_r = [(last_x[c], last_s[c], curve_rate[c]) for c in cleaned]
        results[r] = _projected(fit, requests[r][1], ends_r)
    return [r for r in results if r is not None]


def _projected(fit: LossSolver | None, target: float, ends: list[tuple[float, float, float]]) -> LossTarget:
    """``ends``: (tokens, elapsed s) of each repetition's last point and its tokens/s."""
    if fit is None:
        return LossTarget(method="not projected", detail="the loss is not falling; no curve fits")
    method, needed, formula = fit(target)
    if needed is None:
        return LossTarget(method="not projected", detail=f"{formula}: never reaches {target:g}")
    x_measured = min(x for x, _, _ in ends)
    if needed > MAX_EXTRAPOLATION * x_measured:
        return LossTarget(
            method="not projected",
            detail=f"{formula} needs {needed:,.3g} tokens, > {MAX_EXTRAPOLATION:g}x the {x_measured:,.0f} measured",
        )
    per_rep = [elapsed + (max(needed, x) - x) / tps for x, elapsed, tps in ends]
    return LossTarget(method=method, detail=formula, tokens=needed, seconds=math.fsum(per_rep) / len(per_rep))


_C_MIN, _C_MAX, _C_POINTS = 0.02, 3.0, 32
_UNIT = np.linspace(0.0, 1.0, _C_POINTS)
_C_GRID = _C_MIN * (_C_MAX / _C_MIN) ** _UNIT  # geometric grid of exponents c
MAX_FIT_POINTS = 40  # pooled points beyond this are thinned evenly
_FIT_CHUNK = 256  # curves fitted together: (chunk, grid, points) float64 arrays of ~4 MB


@dataclass(frozen=True, slots=True)
class PowerLaw:
    """L(x) = a + b (x / scale)^-c, x = cumulative tokens."""

    a: float
    b: float
    c: float
    scale: float

    def solve(self, target: float) -> tuple[LossMethod, float | None, str]:
        formula = f"power-law fit L = {self.a:.4g} + {self.b:.4g} (tokens/{self.scale:,.0f})^-{self.c:.3g}"
        if target <= self.a:
            return "power-law fit", None, formula
        return "power-law fit", self.scale * ((target - self.a) / self.b) ** (-1.0 / self.c), formula


def _batched_sse(cs: Any, log_u: Any, y: Any, w: Any) -> tuple[Any, Any, Any]:
    """Least-squares a, b of y = a + b u^-c for each curve g and exponent cs[g, k]; residual inf if b <= 0 or a < 0.

    Normal equations from weighted sums (w masks padding): b = (n Sxy - Sx Sy) / (n Sxx - Sx^2),
    a = (Sy - b Sx) / n, SSE = Syy - a Sy - b Sxy, with x = u^-c = exp(-c ln u).
    """
    basis = np.exp(-cs[:, :, None] * log_u[:, None, :]) * w[:, None, :]  # (G, C, N)
    n = w.sum(axis=1)[:, None]
    sx = basis.sum(axis=2)
    sxx = np.einsum("gcn,gcn->gc", basis, basis)
    sxy = np.einsum("gcn,gn->gc", basis, y)
    sy = (y * w).sum(axis=1)[:, None]
    syy = (y * y * w).sum(axis=1)[:, None]
    denominator = n * sxx - sx * sx
    with np.errstate(divide="ignore", invalid="ignore"):
        b = np.where(denominator > 1e-12 * n * sxx, (n * sxy - sx * sy) / denominator, np.nan)
    a = (sy - b * sx) / n
    residual = syy - a * sy - b * sxy
    return a, b, np.where((b > 0) & (a >= 0), residual, np.inf)  # falls with tokens, towards a loss >= 0


@lru_cache(maxsize=64)
def _thinned(n: int) -> tuple[int, ...]:
    """Indices of MAX_FIT_POINTS rows spread evenly over n (n > MAX_FIT_POINTS)."""
    return tuple(int(i) for i in np.linspace(0, n - 1, MAX_FIT_POINTS).round().astype(int))


def _fit_power_law_rows(x: Any, y: Any, w: Any, scales: Any) -> list[PowerLaw | None]:
    """Power-law fits of (G, MAX_FIT_POINTS) arrays of tokens, loss and weight (0 = padding), _FIT_CHUNK rows at once.

    ``scales`` (G,): each row's largest token count; tokens are fitted in its units (x / scale in (0, 1]), which
    keeps x^-c well conditioned. Padding must have x = scale and y = 0, so that it adds exactly nothing.
    """
    out: list[PowerLaw | None] = []
    for start in range(0, x.shape[0], _FIT_CHUNK):
        stop = start + _FIT_CHUNK
        scale = scales[start:stop]
        log_u = np.log(x[start:stop] / scale[:, None])
        yc, wc = y[start:stop], w[start:stop]
        g = log_u.shape[0]
        rows = np.arange(g)
        _, _, residual = _batched_sse(np.broadcast_to(_C_GRID, (g, _C_POINTS)), log_u, yc, wc)
        best = residual.argmin(axis=1)
        valid = np.isfinite(residual[rows, best]) & (best > 0) & (best < _C_POINTS - 1)
        # refine once between the best coarse point's neighbours (c to ~1 %)
        lo = _C_GRID[np.clip(best - 1, 0, _C_POINTS - 1)]
        hi = _C_GRID[np.clip(best + 1, 0, _C_POINTS - 1)]
        cs = lo[:, None] * (hi / lo)[:, None] ** _UNIT[None, :]
        a, b, residual = _batched_sse(cs, log_u, yc, wc)
        best = residual.argmin(axis=1)
        ok = (valid & np.isfinite(residual[rows, best])).tolist()
        fitted = zip(
            a[rows, best].tolist(), b[rows, best].tolist(), cs[rows, best].tolist(), scale.tolist(), ok, strict=True
        )
        out += [PowerLaw(ai, bi, ci, si) if good else None for ai, bi, ci, si, good in fitted]
    return out


def _fit_log_linear(points: npt.ArrayLike) -> LossSolver | None:
    rows = np.asarray(points, dtype=float).reshape(-1, 3)
    lx = np.log(rows[:, 0])
    y = rows[:, 2]
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
    spans, source = phase_seconds(transitions, startup_s=startup_s, wall_time_s=wall_time_s, train_time_s=train_time_s)
    return TimeBreakdown(**spans, source=source)


def phase_seconds(
    transitions: Iterable[Mapping[str, Any]],
    *,
    startup_s: float = 0.0,
    wall_time_s: float | None = None,
    train_time_s: float | None = None,
) -> tuple[dict[str, float], str]:
    """``time_breakdown``'s seconds per phase (PHASES) and their source, as a plain dict (no model to build)."""
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
        return spans, "SageMaker SecondaryStatusTransitions"
    training = train_time_s or 0.0
    rest = max(0.0, (wall_time_s or 0.0) - training)
    spans["startup"], spans["training"] = max(startup_s, rest), training
    return spans, "benchmark.json timing (local)"
