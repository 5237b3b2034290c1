"""A SageMaker tuning trial of a settings search as train.py sees it: the tuning job's static hyperparameters, the
candidate's name (``search_candidate``), SageMaker's own ``_tuning_objective_metric`` and the trial's name in
TRAINING_JOB_NAME; and the running $/1M tokens it prints, which the tuning job's objective regex reads."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gpuscout_train import args as train_args

from gpuscout.domain.benchmark import BenchmarkResult
from gpuscout.domain.metric_lines import METRIC_DEFINITIONS, OBJECTIVE_METRIC
from gpuscout.errors import TrainingError
from gpuscout.paths import TRAIN_MODULE
from tests.sagemaker_job import job_environment
from tests.unit.test_tuning_requests import _plan, _requests

# What a trial gets on top of a training job's hyperparameters (or instead of them: its name)
TRIAL_ONLY = {"job_name", "search_candidate", "price_per_hour_usd", "objective_min_timed_steps"}


def test_a_trial_trains_exactly_what_its_candidates_job_would(tmp_path: Path) -> None:
    # Given every target's tuning request of a multi-target search and the planner's job for each candidate
    the_plan = _plan()
    assert the_plan.search is not None
    for request, target in zip(_requests(the_plan), the_plan.search.targets, strict=True):
        static = request["TrainingJobDefinition"]["StaticHyperParameters"]
        trial = f"{request['HyperParameterTuningJobName']}-007-0a1b2c3d"
        for spec in (j for j in the_plan.jobs if j.target_index == target.target_index):
            # When train.py reads a trial's hyperparameters (the static ones, the candidate, SageMaker's own)
            hps = {**static, "search_candidate": spec.variant_name, "_tuning_objective_metric": OBJECTIVE_METRIC}
            env = {"SM_INPUT_CONFIG_DIR": str(tmp_path), "SM_HPS": json.dumps(hps), "TRAINING_JOB_NAME": trial}
            as_trial = dataclasses.asdict(train_args.parse_hyperparameters([], env))
            as_job = dataclasses.asdict(
                train_args.parse_hyperparameters([], {"SM_INPUT_CONFIG_DIR": str(tmp_path), "SM_HPS": json.dumps(
                    spec.hyperparameters)})
            )  # fmt: skip
            # Then it trains with the same settings as the candidate's own job, under the trial's name
            assert {k: v for k, v in as_trial.items() if k not in TRIAL_ONLY} == {
                k: v for k, v in as_job.items() if k not in TRIAL_ONLY
            }, spec.variant_name
            assert as_trial["job_name"] == trial and as_trial["search_candidate"] == spec.variant_name
            assert as_trial["price_per_hour_usd"] == spec.price_per_hour_usd * spec.instance_count
    with pytest.raises(TrainingError, match="hyperparameter search_candidate: 'b4-a2' is not a search candidate"):
        train_args.parse_hyperparameters(["--search_candidate", "b4-a2"], {"SM_HPS": json.dumps(static)})


@pytest.mark.slow(seconds=12)
def test_a_trial_prints_the_running_cost_its_tuning_job_minimizes(dataset: Path, tmp_path: Path) -> None:
    # Given a tuning trial of the tiny model: static micro-batch 8 x 1, candidate b2-a2-w0, $3.60/h, first objective
    # value after 3 timed steps, a checkpoint every 5 steps
    trial = "gs-0123456789ab-t00-003-9c1d2e3f"
    hps = {
        "_tuning_objective_metric": OBJECTIVE_METRIC,
        "search_candidate": "b2-a2-w0",
        "run_id": "r-search",
        "job_name": "gs-0123456789ab-t00",
        "instance_type": "ml.g5.xlarge",
        "model_preset": "qwen2-tiny",
        "per_device_train_batch_size": "8",
        "gradient_accumulation_steps": "1",
        "max_steps": "10",
        "learning_rate": "0.003",
        "seed": "7",
        "precision": "auto",
        "packing": "true",
        "checkpoint_interval": "5",
        "validation_batches": "1",
        "price_per_hour_usd": "3.6",
        "objective_min_timed_steps": "3",
    }
    env = job_environment(tmp_path, dataset, hps, TRAINING_JOB_NAME=trial)
    # When it runs (train.py on this CPU, as in the container)
    done = subprocess.run([sys.executable, "-m", TRAIN_MODULE], env=env, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = BenchmarkResult.model_validate_json((tmp_path / "opt/ml/output/data/benchmark.json").read_text())
    assert result.job_name == trial and result.config is not None
    assert (result.config.per_device_batch_size, result.config.gradient_accumulation_steps) == (2, 2)
    assert result.timing is not None and result.throughput is not None and result.throughput.tokens_per_s
    # Then the objective regex (the tuning job's MetricDefinitions) reads a value on every step line from the 3rd
    # timed step on, and the last one is the job's $/1M tokens over all its timed steps
    objective = re.compile(next(d["Regex"] for d in METRIC_DEFINITIONS if d["Name"] == OBJECTIVE_METRIC))
    steps, values = [], []
    for line in done.stdout.splitlines():
        if (match := objective.search(line)) is not None:
            steps.append(int(re.search(r" step=(\d+)", line).group(1)))  # type: ignore[union-attr]
            values.append(float(match.group(1)))
    warmup = result.timing.warmup_steps
    assert steps == list(range(warmup + 3, 11))
    assert values[-1] == pytest.approx(3.6 / 3600 / result.throughput.tokens_per_s * 1e6, rel=1e-6)
    # and its checkpoints are in a folder of its own under the tuning job's location
    assert [p.name for p in (tmp_path / "opt/ml/checkpoints").iterdir()] == [trial]
    assert (tmp_path / "opt/ml/checkpoints" / trial / "step-00000010" / "complete").is_file()
