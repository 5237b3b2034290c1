"""Noisy neighbours: what else used this machine while a local job was measured, and whether it competed.

``ContentionMonitor`` samples once a second, in a thread, while the job runs: the CPU time of every process that is
not the job's process tree or the runner itself (system-wide CPU minus ours, in cores), the 1-minute load average,
and, where NVML is available, compute processes on the GPUs that are not ours. A job is flagged as measured under
competition when other processes used, on average, at least ``max(0.5, 20 %)`` of the CPU cores, or any other
process ran on a GPU. The flag travels with the job row (``JobRecord.contention``) into the analysis, which never
calls a clear winner from a flagged measurement (docs/costs.md, "The verdict").
"""

from __future__ import annotations

import contextlib
import math
import os
import threading

import psutil

from gpuscout.domain.contention import Contention

SAMPLE_INTERVAL_S = 1.0
MIN_OTHER_CORES = 0.5
OTHER_CORES_FRACTION = 0.20


def competing_threshold_cores(cpu_count: int) -> float:
    return max(MIN_OTHER_CORES, OTHER_CORES_FRACTION * cpu_count)


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _gpu_pids() -> set[int] | None:
    """Pids of compute processes on any GPU (NVML), or None without NVML or a GPU."""
    try:
        import pynvml  # nvidia-ml-py: only where a GPU driver is
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        pids: set[int] = set()
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pids.update(p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
        return pids
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


class ContentionMonitor:
    """Samples the machine's other load while the process ``pid`` (and its children) run."""

    def __init__(self, pid: int, *, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.cpu_count = psutil.cpu_count() or os.cpu_count() or 1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"contention-{pid}", daemon=True)
        self._other_cores: list[float] = []
        self._load: list[float] = []
        self._other_gpu: set[int] = set()
        self._known: dict[int, psutil.Process] = {}

    def __enter__(self) -> ContentionMonitor:
        psutil.cpu_percent(interval=None)  # prime: the first reading covers nothing
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _ours_cores(self) -> tuple[float, set[int]]:
        processes = [psutil.Process(os.getpid()), *_tree(self.pid)]
        total, pids = 0.0, set()
        for proc in processes:
            known = self._known.setdefault(proc.pid, proc)  # cpu_percent needs the same Process object each time
            try:
                total += known.cpu_percent(interval=None) / 100.0
                pids.add(proc.pid)
            except psutil.Error:
                continue
        return total, pids

    def sample(self) -> None:
        """One reading (the thread calls this every interval; tests may call it directly)."""
        system = psutil.cpu_percent(interval=None) / 100.0 * self.cpu_count
        ours, pids = self._ours_cores()
        self._other_cores.append(max(0.0, system - ours))
        self._load.append(os.getloadavg()[0])
        gpu = _gpu_pids()
        if gpu is not None:
            self._other_gpu.update(gpu - pids)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except (psutil.Error, OSError):
                continue

    def summary(self) -> Contention:
        """What JobRecord.contention stores."""
        return summarize(self._other_cores, self._load, sorted(self._other_gpu), self.cpu_count)


def summarize(other_cores: list[float], load: list[float], other_gpu_pids: list[int], cpu_count: int) -> Contention:
    mean = math.fsum(other_cores) / len(other_cores) if other_cores else None
    threshold = competing_threshold_cores(cpu_count)
    reasons = []
    if mean is not None and mean >= threshold:
        reasons.append(f"other processes used {mean:.1f} of {cpu_count} CPU cores on average")
    if other_gpu_pids:
        reasons.append(
            f"{len(other_gpu_pids)} other process(es) ran on the GPU (pids {', '.join(map(str, other_gpu_pids))})"
        )
    return Contention(
        samples=len(other_cores),
        cpu_count=cpu_count,
        other_cpu_cores_mean=round(mean, 3) if mean is not None else None,
        other_cpu_cores_max=round(max(other_cores), 3) if other_cores else None,
        load_average_max=round(max(load), 2) if load else None,
        other_gpu_pids=other_gpu_pids,
        competing=bool(reasons),
        note="measured under competition: " + "; ".join(reasons) if reasons else None,
    )
