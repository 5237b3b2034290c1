"""The run summary an analysed cloud run publishes (gpuscout.workflow.close.run_summary), and how a job's failure
reason is classified (gpuscout.cloud.events.classify_failure)."""

from __future__ import annotations

from gpuscout.store.base import RunRecord, RunStatus
from gpuscout.workflow.close import run_summary


def _run(manifest: dict[str, object] | None) -> RunRecord:
    return RunRecord(
        run_id="bench-0123456789ab",
        name="bench",
        status=RunStatus.SUCCEEDED,
        manifest_source="s3://data/manifests/bench.yaml",
        manifest=manifest,
    )


def test_a_tracked_run_s_summary_says_how_to_log_it_to_the_trackers() -> None:
    notice = run_summary(
        _run({"name": "bench", "tracking": {"wandb": {"project": "p"}}}),
        [],
        recommendation="Recommended: p4d",
        report_uri="s3://data/reports/bench-0123456789ab/",
    )
    assert "Experiment trackers: gpuscout track bench-0123456789ab --stack-name <stack>" in notice.message


def test_an_untracked_run_s_summary_does_not_mention_tracking() -> None:
    for manifest in (None, {"name": "bench", "tracking": None}):
        notice = run_summary(_run(manifest), [], recommendation="r", report_uri="s3://data/reports/x/")
        assert "gpuscout track" not in notice.message


def test_a_user_script_s_stderr_in_its_failure_reason_counts_for_oom_only() -> None:
    from gpuscout.cloud.events import classify_failure
    from gpuscout.store.base import JobStatus

    # SageMaker's own reasons
    assert classify_failure("ResourceLimitExceeded: ml.p5.48xlarge for training job usage") is JobStatus.QUOTA
    assert classify_failure("CapacityError: Unable to provision requested ML compute capacity") is JobStatus.CAPACITY
    # a user's script whose stderr (gpuscout_train/job_code.py's reason) mentions quota or capacity words: its own
    # failure
    ours = "fit.py exited with code 1; stderr: botocore.exceptions.ClientError: ... (ResourceLimitExceeded) ..."
    assert classify_failure(ours) is JobStatus.FAILED
    assert classify_failure("fit.py exited with code 1; stderr: InsufficientCapacity in my log") is JobStatus.FAILED
    # and a CUDA out-of-memory error in it is what it says
    oom = "fit.py exited with code 1; stderr: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert classify_failure(oom) is JobStatus.OOM
