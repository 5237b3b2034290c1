"""The HF Trainer example (examples/hf-trainer) end to end through `gpuscout local` on CPU: transformers' real
Trainer with gpuscout's drop-in callback; samples/s and tokens/s in each benchmark.json, samples/s and $ per 1M
samples in the stored analysis and the report."""

import time

import pytest

from gpuscout.local.runner import run_local
from gpuscout.paths import REPO_DIR
from gpuscout.store.base import JobStatus, RunStatus
from gpuscout.store.sqlite import SqliteStore


@pytest.mark.slow(seconds=31)
def test_hf_trainer_example_local_end_to_end(tmp_path):
    store = SqliteStore(tmp_path / "results.db")
    started = time.monotonic()
    run = run_local(REPO_DIR / "examples" / "hf-trainer" / "local.yaml", store=store, runs_dir=tmp_path / "runs")
    assert time.monotonic() - started < 120
    assert run.status is RunStatus.SUCCEEDED, run.error
    jobs = store.list_jobs(run.run_id)
    assert {j.variant_name for j in jobs} == {"b4", "b16"}
    assert all(j.status is JobStatus.COMPLETED for j in jobs), [j.failure_reason for j in jobs]
    for job in jobs:
        bench = job.benchmark
        assert bench is not None and bench.job is not None
        assert bench.job.reporter == "hf_trainer" and bench.job.entry_point == "train.py"
        # the callback stopped the Trainer at max_steps (its own max_steps is 100,000), warm-up excluded
        stop = bench.stop
        assert stop is not None and (stop.rule, stop.reason, stop.steps) == ("fixed", "max_steps reached", 10)
        assert bench.timing.timed_steps == 8
        batch = int(bench.job.hyperparameters["batch_size"])
        assert bench.throughput.samples_timed == 8 * batch
        assert bench.throughput.tokens_timed == 8 * batch * 64  # tokens_per_step from the callback
        assert bench.loss.final_train_loss is not None
    analysis = store.get_result(run.run_id).analysis.model_dump(mode="json")
    assert analysis["unit"] == "samples"
    ranked = sorted(analysis["jobs"], key=lambda a: a["rank"])
    assert all(a["samples_per_s"] > 0 and a["usd_per_million_samples"] > 0 for a in ranked)
    assert all(a["tokens_per_s"] is None for a in ranked)  # tokens/s is in benchmark.json; ranking is per sample
    report = (tmp_path / "runs" / run.run_id / "report" / "report.md").read_text()
    assert "samples/s ± 95 % CI" in report and "$/1M samples on-demand" in report
