"""The training process's host (CPU) memory allocator, set up for training before the model is built.

glibc's malloc gives large freed blocks back to the kernel: blocks above its mmap threshold (128 KiB, raised
dynamically up to 32 MiB) are unmapped on free, and the top of the heap is trimmed once more than the trim threshold
is free. A training step frees and reallocates the same activation and gradient buffers every step, so each step
faults them back in, page by page. Measured on a 2-core Xeon (quickstart.yaml, `gpuscout local`; 6 runs with glibc's
defaults, 5 with these settings): b4-a1 at 100-173k minor page faults/s with 20-42 % of the step time in the kernel;
with the settings below, 3-7k faults/s, 0-4 % in the kernel, and 51-54k tokens/s instead of 41-47k (docs/metrics.md,
"Host allocator"). On machines whose kernel serves faults slowly (transparent huge pages "always", memory reclaim
daemons, ballooned VMs) the faults also caused slow phases that flipped a ranking.

``training`` (the default) keeps freed memory in the process: ``mallopt`` sets the mmap threshold to 1 GiB (32 MiB
where a glibc before 2.36 refuses more), the trim threshold to 2 GiB and the top pad to 256 MiB (PyTorch's CPU
performance guide reaches the same effect with jemalloc or
tcmalloc). ``system`` leaves malloc as the environment configured it, so the two can be compared as variants. An
allocator preloaded with LD_PRELOAD (jemalloc, tcmalloc), or malloc settings the environment gives (GLIBC_TUNABLES'
glibc.malloc.* keys, MALLOC_*_ variables), are left alone and recorded: the user's own tuning is what is measured.
These settings hold for the main thread's heap; a thread's own arena maps blocks above 64 MiB itself. What was in
effect is recorded in benchmark.json (``software.host_allocator``) and shown in the report: it is part of what was
measured.

Imported by trainer; standard library only."""

from __future__ import annotations

import ctypes
import os

KINDS = ("training", "system")
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
MMAP_THRESHOLD = 1 << 30
MMAP_THRESHOLD_FALLBACK = 32 << 20
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: its largest, ~2 GiB
TOP_PAD = 256 << 20
PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")


def _glibc() -> tuple[ctypes.CDLL, str] | None:
    """This process's C library and glibc version, or None when it is not glibc."""
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
        version.restype = ctypes.c_char_p
        return libc, version().decode()
    except (OSError, AttributeError):
        return None


def _environment_tunables() -> str | None:
    """The malloc settings the environment gives the process (GLIBC_TUNABLES' malloc keys, MALLOC_*_), or None."""
    tunables = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t.startswith("glibc.malloc.")]
    legacy = sorted(name for name in os.environ if name.startswith("MALLOC_") and name.endswith("_"))
    found = tunables + [f"{name}={os.environ[name]}" for name in legacy]
    return ", ".join(found) or None


def _size(value: int) -> str:
    return f"{value >> 30} GiB" if value >= 1 << 30 else f"{value >> 20} MiB"


def configure(kind: str) -> str:
    """Set the allocator up for ``kind`` (KINDS) and say what is in effect, in one line."""
    if kind not in KINDS:
        raise ValueError(f"host_allocator must be one of {', '.join(KINDS)}, not {kind!r}")
    preload = os.environ.get("LD_PRELOAD", "")
    preloaded = next((name for name in PRELOADED if name in preload), None)
    if preloaded:
        return f"{preloaded} (LD_PRELOAD); host_allocator {kind} left it as it is"
    glibc = _glibc()
    environment = _environment_tunables()
    if kind == "system" or glibc is None or environment:
        base = f"glibc {glibc[1]} malloc" if glibc else "the C library's malloc (not glibc)"
        if environment:  # the user tuned malloc themselves: theirs is what is measured
            return f"{base} as the environment set it ({environment}); host_allocator {kind} left it as it is"
        return f"{base}, as the environment set it"
    libc, version = glibc
    applied = []
    # glibc releases before 2.36 refuse an mmap threshold above 32 MiB (HEAP_MAX_SIZE / 2): then 32 MiB, its largest
    mmap = next((v for v in (MMAP_THRESHOLD, MMAP_THRESHOLD_FALLBACK) if libc.mallopt(M_MMAP_THRESHOLD, v) == 1), None)
    if mmap is not None:
        applied.append(f"mmap_threshold {_size(mmap)}")
    if libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1:
        applied.append(f"trim_threshold {_size(TRIM_THRESHOLD + 1)}")
    if libc.mallopt(M_TOP_PAD, TOP_PAD) == 1:
        applied.append(f"top_pad {_size(TOP_PAD)}")
    if not applied:
        return f"glibc {version} malloc, as the environment set it (mallopt refused the training settings)"
    missing = "" if len(applied) == 3 else " (mallopt refused the others)"
    return f"glibc {version} malloc kept for training: {', '.join(applied)}{missing}"
