"""A settings search in the cloud: one CreateHyperParameterTuningJob request per target, valid for SageMaker's own
API model (botocore's ParamValidator plus the lengths, patterns and map sizes it leaves out)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from gpuscout.cloud.sagemaker_requests import DataSource, RequestSettings, training_job_request
from gpuscout.cloud.tuning_requests import (
    CANDIDATE_HYPERPARAMETER,
    CANDIDATE_KEYS,
    MAX_CATEGORICAL_VALUES,
    SearchTarget,
    TuningRequestError,
    search_target,
    static_hyperparameters,
    tuning_job_name,
    tuning_job_request,
)
from gpuscout.domain.candidates import candidate_name, parse_candidate_name
from gpuscout.domain.catalog import load_catalog
from gpuscout.domain.jobspec import JOB_NAME_RE
from gpuscout.domain.manifest_loader import parse_manifest
from gpuscout.domain.metric_lines import (
    OBJECTIVE_KEY,
    OBJECTIVE_METRIC,
    format_metric_line,
    usd_per_million_tokens,
)
from gpuscout.plan.jobs import Plan
from gpuscout.plan.planner import plan
from tests.unit.test_sagemaker_requests import SAGEMAKER, _assert_valid, _check_constraints

SETTINGS = RequestSettings(
    role_arn="arn:aws:iam::123456789012:role/gpuscout-sagemaker",
    training_image_uri="123456789012.dkr.ecr.us-east-1.amazonaws.com/gpuscout-training:3f2c1a",
    data_bucket="gpuscout-data-123456789012",
    artifacts_bucket="gpuscout-artifacts-123456789012",
)
DATA = DataSource(source="bundled:hebrew-bible", tokenizer="bpe", sequence_length=1024, vocab_size=4096)
RUN_ID = "qwen-search-20261123-171103-c23acf"
# Three targets: on-demand, spot (a stated wait), two P5 nodes with their own space; 8 sequences per GPU per step.
MANIFEST = """
name: qwen-search
model: {preset: qwen2.5-0.5b}
tokenizer: {kind: bpe, vocab_size: 4096}
dataset: {source: "bundled:hebrew-bible"}
sequence_length: 1024
training: {max_steps: 40, learning_rate: 2.0e-5, precision: bf16}
network_isolation: true
targets:
  - instance_type: ml.g5.12xlarge
  - instance_type: ml.p4d.24xlarge
    spot: true
    max_wait_hours: 6
  - instance_type: ml.p5.48xlarge
    instance_count: 2
constraints: {budget_usd: 900}
search:
  space:
    per_device_batch_size: [1, 2, 4, 8]
    gradient_checkpointing: [false, true]
    deepspeed_stage: [0, 2]
    dataloader_workers: [0, 2]
  by_instance_type:
    ml.p5.48xlarge: {attention: [sdpa, flex], deepspeed_stage: [0], dataloader_workers: [2]}
  sequences_per_step: 8
  max_trials: 12
  seed: 7
"""


def _plan(text: str = MANIFEST) -> Plan:
    catalog = load_catalog()
    return plan(parse_manifest(text, "search.yaml", catalog), catalog, run_id=RUN_ID)


def _requests(the_plan: Plan, *, max_parallel_jobs: int = 2) -> list[dict[str, Any]]:
    assert the_plan.search is not None
    return [
        tuning_job_request(
            target,
            [j for j in the_plan.jobs if j.target_index == target.target_index],
            the_plan.search,
            SETTINGS,
            DATA,
            enable_network_isolation=True,
            max_parallel_jobs=max_parallel_jobs,
            spot_max_wait_seconds=6 * 3600 if target.target_index == 1 else None,
        )
        for target in the_plan.search.targets
    ]


def test_every_target_of_a_search_is_a_valid_create_hyper_parameter_tuning_job_call() -> None:
    the_plan = _plan()
    assert the_plan.search is not None
    shape = SAGEMAKER.operation_model("CreateHyperParameterTuningJob").input_shape
    requests = _requests(the_plan)
    assert len(requests) == len(the_plan.search.targets) == 3
    for target, request in zip(the_plan.search.targets, requests, strict=True):
        _assert_valid("CreateHyperParameterTuningJob", request)
        _check_constraints(shape, request, "CreateHyperParameterTuningJob")
        # what the state machine adds with the vpc setting is valid too
        definition = request["TrainingJobDefinition"]
        vpc = {"Subnets": ["subnet-0123456789abcdef0"], "SecurityGroupIds": ["sg-0123456789abcdef0"]}
        with_vpc = {**request, "TrainingJobDefinition": {**definition, "VpcConfig": vpc}}
        _assert_valid("CreateHyperParameterTuningJob", with_vpc)
        _check_constraints(shape, with_vpc, "CreateHyperParameterTuningJob")

        # One categorical hyperparameter: the target's launchable candidates (the skipped ones never appear)
        specs = [j for j in the_plan.jobs if j.target_index == target.target_index]
        config = request["HyperParameterTuningJobConfig"]
        [candidates] = config["ParameterRanges"]["CategoricalParameterRanges"]
        assert candidates == {"Name": CANDIDATE_HYPERPARAMETER, "Values": target.candidates}
        assert set(candidates["Values"]) == {s.variant_name for s in specs}
        assert not {s.name for s in target.skipped} & set(candidates["Values"])
        assert set(config["ParameterRanges"]) == {"CategoricalParameterRanges"}
        # Minimize the running $/1M tokens that train.py prints; early stopping on (pruning is on by default)
        assert config["HyperParameterTuningJobObjective"] == {"Type": "Minimize", "MetricName": OBJECTIVE_METRIC}
        metrics = {d["Name"] for d in definition["AlgorithmSpecification"]["MetricDefinitions"]}
        assert OBJECTIVE_METRIC in metrics
        assert (config["Strategy"], config["TrainingJobEarlyStoppingType"]) == ("Bayesian", "Auto")
        assert config["RandomSeed"] == 7
        assert config["ResourceLimits"] == {
            "MaxNumberOfTrainingJobs": min(12, len(target.candidates)),
            "MaxParallelTrainingJobs": 2,
        }
        # The static hyperparameters: what every candidate shares, the job's price and the objective's first rung
        static = definition["StaticHyperParameters"]
        assert static["job_name"] == request["HyperParameterTuningJobName"]
        price = specs[0].price_per_hour_usd * specs[0].instance_count
        assert float(static["price_per_hour_usd"]) == pytest.approx(price)
        assert static["objective_min_timed_steps"] == str(the_plan.search.min_timed_steps) == "4"
        assert static["max_steps"] == specs[0].hyperparameters["max_steps"] == "40"
        for key, value in static.items():
            if key not in CANDIDATE_KEYS and key in specs[0].hyperparameters:
                assert all(s.hyperparameters[key] == value for s in specs), key
        assert CANDIDATE_HYPERPARAMETER not in static
        # As a training job of the same target: image, channels, output, instances, isolation, tags
        training = training_job_request(specs[0], SETTINGS, DATA, enable_network_isolation=True)
        for field in ("AlgorithmSpecification", "RoleArn", "InputDataConfig", "OutputDataConfig", "ResourceConfig"):
            assert definition[field] == training[field], field
        assert definition["ResourceConfig"]["InstanceType"] == target.instance_type
        assert definition["EnableNetworkIsolation"] is True and request["Tags"] == training["Tags"]
        assert {"Key": "gpuscout:run-id", "Value": RUN_ID} in request["Tags"]
        assert "GPUSCOUT_JOB_NAME" not in definition["Environment"]  # each trial has its own name
        assert definition["CheckpointConfig"] == {
            "S3Uri": f"s3://{SETTINGS.artifacts_bucket}/checkpoints/{RUN_ID}/{request['HyperParameterTuningJobName']}/",
            "LocalPath": "/opt/ml/checkpoints",
        }
        stopping = definition["StoppingCondition"]
        assert stopping["MaxRuntimeInSeconds"] == max(s.max_runtime_seconds for s in specs)
        assert definition["EnableManagedSpotTraining"] is specs[0].spot
        if specs[0].spot:
            assert stopping["MaxWaitTimeInSeconds"] == 6 * 3600 > stopping["MaxRuntimeInSeconds"]
        else:
            assert "MaxWaitTimeInSeconds" not in stopping
    assert requests[2]["TrainingJobDefinition"]["ResourceConfig"]["InstanceCount"] == 2


def test_tuning_job_names_fit_sagemaker_and_their_trials_start_like_every_gpuscout_job() -> None:
    names = [r["HyperParameterTuningJobName"] for r in _requests(_plan())]
    assert names == [tuning_job_name(RUN_ID, i) for i in range(3)] and len(set(names)) == 3
    assert tuning_job_name(f"{RUN_ID}-r2", 0) not in names  # a retried run gets new names
    for name in names:
        assert len(name) <= 32 and re.fullmatch(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,31}", name)
        # SageMaker's trial names start with the tuning job's name: "gs-", the prefix the EventBridge rule matches
        # (tests/infra: JobStateChanged), and a valid training job name
        trial = f"{name}-012-6d2e9f0a"
        assert trial.startswith("gs-") and JOB_NAME_RE.match(trial)


def test_a_target_with_more_candidates_than_a_tuning_job_takes_is_refused_naming_search() -> None:
    # Given 4 x 2 x 2 x 2 x 2 = 64 settings on one instance type, most of which fit
    text = MANIFEST.replace(
        "    dataloader_workers: [0, 2]\n", "    dataloader_workers: [0, 2]\n    torch_compile: [false, true]\n"
    )
    the_plan = _plan(text)
    assert the_plan.search is not None
    target = the_plan.search.targets[1]
    assert len(target.candidates) > MAX_CATEGORICAL_VALUES
    specs = [j for j in the_plan.jobs if j.target_index == 1]
    with pytest.raises(TuningRequestError) as info:
        tuning_job_request(target, specs, the_plan.search, SETTINGS, DATA, enable_network_isolation=False,
                           max_parallel_jobs=1)  # fmt: skip
    message = str(info.value)
    assert message.startswith("search: targets[1] ml.p4d.24xlarge has ")
    assert f"at most {MAX_CATEGORICAL_VALUES}" in message and "search.by_instance_type.ml.p4d.24xlarge" in message


def test_the_categorical_limit_is_the_api_models() -> None:
    values = SAGEMAKER.shape_for("CategoricalParameterRange").members["Values"]  # type: ignore[attr-defined]
    assert values.metadata["max"] == MAX_CATEGORICAL_VALUES
    assert SAGEMAKER.shape_for("HyperParameterTuningJobName").metadata["max"] == 32


@pytest.mark.parametrize(
    ("pruning", "max_trials", "expected"),
    [(True, 100, ("Bayesian", "Auto")), (False, 100, ("Grid", "Off")), (False, 3, ("Bayesian", "Off"))],
)
def test_strategy_and_early_stopping(pruning: bool, max_trials: int, expected: tuple[str, str]) -> None:
    text = MANIFEST.replace("  max_trials: 12\n", f"  max_trials: {max_trials}\n  pruning: {{enabled: {pruning}}}\n")
    the_plan = _plan(text)
    assert the_plan.search is not None
    request = _requests(the_plan, max_parallel_jobs=8)[0]
    _assert_valid("CreateHyperParameterTuningJob", request)
    config = request["HyperParameterTuningJobConfig"]
    assert (config["Strategy"], config["TrainingJobEarlyStoppingType"]) == expected
    candidates = len(the_plan.search.targets[0].candidates)
    # Grid runs every candidate exactly once (MaxNumberOfTrainingJobs must then be their number)
    assert config["ResourceLimits"]["MaxNumberOfTrainingJobs"] == min(max_trials, candidates)
    assert config["ResourceLimits"]["MaxParallelTrainingJobs"] == min(8, max_trials, candidates)


def test_candidate_names_parse_back_into_their_settings() -> None:
    the_plan = _plan()
    assert the_plan.search is not None
    names = [n for t in the_plan.search.targets for n in t.candidates]
    names += [s.name for t in the_plan.search.targets for s in t.skipped]
    for name in [*names, "b8-a1-z2-ckpt-compile-fce-flex-w2"]:
        settings = parse_candidate_name(name)
        assert candidate_name(settings, settings["gradient_accumulation_steps"]) == name
    for spec in the_plan.jobs:  # the settings the planner gave each candidate's job
        settings = parse_candidate_name(spec.variant_name)
        hp = spec.hyperparameters
        assert (str(settings["per_device_batch_size"]), str(settings["gradient_accumulation_steps"])) == (
            hp["per_device_train_batch_size"],
            hp["gradient_accumulation_steps"],
        )
        assert str(settings["deepspeed_stage"]) == hp["deepspeed_stage"]
        assert str(settings["gradient_checkpointing"]).lower() == hp["gradient_checkpointing"]
        assert settings["attention"] == hp["attention_implementation"]
    for bad in ("b4-a2", "a2-b4-w0", "b4-a2-w0-w1", "b4-a2-z0-w0", "b4-a2-sdpa-w0", "b4-a2-w0-x", ""):
        with pytest.raises(ValueError, match="is not a search candidate name"):
            parse_candidate_name(bad)


def test_candidates_that_differ_in_what_their_name_does_not_carry_are_refused() -> None:
    the_plan = _plan()
    specs = [j for j in the_plan.jobs if j.target_index == 0][:2]
    other = specs[1].model_copy(update={"hyperparameters": {**specs[1].hyperparameters, "learning_rate": "0.1"}})
    with pytest.raises(TuningRequestError, match="differ in learning_rate"):
        static_hyperparameters([specs[0], other], "targets[0] ml.g5.12xlarge")


METHODS_SEARCH = """
name: qwen-methods
model: {hf_id: Qwen/Qwen2.5-0.5B}
tokenizer: {kind: qwen}
dataset: {source: "bundled:hebrew-bible"}
sequence_length: 1024
training: {max_steps: 40, learning_rate: 2.0e-5, precision: bf16}
targets:
  - instance_type: ml.g5.12xlarge
variants:
  - {name: base, method: lora, lora: {rank: 8, alpha: 16}}
constraints: {budget_usd: 900, target_loss: 2.0}
search:
  space: {per_device_batch_size: [4], deepspeed_stage: [0, 2], method: [full, lora, qlora], lora_rank: [8, 32]}
  sequences_per_step: 8
  pruning: {enabled: false}
"""


def test_a_search_over_methods_and_ranks_is_one_valid_tuning_job_whose_trials_read_their_method() -> None:
    text = METHODS_SEARCH
    the_plan = _plan(text)
    assert the_plan.search is not None
    request = _requests(the_plan, max_parallel_jobs=8)[0]
    _assert_valid("CreateHyperParameterTuningJob", request)
    static = request["TrainingJobDefinition"]["StaticHyperParameters"]
    # the adapters' shared knobs are static; the method and the rank come with each trial's candidate name
    assert (static["lora_alpha"], static["lora_target_modules"].count(",")) == ("16", 6)
    assert "method" not in static and "lora_rank" not in static
    target = the_plan.search.targets[0]
    assert {parse_candidate_name(n)["method"] for n in target.candidates} == {"full", "lora", "qlora"}
    assert {parse_candidate_name(n).get("lora_rank") for n in target.candidates} == {None, 8, 32}
    # ZeRO with an adapter is skipped with why, never launched
    assert any(s.reason.startswith("method lora trains only the adapters") for s in target.skipped)


def test_the_search_file_gives_each_trial_its_candidates_spec() -> None:
    the_plan = _plan()
    assert the_plan.search is not None
    target = the_plan.search.targets[0]
    specs = [j for j in the_plan.jobs if j.target_index == 0]
    found = SearchTarget.model_validate_json(search_target(target, specs, the_plan.search).model_dump_json())
    assert found.tuning_job_name == tuning_job_name(RUN_ID, 0) and found.early_stopping is True
    trial = found.trial_spec(specs[3].variant_name, f"{found.tuning_job_name}-004-0a1b2c3d")
    assert trial.job_name == trial.hyperparameters["job_name"] == f"{found.tuning_job_name}-004-0a1b2c3d"
    assert trial.model_dump(exclude={"job_name", "hyperparameters"}) == specs[3].model_dump(
        exclude={"job_name", "hyperparameters"}
    )


def test_the_objective_regex_reads_only_the_running_cost_on_step_lines() -> None:
    definitions = {d["Name"]: re.compile(d["Regex"]) for d in _requests(_plan())[0]["TrainingJobDefinition"][
        "AlgorithmSpecification"]["MetricDefinitions"]}  # fmt: skip
    objective = definitions[OBJECTIVE_METRIC]
    value = usd_per_million_tokens(5.672, 26_021.7)
    assert value == pytest.approx(5.672 / 3600 / 26_021.7 * 1e6)
    line = format_metric_line({"step": 9, "loss": 4.2, "tokens_per_s": 26_021.7, OBJECTIVE_KEY: value})
    match = objective.search(line)
    assert match is not None and float(match.group(1)) == pytest.approx(value, rel=1e-7)
    assert objective.search(format_metric_line({"step": 2, "loss": 4.9, "tokens_per_s": 9000.0})) is None
    assert objective.search(format_metric_line({"tokens_per_s": 26_021.7}, summary=True)) is None
    assert usd_per_million_tokens(5.672, 0.0) is None
