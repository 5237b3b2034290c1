"""Suite-wide collection order: the longest test files first.

`make test` runs two workers with ``--dist loadfile --no-loadscope-reorder``: each file runs whole on one worker, and
a worker takes the next file in collection order when it runs low. Files holding tests marked
``slow(seconds=N)`` come first, longest (sum of N) first, so the two multi-minute files start at once and the many
short ones fill in behind them; otherwise a long file drawn last keeps one worker busy minutes after the other has
finished (12 min 40 s against about 10 min, measured on a 2-core AMD EPYC). The order inside a file never changes.
"""

from __future__ import annotations

import gc
import os
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

DEFAULT_SLOW_SECONDS = 10.0


def slow_seconds(item: pytest.Item) -> float:
    """A test's ``slow`` mark's expected seconds (0 if it has none)."""
    mark = item.get_closest_marker("slow")
    if mark is None:
        return 0.0
    return float(mark.kwargs.get("seconds", DEFAULT_SLOW_SECONDS))


# A full collection in a test worker walks every object it holds (torch, transformers, moto, the CDK app, ...: 0.25 to
# 0.5 s each in the runs below); during the tests it runs after this many younger collections (Python's default: 10)
WORKER_FULL_COLLECTION_EVERY = 100


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[None]:
    """No automatic garbage collection while the test files are imported; then their objects frozen.

    Each worker imports every test file (torch, transformers, moto, the CDK app, ...), and the collections that those
    imports' allocations set off walk all that was loaded so far: `pytest --collect-only` took 11.1 CPU-seconds with
    them, 7.0 without (median of five paired runs, 2-core Xeon, 2026-11-26; gpuscout_train/startup_gc.py pauses the same
    collector in a training job). When collection is done, its cycles are freed once and what survives is frozen: a
    full collection then walks only what the tests allocate, and the worker's exit does not walk it again.

    Full collections stay costly while the tests run (the modules they import later, what moto and the tests build):
    in four in-process files (the state machine, the cloud handlers, the event-order property, cloud tracking:
    91-105 CPU-s), full collections took 14.9 s as Python sets them, 11.5 s frozen, 4.9 s frozen and run a tenth as
    often (one run each, 2-core Xeon, 2026-11-26). The processes the tests start (train.py, the CLI) keep Python's
    defaults: this is the test process's setting only. (A wrapper: xdist's controller, which collects nothing, ends
    with the collector on too.)
    """
    gc.disable()
    try:
        return (yield)
    finally:
        gc.collect()
        gc.freeze()
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, WORKER_FULL_COLLECTION_EVERY)
        gc.enable()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    weight: dict[Path, float] = defaultdict(float)
    first_seen: dict[Path, int] = {}
    for item in items:
        weight[item.path] += slow_seconds(item)
        first_seen.setdefault(item.path, len(first_seen))
    items.sort(key=lambda item: (-weight[item.path], first_seen[item.path]))


# What the suite's times depend on, printed after the slowest tests (and so in CI's log)
KERNEL_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS")


def machine_lines() -> list[str]:
    """The machine a run's times were measured on: the CPU model, its cores and memory, the kernel variables make
    test sets, and whether bf16 matmuls run natively. The pool mixes Xeons with native bf16 and AVX2-only AMD EPYCs
    that run the same suite at different speeds; a time read from a log says which it was."""
    from gpuscout.domain.cpu import cpuinfo_field, detect_cpu_precisions

    model = cpuinfo_field("model name") or "CPU model unknown (no /proc/cpuinfo)"
    memory = cpuinfo_field("memtotal", cpuinfo=Path("/proc/meminfo"))  # "24683660 kB"
    size = f", {int(memory.split()[0]) / 2**20:.0f} GiB" if memory and memory.split()[0].isdigit() else ""
    kernels = " ".join(f"{name}={os.environ.get(name, '(unset)')}" for name in KERNEL_VARIABLES)
    bf16 = detect_cpu_precisions()
    verdict = "native" if bf16.bf16_native else "on the reference path (~1 % of fp32)"
    return [
        f"machine: {model}, {os.cpu_count()} cores{size}",
        f"kernels: {kernels}; bf16 matmuls {verdict}: {bf16.reason}",
    ]


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any) -> None:
    """After the slowest tests (make test's --durations=15), even under -q."""
    terminalreporter.section("the machine these times were measured on")
    for line in machine_lines():
        terminalreporter.write_line(line)


def _share_botocore_model_files() -> None:
    """Parse each of botocore's JSON files (service models, endpoint rules, partitions) once per test process.

    moto's ``mock_aws()`` gives every test a fresh boto3 default session, and a fresh session's loader parses every
    model a client needs again: 6.7 s of test_cloud_handlers' 31 s (cProfile, 2-core Xeon) went to ``json.loads`` of
    the same files. The files do not change while the suite runs, and one session already hands the same parsed
    model to every client it makes, so the tests still see exactly what botocore ships. Without botocore (a GPU
    machine's own Python running ``make gpu-check``'s CUDA tests) there is nothing to share.
    """
    try:
        from botocore.loaders import JSONFileLoader
    except ImportError:
        return

    load_file = JSONFileLoader.load_file
    parsed: dict[str, Any] = {}

    def load_file_once(self: JSONFileLoader, file_path: str) -> Any:
        if file_path not in parsed:
            data = load_file(self, file_path)
            if data is None:  # not there: asked again, as botocore would
                return None
            parsed[file_path] = data
        return parsed[file_path]

    JSONFileLoader.load_file = load_file_once  # type: ignore[method-assign]


_share_botocore_model_files()
