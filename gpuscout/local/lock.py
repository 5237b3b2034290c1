"""One ``gpuscout local`` at a time per runs folder: two benchmarks on one machine measure each other. The lock is
per runs folder, not per machine, and says so: a run with another ``--runs-dir`` is not refused; the contention
monitor (contention.py) flags the measurements such a run disturbs.

An advisory ``fcntl`` lock on ``<runs_dir>/.gpuscout-local.lock``; the file says who holds it (host, pid, run id,
since when) so the refusal can name the holder. The kernel drops the lock when its process ends, however it ends,
so a killed run never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from gpuscout.errors import GpuscoutError

LOCK_NAME = ".gpuscout-local.lock"


class RunsFolderBusyError(GpuscoutError):
    """Another ``gpuscout local`` holds the runs folder."""


class RunsFolderLock:
    def __init__(self, runs_dir: Path, *, run_id: str, host: str) -> None:
        self.path = Path(runs_dir) / LOCK_NAME
        self.run_id = run_id
        self.host = host
        self._file: IO[str] | None = None

    def __enter__(self) -> RunsFolderLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = _holder(handle.read())
            handle.close()
            raise RunsFolderBusyError(
                f"another gpuscout local is running with the runs folder {self.path.parent} ({holder}); two "
                "benchmarks on one machine measure each other: wait for it, or pass --allow-concurrent to run both "
                "anyway (this lock is per runs folder: a run with another --runs-dir is not refused, its "
                "measurements are flagged as contended instead)"
            ) from None
        handle.seek(0)
        handle.truncate()
        record = {"host": self.host, "pid": os.getpid(), "run_id": self.run_id, "since": datetime.now(UTC).isoformat()}
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        self._file = handle
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.seek(0)
            self._file.truncate()
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def _holder(text: str) -> str:
    try:
        data: dict[str, Any] = json.loads(text)
        return f"run {data['run_id']}, pid {data['pid']} on {data['host']}, since {data['since'][:19]} UTC"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"
