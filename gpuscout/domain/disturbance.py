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
- or when a single slow step's time above the reference is at least ``LONE_STEP_EXCESS_FRACTION`` of the timed time
  and at least ``LONE_STEP_MIN_EXCESS_S``: one stall (a recompile under torch.compile, a swap-in, a checkpoint
  written inside a step) that alone moved the figure by a quarter or more. The floor in seconds keeps a scheduling
  delay of tens of milliseconds in a short job of millisecond steps a hiccup;
- or the steps split into two phases (each at least ``MIN_PHASE_STEPS`` long, at the change point that least
  absolute deviations from the phases' medians find) whose medians differ by ``PHASE_FACTOR`` or more, and the slower
  phase's time above the faster phase's median is at least ``MIN_EXCESS_FRACTION`` of the timed time: a level shift,
  even one too small to make single steps "slow", but not three slow steps at the end of a long run;
- or, on a GPU, ``THROTTLE_FRACTION`` or more of the timed steps ended with NVML reporting a thermal or hardware
  slowdown.

A step's time here excludes its wait for data (``dataloader_wait_s``): an input pipeline that cannot keep up is a
cost of the settings, already in the throughput, not a disturbance.

Where the steps carry the process's resource use (train.py and the report helper record it with getrusage), the
evidence line compares the slow steps with the others: the kernel's share of the step time and the minor-fault rate.
Jobs with fewer than ``MIN_STEPS`` timed steps are not judged (the interval check of the verdict already refuses
them). Standard library only: the training image runs it too.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the training job's SDK imports this module: no pydantic at run time
    from gpuscout.domain.benchmark import BenchmarkResult, Disturbance

SLOW_FACTOR = 1.8
MIN_SLOW_STEPS = 2
MIN_EXCESS_FRACTION = 0.10
LONE_STEP_EXCESS_FRACTION = 0.25
LONE_STEP_MIN_EXCESS_S = 0.5
PHASE_FACTOR = 1.5
MIN_PHASE_STEPS = 3
MAX_SPLITS = 64  # split points tried by the two-phase test (evenly spaced): linear in the steps, not quadratic
MIN_STEPS = 6
THROTTLE_FRACTION = 0.10
KERNEL_NOTE_SHARE = 0.25  # the kernel's share of all timed step time that earns a note (not a disturbance)
KERNEL_RISE = 0.05  # the kernel's share of the slow steps' time above the others' that the evidence blames on it
# NVML clock-event reasons that slow a GPU down against its will: hardware slowdown, software and hardware thermal
# slowdown, power brake. Not counted: the software power cap (0x4), the normal state of a fully loaded H100 or A100
# running at its power limit; GPU idle, application clocks and sync boost. All bits stay recorded in steps[].
THROTTLE_BITS = 0x8 | 0x20 | 0x40 | 0x80


def kernel_note(disturbance: Disturbance | None) -> str | None:
    """A note when the kernel took KERNEL_NOTE_SHARE or more of the timed steps' time: a steady cost (page faults, most
    often) that the figures include and the step statistics cannot see, since every step pays it alike."""
    share = disturbance.system_share if disturbance else None
    if share is None or share < KERNEL_NOTE_SHARE:
        return None
    faults = (disturbance.minor_faults_per_s if disturbance else None) or 0.0
    return (
        f"the kernel took {100 * share:.0f} % of the step time at {_rate(faults)} minor page faults/s "
        "(a host allocator that returns memory every step does this; see host_allocator)"
    )


def _compute_s(step: Mapping[str, Any]) -> float:
    """The step's time without its wait for data: a starved input pipeline is the settings' cost (it is in the
    throughput), not a disturbance."""
    return max(0.0, float(step.get("seconds") or 0) - float(step.get("dataloader_wait_s") or 0))


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
    """The change point of a level shift: the split (index of the first step of the second phase) whose two phases
    lie closest to their own medians (least absolute deviations), and the ratio of those medians (>= 1); None when
    the steps are too few for two phases. Without a shift the ratio stays near 1."""
    best: tuple[int, float, float] | None = None  # split, ratio, spread around the two medians
    splits = range(MIN_PHASE_STEPS, len(times) - MIN_PHASE_STEPS + 1)
    for k in splits[:: max(1, math.ceil(len(splits) / MAX_SPLITS))]:
        a, b = statistics.median(times[:k]), statistics.median(times[k:])
        if min(a, b) <= 0:
            continue
        spread = math.fsum(abs(t - a) for t in times[:k]) + math.fsum(abs(t - b) for t in times[k:])
        if best is None or spread < best[2]:
            best = (k, max(a, b) / min(a, b), spread)
    return (best[0], best[1]) if best else None


def detect(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The Disturbance fields (gpuscout.domain.benchmark.Disturbance) of a job's steps (benchmark.json's ``steps``:
    ``seconds``, ``timed``, ``step`` and, where measured, ``system_s``, ``minor_faults``, ``throttle_reasons``)."""
    timed = [s for s in steps if s.get("timed", True) and _compute_s(s) > 0]
    out: dict[str, Any] = {"disturbed": False, "evidence": None, "timed_steps": len(timed), "slow_steps": 0}
    if len(timed) < MIN_STEPS:
        return out
    times = [_compute_s(s) for s in timed]
    total = math.fsum(times)
    quarter = sorted(times)[: max(2, math.ceil(len(times) / 4))]
    reference = statistics.median(quarter)
    slow = [s for s, t in zip(timed, times, strict=True) if t > SLOW_FACTOR * reference]
    excess = math.fsum(_compute_s(s) - reference for s in slow)
    phase = _two_phases(times)
    throttled = [s for s in timed if int(s.get("throttle_reasons") or 0) & THROTTLE_BITS]
    out.update(
        slow_steps=len(slow),
        reference_step_s=reference,
        slow_median_ratio=statistics.median(_compute_s(s) for s in slow) / reference if slow else None,
        phase_ratio=phase[1] if phase else None,
        throttled_steps=len(throttled),
        system_share=_share(timed, "system_s"),  # the whole timed time's, not a disturbance by itself
        minor_faults_per_s=_share(timed, "minor_faults"),
        compiled_graphs_timed=_graphs(timed),
    )

    reasons: list[str] = []
    odd: list[Mapping[str, Any]] = []  # the steps the accounting compares with the others
    scattered = len(slow) >= MIN_SLOW_STEPS and excess >= MIN_EXCESS_FRACTION * total
    lone = len(slow) == 1 and excess >= max(LONE_STEP_EXCESS_FRACTION * total, LONE_STEP_MIN_EXCESS_S)
    if scattered or lone:
        which = f"{len(slow)} of {len(timed)} timed steps" if scattered else f"step {slow[0].get('step', '?')} alone"
        reasons.append(
            f"{which} {out['slow_median_ratio']:.1f}x the fastest quarter's median "
            f"({1000 * reference:.0f} ms), {100 * excess / total:.0f} % of the timed time"
        )
        odd = slow
    phase_excess = 0.0
    if phase is not None and phase[1] >= PHASE_FACTOR:
        k = phase[0]
        later_slower = statistics.median(times[k:]) > statistics.median(times[:k])
        slower, faster = (timed[k:], times[:k]) if later_slower else (timed[:k], times[k:])
        floor = statistics.median(faster)
        phase_excess = math.fsum(max(0.0, _compute_s(s) - floor) for s in slower)
    if phase is not None and phase[1] >= PHASE_FACTOR and phase_excess >= MIN_EXCESS_FRACTION * total:
        ratio = phase[1]
        reasons.append(
            f"steps {slower[0].get('step', '?')}-{slower[-1].get('step', '?')} ran {ratio:.1f}x slower than the "
            f"{'earlier' if later_slower else 'later'} ones"
        )
        odd = odd or slower
    if len(throttled) >= max(1, math.ceil(THROTTLE_FRACTION * len(timed))):
        reasons.append(f"the GPU reported a thermal or hardware slowdown in {len(throttled)} of {len(timed)} steps")
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
    graphs = _graphs(odd)
    explains = None
    if graphs:
        where = "that step" if len(odd) == 1 else "those steps"
        evidence += f"; torch.compile compiled {graphs} graph{'s' if graphs > 1 else ''} in {where}"
        explains = not _disturbed_without_compiles(steps, reference)
        if not explains:
            evidence += ", which alone does not explain the flag"
    out.update(disturbed=True, evidence=evidence, compiled_graphs_slow=graphs, compile_explains=explains)
    return out


def _disturbed_without_compiles(steps: Sequence[Mapping[str, Any]], reference: float) -> bool:
    """Whether the steps would still be flagged had each step that compiled a graph run at the reference step's
    time (its wait for data kept): a compile in one step of a slow phase or a noisy neighbour's does not explain it."""
    rest = [
        {**s, "seconds": reference + float(s.get("dataloader_wait_s") or 0), "compiled_graphs": 0}
        if (s.get("compiled_graphs") or 0) > 0
        else s
        for s in steps
    ]
    return bool(detect(rest)["disturbed"])


def judged(benchmark: BenchmarkResult) -> Disturbance | None:
    """A benchmark.json's disturbance as this release's detector judges it: from its steps where it has them (so a
    job written by an older release is judged as a new one), else what the job wrote (None: nothing)."""
    from gpuscout.domain.benchmark import Disturbance  # here: the training job's SDK imports this module, not pydantic

    if benchmark.steps:
        # the detector reads the step accounts as the job wrote them (its own process has no models)
        return Disturbance.model_validate(detect([step.model_dump() for step in benchmark.steps]))
    return benchmark.disturbance


def recompiled(disturbance: Disturbance | None) -> bool:
    """A disturbed measurement that torch.compile's compiles explain (``compile_explains``): the cause is in the job
    (shapes or guards that change between steps), so a second run of the same settings, on any machine, repeats it."""
    return bool(disturbance and disturbance.disturbed and disturbance.compile_explains)


def _graphs(steps: Sequence[Mapping[str, Any]]) -> int | None:
    """Graphs torch.compile compiled during the steps (None where no step counted them)."""
    counts = [s.get("compiled_graphs") for s in steps]
    return sum(int(c) for c in counts if c is not None) if any(c is not None for c in counts) else None
