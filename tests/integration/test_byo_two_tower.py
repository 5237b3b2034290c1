"""The two-tower example end to end through `gpuscout local` on CPU: the user's own script, the gpuscout_report
helper, samples/s and $ per 1M samples in the stored analysis and the report."""

import time

from gpuscout.local.runner import run_local
from gpuscout.paths import REPO_DIR
from gpuscout.store.base import JobStatus, RunStatus
from gpuscout.store.sqlite import SqliteStore


def test_two_tower_local_end_to_end(tmp_path):
    store = SqliteStore(tmp_path / "results.db")
    started = time.monotonic()
    run = run_local(REPO_DIR / "examples" / "two-tower" / "local.yaml", store=store, runs_dir=tmp_path / "runs")
    assert time.monotonic() - started < 60
    assert run.status is RunStatus.SUCCEEDED
    jobs = store.list_jobs(run.run_id)
    assert {j.variant_name for j in jobs} == {"b128", "b512"}
    assert all(j.status is JobStatus.COMPLETED for j in jobs)
    for job in jobs:
        bench = job.benchmark or {}
        assert bench["unit"] == "samples" and bench["job"]["entry_point"] == "train.py"
        assert bench["throughput"]["samples_per_s"] > 0 and bench["timing"]["timed_steps"] == 10
        assert bench["job"]["hyperparameters"]["batch_size"] in ("128", "512")
    analysis = store.get_result(run.run_id).analysis
    assert analysis["unit"] == "samples"
    ranked = sorted(analysis["jobs"], key=lambda a: a["rank"])
    assert all(a["samples_per_s"] > 0 and a["usd_per_million_samples"] > 0 for a in ranked)
    assert ranked[0]["usd_per_million_samples"] <= ranked[1]["usd_per_million_samples"]
    assert all(a["tokens_per_s"] is None for a in ranked)
    report = (tmp_path / "runs" / run.run_id / "report" / "report.md").read_text()
    assert "samples/s ± 95 % CI" in report and "$/1M samples on-demand" in report
