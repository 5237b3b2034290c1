"""Job events delivered at least once and in any order: the row always ends at the true latest state and never
moves backwards. Runs against every ResultStore (SQLite, DynamoDB via moto)."""

from __future__ import annotations

import os
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from tempfile import TemporaryDirectory

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_factories import STORE_FACTORIES

from gpuscout.store.base import JOB_STATUS_RANK, TERMINAL_JOB_STATUSES, JobRecord, JobStatus, ResultStore, RunRecord
from tests.job_specs import job_spec

T0 = datetime(2025, 3, 13, 10, 0, tzinfo=UTC)
TERMINALS = sorted(TERMINAL_JOB_STATUSES)
LIVE = [JobStatus.STARTING, JobStatus.TRAINING, JobStatus.STOPPING]


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[tuple[JobStatus, datetime, int]], list[int]]:
    """A true job timeline (live states, then one terminal state; times non-decreasing, ties allowed) and a
    delivery order: every event at least once, some several times, shuffled."""
    live = draw(st.lists(st.sampled_from(LIVE), min_size=0, max_size=5))
    terminal = draw(st.sampled_from(TERMINALS))
    gaps = draw(st.lists(st.integers(min_value=0, max_value=3), min_size=len(live) + 1, max_size=len(live) + 1))
    timeline: list[tuple[JobStatus, datetime, int]] = []
    elapsed = 0
    previous: tuple[datetime, int] | None = None
    for index, (status, gap) in enumerate(zip([*live, terminal], gaps, strict=True)):
        elapsed += gap
        when = T0 + timedelta(seconds=elapsed)
        # At equal times SageMaker's later state is the higher-ranked one; keep the truth consistent with that.
        if previous is not None and when == previous[0] and JOB_STATUS_RANK[status] <= previous[1]:
            elapsed += 1
            when = T0 + timedelta(seconds=elapsed)
        timeline.append((status, when, index))
        previous = (when, JOB_STATUS_RANK[status])
    extra = draw(st.lists(st.integers(min_value=0, max_value=len(timeline) - 1), max_size=6))
    order = draw(st.permutations(list(range(len(timeline))) + extra))
    return timeline, order


def _check(store: ResultStore, job_name: str, history: tuple[list[tuple[JobStatus, datetime, int]], list[int]]):
    timeline, order = history
    store.put_job(
        JobRecord(
            run_id="run-p",
            job_name=job_name,
            status=JobStatus.PLANNED,
            instance_type="ml.g5.8xlarge",
            variant_name="b4",
            spec=job_spec(job_name, "run-p", instance_type="ml.g5.8xlarge", variant_name="b4"),
        )
    )
    seen: tuple[datetime, int] | None = None
    reached_terminal = False
    for position in order:
        status, when, index = timeline[position]
        store.apply_job_event("run-p", job_name, status, when, billable_seconds=index)
        row = store.get_job("run-p", job_name)
        assert row is not None and row.last_event_time is not None
        current = (row.last_event_time, JOB_STATUS_RANK[row.status])
        assert seen is None or current >= seen, "the row moved backwards"
        assert not (reached_terminal and row.status not in TERMINAL_JOB_STATUSES), "a terminal state regressed"
        seen = current
        reached_terminal = row.status in TERMINAL_JOB_STATUSES
    final = store.get_job("run-p", job_name)
    latest_status, latest_time, latest_index = timeline[-1]
    assert final is not None
    assert (final.status, final.last_event_time, final.billable_seconds) == (latest_status, latest_time, latest_index)


# The SQLite file lives in RAM where the machine has /dev/shm: a sequence commits ~15 times and each commit syncs the
# file to disk (200 sequences: 1.74 s in /tmp, 0.79 s in /dev/shm, idle 2-core Xeon). What is tested is the SQL.
# A hard-killed worker cannot remove its folder, and /dev/shm is memory. A run holds an exclusive flock on a file in its
# folder while it runs (the kernel drops it when the process ends, however it ends); a run first removes the folders
# whose lock it can take. A lock, not a pid: pids are reused, and a /dev/shm shared between containers holds folders of
# processes this one's /proc does not show.
SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
SCRATCH_PREFIX = "gpuscout-events-"
SCRATCH_LOCK = "in-use.lock"


def _hold_scratch(folder: Path) -> int:
    """Mark ``folder`` in use until the returned descriptor is closed or this process ends."""
    import fcntl

    fd = os.open(folder / SCRATCH_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _remove_orphaned_scratch(scratch: Path) -> list[Path]:
    """Remove ``scratch``'s folders of this test that no live run holds; the folders removed. A folder without its lock
    file (one being made this instant) is left alone."""
    import fcntl

    removed = []
    for folder in scratch.glob(f"{SCRATCH_PREFIX}*"):
        try:
            fd = os.open(folder / SCRATCH_LOCK, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live run holds it
            os.close(fd)
            continue
        shutil.rmtree(folder, ignore_errors=True)
        os.close(fd)
        if not folder.exists():
            removed.append(folder)
    return removed


def test_a_killed_runs_scratch_folder_is_removed_by_the_next(tmp_path: Path) -> None:
    # Given a folder whose run ended without removing it, one a live run holds, one being made, and someone else's
    ended, live, new = (tmp_path / f"{SCRATCH_PREFIX}{name}" for name in ("ended", "live", "new"))
    other = tmp_path / "someone-elses"
    for folder in (ended, live, new, other):
        folder.mkdir()
    os.close(_hold_scratch(ended))  # its process is gone: the lock went with it
    held = _hold_scratch(live)
    try:
        # When a run cleans up, Then only the ended run's folder goes
        assert _remove_orphaned_scratch(tmp_path) == [ended]
        assert live.is_dir() and new.is_dir() and other.is_dir() and not ended.exists()
    finally:
        os.close(held)


def _property_run(store_name: str, examples: int) -> None:
    counter = iter(range(10**9))
    if SCRATCH:
        _remove_orphaned_scratch(Path(SCRATCH))
    prefix = f"{SCRATCH_PREFIX}{os.getpid()}-"
    with TemporaryDirectory(dir=SCRATCH, prefix=prefix) as tmp:
        held = _hold_scratch(Path(tmp)) if SCRATCH else None
        try:
            with STORE_FACTORIES[store_name](Path(tmp)) as store:
                store.put_run(RunRecord(run_id="run-p", name="p", status="RUNNING", manifest_source="s3://b/k"))

                @settings(
                    max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
                )
                @given(history=histories())
                def run(history: tuple[list[tuple[JobStatus, datetime, int]], list[int]]) -> None:
                    _check(store, f"gs-prop-{next(counter)}", history)

                run()
        finally:
            if held is not None:
                os.close(held)


# Sequences per store in the default suite. SQLite is cheap (10-20 ms a sequence); every moto DynamoDB call goes
# through botocore and moto's request parsing (about 6 ms each, ~15 calls a sequence), so it gets fewer. One store
# (one SQLite file, one moto table) serves every example of a test; each example uses its own job row.
SEQUENCES = {"sqlite": 1000, "dynamodb": 200}


@pytest.mark.slow(seconds=15)  # DynamoDB 14 s, SQLite 4.5 s in /dev/shm (2-core Xeon, idle)
@pytest.mark.parametrize("store_name", sorted(STORE_FACTORIES))
def test_any_delivery_order_ends_at_the_latest_state(store_name: str) -> None:
    """The issue's bar: 1,000 random delivery sequences (on SQLite; 200 more against moto DynamoDB)."""
    _property_run(store_name, SEQUENCES[store_name])
