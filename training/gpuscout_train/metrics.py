"""Step timing, throughput statistics, the steady-state stop rule and GPU sampling for train.py.

Timing method (docs/metrics.md): the training loop synchronizes the device (``torch.cuda.synchronize``) before
reading ``time.perf_counter`` at the start and the end of every optimizer step, so a step's time covers its data
wait, forward, backward and optimizer update of all micro-batches. The first ``warmup_steps`` steps (compile,
allocator growth, cuDNN autotune) are excluded from every throughput figure.
"""

from __future__ import annotations

import math
import resource
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from gpuscout.domain.intervals import ratio_ci95  # the project's one implementation of the t statistics


def default_warmup_steps(max_steps: int) -> int:
    """max(3, ceil(10 % of max_steps)), but always leaving at least one timed step."""
    return max(0, min(max(3, math.ceil(0.1 * max_steps)), max_steps - 1))


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class StepRecord:
    step: int
    seconds: float
    tokens: int  # non-padding tokens of all ranks
    samples: int  # sequences of all ranks
    dataloader_wait_s: float
    loss: float
    timed: bool = True  # False for warmup steps (also the first steps after resuming from a checkpoint)
    # the process's own resource use during the step (ResourceMeter; None where not measured)
    user_s: float | None = None  # CPU time in user mode, all threads of the process
    system_s: float | None = None  # CPU time in the kernel on the process's behalf (page faults, syscalls)
    minor_faults: int | None = None  # page faults served without I/O (a fresh or reclaimed page mapped in)
    major_faults: int | None = None  # page faults that read from disk
    voluntary_switches: int | None = None  # the process waited (I/O, a lock, a collective)
    involuntary_switches: int | None = None  # the scheduler took the CPU away (another task wanted it)
    sm_clock_mhz: float | None = None  # GPU 0 of this rank's SM clock at the step's end (NVML)
    throttle_reasons: int | None = None  # NVML clock-event (throttle) reason bits at the step's end, 0 = none
    compiled_graphs: int | None = None  # graphs torch.compile (dynamo) compiled during the step: seconds each


USAGE_FIELDS = (
    "user_s",
    "system_s",
    "minor_faults",
    "major_faults",
    "voluntary_switches",
    "involuntary_switches",
    "sm_clock_mhz",
    "throttle_reasons",
    "compiled_graphs",
)


def step_accounts(records: list[StepRecord]) -> list[dict[str, Any]]:
    """benchmark.json's ``steps``: each step's time, work and resource use (gpuscout.domain.benchmark.StepAccount)."""
    out = []
    for r in records:
        row: dict[str, Any] = {
            "step": r.step,
            "seconds": r.seconds,
            "timed": r.timed,
            "tokens": r.tokens,
            "samples": r.samples,
            "dataloader_wait_s": r.dataloader_wait_s,
        }
        row.update({name: getattr(r, name) for name in USAGE_FIELDS if getattr(r, name) is not None})
        out.append(row)
    return out


@dataclass
class StepUsage:
    """A ResourceMeter reading: what the process had used by then."""

    user_s: float
    system_s: float
    minor_faults: int
    major_faults: int
    voluntary_switches: int
    involuntary_switches: int
    compiled_graphs: int | None = None  # dynamo's count so far; None while torch.compile was never loaded


def compiled_graphs() -> int | None:
    """How many graphs torch.compile (dynamo) has compiled in this process so far: a recompile inside a timed step
    costs seconds, which the step's time alone cannot tell from a stall. None when dynamo was never imported."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    if counters is None:
        return None
    return int(counters["stats"]["unique_graphs"])


class ResourceMeter:
    """The process's own CPU time, page faults and context switches (getrusage(RUSAGE_SELF): every thread of the
    process, not its children), read around each optimizer step; plus the GPU's SM clock and throttle reasons where
    NVML answers. A reading costs a few microseconds."""

    def __init__(self, sampler: GpuSampler | None = None) -> None:
        self._sampler = sampler

    @staticmethod
    def read() -> StepUsage:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return StepUsage(
            user_s=r.ru_utime,
            system_s=r.ru_stime,
            minor_faults=r.ru_minflt,
            major_faults=r.ru_majflt,
            voluntary_switches=r.ru_nvcsw,
            involuntary_switches=r.ru_nivcsw,
            compiled_graphs=compiled_graphs(),
        )

    def since(self, before: StepUsage) -> dict[str, Any]:
        """StepRecord's usage fields for the span from ``before`` until now."""
        now = self.read()
        fields: dict[str, Any] = {
            "user_s": round(now.user_s - before.user_s, 6),
            "system_s": round(now.system_s - before.system_s, 6),
            "minor_faults": now.minor_faults - before.minor_faults,
            "major_faults": now.major_faults - before.major_faults,
            "voluntary_switches": now.voluntary_switches - before.voluntary_switches,
            "involuntary_switches": now.involuntary_switches - before.involuntary_switches,
        }
        if now.compiled_graphs is not None:  # dynamo loaded by now: a graph count from before it loaded was 0
            fields["compiled_graphs"] = now.compiled_graphs - (before.compiled_graphs or 0)
        if self._sampler is not None:
            clock, reasons = self._sampler.clocks()
            fields["sm_clock_mhz"], fields["throttle_reasons"] = clock, reasons
        return fields


@dataclass
class StepStats:
    """Per-step records and the statistics over the timed (post-warmup) steps."""

    warmup_steps: int
    records: list[StepRecord] = field(default_factory=list)

    def add(self, record: StepRecord) -> None:
        self.records.append(record)

    def is_warmup(self, steps_in_this_process: int) -> bool:
        """Warmup is counted per process start: a resumed run warms up again before its steps are timed."""
        return steps_in_this_process <= self.warmup_steps

    @property
    def timed(self) -> list[StepRecord]:
        return [r for r in self.records if r.timed]

    def tokens_per_s_ci95(self) -> tuple[float, float, float]:
        """Throughput over the timed steps (total tokens / total time) and its 95 % interval."""
        return self.rate_ci95("tokens")

    def rate_ci95(self, unit: str = "tokens") -> tuple[float, float, float]:
        """Throughput of ``unit`` ("tokens" or "samples") over the timed steps (total / total time), 95 % interval."""
        timed = [r for r in self.timed if r.seconds > 0]
        amounts = [float(r.samples if unit == "samples" else r.tokens) for r in timed]
        return ratio_ci95(amounts, [r.seconds for r in timed])

    def steady_state_reached(
        self, *, ci_tolerance: float, min_timed_steps: int, unit: str = "tokens", min_timed_seconds: float = 0.0
    ) -> tuple[bool, str]:
        """Steady state: after ``min_timed_steps`` timed steps and ``min_timed_seconds`` of timed work, the 95 % CI
        half-width of the ``unit`` rate (total / total time, see ratio_ci95) is within ``ci_tolerance`` (a fraction:
        0.02 = +-2 %) of that estimate."""
        timed_count = sum(1 for r in self.timed if r.seconds > 0)
        if timed_count < max(2, min_timed_steps) or sum(r.seconds for r in self.timed) < min_timed_seconds:
            return False, ""
        mean, low, high = self.rate_ci95(unit)
        half = (high - low) / 2
        if mean > 0 and half / mean <= ci_tolerance:
            return True, (
                f"throughput CI within +-{100 * half / mean:.2f} % (tolerance +-{100 * ci_tolerance:.2f} %) "
                f"after {timed_count} timed steps"
            )
        return False, ""

    def summary(self) -> dict[str, Any]:
        timed = self.timed
        if not timed:
            raise ValueError("no timed steps: max_steps must exceed warmup_steps")
        times = [r.seconds for r in timed]
        seconds = sum(times)
        tokens = sum(r.tokens for r in timed)
        samples = sum(r.samples for r in timed)
        rate, low, high = self.tokens_per_s_ci95()
        _, samples_low, samples_high = self.rate_ci95("samples")
        return {
            "timed_steps": len(timed),
            "step_time_mean_s": statistics.fmean(times),
            "step_time_p50_s": percentile(times, 50),
            "step_time_p90_s": percentile(times, 90),
            "tokens_per_s": rate,  # total tokens / total time over the timed steps
            "tokens_per_s_ci95": (low, high),  # delta-method interval around that same estimate
            "samples_per_s": samples / seconds,
            "samples_per_s_ci95": (samples_low, samples_high),
            "samples_timed": samples,
            "tokens_timed": tokens,
            "train_time_s": sum(r.seconds for r in self.records),
            "dataloader_wait_fraction": min(1.0, sum(r.dataloader_wait_s for r in timed) / seconds),
        }


class GpuSampler:
    """Samples GPU utilization (%) and power (W) of the local GPUs with NVML in a background thread.

    The means ``stop`` returns cover only the samples taken while ``timing(True)`` was in force (the timed steps:
    warmup, compilation, validation and checkpoints excluded); ``recent_utilization`` sees every sample."""

    def __init__(self, device_indices: list[int], interval_s: float = 0.5) -> None:
        self._interval = interval_s
        self._util: list[float] = []
        self._power: list[float] = []
        self._timed_util: list[float] = []
        self._timed_power: list[float] = []
        self._stop = threading.Event()
        self._timed = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._reported = 0  # utilization samples already returned by recent_utilization
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in device_indices]
        except Exception:  # NVML missing or no driver: the figures stay None
            self._nvml = None

    @property
    def available(self) -> bool:
        return self._nvml is not None and bool(self._handles)

    def driver_version(self) -> str | None:
        if not self.available:
            return None
        version = self._nvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            for handle in self._handles:
                timed = self._timed.is_set()
                try:
                    util = float(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                    power = self._nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
                except Exception:  # a transient NVML error loses one sample, not the run
                    continue
                self._util.append(util)
                self._power.append(power)
                if timed:
                    self._timed_util.append(util)
                    self._timed_power.append(power)

    def timing(self, on: bool) -> None:
        """Count the samples from now on towards the means ``stop`` returns (True) or not (False)."""
        if on:
            self._timed.set()
        else:
            self._timed.clear()

    def start(self) -> None:
        if self.available and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
            self._thread.start()

    def clocks(self) -> tuple[float | None, int | None]:
        """The first GPU's SM clock (MHz) and its clock-event (throttle) reason bits now; (None, None) without
        NVML or when NVML does not answer."""
        if not self.available:
            return None, None
        handle = self._handles[0]
        try:
            clock = float(self._nvml.nvmlDeviceGetClockInfo(handle, self._nvml.NVML_CLOCK_SM))
        except Exception:
            clock = None
        try:
            reasons = int(self._nvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
        except Exception:
            try:  # older NVML bindings name it for throttling
                reasons = int(self._nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))
            except Exception:
                reasons = None
        return clock, reasons

    def recent_utilization(self) -> float | None:
        """Mean utilization (%) of the samples taken since the previous call (one optimizer step's, for experiment
        tracking); None when there is none (no NVML, or a step shorter than the sampling interval)."""
        samples = self._util[self._reported :]
        self._reported += len(samples)
        return statistics.fmean(samples) if samples else None

    def stop(self) -> tuple[float | None, float | None]:
        """Stops sampling; returns (mean utilization %, mean power W per GPU) over the timed samples. Calling it
        again returns the same."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=2)
        util = statistics.fmean(self._timed_util) if self._timed_util else None
        power = statistics.fmean(self._timed_power) if self._timed_power else None
        return util, power


class Stopwatch:
    """perf_counter seconds after synchronizing the device, so queued GPU work is counted where it belongs."""

    def __init__(self, synchronize: Any) -> None:
        self._sync = synchronize

    def now(self) -> float:
        self._sync()
        return time.perf_counter()
