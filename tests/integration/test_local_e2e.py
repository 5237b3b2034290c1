"""`gpuscout local` end to end on a very small manifest: real data preparation, real train.py subprocesses.

Two variants train for a few steps. A third one is broken after planning (its micro batch set to 0, which
train.py rejects at start-up) to show that a configuration failing inside train.py is caught by its 2-step canary
and recorded with its reason, never timed, while the others still run and get ranked. (The manifest and planner
refuse such settings up front, so the test edits the planned job, as a corrupted or hand-edited job spec would.)
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from gpuscout.cli import app as cli
from gpuscout.cli.local_view import RichRunObserver
from gpuscout.domain.catalog import Catalog
from gpuscout.domain.manifest import Manifest
from gpuscout.domain.manifest_loader import load_manifest
from gpuscout.local import runner as local
from gpuscout.local.data_cache import prepare_data, verify_prepared
from gpuscout.local.runner import run_local
from gpuscout.plan.jobs import Plan
from gpuscout.store.base import JobStatus, RunStatus
from gpuscout.store.sqlite import SqliteStore

MANIFEST = """
name: e2e-tiny
model:
  preset: qwen2-tiny
tokenizer:
  kind: bpe
  vocab_size: 512
dataset:
  source: bundled:hebrew-bible
  max_documents: 12
sequence_length: 64
training:
  max_steps: 6
  learning_rate: 1.0e-3
  validation_batches: 1
targets:
  - instance_type: local
    price_per_hour_usd: 0.096
variants:
  - name: b2-a2
    per_device_batch_size: 2
    gradient_accumulation_steps: 2
    dataloader_workers: 0
  - name: b4-a1
    per_device_batch_size: 4
    gradient_accumulation_steps: 1
    dataloader_workers: 0
  - name: broken
    per_device_batch_size: 4
    gradient_accumulation_steps: 1
    dataloader_workers: 0
constraints:
  budget_usd: 1.0
"""


REAL_PLAN_JOBS = local.plan_jobs


def _plan_with_a_broken_job(manifest: Manifest, catalog: Catalog, **kwargs: Any) -> Plan:
    plan = REAL_PLAN_JOBS(manifest, catalog, **kwargs)
    jobs = [
        job.model_copy(update={"hyperparameters": {**job.hyperparameters, "per_device_train_batch_size": "0"}})
        if job.variant_name == "broken"
        else job
        for job in plan.jobs
    ]
    return plan.model_copy(update={"jobs": jobs})


@pytest.mark.slow(seconds=54)
@pytest.mark.timeout(600)
def test_local_run_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "plan_jobs", _plan_with_a_broken_job)
    manifest_path = tmp_path / "e2e.yaml"
    manifest_path.write_text(MANIFEST)
    db = tmp_path / "gpuscout.db"
    store = SqliteStore(db)
    runs_dir = tmp_path / "runs"
    out = io.StringIO()
    console = Console(file=out, width=160)

    run = run_local(manifest_path, store=store, runs_dir=runs_dir, observer=RichRunObserver(console))

    printed = out.getvalue()
    assert run.status is RunStatus.SUCCEEDED, printed
    run_dir = runs_dir / run.run_id
    assert (run_dir / "manifest.yaml").read_text() == MANIFEST
    jobs = {j.variant_name: j for j in store.list_jobs(run.run_id)}
    assert set(jobs) == {"b2-a2", "b4-a1", "broken"}

    for variant in ("b2-a2", "b4-a1"):
        job = jobs[variant]
        assert job.status is JobStatus.COMPLETED, job.failure_reason
        assert job.benchmark is not None
        assert job.benchmark.throughput.tokens_per_s > 0
        assert job.benchmark.stop.steps == 6
        opt_ml = run_dir / "jobs" / job.job_name / "opt" / "ml"
        hps = json.loads((opt_ml / "input" / "config" / "hyperparameters.json").read_text())
        assert hps["max_steps"] == "6"
        assert (opt_ml / "input" / "data" / "train" / "dataset.json").is_file()
        assert (opt_ml / "output" / "data" / "benchmark.json").is_file()
        assert "gpuscout_metric step=" in (run_dir / "jobs" / job.job_name / "train.log").read_text()

    failed = jobs["broken"]
    assert failed.status is JobStatus.FAILED
    assert failed.failure_reason is not None
    assert "per_device_train_batch_size must be at least 1" in failed.failure_reason
    # the broken configuration failed in its 2-step canary, so it was never timed
    assert failed.failure_reason.startswith("not run: its canary (2 steps of the same configuration) failed")
    assert not (run_dir / "jobs" / failed.job_name).exists()
    assert len(list((run_dir / "canary").iterdir())) == 3

    result = store.get_result(run.run_id)
    assert result is not None
    ranked = {a["variant_name"]: a for a in result.analysis.model_dump(mode="json")["jobs"]}
    assert sorted(ranked[v]["rank"] for v in ("b2-a2", "b4-a1")) == [1, 2]
    assert ranked["broken"]["rank"] is None
    assert "malloc kept for training" in ranked["b4-a1"]["host_allocator"]  # what was measured includes it
    assert ranked["b4-a1"]["host_allocator"] in (run_dir / "report" / "report.md").read_text()
    assert result.analysis.model_dump(mode="json")["recommendation"]["job_name"] in {
        jobs["b2-a2"].job_name,
        jobs["b4-a1"].job_name,
    }
    assert "n/a (CPU)" in printed
    assert "Recommendation" in printed

    # The report of a CPU run: what a reader asks first, and nothing a CPU run has no data for
    report_dir = run_dir / "report"
    markdown = (report_dir / "report.md").read_text()
    ranked_header = markdown.split("## Ranked results", 1)[1].strip().splitlines()[0]
    for absent in ("MFU", "spot", "per GPU", "peak mem"):
        assert absent not in ranked_header, ranked_header  # every row would say "–"
    assert "| local / b2-a2 | 2 | 2 |" in markdown and "| local / b4-a1 | 4 | 1 |" in markdown  # the settings
    assert "## Settings of each variant" in markdown and "micro-batch | accumulation" in markdown
    prices = markdown.split("## Prices used (snapshot)", 1)[1].split("## Assumptions", 1)[0]
    assert "ml." not in prices and "| local |" in prices  # only the instance types the run measured
    assert {"step_rates.png", "loss_per_step.png"} <= {p.name for p in report_dir.glob("*.png")}
    assert "0.00 h" not in markdown and "e-0" not in markdown  # seconds in seconds, dollars without exponents

    # Read back through the CLI, as a user would afterwards.
    runner = CliRunner(env={"COLUMNS": "200"})  # xdist workers set COLUMNS=80
    listed = runner.invoke(cli.app, ["runs", "--db", str(db)])
    assert listed.exit_code == 0
    assert run.run_id in listed.stdout
    shown = runner.invoke(cli.app, ["results", run.run_id, "--format", "json", "--db", str(db)])
    assert shown.exit_code == 0, shown.stdout
    payload = json.loads(shown.stdout)
    assert {j["variant"] for j in payload["jobs"]} == {"b2-a2", "b4-a1", "broken"}
    assert all(j["usd_per_million_tokens"] > 0 for j in payload["jobs"] if j["rank"] is not None)

    # A second run of the same data reuses the prepared data instead of preparing it again.
    again = io.StringIO()
    cached = prepare_data(load_manifest(manifest_path), runs_dir / ".cache" / "data", Console(file=again).print)
    assert (cached / "dataset.json").is_file()
    assert "reusing prepared data" in again.getvalue()
    # A damaged cache entry (a shard changed after it was written) is detected by its sha256 and prepared again.
    shard = next(cached.glob("train-*.input_ids.npy"))
    data = shard.read_bytes()
    shard.write_bytes(data[:-8] + bytes(b ^ 0xFF for b in data[-8:]))  # flipped: a padded row may end in zeros already
    damaged = io.StringIO()
    prepared = prepare_data(load_manifest(manifest_path), runs_dir / ".cache" / "data", Console(file=damaged).print)
    assert "is damaged (sha256 of the shards differs from dataset.json); preparing it again" in " ".join(
        damaged.getvalue().split()
    )
    assert verify_prepared(prepared) is None
