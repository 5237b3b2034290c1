"""A full disk: wherever it strikes (the run folder, data preparation, a
job's files, its log), the user reads one line naming the disk's folder and the space left, nothing half-written is
left behind, and what was measured before is kept and analysed. /dev/full stands for a full disk: every write to it
fails with ENOSPC, as on a disk with no space left."""

from __future__ import annotations

import errno
import io
import sqlite3
import textwrap
from pathlib import Path

import pytest
from test_local import _fake_data
from typer.testing import CliRunner

from gpuscout import paths
from gpuscout.cli import app as cli
from gpuscout.domain.catalog import load_catalog
from gpuscout.errors import DISK_FULL, DiskFullError, free_space_text, is_disk_full
from gpuscout.local import runner as local
from gpuscout.local.job_process import JobFolders, JobProgress, _pump
from gpuscout.local.runner import run_local
from gpuscout.store.base import JobStatus, RunStatus
from gpuscout.store.sqlite import SqliteStore
from tests.stand_ins import use_stand_ins

QUICKSTART = paths.MANIFESTS_DIR / "quickstart.yaml"
FULL = Path("/dev/full")
BENCHMARK = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks" / "local-cpu-r0.json"


def _enospc(filename: str | None = None) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", filename)


@pytest.mark.parametrize(
    "err",
    [
        _enospc("/x"),
        OSError(errno.EDQUOT, "Disk quota exceeded"),
        Exception("No space left on device (os error 28)"),  # Rust's io::Error through the tokenizers library
        sqlite3.OperationalError("database or disk is full"),
    ],
    ids=["ENOSPC", "EDQUOT", "rust", "sqlite"],
)
def test_a_full_disk_is_recognised_however_it_is_said(err: Exception) -> None:
    assert is_disk_full(err)
    try:  # and through a chain of exceptions raised from it
        try:
            raise err
        except Exception as inner:
            raise RuntimeError("writing the report failed") from inner
    except RuntimeError as outer:
        assert is_disk_full(outer)


@pytest.mark.parametrize("err", [OSError(errno.ENOENT, "No such file or directory"), ValueError("full of hope")])
def test_other_errors_are_not_a_full_disk(err: Exception) -> None:
    assert not is_disk_full(err)


def test_the_free_space_is_said_for_the_nearest_folder_that_exists(tmp_path: Path) -> None:
    assert free_space_text(tmp_path / "not" / "yet") == free_space_text(tmp_path)
    assert free_space_text(tmp_path).endswith(" free")
    message = str(DiskFullError(tmp_path / "runs", "writing the run folder", hint="choose another --runs-dir"))
    assert message.startswith(f"{DISK_FULL} {tmp_path / 'runs'} (")
    assert message.endswith("free) while writing the run folder; choose another --runs-dir")


def test_a_job_log_on_a_full_disk_is_given_up_and_its_pipe_still_read() -> None:
    # Given a job's stdout whose log cannot be written
    progress = JobProgress()
    lines = io.StringIO("".join(f"gpuscout_metric step={n} loss=1.5 tokens_per_s=100\n" for n in range(1, 2001)))
    # When the pump copies it (before: the thread died with a traceback and the job blocked on a full pipe)
    _pump(lines, FULL, progress)
    # Then every line was read (the progress knows the last step) and why the log is missing is kept
    assert progress.step == 2000 and progress.lines == 2000
    assert progress.log_lost is not None and "No space left on device" in progress.log_lost


def _stand_in_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A train.py whose second variant's job writes to a full disk; the others write a complete benchmark.json."""
    train = f"BENCHMARK = {str(BENCHMARK)!r}\n" + textwrap.dedent(
        """
        import json, os, shutil
        if "t0v1" in json.loads(os.environ["SM_HPS"])["job_name"]:
            with open("/dev/full", "w") as checkpoint:
                checkpoint.write("x" * 100_000)
        shutil.copyfile(BENCHMARK, os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], "benchmark.json"))
        """
    )
    use_stand_ins(monkeypatch, tmp_path / "stand-ins", train=train)
    _fake_data(tmp_path, monkeypatch)


def test_a_job_that_fills_the_disk_fails_saying_so_and_names_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _stand_in_training(tmp_path, monkeypatch)
    store = SqliteStore(tmp_path / "g.db")
    run_dir = tmp_path / "runs"
    with pytest.raises(DiskFullError) as raised:
        run_local(QUICKSTART, store=store, runs_dir=run_dir, canary=False, catalog=load_catalog())
    # Then the run stopped after the job that filled the disk: the first job's measurement is kept and analysed,
    # the second failed with the disk's folder in its reason, the third did not start and says why
    [run] = store.list_runs()
    assert run.status is RunStatus.STOPPED
    assert run.error is not None and DISK_FULL in run.error
    jobs = {j.variant_name: j for j in store.list_jobs(run.run_id)}
    assert jobs["b1-a4"].status is JobStatus.COMPLETED
    second = jobs["b4-a1"]
    assert second.status is JobStatus.FAILED and second.failure_reason is not None
    assert second.failure_reason.startswith(f"{DISK_FULL} {run_dir / run.run_id / 'jobs' / second.job_name}")
    assert "No space left on device" in second.failure_reason  # the job's own words follow
    assert jobs["b4-a1-nopack"].status is JobStatus.STOPPED
    assert (jobs["b4-a1-nopack"].failure_reason or "").startswith(f"not started: run interrupted ({DISK_FULL} ")
    assert str(raised.value).startswith(f"{DISK_FULL} {run_dir / run.run_id / 'jobs' / second.job_name}")


def test_a_run_folder_that_cannot_be_written_is_not_left_half_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a disk that fills up as plan.json is written (before: an empty plan.json and "unexpected error")
    real_write_text = Path.write_text

    def write_text(self: Path, data: str, *args: object, **kwargs: object) -> int:
        if self.name.startswith(".plan.json"):
            real_write_text(self, data[:10])  # what a full disk lets through
            raise _enospc(str(self))
        return real_write_text(self, data, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", write_text)
    store = SqliteStore(tmp_path / "g.db")
    # When a run starts there
    with pytest.raises(DiskFullError) as raised:
        run_local(QUICKSTART, store=store, runs_dir=tmp_path / "runs", canary=False)
    # Then the error names the run folder, and the folder it made is gone: no run, nothing half-written
    assert str(raised.value).startswith(f"{DISK_FULL} {tmp_path / 'runs'}/quickstart-")
    assert "while writing the run folder; free space there or choose another --runs-dir" in str(raised.value)
    assert [p.name for p in (tmp_path / "runs").iterdir() if not p.name.startswith(".")] == []
    assert store.list_runs() == []


def test_an_existing_run_folder_keeps_its_files_when_a_rewrite_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a resumed run's folder with its plan (the rewrite goes aside first, then is renamed over it)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "plan.json").write_text("[]\n")
    monkeypatch.setattr(local.shutil, "copyfile", lambda *_a, **_k: (_ for _ in ()).throw(_enospc()))
    with pytest.raises(DiskFullError):
        local._write_run_folder(run_dir, QUICKSTART, [])
    assert sorted(p.name for p in run_dir.iterdir()) == ["plan.json"]
    assert (run_dir / "plan.json").read_text() == "[]\n"


def test_data_preparation_on_a_full_disk_names_the_cache_and_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given data preparation that stops with its disk-full line (training/gpuscout_data/prepare.py's main)
    use_stand_ins(
        monkeypatch,
        tmp_path / "stand-ins",
        prepare="import sys\nprint('data_preparation: error: no space left on the disk holding /c/x.npy "
        "([Errno 28] No space left on device)', file=sys.stderr)\nsys.exit(2)\n",
    )
    store = SqliteStore(tmp_path / "g.db")
    with pytest.raises(DiskFullError) as raised:
        run_local(QUICKSTART, store=store, runs_dir=tmp_path / "runs", canary=False)
    cache = tmp_path / "runs" / ".cache" / "data"
    message = str(raised.value)
    assert message.startswith(f"{DISK_FULL} {cache} (") and "while preparing the data" in message
    assert "choose another --runs-dir (log: " in message and message.endswith(".prepare.log)")
    assert not list(cache.glob(".*.tmp")), "the staging folder is removed"
    # and every job says it did not start, and why: no row stays PLANNED
    [run] = store.list_runs()
    assert run.status is RunStatus.STOPPED
    assert {j.status for j in store.list_jobs(run.run_id)} == {JobStatus.STOPPED}
    reasons = {j.failure_reason for j in store.list_jobs(run.run_id)}
    assert reasons == {f"not started: run interrupted ({DISK_FULL} {cache})"}


def test_a_job_folder_that_cannot_be_made_stops_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_data(tmp_path, monkeypatch)
    started: list[str] = []

    def create(root: Path, spec: object, data_dir: object) -> JobFolders:
        started.append(root.name)
        raise _enospc(str(root / "opt" / "ml" / "input" / "config" / "hyperparameters.json"))

    monkeypatch.setattr(JobFolders, "create", staticmethod(create))
    store = SqliteStore(tmp_path / "g.db")
    with pytest.raises(DiskFullError) as raised:
        run_local(QUICKSTART, store=store, runs_dir=tmp_path / "runs", canary=False)
    assert len(started) == 1, "the next jobs are not tried on the full disk"
    assert f"while starting job {started[0]}" in str(raised.value)
    [run] = store.list_runs()
    statuses = {j.job_name: (j.status, j.failure_reason) for j in store.list_jobs(run.run_id)}
    assert statuses[started[0]][0] is JobStatus.STOPPED
    assert all(status is JobStatus.STOPPED for status, _ in statuses.values())


def test_the_cli_says_a_full_disk_in_one_line_wherever_it_struck(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a command that meets a full disk somewhere gpuscout did not expect it
    def full(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("could not save") from _enospc("/data/runs/x/report/report.html")

    monkeypatch.setattr(cli, "open_store", full)
    result = CliRunner(env={"COLUMNS": "200"}).invoke(cli.app, ["runs"])
    # Then it is one readable error naming the file, not "unexpected error" and a traceback
    assert result.exit_code == 1
    assert "unexpected error" not in result.output and "Traceback" not in result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1
    assert lines[0].startswith("error: no space left on the disk holding /data/runs/x/report/report.html")
