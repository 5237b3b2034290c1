"""SQLite specifics beyond the shared contract: file location, schema versioning, WAL, persistence, errors."""

from __future__ import annotations

import sqlite3
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpuscout.errors import StoreError
from gpuscout.store.base import JobRecord, JobStatus, RunRecord, RunStatus
from gpuscout.store.sqlite import SCHEMA_VERSION, SqliteStore, default_db_path
from tests.job_specs import job_spec

T0 = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)


def _run(run_id: str = "run-a") -> RunRecord:
    return RunRecord(run_id=run_id, name="demo", status=RunStatus.PLANNED, manifest_source="m.yaml", created_at=T0)


def _job(name: str = "gs-a") -> JobRecord:
    return JobRecord(
        run_id="run-a",
        job_name=name,
        status=JobStatus.PLANNED,
        instance_type="local",
        variant_name="v",
        spec=job_spec(name, "run-a"),
    )


def test_default_path_follows_gpuscout_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUSCOUT_HOME", str(tmp_path / "home"))
    assert default_db_path() == tmp_path / "home" / "gpuscout.db"
    store = SqliteStore()
    assert store.path == tmp_path / "home" / "gpuscout.db"
    assert store.path.is_file()


def test_default_path_without_env_is_in_the_user_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUSCOUT_HOME", raising=False)
    assert default_db_path() == Path.home() / ".gpuscout" / "gpuscout.db"


def test_data_survives_reopening_and_uses_wal(tmp_path: Path) -> None:
    db = tmp_path / "nested" / "g.db"
    SqliteStore(db).put_run(_run())
    again = SqliteStore(db)
    assert again.get_run("run-a").name == "demo"
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "g.db"
    SqliteStore(db)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    with pytest.raises(StoreError, match="newer than this gpuscout supports"):
        SqliteStore(db)


def test_an_unreadable_file_is_a_store_error(tmp_path: Path) -> None:
    db = tmp_path / "g.db"
    db.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="cannot open the result database") as info:
        SqliteStore(db)
    assert isinstance(info.value.__cause__, sqlite3.Error)


def test_update_run_rejects_unknown_fields_and_bad_values(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "g.db")
    store.put_run(_run())
    with pytest.raises(StoreError, match="colour"):
        store.update_run("run-a", colour="red")
    with pytest.raises(StoreError):
        store.update_run("run-a", status="EXPLODED")
    assert store.get_run("run-a").status is RunStatus.PLANNED


def test_events_may_not_set_their_own_bookkeeping_fields(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "g.db")
    store.put_job(_job())
    with pytest.raises(StoreError, match="status_rank"):
        store.apply_job_event("run-a", "gs-a", JobStatus.TRAINING, T0, status_rank=99)
    with pytest.raises(StoreError, match="nonsense"):
        store.apply_job_event("run-a", "gs-a", JobStatus.TRAINING, T0, nonsense=1)


def test_naive_event_times_are_utc(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "g.db")
    store.put_job(_job())
    assert store.apply_job_event("run-a", "gs-a", JobStatus.TRAINING, T0)
    naive_earlier = (T0 - timedelta(seconds=1)).replace(tzinfo=None)
    assert not store.apply_job_event("run-a", "gs-a", JobStatus.STOPPING, naive_earlier)


def test_concurrent_events_apply_exactly_once(tmp_path: Path) -> None:
    db = tmp_path / "g.db"
    SqliteStore(db).put_job(_job())
    outcomes: list[bool] = []
    lock = threading.Lock()

    def deliver() -> None:
        changed = SqliteStore(db).apply_job_event("run-a", "gs-a", JobStatus.COMPLETED, T0, billable_seconds=7)
        with lock:
            outcomes.append(changed)

    threads = [threading.Thread(target=deliver) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == [False] * 5 + [True]


def test_a_damaged_database_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    # Given a database with runs whose pages were overwritten (a crash mid-copy, a bad disk)
    path = tmp_path / "gpuscout.db"
    store = SqliteStore(path)
    for i in range(200):
        store.put_run(_run(f"run-{i:03d}").model_copy(update={"error": "x" * 400}))
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(path.read_bytes())
    assert len(data) > 40_000
    data[8192:24576] = bytes(range(256)) * 64  # three pages of the table's b-tree
    path.write_bytes(bytes(data))
    before = path.read_bytes()
    # When it is opened, Then a clear refusal names the file and what to do, and the file is left as it was
    with pytest.raises(StoreError, match=r"is damaged .*nothing was written to it.*Move it aside") as err:
        SqliteStore(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)  # one line for the CLI
    assert path.read_bytes() == before


def test_a_database_on_read_only_media_is_readable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuscout.store import sqlite as sqlite_module

    path = tmp_path / "gpuscout.db"
    SqliteStore(path).put_run(_run("kept"))
    # Given the file and its folder cannot be written (root can write anything here, so the check is what we fake)
    monkeypatch.setattr(sqlite_module, "_writable", lambda _path: False)
    for leftover in tmp_path.glob("gpuscout.db-*"):  # as a copy on read-only media would be: no WAL files beside it
        leftover.unlink()
    # When a read-only command opens it, Then it reads (a real read-only connection) and refuses writes plainly
    store = SqliteStore(path, create=False)
    assert store.read_only and store.get_run("kept").run_id == "kept"
    assert [r.run_id for r in store.list_runs()] == ["kept"]
    with pytest.raises(StoreError, match=r"readonly|read-only"):
        store.put_run(_run("new"))
    assert store._read_only_uri().endswith("?mode=ro")  # a reader that still sees a writer's WAL and locks


def test_on_media_where_even_a_read_only_open_fails_the_file_is_read_immutable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuscout.store import sqlite as sqlite_module

    path = tmp_path / "gpuscout.db"
    SqliteStore(path).put_run(_run("kept"))
    monkeypatch.setattr(sqlite_module, "_writable", lambda _path: False)
    real_connect = sqlite3.connect

    def no_shm_beside_it(target: str, *args: object, **kwargs: object) -> sqlite3.Connection:
        if str(target).endswith("?mode=ro"):  # what a WAL database without its -shm on read-only media does
            raise sqlite3.OperationalError("unable to open database file")
        return real_connect(target, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sqlite_module.sqlite3, "connect", no_shm_beside_it)
    store = SqliteStore(path, create=False)
    assert store._read_only_uri().endswith("&immutable=1") and store.get_run("kept").run_id == "kept"


def test_a_database_deleted_while_in_use_says_so(tmp_path: Path) -> None:
    from gpuscout.errors import StoreError

    db = tmp_path / "g.db"
    store = SqliteStore(db)
    assert store.list_runs() == []
    # Given the file deleted while the store is in use (what `rm ~/.gpuscout/gpuscout.db` mid-run does)
    for path in tmp_path.glob("g.db*"):
        path.unlink()
    # Then the next read says what happened, not "no such table: runs"
    with pytest.raises(StoreError, match=r"its tables are gone .*deleted or replaced while gpuscout used it"):
        store.list_runs()
