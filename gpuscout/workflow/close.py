"""Close (the end of "Analyze run"; a refusal at "Validate manifest" or "Plan jobs"; "Mark run failed"): how a run
ends. Its final status is recorded (``close_status``) and whoever dropped the manifest is told: how the run ended (the
run, its status, the jobs by status, the recommendation and where the report is) or why it never started. Sending
goes through a ``ports.Notifier`` (the cloud's SNS topic, whose e-mail subscribers get it as plain text); a message
that cannot be sent never fails the run: the result is already stored. Locally the console says the same as the run
ends, so the local driver has no notifier."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from gpuscout.store.base import JobRecord, JobStatus, ResultStore, RunRecord, RunStatus
from gpuscout.workflow.ports import Notice, Notifier

SUBJECT_LIMIT = 99  # SNS: printable ASCII, no line breaks, "less than 100 characters" (botocore's PublishInput)


def close_status(
    store: ResultStore, run_id: str, jobs: list[JobRecord], *, interrupted: str | None = None
) -> RunRecord:
    """The run's final status: STOPPED when ``interrupted`` names what stopped it; else SUCCEEDED when a job
    completed, FAILED when none did. A run the cloud's budget guard STOPPED meanwhile stays STOPPED (the check and
    the write are one store call)."""
    if interrupted:
        return store.update_run(run_id, status=RunStatus.STOPPED, error=f"interrupted ({interrupted})")
    if any(j.status is JobStatus.COMPLETED for j in jobs):
        return store.update_run(run_id, unless_status=(RunStatus.STOPPED,), status=RunStatus.SUCCEEDED, error=None)
    error = f"none of the {len(jobs)} job(s) completed"
    return store.update_run(run_id, unless_status=(RunStatus.STOPPED,), status=RunStatus.FAILED, error=error)


def _ascii_line(text: str) -> str:
    printable = "".join(ch if 32 <= ord(ch) < 127 else "?" for ch in " ".join(text.split()))
    return printable[:SUBJECT_LIMIT]


def run_summary(
    run: RunRecord, jobs: Sequence[JobRecord], *, recommendation: str, report_uri: str, console_url: str | None = None
) -> Notice:
    canaries = [j for j in jobs if j.is_canary]
    jobs = [j for j in jobs if not j.is_canary]
    counts = Counter(j.status.value for j in jobs)
    by_status = ", ".join(f"{n} {status.lower()}" for status, n in sorted(counts.items())) or "no jobs"
    subject = _ascii_line(f"gpuscout: run {run.name} {run.status.value}")
    lines = [
        f"Run {run.run_id} ({run.name}) finished: {run.status.value}.",
        f"Jobs: {len(jobs)} ({by_status}).",
    ]
    if canaries:
        canary_counts = Counter(j.status.value for j in canaries)
        lines.append(
            f"Canaries: {len(canaries)} ("
            + ", ".join(f"{n} {status.lower()}" for status, n in sorted(canary_counts.items()))
            + ")."
        )
    if run.error:
        lines.append(f"Error: {run.error}")
    failed = [j for j in [*canaries, *jobs] if j.failure_reason and j.status is not JobStatus.COMPLETED]
    for job in failed[:10]:
        lines.append(f"  - {job.job_name} {job.status.value}: {job.failure_reason}")
    if len(failed) > 10:
        lines.append(f"  ... and {len(failed) - 10} more (gpuscout status {run.run_id})")
    lines += ["", recommendation, "", f"Report: {report_uri}", f"Details: gpuscout results {run.run_id}"]
    if (run.manifest or {}).get("tracking"):  # the run level is logged from the user's machine (cloud/run_tracking.py)
        lines.append(f"Experiment trackers: gpuscout track {run.run_id} --stack-name <stack>")
    if console_url:
        lines.append(f"Execution: {console_url}")
    return Notice(subject=subject, message="\n".join(lines) + "\n")


def refusal_notice(run_id: str | None, error: str, cause: str) -> Notice:
    """A run that never started: a rejected manifest (ManifestRejected) or a refused plan (PlanRefused), with why."""
    status = "REJECTED" if error == "ManifestRejected" else "REFUSED"
    what = "manifest was rejected" if status == "REJECTED" else "plan was refused"
    subject = _ascii_line(f"gpuscout: run {run_id or '(none)'} {status}")
    lines = [f"Run {run_id or '(no run id)'}: the {what}; nothing was launched.", "", cause.strip(), ""]
    if run_id:
        lines.append(f"Details: gpuscout status {run_id}")
    return Notice(subject=subject, message="\n".join(lines) + "\n")


def notify_run(
    run: RunRecord,
    jobs: Sequence[JobRecord],
    *,
    recommendation: str,
    report_uri: str,
    notifier: Notifier | None,
    console_url: str | None = None,
) -> bool | str:
    """Send the run summary (``run_summary``): True when sent, False without a notifier, else why it was not."""
    if notifier is None:
        return False
    notice = run_summary(run, jobs, recommendation=recommendation, report_uri=report_uri, console_url=console_url)
    return notifier.publish(notice) or True


def notify_refusal(run_id: str | None, error: str, cause: str, *, notifier: Notifier | None) -> bool | str:
    """Send why a run never started (``refusal_notice``): True when sent, False without a notifier, else why not."""
    if notifier is None:
        return False
    return notifier.publish(refusal_notice(run_id, error, cause)) or True
