"""The training process's host (CPU) memory allocator, set up for training before the model is built.

glibc's malloc gives large freed blocks back to the kernel: blocks above its mmap threshold (128 KiB, raised
dynamically up to 32 MiB) are unmapped on free, and the top of the heap is trimmed once more than the trim threshold
is free. A training step frees and reallocates the same activation and gradient buffers every step, so each step
faults them back in, page by page. Measured on a 2-core Xeon (quickstart.yaml, `gpuscout local`, 6 runs each):
100-170k minor page faults/s and 20-40 % of the step time in the kernel for the 4-sequence micro-batches; with the
settings below, 1-7k faults/s, ~1 % in the kernel, and b4-a1 at 51-54k tokens/s instead of 41-47k (docs/metrics.md,
"Host allocator"). On machines whose kernel serves faults slowly (transparent huge pages "always", memory reclaim
daemons, ballooned VMs) the faults also caused slow phases that flipped a ranking.

``training`` (the default) keeps freed memory in the process: ``mallopt`` sets the mmap threshold to 1 GiB, the trim
threshold to 2 GiB and the top pad to 256 MiB (PyTorch's CPU performance guide reaches the same effect with jemalloc or
tcmalloc). ``system`` leaves malloc as the environment configured it, so the two can be compared as variants. An
allocator preloaded with LD_PRELOAD (jemalloc, tcmalloc) is left alone and recorded. What was in effect is recorded in
benchmark.json (``software.host_allocator``) and shown in the report: it is part of what was measured.

Imported by train_loop; standard library only."""

from __future__ import annotations

import ctypes
import os

KINDS = ("training", "system")
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
MMAP_THRESHOLD = 1 << 30
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


def configure(kind: str) -> str:
    """Set the allocator up for ``kind`` (KINDS) and say what is in effect, in one line."""
    if kind not in KINDS:
        raise ValueError(f"host_allocator must be one of {', '.join(KINDS)}, not {kind!r}")
    preload = os.environ.get("LD_PRELOAD", "")
    preloaded = next((name for name in PRELOADED if name in preload), None)
    if preloaded:
        return f"{preloaded} (LD_PRELOAD); host_allocator {kind} left it as it is"
    glibc = _glibc()
    tunables = os.environ.get("GLIBC_TUNABLES") or os.environ.get("MALLOC_TRIM_THRESHOLD_")
    if kind == "system" or glibc is None:
        base = f"glibc {glibc[1]} malloc" if glibc else "the C library's malloc (not glibc)"
        return f"{base}, as the environment set it" + (" (GLIBC_TUNABLES/MALLOC_* set)" if tunables else "")
    libc, version = glibc
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    if not all(libc.mallopt(ctypes.c_int(option), ctypes.c_int(value)) == 1 for option, value in settings):
        return f"glibc {version} malloc, as the environment set it (mallopt refused the training settings)"
    return f"glibc {version} malloc kept for training: mmap_threshold 1 GiB, trim_threshold 2 GiB, top_pad 256 MiB"
