"""The run-summary notification: when a run has been analysed, one message to the stack's SNS topic (e-mail
subscribers get it as plain text): the run, its final status, the jobs by status, the recommendation and where the
report is. Publishing never fails the run: the result is already stored, so a failed publish is logged and returned.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from gpuscout.store.base import JobRecord, JobStatus, RunRecord

SUBJECT_LIMIT = 99  # SNS: printable ASCII, no line breaks, "less than 100 characters" (botocore's PublishInput)


@dataclass(frozen=True)
class Notice:
    subject: str
    message: str


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


def publish(sns: Any, topic_arn: str, notice: Notice) -> str | None:
    """Publish; returns None when sent, else why not (the caller logs it; the run is not failed for it)."""
    try:
        sns.publish(TopicArn=topic_arn, Subject=notice.subject, Message=notice.message)
    except (ClientError, BotoCoreError) as err:
        return f"cannot publish the run summary to {topic_arn}: {err}"
    return None


def refusal_notice(run_id: str | None, error: str, cause: str) -> Notice:
    """A run that never started: a rejected manifest (ManifestRejected) or a refused plan (PlanRefused), with why."""
    status = "REJECTED" if error == "ManifestRejected" else "REFUSED"
    what = "manifest was rejected" if status == "REJECTED" else "plan was refused"
    subject = _ascii_line(f"gpuscout: run {run_id or '(none)'} {status}")
    lines = [f"Run {run_id or '(no run id)'}: the {what}; nothing was launched.", "", cause.strip(), ""]
    if run_id:
        lines.append(f"Details: gpuscout status {run_id}")
    return Notice(subject=subject, message="\n".join(lines) + "\n")
