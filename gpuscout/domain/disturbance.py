"""Whether a job's measurement was disturbed: the timed steps did not run at one speed (docs/metrics.md, "Disturbed
measurements").

A measurement is disturbed when something other than the training settings changed the speed of some of its steps:
a slow phase (on the machines here, the kernel faulting pages back in that the allocator had just returned, at 50-85k
minor faults/s), a noisy neighbour, a GPU that throttled. Such a job's tokens/s describes the disturbance as much as
the settings, so it is flagged wherever it is shown and never wins a comparison (analysis/recommend.py).

The detector reads only the timed steps (warm-up excluded) and uses robust statistics, so a few slow steps cannot hide
behind a mean and a single hiccup does not condemn a run:

- the reference step is the median of the fastest quarter of the timed steps (at least two of them);
- a step is slow when it took more than ``SLOW_FACTOR`` times the reference; the job is disturbed when at least
  ``MIN_SLOW_STEPS`` steps were slow and their time above the reference is at least ``MIN_EXCESS_FRACTION`` of the
  timed time (a lone hiccup, or two slow steps among hundreds, change the figure by less than that);
- or the steps split into two phases (each at least ``MIN_PHASE_STEPS`` long) whose medians differ by ``PHASE_FACTOR``
  or more: a level shift, even one too small to make single steps "slow";
- or, on a GPU, ``THROTTLE_FRACTION`` or more of the timed steps ended with NVML reporting a power or thermal
  slowdown.

Where the steps carry the process's resource use (train.py and the report helper record it with getrusage), the
evidence line compares the slow steps with the others: the kernel's share of the step time and the minor-fault rate.
Jobs with fewer than ``MIN_STEPS`` timed steps are not judged (the interval check of the verdict already refuses
them). Standard library only: the training image runs it too.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

SLOW_FACTOR = 1.8
MIN_SLOW_STEPS = 2
MIN_EXCESS_FRACTION = 0.10
PHASE_FACTOR = 1.5
MIN_PHASE_STEPS = 3
MAX_SPLITS = 64  # split points tried by the two-phase test (evenly spaced): linear in the steps, not quadratic
MIN_STEPS = 6
THROTTLE_FRACTION = 0.10
KERNEL_RISE = 0.05  # the kernel's share of the slow steps' time above the others' that the evidence blames on it
# NVML clock-event reasons that slow a GPU down against its will: software power cap, hardware slowdown, software
# and hardware thermal slowdown, power brake (GPU idle, application clocks and sync boost are not disturbances)
THROTTLE_BITS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


def _rate(per_s: float) -> str:
    return f"{per_s / 1000:.0f}k" if per_s >= 10_000 else f"{per_s:,.0f}"


def _share(steps: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """Sum of ``key`` over the steps / their time; None when a step lacks it or no time passed."""
    values = [s.get(key) for s in steps]
    seconds = math.fsum(float(s["seconds"]) for s in steps)
    if not steps or seconds <= 0 or any(v is None for v in values):
        return None
    return math.fsum(float(v) for v in values if v is not None) / seconds


def _two_phases(times: Sequence[float]) -> tuple[int, float] | None:
    """The split (index of the first step of the second phase) whose phase medians differ most, and that ratio
    (>= 1); None when the steps are too few for two phases. Medians tie over many splits around a change, so among
    the splits within 1 % of the largest ratio the one whose phases lie closest to their own medians wins: the
    change point itself."""
    candidates: list[tuple[int, float, float]] = []  # split, ratio, spread around the two medians
    splits = range(MIN_PHASE_STEPS, len(times) - MIN_PHASE_STEPS + 1)
    for k in splits[:: max(1, math.ceil(len(splits) / MAX_SPLITS))]:
        a, b = statistics.median(times[:k]), statistics.median(times[k:])
        if min(a, b) <= 0:
            continue
        spread = math.fsum(abs(t - a) for t in times[:k]) + math.fsum(abs(t - b) for t in times[k:])
        candidates.append((k, max(a, b) / min(a, b), spread))
    if not candidates:
        return None
    top = max(ratio for _, ratio, _ in candidates)
    k, ratio, _ = min((c for c in candidates if c[1] >= 0.99 * top), key=lambda c: c[2])
    return k, ratio


def detect(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The Disturbance fields (gpuscout.domain.benchmark.Disturbance) of a job's steps (benchmark.json's ``steps``:
    ``seconds``, ``timed``, ``step`` and, where measured, ``system_s``, ``minor_faults``, ``throttle_reasons``)."""
    timed = [s for s in steps if s.get("timed", True) and float(s.get("seconds") or 0) > 0]
    out: dict[str, Any] = {"disturbed": False, "evidence": None, "timed_steps": len(timed), "slow_steps": 0}
    if len(timed) < MIN_STEPS:
        return out
    times = [float(s["seconds"]) for s in timed]
    total = math.fsum(times)
    quarter = sorted(times)[: max(2, math.ceil(len(times) / 4))]
    reference = statistics.median(quarter)
    slow = [s for s, t in zip(timed, times, strict=True) if t > SLOW_FACTOR * reference]
    excess = math.fsum(float(s["seconds"]) - reference for s in slow)
    phase = _two_phases(times)
    throttled = [s for s in timed if int(s.get("throttle_reasons") or 0) & THROTTLE_BITS]
    out.update(
        slow_steps=len(slow),
        reference_step_s=reference,
        slow_median_ratio=statistics.median(float(s["seconds"]) for s in slow) / reference if slow else None,
        phase_ratio=phase[1] if phase else None,
        throttled_steps=len(throttled),
    )

    reasons: list[str] = []
    odd: list[Mapping[str, Any]] = []  # the steps the accounting compares with the others
    if len(slow) >= MIN_SLOW_STEPS and excess >= MIN_EXCESS_FRACTION * total:
        reasons.append(
            f"{len(slow)} of {len(timed)} timed steps {out['slow_median_ratio']:.1f}x the fastest quarter's median "
            f"({1000 * reference:.0f} ms), {100 * excess / total:.0f} % of the timed time"
        )
        odd = slow
    if phase is not None and phase[1] >= PHASE_FACTOR:
        k, ratio = phase
        first, second = timed[:k], timed[k:]
        later_slower = statistics.median(times[k:]) > statistics.median(times[:k])
        slower = second if later_slower else first
        reasons.append(
            f"steps {slower[0].get('step', '?')}-{slower[-1].get('step', '?')} ran {ratio:.1f}x slower than the "
            f"{'earlier' if later_slower else 'later'} ones"
        )
        odd = odd or slower
    if len(throttled) >= max(1, math.ceil(THROTTLE_FRACTION * len(timed))):
        reasons.append(f"the GPU reported a power or thermal slowdown in {len(throttled)} of {len(timed)} steps")
        odd = odd or throttled
    if not reasons:
        return out

    ids = {id(s) for s in odd}
    rest = [s for s in timed if id(s) not in ids]
    accounting = {
        "system_share_slow": _share(odd, "system_s"),
        "system_share_fast": _share(rest, "system_s"),
        "minor_faults_per_s_slow": _share(odd, "minor_faults"),
        "minor_faults_per_s_fast": _share(rest, "minor_faults"),
    }
    out.update(accounting)
    evidence = "; ".join(reasons)
    slow_sys, slow_faults = accounting["system_share_slow"], accounting["minor_faults_per_s_slow"]
    fast_sys, fast_faults = accounting["system_share_fast"], accounting["minor_faults_per_s_fast"]
    if slow_sys is not None and slow_faults is not None and fast_sys is not None and fast_faults is not None:
        if slow_sys > fast_sys + KERNEL_RISE:
            evidence += (
                f"; in those steps the kernel took {100 * slow_sys:.0f} % of the time at {_rate(slow_faults)} minor "
                f"faults/s ({100 * fast_sys:.0f} % and {_rate(fast_faults)}/s in the others)"
            )
        else:
            evidence += (
                f"; the process's own kernel time did not rise in them ({100 * slow_sys:.0f} % at {_rate(slow_faults)} "
                f"minor faults/s, {100 * fast_sys:.0f} % at {_rate(fast_faults)}/s in the others): the time went "
                "outside it (the CPU taken by another process, I/O or a wait)"
            )
    out.update(disturbed=True, evidence=evidence)
    return out
