"""The run summary an analysed cloud run publishes (gpuscout.cloud.notify.run_summary)."""

from __future__ import annotations

from gpuscout.cloud.notify import run_summary
from gpuscout.store.base import RunRecord, RunStatus


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
