"""What a local run reports as it goes (the ``RunObserver`` protocol; the CLI's rich view implements it) and an
observer that reports nothing.

May import: gpuscout.domain, gpuscout.store, gpuscout.workflow (its ports) and gpuscout.local.job_process."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from gpuscout.domain.jobspec import JobSpec
from gpuscout.domain.run_analysis import RunAnalysis
from gpuscout.local.job_process import JobProgress
from gpuscout.store.base import (
    JobRecord,
    RunRecord,
)
from gpuscout.workflow.ports import JobOutcome

if TYPE_CHECKING:
    from gpuscout.plan.jobs import Plan


class RunObserver(Protocol):
    """What the runner tells its caller while a run goes on (the CLI draws it: gpuscout.cli.local_view)."""

    def planned(self, the_plan: Plan) -> None: ...

    def message(self, text: str, *, warning: bool = False) -> None: ...

    def jobs_running(self) -> AbstractContextManager[None]: ...

    def job_started(self, index: int, total: int, spec: JobSpec, max_steps: int | None) -> None: ...

    def job_progress(self, spec: JobSpec, progress: JobProgress, max_steps: int | None) -> None: ...

    def job_finished(self, spec: JobSpec, outcome: JobOutcome) -> None: ...

    def interrupted(self) -> None: ...

    def finished(
        self, run: RunRecord, analysis: RunAnalysis | None, jobs: Sequence[JobRecord], report_md: Path | None
    ) -> None: ...


class SilentObserver:
    """A RunObserver that shows nothing (library use, tests)."""

    def planned(self, the_plan: Plan) -> None:
        return None

    def message(self, text: str, *, warning: bool = False) -> None:
        return None

    def jobs_running(self) -> AbstractContextManager[None]:
        return nullcontext()

    def job_started(self, index: int, total: int, spec: JobSpec, max_steps: int | None) -> None:
        return None

    def job_progress(self, spec: JobSpec, progress: JobProgress, max_steps: int | None) -> None:
        return None

    def job_finished(self, spec: JobSpec, outcome: JobOutcome) -> None:
        return None

    def interrupted(self) -> None:
        return None

    def finished(
        self, run: RunRecord, analysis: RunAnalysis | None, jobs: Sequence[JobRecord], report_md: Path | None
    ) -> None:
        return None
