"""SQLite result store for local runs (``gpuscout local``): one file, stdlib sqlite3, WAL journal.

One table per record type holds the whole record as JSON plus the key columns it is queried on. The schema is
versioned (table ``schema_version``); a database written by a newer gpuscout is refused rather than misread.
Every write is one transaction; ``apply_job_event`` reads and writes under ``BEGIN IMMEDIATE`` so two writers
cannot interleave between the condition check and the update.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Collection, Iterator, Sequence
from contextlib import closing, contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from gpuscout.errors import RunExistsError, RunNotFoundError, StoreError
from gpuscout.store.base import (
    JOB_STATUS_RANK,
    TERMINAL_JOB_STATUSES,
    JobRecord,
    JobStatus,
    ResultRecord,
    RunRecord,
    RunStatus,
    as_utc,
    outdated_result,
    utcnow,
)

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    created_at TEXT NOT NULL,
    status TEXT NOT NULL,
    payload TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_created_at ON runs (created_at);
CREATE TABLE IF NOT EXISTS jobs (
    run_id TEXT NOT NULL,
    job_name TEXT NOT NULL,
    status TEXT NOT NULL,
    payload TEXT NOT NULL,
    PRIMARY KEY (run_id, job_name)
);
CREATE TABLE IF NOT EXISTS results (
    run_id TEXT PRIMARY KEY,
    payload TEXT NOT NULL
);
"""

# Fields an event may not set through **fields: they are the row's identity or the event's own outcome.
_EVENT_RESERVED_FIELDS = frozenset({"run_id", "job_name", "status", "last_event_time", "status_rank", "updated_at"})


def default_db_path() -> Path:
    """``$GPUSCOUT_HOME/gpuscout.db``, by default ``~/.gpuscout/gpuscout.db``."""
    home = os.environ.get("GPUSCOUT_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".gpuscout"
    return base / "gpuscout.db"


def _writable(path: Path) -> bool:
    """Whether SQLite could write ``path`` and its journal beside it (the file and its folder)."""
    return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)


def _sort_key(value: datetime) -> str:
    """A fixed-width UTC timestamp whose string order is its time order."""
    return as_utc(value).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


M = TypeVar("M", RunRecord, JobRecord)


def _decoded(model: type[M], payload: str) -> M:
    """A stored row as its record; a row this version cannot read (another version wrote it) is a StoreError that
    names the row, not a validation traceback."""
    try:
        return model.model_validate_json(payload)
    except ValidationError as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise StoreError(
            f"a stored {model.__name__} row is not in this version's format ({first}); read it with the gpuscout "
            "version that wrote it"
        ) from err


class SqliteStore:
    """``ResultStore`` backed by one SQLite file (created with its folder on first use)."""

    def __init__(self, path: Path | str | None = None, *, create: bool = True) -> None:
        """Open (and with ``create``, create) the database; ``create=False`` is for read-only commands, which must
        not leave an empty database (or its folder) behind: a missing file is a StoreError naming it."""
        self.path = Path(path).expanduser() if path is not None else default_db_path()
        if not create and not self.path.is_file():
            raise StoreError(
                f"no result database at {self.path}"
                + (" (the default; pass --db or set GPUSCOUT_DB for another)" if path is None else "")
                + "; `gpuscout local` creates it with the first run"
            )
        existed = self.path.is_file()
        # a database on read-only media (a mounted backup, a shared results folder) is still readable: read-only
        # commands open it read-only instead of failing on the journal set-up
        self.read_only = not create and existed and not _writable(self.path)
        try:
            if not self.read_only:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._connect() as conn:
                if existed:
                    self._check_integrity(conn)
                if not self.read_only:
                    conn.execute("PRAGMA journal_mode=WAL")
                    conn.executescript(_SCHEMA)
                self._check_schema_version(conn)
        except (OSError, sqlite3.Error) as err:
            raise StoreError(f"cannot open the result database {self.path}: {err}") from err

    def _read_only_uri(self) -> str:
        """mode=ro, which still sees a writer's WAL and locks; immutable=1 only where that cannot open (no -shm
        beside a WAL database on read-only media), since an immutable reader ignores the WAL and any change."""
        if getattr(self, "_ro_uri", None) is None:
            base = f"{self.path.resolve().as_uri()}?mode=ro"
            try:
                with closing(sqlite3.connect(base, uri=True, timeout=30.0)) as probe:
                    probe.execute("SELECT count(*) FROM sqlite_master").fetchone()
                self._ro_uri = base
            except sqlite3.OperationalError:
                self._ro_uri = f"{base}&immutable=1"
        return str(self._ro_uri)

    def _check_integrity(self, conn: sqlite3.Connection) -> None:
        """A damaged file is refused before anything is written into it (PRAGMA quick_check)."""
        rows = [str(row[0]) for row in conn.execute("PRAGMA quick_check(5)").fetchall()]
        if rows != ["ok"]:
            problems = [line.strip() for row in rows for line in row.splitlines() if line.strip("* \t")]
            raise StoreError(
                f"the result database {self.path} is damaged ({'; '.join(problems)}); nothing was written to it. "
                f"Move it aside (its runs' folders stay readable) and run again, or pass --db for another file"
            )

    def _check_schema_version(self, conn: sqlite3.Connection) -> None:
        with conn:
            row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
            found = row[0] if row else None
            if found is None and self.read_only:
                raise StoreError(f"{self.path} is read-only and holds no gpuscout schema")
            if found is None:
                conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
            elif found > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path} has schema version {found}, newer than this gpuscout supports "
                    f"({SCHEMA_VERSION}); upgrade gpuscout or use another --db"
                )

    def __repr__(self) -> str:
        return f"SqliteStore({str(self.path)!r})"

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        """A connection whose ``with`` block is one transaction (commit on success, rollback on error)."""
        target, uri = (self._read_only_uri(), True) if self.read_only else (str(self.path), False)
        with closing(sqlite3.connect(target, timeout=30.0, isolation_level="DEFERRED", uri=uri)) as conn:
            conn.execute("PRAGMA foreign_keys=ON")
            yield conn

    @contextmanager
    def _transaction(self, *, immediate: bool = False) -> Iterator[sqlite3.Connection]:
        try:
            with self._connect() as conn:
                if immediate:
                    conn.execute("BEGIN IMMEDIATE")
                with conn:
                    yield conn
        except sqlite3.Error as err:
            if "no such table" in str(err):  # the file was deleted or replaced after it was opened
                raise StoreError(
                    f"result database {self.path}: its tables are gone ({err}); was the file deleted or replaced "
                    "while gpuscout used it? A running run's files in its runs folder are kept; `gpuscout runs` "
                    "lists what this database holds"
                ) from err
            raise StoreError(f"result database {self.path}: {err}") from err

    # Runs

    def put_run(self, run: RunRecord) -> None:
        with self._transaction() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO runs (run_id, created_at, status, payload) VALUES (?, ?, ?, ?)",
                (run.run_id, _sort_key(run.created_at), run.status.value, run.model_dump_json()),
            )

    def get_run(self, run_id: str) -> RunRecord:
        with self._transaction() as conn:
            row = conn.execute("SELECT payload FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        if row is None:
            raise RunNotFoundError(run_id)
        return _decoded(RunRecord, row[0])

    def list_runs(self, limit: int = 50) -> list[RunRecord]:
        with self._transaction() as conn:
            rows = conn.execute(
                "SELECT payload FROM runs ORDER BY created_at DESC, run_id DESC LIMIT ?", (limit,)
            ).fetchall()
        return [_decoded(RunRecord, r[0]) for r in rows]

    def delete_run(self, run_id: str) -> None:
        """Remove the run, its jobs and its result in one transaction. Raises RunNotFoundError."""
        with self._transaction(immediate=True) as conn:
            if conn.execute("DELETE FROM runs WHERE run_id = ?", (run_id,)).rowcount == 0:
                raise RunNotFoundError(run_id)
            conn.execute("DELETE FROM jobs WHERE run_id = ?", (run_id,))
            conn.execute("DELETE FROM results WHERE run_id = ?", (run_id,))

    def create_run(self, run: RunRecord, *, replace: Collection[RunStatus] = ()) -> None:
        with self._transaction(immediate=True) as conn:
            row = conn.execute("SELECT status FROM runs WHERE run_id = ?", (run.run_id,)).fetchone()
            if row is not None and row[0] not in {RunStatus(s).value for s in replace}:
                raise RunExistsError(run.run_id, row[0])
            conn.execute(
                "INSERT OR REPLACE INTO runs (run_id, created_at, status, payload) VALUES (?, ?, ?, ?)",
                (run.run_id, _sort_key(run.created_at), run.status.value, run.model_dump_json()),
            )

    def update_run(self, run_id: str, *, unless_status: Collection[RunStatus] = (), **fields: Any) -> RunRecord:
        unknown = sorted(set(fields) - set(RunRecord.model_fields))
        if unknown:
            raise StoreError(f"update_run: a run has no field {', '.join(unknown)}")
        with self._transaction(immediate=True) as conn:  # one writer at a time: nothing is lost
            row = conn.execute("SELECT payload FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            if row is None:
                raise RunNotFoundError(run_id)
            current = _decoded(RunRecord, row[0])
            if current.status in set(unless_status):
                return current
            try:
                updated = RunRecord.model_validate(
                    {**current.model_dump(), **fields, "updated_at": fields.get("updated_at", utcnow())}
                )
            except ValidationError as err:
                raise StoreError(f"update_run {run_id}: {err}") from err
            conn.execute(
                "UPDATE runs SET created_at = ?, status = ?, payload = ? WHERE run_id = ?",
                (_sort_key(updated.created_at), updated.status.value, updated.model_dump_json(), run_id),
            )
        return updated

    # Jobs

    def put_jobs(self, jobs: Sequence[JobRecord]) -> None:
        with self._transaction() as conn:
            conn.executemany(
                "INSERT OR REPLACE INTO jobs (run_id, job_name, status, payload) VALUES (?, ?, ?, ?)",
                [(job.run_id, job.job_name, job.status.value, job.model_dump_json()) for job in jobs],
            )

    def put_job(self, job: JobRecord) -> None:
        with self._transaction() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO jobs (run_id, job_name, status, payload) VALUES (?, ?, ?, ?)",
                (job.run_id, job.job_name, job.status.value, job.model_dump_json()),
            )

    def create_job(self, job: JobRecord) -> bool:
        with self._transaction() as conn:
            cursor = conn.execute(
                "INSERT OR IGNORE INTO jobs (run_id, job_name, status, payload) VALUES (?, ?, ?, ?)",
                (job.run_id, job.job_name, job.status.value, job.model_dump_json()),
            )
        return cursor.rowcount == 1

    def get_job(self, run_id: str, job_name: str) -> JobRecord | None:
        with self._transaction() as conn:
            row = conn.execute(
                "SELECT payload FROM jobs WHERE run_id = ? AND job_name = ?", (run_id, job_name)
            ).fetchone()
        return _decoded(JobRecord, row[0]) if row else None

    def list_jobs(self, run_id: str) -> list[JobRecord]:
        with self._transaction() as conn:
            rows = conn.execute("SELECT payload FROM jobs WHERE run_id = ? ORDER BY job_name", (run_id,)).fetchall()
        return [_decoded(JobRecord, r[0]) for r in rows]

    def apply_job_event(
        self,
        run_id: str,
        job_name: str,
        status: JobStatus,
        event_time: datetime,
        **fields: Any,
    ) -> bool:
        """Apply a job state change if it is newer (or equally new with a higher rank) and does not regress a
        terminal status. An event for a job that has no row changes nothing and returns False."""
        status = JobStatus(status)
        reserved = sorted(set(fields) & _EVENT_RESERVED_FIELDS)
        unknown = sorted(set(fields) - set(JobRecord.model_fields))
        if reserved or unknown:
            raise StoreError(f"apply_job_event: cannot set {', '.join(reserved + unknown)} from an event")
        event_time = as_utc(event_time)
        rank = JOB_STATUS_RANK[status]
        with self._transaction(immediate=True) as conn:
            row = conn.execute(
                "SELECT payload FROM jobs WHERE run_id = ? AND job_name = ?", (run_id, job_name)
            ).fetchone()
            if row is None:
                return False
            current = _decoded(JobRecord, row[0])
            if current.status in TERMINAL_JOB_STATUSES and status not in TERMINAL_JOB_STATUSES:
                return False
            if current.last_event_time is not None:
                last = as_utc(current.last_event_time)
                if event_time < last or (event_time == last and rank <= current.status_rank):
                    return False
            try:
                updated = JobRecord.model_validate(
                    {
                        **current.model_dump(),
                        **fields,
                        "status": status,
                        "status_rank": rank,
                        "last_event_time": event_time,
                        "updated_at": utcnow(),
                    }
                )
            except ValidationError as err:
                raise StoreError(f"apply_job_event {run_id}/{job_name}: {err}") from err
            conn.execute(
                "UPDATE jobs SET status = ?, payload = ? WHERE run_id = ? AND job_name = ?",
                (updated.status.value, updated.model_dump_json(), run_id, job_name),
            )
        return True

    # Results

    def put_result(self, result: ResultRecord) -> None:
        with self._transaction() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO results (run_id, payload) VALUES (?, ?)",
                (result.run_id, result.model_dump_json()),
            )

    def get_result(self, run_id: str) -> ResultRecord | None:
        with self._transaction() as conn:
            row = conn.execute("SELECT payload FROM results WHERE run_id = ?", (run_id,)).fetchone()
        if row is None:
            return None
        try:
            return ResultRecord.model_validate_json(row[0])
        except ValidationError as err:
            remedy = f"analyse it again with `gpuscout analyze {run_id}` (and the same --db)"
            raise StoreError(outdated_result(run_id, err, remedy=remedy)) from err
