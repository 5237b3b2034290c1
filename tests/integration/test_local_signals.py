"""A local run always ends in a final state, and never leaves an orphan: real signals to a real `gpuscout local`.

The jobs are stand-ins (tests/stand_ins.py, first on PYTHONPATH): data preparation writes an empty dataset at once and
train.py records its pid and sleeps, so each test takes seconds while exercising the real process handling.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from gpuscout import paths
from gpuscout.cli.local_view import RichRunObserver
from gpuscout.domain.catalog import load_catalog
from gpuscout.domain.jobspec import JobSpec
from gpuscout.domain.run_analysis import RunAnalysis
from gpuscout.local import closing, job_process
from gpuscout.local import runner as local
from gpuscout.local.data_cache import remove_stale_staging
from gpuscout.local.job_process import JobFolders
from gpuscout.local.process_control import QuitNow, SignalGuard, process_alive
from gpuscout.local.runner import run_local
from gpuscout.store.base import JobStatus, RunStatus
from gpuscout.store.sqlite import SqliteStore
from gpuscout.workflow.ports import JobOutcome
from tests.prepared_data import DATASET_SUMMARY
from tests.run_analyses import run_analysis
from tests.stand_ins import stand_in_packages

QUICKSTART = paths.MANIFESTS_DIR / "quickstart.yaml"
REPO = Path(__file__).resolve().parents[2]

DATA_PREPARATION = """
import os, sys
from pathlib import Path
out = Path(sys.argv[sys.argv.index("--output") + 1])
out.mkdir(parents=True)
(out / "dataset.json").write_text(os.environ["DATASET_SUMMARY"])
"""
TRAIN = """
import os, sys, time
from pathlib import Path
Path(os.environ["PIDS_DIR"], f"{os.getpid()}.pid").write_text(str(os.getpid()))
print("gpuscout_metric step=1 loss=9.0 tokens_per_s=100.0", flush=True)
time.sleep(600)
"""


@pytest.fixture
def stand_ins(tmp_path: Path) -> dict[str, str]:
    packages = stand_in_packages(tmp_path / "stand-ins", train=TRAIN, prepare=DATA_PREPARATION)
    pids = tmp_path / "pids"
    pids.mkdir()
    return {
        **os.environ,
        "PIDS_DIR": str(pids),
        "PYTHONPATH": os.pathsep.join([str(packages), str(REPO)]),
        "DATASET_SUMMARY": json.dumps(DATASET_SUMMARY),
    }


def _start(tmp_path: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "gpuscout", "local", str(QUICKSTART), "--runs-dir", str(tmp_path / "runs")]
    command += ["--db", str(tmp_path / "g.db"), "--no-canary"]  # the signal lands on a timed job
    return subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_child(tmp_path: Path, proc: subprocess.Popen[str], timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list((tmp_path / "pids").glob("*.pid"))
        if found:
            return int(found[0].read_text())
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)
    raise AssertionError("train.py never started")


def _gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process_alive(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_stop_the_run_like_ctrl_c(tmp_path: Path, stand_ins: dict[str, str], signum: int) -> None:
    # Given a `gpuscout local` with train.py running
    proc = _start(tmp_path, stand_ins)
    child = _wait_for_child(tmp_path, proc)
    # When it gets SIGTERM (or SIGHUP: an ssh drop)
    proc.send_signal(signum)
    output, _ = proc.communicate(timeout=60)
    # Then the run ends STOPPED with every job final, the child is gone, and the exit code says "interrupted"
    assert proc.returncode == 130, output
    name = signal.Signals(signum).name
    store = SqliteStore(tmp_path / "g.db")
    [run] = store.list_runs()
    assert run.status is RunStatus.STOPPED and run.error == f"interrupted ({name})"
    jobs = store.list_jobs(run.run_id)
    assert {j.status for j in jobs} == {JobStatus.STOPPED}
    assert sorted(j.failure_reason for j in jobs)[0] == f"interrupted ({name})"
    assert _gone(child), "train.py survived its parent's SIGTERM"


@pytest.mark.timeout(120)
def test_a_killed_runner_takes_its_child_along_and_the_run_can_be_closed(
    tmp_path: Path, stand_ins: dict[str, str]
) -> None:
    # Given a `gpuscout local` with train.py running, When it is SIGKILLed (nothing of it can clean up)
    proc = _start(tmp_path, stand_ins)
    child = _wait_for_child(tmp_path, proc)
    proc.kill()
    proc.communicate(timeout=30)
    # Then its child dies with it (PR_SET_PDEATHSIG), not holding a GPU for ever
    assert _gone(child), "train.py outlived a SIGKILLed gpuscout local"
    # and `gpuscout runs` shows the run as ABANDONED, naming the command that closes it
    db = str(tmp_path / "g.db")
    cli = [sys.executable, "-m", "gpuscout"]
    env = {**stand_ins, "COLUMNS": "300"}
    listing = subprocess.run([*cli, "runs", "--db", db], env=env, capture_output=True, text=True, check=True).stdout
    store = SqliteStore(tmp_path / "g.db")
    [run] = store.list_runs()
    assert run.status is RunStatus.RUNNING and "ABANDONED" in listing and f"gpuscout analyze {run.run_id}" in listing
    # When `gpuscout analyze RUN_ID` runs, Then the run is closed: STOPPED, every job final, with why
    subprocess.run([*cli, "analyze", run.run_id, "--db", db], env=env, capture_output=True, text=True, check=True)
    run = store.get_run(run.run_id)
    assert run.status is RunStatus.STOPPED and run.error is not None and "abandoned" in run.error
    assert {j.status for j in store.list_jobs(run.run_id)} == {JobStatus.STOPPED}
    listing = subprocess.run([*cli, "runs", "--db", db], env=env, capture_output=True, text=True, check=True).stdout
    assert "ABANDONED" not in listing


def test_a_second_signal_cannot_cut_the_final_analysis_short(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a run whose first job completed and whose second is interrupted by Ctrl-C
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset.json").write_text(json.dumps(DATASET_SUMMARY))
    monkeypatch.setattr(local, "prepare_data", lambda *_args, **_kw: data)
    calls: list[str] = []

    def fake_run_job(spec: JobSpec, folders: JobFolders, **_: object) -> JobOutcome:
        calls.append(spec.job_name)
        if len(calls) == 1:
            return JobOutcome(JobStatus.COMPLETED, None, None, 1.0)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        raise AssertionError("the signal did not interrupt the job")

    analysed: list[str] = []

    def analysis_hit_by_a_second_signal(run, *_args: object, **_kw: object) -> RunAnalysis:
        os.kill(os.getpid(), signal.SIGTERM)  # When a second signal arrives during the final analysis
        time.sleep(0.2)
        analysed.append(run.run_id)
        return run_analysis(run.run_id)

    monkeypatch.setattr(job_process, "run_job", fake_run_job)
    monkeypatch.setattr(closing, "analyze_and_report", analysis_hit_by_a_second_signal)
    store = SqliteStore(tmp_path / "g.db")
    observer = RichRunObserver(Console(file=io.StringIO()))
    run = run_local(
        QUICKSTART, store=store, runs_dir=tmp_path / "runs", observer=observer, catalog=load_catalog(), canary=False
    )
    # Then the analysis finished and the run is final
    assert analysed == [run.run_id]
    assert run.status is RunStatus.STOPPED and run.error == "interrupted (Ctrl-C)"


def _run_with_signals_during_the_analysis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, presses: int
) -> tuple[SqliteStore, str, list[str]]:
    """A run whose jobs all complete, then ``presses`` Ctrl-Cs during its final analysis; (store, output, analysed)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset.json").write_text(json.dumps(DATASET_SUMMARY))
    monkeypatch.setattr(local, "prepare_data", lambda *_args, **_kw: data)
    monkeypatch.setattr(job_process, "run_job", lambda *_a, **_k: JobOutcome(JobStatus.COMPLETED, None, None, 1.0))
    analysed: list[str] = []

    def slow_analysis(run, *_args: object, **_kw: object) -> RunAnalysis:
        for _ in range(presses):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
        analysed.append(run.run_id)
        return run_analysis(run.run_id)

    monkeypatch.setattr(closing, "analyze_and_report", slow_analysis)
    store = SqliteStore(tmp_path / "g.db")
    out = io.StringIO()
    observer = RichRunObserver(Console(file=out, width=200))
    try:
        run_local(QUICKSTART, store=store, runs_dir=tmp_path / "runs", observer=observer, canary=False)
    except KeyboardInterrupt:
        assert presses > 1
    return store, out.getvalue(), analysed


def test_ctrl_c_during_the_final_analysis_is_answered_at_once_and_the_analysis_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a run whose jobs all completed, When Ctrl-C is pressed once during its final analysis (before: ignored
    # without a word)
    store, out, analysed = _run_with_signals_during_the_analysis(tmp_path, monkeypatch, presses=1)
    [run] = store.list_runs()
    # Then the user is told at once what goes on first and how to quit, and the analysis finishes
    assert (
        "Ctrl-C: finishing the run's analysis and report of what was measured first; press Ctrl-C again to quit " in out
    )
    assert f"(then `gpuscout analyze {run.run_id}` finishes them)" in out
    assert analysed == [run.run_id]
    assert run.status is RunStatus.SUCCEEDED


def test_ctrl_c_twice_during_the_final_analysis_quits_and_says_how_to_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, out, analysed = _run_with_signals_during_the_analysis(tmp_path, monkeypatch, presses=2)
    [run] = store.list_runs()
    # Then it quits (KeyboardInterrupt: the CLI's exit 130) before the analysis ended, the run is final and says
    # which command makes its analysis
    assert analysed == []
    assert run.status is RunStatus.STOPPED
    assert run.error == f"quit before its analysis (Ctrl-C twice); `gpuscout analyze {run.run_id}` analyses what " \
                        "was measured and writes the report"  # fmt: skip
    assert f"quit: run {run.run_id} STOPPED before its analysis" in out
    assert {j.status for j in store.list_jobs(run.run_id)} == {JobStatus.COMPLETED}  # what was measured is kept
    # and once `gpuscout analyze` made the analysis, the run no longer says it has none
    from gpuscout.local.closing import close_abandoned_run

    monkeypatch.undo()  # the analysis as it really runs
    closed = close_abandoned_run(run, store)
    assert (
        closed.status is RunStatus.STOPPED
        and closed.error == "quit (Ctrl-C twice); analysed afterwards (`gpuscout analyze`)"
    )
    assert store.get_result(run.run_id) is not None


def test_a_deferred_signal_is_told_once_and_only_a_second_ctrl_c_forces() -> None:
    told: list[str] = []
    with SignalGuard(on_deferred=told.append) as guard:
        guard.defer()
        os.kill(os.getpid(), signal.SIGHUP)  # after an ssh drop there is no terminal to tell
        time.sleep(0.1)
        assert told == []
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's signals never force
        time.sleep(0.1)
        assert told == ["SIGTERM"]
        with pytest.raises(QuitNow):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        os.kill(os.getpid(), signal.SIGINT)  # once quitting, further presses are recorded only
        time.sleep(0.1)
    assert guard.received == ["SIGHUP", "SIGTERM", "SIGTERM", "Ctrl-C", "Ctrl-C"]


def test_signal_guard_raises_then_records() -> None:
    with SignalGuard() as guard:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        guard.defer()
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
    assert guard.received == ["SIGTERM", "SIGHUP", "Ctrl-C"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_stale_staging_folders_of_dead_processes_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    stale = tmp_path / f".abc123.{int(dead.stdout)}.tmp"
    live = tmp_path / f".abc123.{os.getpid()}.tmp"
    for folder in (stale, live):
        folder.mkdir()
        (folder / "shard-0.bin").write_bytes(b"x")
    assert remove_stale_staging(tmp_path) == [stale]
    assert not stale.exists() and live.exists()


def test_runs_record_host_and_pid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dataset.json").write_text(json.dumps(DATASET_SUMMARY))
    monkeypatch.setattr(local, "prepare_data", lambda *_args, **_kw: tmp_path)
    monkeypatch.setattr(job_process, "run_job", lambda *_a, **_k: JobOutcome(JobStatus.FAILED, None, "boom", 0.1))
    store = SqliteStore(tmp_path / "g.db")
    run = run_local(QUICKSTART, store=store, runs_dir=tmp_path / "runs", catalog=load_catalog())
    assert run.pid == os.getpid() and run.host
    assert json.loads(store.get_run(run.run_id).model_dump_json())["pid"] == os.getpid()
