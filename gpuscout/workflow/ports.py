"""What a step needs from the face that drives it, as protocols: the steps take these and never a boto3 client, a
subprocess or a console. The result store's protocol is ``gpuscout.store.base.ResultStore`` (SQLite locally, DynamoDB
in the cloud).

- ``JobLauncher``: runs one job to its end and says how it ended (locally a subprocess in a job folder; in the cloud
  the state machine launches SageMaker jobs itself, so no cloud step takes one);
- ``ReportSink``: where a written report is published (the cloud's data bucket; locally the run folder is the place,
  so no sink);
- ``Notifier``: who is told that a run ended or was refused (the stack's SNS topic; locally the console).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpuscout.domain.benchmark import BenchmarkResult
from gpuscout.domain.contention import Contention
from gpuscout.domain.jobspec import JobSpec
from gpuscout.store.base import JobStatus


@dataclass
class JobOutcome:
    """How one job ended: its status, its benchmark.json (when it wrote one), why it failed, how long it ran."""

    status: JobStatus
    benchmark: BenchmarkResult | None
    failure_reason: str | None
    wall_seconds: float
    contention: Contention | None = None  # the machine's other load while the job ran (local/contention.py)
    log: str | None = None  # where its error output is, for a reason that points to it


class JobLauncher(Protocol):
    def run(self, spec: JobSpec, place: str) -> JobOutcome:
        """Run ``spec`` to its end under ``place`` (a name that keeps its files apart: "canary", "calibration")."""
        ...


class ReportSink(Protocol):
    def publish(self, run_id: str, folder: Path) -> str:
        """Publish every file of the report written in ``folder``; returns where it is (an s3:// URI)."""
        ...


@dataclass(frozen=True)
class Notice:
    """One message to whoever dropped the manifest: a subject line and a plain-text body."""

    subject: str
    message: str


class Notifier(Protocol):
    def publish(self, notice: Notice) -> str | None:
        """Send ``notice``; None when sent, else why not (a lost message never fails the run)."""
        ...
