"""Noisy neighbours: the other load during a job is recorded and flags the verdict; one local run per runs folder."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuscout.local.contention import ContentionMonitor, competing_threshold_cores, summarize
from gpuscout.local.lock import RunsFolderBusyError, RunsFolderLock


def test_the_summary_flags_competition_for_cpu_and_gpu() -> None:
    quiet = summarize([0.1, 0.2, 0.0], [0.4, 0.5], [], cpu_count=2)
    assert quiet.competing is False and quiet.note is None and quiet.other_cpu_cores_mean == 0.1
    busy = summarize([1.2, 1.4], [2.5, 2.7], [], cpu_count=2)
    assert busy.competing is True and busy.load_average_max == 2.7
    assert busy.note == "measured under competition: other processes used 1.3 of 2 CPU cores on average"
    gpu = summarize([0.0], [0.1], [4242], cpu_count=16)
    assert gpu.competing is True and "(pids 4242)" in (gpu.note or "")
    assert competing_threshold_cores(2) == 0.5 and competing_threshold_cores(16) == pytest.approx(3.2)


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.timeout(60)
def test_a_busy_neighbour_is_seen_and_our_own_job_is_not() -> None:
    # Given our "job" sleeps while a neighbour process burns a whole core
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    neighbour = multiprocessing.get_context("spawn").Process(target=_burn, args=(6.0,))
    neighbour.start()
    try:
        with ContentionMonitor(job.pid, interval_s=0.5) as monitor:
            time.sleep(4.0)
    finally:
        neighbour.terminate()
        job.kill()
        job.wait()
    summary = monitor.summary()
    # Then about one core of other load is recorded (the runner's own test process is ours, the neighbour is not)
    assert summary.samples >= 5
    assert (summary.other_cpu_cores_mean or 0.0) >= 0.6, summary


@pytest.mark.parametrize(("job_percent", "other", "competing"), [(120.0, 0.0, False), (50.0, 0.7, True)])
def test_our_own_job_is_not_counted_as_competition(
    monkeypatch: pytest.MonkeyPatch, job_percent: float, other: float, competing: bool
) -> None:
    # Deterministic accounting (a real busy job would be disturbed by the other test worker on 2 cores): the system
    # is 60 % busy on 2 cores = 1.2 cores; whatever of it our job tree used is ours, the rest is other processes.
    import psutil

    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: 60.0)
        monkeypatch.setattr(
            psutil.Process, "cpu_percent", lambda self, interval=None: job_percent if self.pid == job.pid else 0.0
        )
        monitor = ContentionMonitor(job.pid)
        monitor.cpu_count = 2
        monitor.sample()
        monitor.sample()
    finally:
        job.kill()
        job.wait()
    summary = monitor.summary()
    assert summary.other_cpu_cores_mean == pytest.approx(other) and summary.competing is competing


def test_one_run_per_runs_folder_names_the_holder(tmp_path: Path) -> None:
    # Given a runs folder held by another process (the lock is per open file, as between two processes)
    holder = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, time; from pathlib import Path; from gpuscout.local.lock import RunsFolderLock\n"
            f"with RunsFolderLock(Path({str(tmp_path)!r}), run_id='run-a', host='box'):\n"
            "    print('held', flush=True); time.sleep(30)"
        )],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        # When a second run takes the same folder, Then it is refused with the holder named
        with pytest.raises(RunsFolderBusyError) as refused:
            RunsFolderLock(tmp_path, run_id="run-b", host="box").__enter__()
        message = str(refused.value)
        assert "run run-a" in message and f"pid {holder.pid} on box" in message and "--allow-concurrent" in message
        assert "this lock is per runs folder" in message  # not a promise that the machine has one benchmark at a time
        # and a run with another runs folder is not refused (the contention monitor flags what it disturbs)
        other = tmp_path / "other"
        other.mkdir()
        with RunsFolderLock(other, run_id="run-d", host="box"):
            pass
    finally:
        holder.kill()
        holder.wait()
    # And once the holder is gone (even killed), the folder is free again
    with RunsFolderLock(tmp_path, run_id="run-c", host="box"):
        pass


def test_a_busy_runs_folder_refuses_before_the_plan_is_shown(tmp_path: Path) -> None:
    from gpuscout.local.observer import SilentObserver
    from gpuscout.local.runner import run_local
    from gpuscout.paths import MANIFESTS_DIR
    from gpuscout.store.sqlite import SqliteStore

    shown: list[str] = []

    class Observer(SilentObserver):
        def planned(self, the_plan):  # type: ignore[no-untyped-def]
            shown.append(the_plan.run_id)

    runs = tmp_path / "runs"
    store = SqliteStore(tmp_path / "g.db")
    # Given the runs folder held (flock: a second open file, even in this process, is another holder)
    with RunsFolderLock(runs, run_id="run-a", host="box"), pytest.raises(RunsFolderBusyError):
        run_local(MANIFESTS_DIR / "quickstart.yaml", store=store, runs_dir=runs, observer=Observer())
    # Then no plan (with a run id that would never exist) was printed, and no run was recorded
    assert shown == [] and store.list_runs() == []
