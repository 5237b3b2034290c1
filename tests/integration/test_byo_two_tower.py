"""The two-tower example end to end through `gpuscout local` on CPU: the user's own script, the gpuscout_report
helper, samples/s and $ per 1M samples in the stored analysis and the report; and the HF Trainer callback on a
real transformers Trainer."""

import time
from pathlib import Path

import pytest

from gpuscout.local.runner import run_local
from gpuscout.paths import REPO_DIR
from gpuscout.store.base import JobStatus, RunStatus
from gpuscout.store.sqlite import SqliteStore


@pytest.fixture(scope="module")
def example_run(tmp_path_factory):
    """examples/two-tower/local.yaml run once through `gpuscout local`; the tests below read the same run."""
    tmp_path = tmp_path_factory.mktemp("two-tower")
    store = SqliteStore(tmp_path / "results.db")
    started = time.monotonic()
    run = run_local(REPO_DIR / "examples" / "two-tower" / "local.yaml", store=store, runs_dir=tmp_path / "runs")
    return run, store, tmp_path, time.monotonic() - started


@pytest.mark.slow(seconds=18)
def test_two_tower_local_end_to_end(example_run):
    run, store, tmp_path, seconds = example_run
    # the example stays a quick try: within the suite's 120 s a test. 60 s was the bound: the run took 16 s on a
    # 2-core Xeon and 59.5 s and 60.9 s beside the other worker on one core's worth of it (2026-11-26, fresh clones
    # in a cgroup; jobs the disturbance detector flags under that load are measured again), failing once.
    assert seconds < 120
    assert run.status is RunStatus.SUCCEEDED
    jobs = store.list_jobs(run.run_id)
    assert {j.variant_name for j in jobs} == {"b128", "b512"}
    assert all(j.status is JobStatus.COMPLETED for j in jobs)
    for job in jobs:
        bench = job.benchmark
        assert bench is not None and bench.job is not None
        assert bench.unit == "samples" and bench.job.entry_point == "train.py"
        assert bench.throughput.samples_per_s > 0 and bench.timing.timed_steps == 10
        assert bench.job.hyperparameters["batch_size"] in ("128", "512")
    analysis = store.get_result(run.run_id).analysis.model_dump(mode="json")
    assert analysis["unit"] == "samples"
    ranked = sorted(analysis["jobs"], key=lambda a: a["rank"])
    assert all(a["samples_per_s"] > 0 and a["usd_per_million_samples"] > 0 for a in ranked)
    assert ranked[0]["usd_per_million_samples"] <= ranked[1]["usd_per_million_samples"]
    assert all(a["tokens_per_s"] is None for a in ranked)
    report = (tmp_path / "runs" / run.run_id / "report" / "report.md").read_text()
    assert "samples/s ± 95 % CI" in report and "$/1M samples on-demand" in report


HF_TRAINER_SCRIPT = """
import torch
import gpuscout_report as gs
from transformers import Trainer, TrainingArguments

class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return {"loss": torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y)}

torch.manual_seed(0)
data = [{"x": torch.randn(4), "y": torch.randn(())} for _ in range(512)]
args = TrainingArguments(output_dir="trainer-out", per_device_train_batch_size=8, max_steps=20, logging_steps=1,
                         report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
trainer = Trainer(model=Regression(), args=args, train_dataset=data,
                  callbacks=[gs.hf_trainer_callback(samples_per_step=8)])
trainer.train()
print("trainer stopped at step", trainer.state.global_step)
"""


@pytest.mark.slow(seconds=17)
def test_the_hf_trainer_callback_reports_every_step_and_writes_the_benchmark(tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    # Given a plain HF Trainer script with the drop-in callback (transformers' real Trainer, on the CPU)
    (tmp_path / "train.py").write_text(HF_TRAINER_SCRIPT)
    env = {**os.environ, "SM_OUTPUT_DATA_DIR": str(tmp_path / "out"), "GPUSCOUT_UNIT": "samples",
           "GPUSCOUT_MAX_STEPS": "20", "GPUSCOUT_STOP_RULE": "fixed", "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    # When it trains
    done = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # Then every optimizer step was reported, warm-up excluded, and benchmark.json says samples/s with the loss
    assert "trainer stopped at step 20" in done.stdout
    bench = json.loads((tmp_path / "out" / "benchmark.json").read_text())
    assert bench["status"] == "completed" and bench["unit"] == "samples"
    assert bench["timing"]["timed_steps"] == 20 - bench["timing"]["warmup_steps"] > 0
    assert bench["throughput"]["samples_per_s"] > 0
    assert bench["loss"]["train"] and all(p["loss"] is not None for p in bench["loss"]["train"])
    assert "gpuscout_metric" in done.stdout


@pytest.mark.slow(seconds=40)
def test_without_an_estimate_each_variant_is_calibrated_on_this_machine_and_the_report_says_so(tmp_path):
    import re

    import pytest

    from gpuscout.domain.catalog import load_catalog
    from gpuscout.domain.manifest_loader import load_manifest
    from gpuscout.errors import PlanError
    from gpuscout.plan.planner import plan

    # Given the two-tower local manifest without job.estimate
    text = (REPO_DIR / "examples" / "two-tower" / "local.yaml").read_text()
    text = re.sub(r"  estimate:\n(    .*\n)+", "", text).replace(
        "source_dir: .", f"source_dir: {REPO_DIR}/examples/two-tower"
    )
    path = tmp_path / "calibrated.yaml"
    path.write_text(text)
    store = SqliteStore(tmp_path / "results.db")
    messages = []

    from gpuscout.local.observer import SilentObserver

    class Observer(SilentObserver):
        def message(self, text, *, warning=False):
            messages.append(text)

    # When it runs
    run = run_local(path, store=store, runs_dir=tmp_path / "runs", observer=Observer())
    # Then each variant ran a short calibration first, and its measured rate is the plan's prediction
    assert run.status is RunStatus.SUCCEEDED
    assert [m for m in messages if str(m).startswith("calibrating")] == [
        "calibrating 'b128': 7 steps on this machine (no job.estimate)",
        "calibrating 'b512': 7 steps on this machine (no job.estimate)",
    ]
    for job in store.list_jobs(run.run_id):
        prediction = job.spec.prediction
        assert prediction.method.startswith("calibrated: ") and "5 timed steps of this variant" in prediction.method
        assert (prediction.samples_per_s or 0) > 0 and prediction.training_seconds > 0
    # and the report says how each prediction was made, and how the measurement compares
    report = (tmp_path / "runs" / run.run_id / "report" / "report.md").read_text()
    assert "planner's prediction" in report and "(calibrated: " in report and "x of it" in report
    # A cloud target cannot be calibrated here: without an estimate the plan is refused, saying what to do
    cloud = load_manifest(REPO_DIR / "examples" / "two-tower" / "cloud.yaml")
    cloud = cloud.model_copy(update={"job": cloud.job.model_copy(update={"estimate": None})})
    with pytest.raises(PlanError, match=r"targets\[0\] ml.g5.8xlarge: job.estimate is required for a cloud target"):
        plan(cloud, load_catalog(), run_id="r")


def test_the_report_names_the_users_estimate_as_the_prediction(example_run):
    run, _, tmp_path, _ = example_run
    report = (tmp_path / "runs" / run.run_id / "report" / "report.md").read_text()
    assert "| 20,000 samples/s (user's estimate (job.estimate): 20,000 samples/s per device x 1 device; " in report
