"""The request builders produce what SageMaker's own API model accepts, with the paths of the Cloud contract."""

from __future__ import annotations

from typing import Any

import botocore.session
import pytest
from botocore.validate import ParamValidator

from gpuscout.cloud.sagemaker_requests import (
    DataSource,
    RequestSettings,
    max_wait_seconds,
    processing_job_request,
    training_job_request,
)
from gpuscout.domain.jobspec import JobSpec, Prediction
from gpuscout.domain.metric_lines import METRIC_DEFINITIONS

SETTINGS = RequestSettings(
    role_arn="arn:aws:iam::123456789012:role/sm",
    processing_role_arn="arn:aws:iam::123456789012:role/prep",
    training_image_uri="123456789012.dkr.ecr.us-east-1.amazonaws.com/gpuscout:1",
    data_bucket="data-b",
    artifacts_bucket="art-b",
)
DATA = DataSource(source="s3://raw-b/corpus/", tokenizer="qwen", sequence_length=2048, max_documents=1000)
SAGEMAKER = botocore.session.get_session().get_service_model("sagemaker")


def _spec(spot: bool) -> JobSpec:
    return JobSpec(
        job_name="gs-abc-t0v0r0-p5-48xlarge-b8",
        run_id="demo-1234",
        target_index=0,
        variant_name="b8",
        repetition=0,
        instance_type="ml.p5.48xlarge",
        instance_count=2,
        gpus_per_instance=8,
        spot=spot,
        price_per_hour_usd=98.32,
        precision="bf16",
        max_runtime_seconds=5400,
        hyperparameters={"max_steps": "100", "run_id": "demo-1234"},
        prediction=Prediction(
            tokens_per_s=1e6, mfu_assumed=0.4, training_seconds=600, overhead_seconds=300, cost_usd=49.0, method="x"
        ),
    )


def _assert_valid(operation: str, request: dict[str, Any]) -> None:
    report = ParamValidator().validate(request, SAGEMAKER.operation_model(operation).input_shape)
    assert not report.has_errors(), report.generate_report()


@pytest.mark.parametrize("spot", [False, True])
def test_training_request_is_a_valid_create_training_job_call(spot: bool) -> None:
    request = training_job_request(_spec(spot), SETTINGS, DATA, enable_network_isolation=True)
    _assert_valid("CreateTrainingJob", request)
    assert request["AlgorithmSpecification"]["MetricDefinitions"] == METRIC_DEFINITIONS
    assert request["ResourceConfig"] == {"InstanceType": "ml.p5.48xlarge", "InstanceCount": 2, "VolumeSizeInGB": 100}
    assert request["InputDataConfig"][0]["ChannelName"] == "train"
    assert request["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3Uri"] == (
        f"s3://data-b/processed/{DATA.cache_key}/"
    )
    assert request["OutputDataConfig"] == {"S3OutputPath": "s3://art-b/output/demo-1234/"}
    assert request["CheckpointConfig"] == {
        "S3Uri": "s3://art-b/checkpoints/demo-1234/gs-abc-t0v0r0-p5-48xlarge-b8/",
        "LocalPath": "/opt/ml/checkpoints",
    }
    assert request["EnableNetworkIsolation"] is True
    assert request["EnableManagedSpotTraining"] is spot
    assert {"Key": "gpuscout:managed", "Value": "true"} in request["Tags"]
    stopping = request["StoppingCondition"]
    assert stopping["MaxRuntimeInSeconds"] == 5400
    if spot:
        assert stopping["MaxWaitTimeInSeconds"] > stopping["MaxRuntimeInSeconds"]
    else:
        assert "MaxWaitTimeInSeconds" not in stopping


def test_max_wait_honours_the_manifest_but_always_exceeds_the_runtime() -> None:
    assert max_wait_seconds(3600) == 7200
    assert max_wait_seconds(600) == 600 + 3600
    assert max_wait_seconds(3600, 36_000) == 36_000
    assert max_wait_seconds(3600, 1800) == 3601


def test_processing_request_is_a_valid_create_processing_job_call() -> None:
    request = processing_job_request("demo-1234", SETTINGS, DATA)
    _assert_valid("CreateProcessingJob", request)
    assert request["RoleArn"] == "arn:aws:iam::123456789012:role/prep"  # not the training jobs' role
    assert request["ProcessingResources"]["ClusterConfig"]["InstanceType"] == "ml.m5.xlarge"
    assert request["ProcessingInputs"][0]["S3Input"]["S3Uri"] == "s3://raw-b/corpus/"
    args = request["AppSpecification"]["ContainerArguments"]
    assert args[args.index("--max-documents") + 1] == "1000"
    assert args[args.index("--sequence-length") + 1] == "2048"


def test_bundled_sources_need_no_processing_input() -> None:
    request = processing_job_request("demo-1234", SETTINGS, DataSource("bundled:hebrew-bible", "bpe", 256))
    _assert_valid("CreateProcessingJob", request)
    assert request["ProcessingInputs"] == []


def test_cache_key_depends_on_what_changes_the_processed_bytes() -> None:
    same = DataSource(source="s3://raw-b/corpus/", tokenizer="qwen", sequence_length=2048, max_documents=1000)
    assert same.cache_key == DATA.cache_key
    for other in (
        DataSource("s3://raw-b/other/", "qwen", 2048, 1000),
        DataSource("s3://raw-b/corpus/", "bpe", 2048, 1000),
        DataSource("s3://raw-b/corpus/", "qwen", 4096, 1000),
        DataSource("s3://raw-b/corpus/", "qwen", 2048, None),
    ):
        assert other.cache_key != DATA.cache_key


def test_an_s3_model_is_the_model_input_channel() -> None:
    # Given a job whose model is an S3 prefix (model.path), When its request is built
    spec = _spec(False)
    spec = spec.model_copy(
        update={"hyperparameters": {**spec.hyperparameters, "model_name_or_path": "s3://data-b/raw/models/q/"}}
    )
    request = training_job_request(spec, SETTINGS, DATA, enable_network_isolation=True)
    _assert_valid("CreateTrainingJob", request)
    # Then SageMaker downloads it as the "model" channel (train.py reads SM_CHANNEL_MODEL): no network needed
    channels = {c["ChannelName"]: c for c in request["InputDataConfig"]}
    assert set(channels) == {"train", "model"}
    assert channels["model"]["DataSource"]["S3DataSource"]["S3Uri"] == "s3://data-b/raw/models/q/"
    # and a preset or hub model adds no channel
    assert (
        len(training_job_request(_spec(False), SETTINGS, DATA, enable_network_isolation=False)["InputDataConfig"]) == 1
    )


def test_a_canary_with_network_reads_its_part_of_an_s3_model_itself() -> None:
    # Given the canary of a job whose model is an S3 prefix (a canary_layers cut)
    spec = _spec(False)
    hp = {**spec.hyperparameters, "model_name_or_path": "s3://data-b/raw/models/q/", "canary_layers": "2"}
    canary = spec.model_copy(update={"hyperparameters": hp})
    # When it has network, Then it gets no model channel (which would copy the whole checkpoint): train.py reads
    # only its layers' byte ranges (training/gpuscout_train/partial_checkpoint.py)
    request = training_job_request(canary, SETTINGS, DATA, enable_network_isolation=False)
    assert [c["ChannelName"] for c in request["InputDataConfig"]] == ["train"]
    # and under network isolation the channel is its only way in
    isolated = training_job_request(canary, SETTINGS, DATA, enable_network_isolation=True)
    assert [c["ChannelName"] for c in isolated["InputDataConfig"]] == ["train", "model"]


# -- the user's own code (a job section) --------------------------------------------------------------------------


def _check_constraints(shape: Any, value: Any, where: str) -> None:
    """What ParamValidator leaves out: the API model's max lengths, patterns and map sizes, recursively (the
    patterns are Java's: the ``regex`` module reads their ``\\p{...}`` classes)."""
    import regex

    meta = shape.metadata
    if shape.type_name == "structure":
        for name, member in shape.members.items():
            if name in value:
                _check_constraints(member, value[name], f"{where}.{name}")
    elif shape.type_name == "list":
        assert len(value) <= meta.get("max", len(value)), where
        for i, item in enumerate(value):
            _check_constraints(shape.member, item, f"{where}[{i}]")
    elif shape.type_name == "map":
        assert len(value) <= meta.get("max", len(value)), f"{where}: {len(value)} entries"
        for key, item in value.items():
            _check_constraints(shape.key, key, f"{where} key {key!r}")
            _check_constraints(shape.value, item, f"{where}[{key!r}]")
    elif shape.type_name == "string":
        assert len(value) <= meta.get("max", len(value)), f"{where}: {len(value)} characters"
        if "pattern" in meta:
            assert regex.fullmatch(meta["pattern"], value), f"{where}: {value!r} !~ {meta['pattern']}"


def _two_tower_plan(source_dir: str = "s3://data-b/raw/code/two-tower-cloud-0123456789abcdef/") -> list[JobSpec]:
    from gpuscout.domain.catalog import load_catalog
    from gpuscout.domain.manifest_loader import parse_manifest
    from gpuscout.paths import REPO_DIR
    from gpuscout.plan.planner import plan

    text = (
        (REPO_DIR / "examples" / "two-tower" / "cloud.yaml")
        .read_text()
        .replace("source_dir: .", f"source_dir: {source_dir}")
    )
    return plan(parse_manifest(text, "cloud.yaml"), load_catalog(), run_id="two-tower-cloud-20261123-abcdef").jobs


def test_a_job_section_request_is_a_valid_create_training_job_call_with_the_code_channel() -> None:
    from gpuscout.plan.canary import plan_cloud_canaries

    specs = _two_tower_plan()
    canaries = [c.spec for c in plan_cloud_canaries(specs, instance_type="ml.g5.8xlarge", gpus_per_instance=1,
                                                    price_per_hour_usd=2.45)]  # fmt: skip
    assert len(specs) == 12 and len(canaries) == 6  # 3 instance types x 2 batch sizes; spot shares a configuration
    shape = SAGEMAKER.operation_model("CreateTrainingJob").input_shape
    for spec in [*specs, *canaries]:
        request = training_job_request(spec, SETTINGS, None, enable_network_isolation=False)
        _assert_valid("CreateTrainingJob", request)
        _check_constraints(shape, request, "CreateTrainingJob")
        # The code channel is the only input: the user's script reads its own data, nothing is prepared
        assert request["InputDataConfig"] == [
            {
                "ChannelName": "code",
                "DataSource": {"S3DataSource": {"S3DataType": "S3Prefix", "S3DataDistributionType": "FullyReplicated",
                                                "S3Uri": "s3://data-b/raw/code/two-tower-cloud-0123456789abcdef/"}},
                "InputMode": "File",
            }
        ]  # fmt: skip
        # the script's own arguments are the hyperparameters (the launcher passes them as --key value)
        assert request["HyperParameters"]["batch_size"] in ("4096", "16384")
        assert "max_steps" not in request["HyperParameters"] and "run_id" not in request["HyperParameters"]
        env = request["Environment"]
        assert env["GPUSCOUT_ENTRY_POINT"] == "train.py" and env["GPUSCOUT_REQUIREMENTS"] == "requirements.txt"
        assert env["GPUSCOUT_DISTRIBUTION"] == "per_gpu" and env["GPUSCOUT_UNIT"] == "samples"
        assert env["GPUSCOUT_CHECKPOINT_DIR"] == request["CheckpointConfig"]["LocalPath"] == "/opt/ml/checkpoints"
        if "-canary" in spec.job_name:
            assert (env["GPUSCOUT_MAX_STEPS"], env["GPUSCOUT_STOP_RULE"], env["GPUSCOUT_CANARY"]) == ("2", "fixed", "1")
            assert request["HyperParameters"]["interactions"] == "50000"  # job.canary_arguments
            assert request["ResourceConfig"]["InstanceType"] == "ml.g5.8xlarge"
        else:
            assert (env["GPUSCOUT_MAX_STEPS"], env["GPUSCOUT_STOP_RULE"]) == ("2000", "steady_state")
            assert request["HyperParameters"]["interactions"] == "2000000"
        assert request["EnableManagedSpotTraining"] is spec.spot


def test_a_job_section_request_needs_its_code_in_s3() -> None:
    [spec, *_] = _two_tower_plan(source_dir="s3://data-b/raw/code/x/")
    local = spec.model_copy(update={"job_code": spec.job_code.model_copy(update={"source_dir": "/home/me/code"})})
    with pytest.raises(ValueError, match="not in S3"):
        training_job_request(local, SETTINGS, None, enable_network_isolation=False)


def test_a_tracked_job_gets_its_tracking_settings_in_one_environment_value() -> None:
    from gpuscout.domain.manifest_search import TrackingSection
    from gpuscout.domain.tracking import TRACKING_ENV, JobTracking

    # Given a job whose manifest tracks with a SageMaker managed MLflow server and W&B (offline)
    arn = "arn:aws:sagemaker:us-east-1:123456789012:mlflow-tracking-server/team"
    tracking = TrackingSection.model_validate({"mlflow": {"tracking_uri": arn, "experiment": "demo"},
                                               "wandb": {"project": "gpuscout"}})  # fmt: skip
    spec = _spec(False).model_copy(update={"tracking": tracking})
    # When its request is built
    request = training_job_request(spec, SETTINGS, DATA, enable_network_isolation=False)
    # Then the request is valid (the value fits SageMaker's 512 characters) and the job learns where to track
    _assert_valid("CreateTrainingJob", request)
    _check_constraints(SAGEMAKER.operation_model("CreateTrainingJob").input_shape, request, "request")
    value = JobTracking.model_validate_json(request["Environment"][TRACKING_ENV])
    assert value.mlflow is not None and (value.mlflow.tracking_uri, value.mlflow.experiment) == (arn, "demo")
    assert value.wandb is not None and (value.wandb.dir, value.wandb.mode) == ("/opt/ml/output/data", "offline")
    assert not value.wandb.log_artifacts  # an offline Artifact's files stay in the container: they would not sync
    assert (value.variant, value.instance_count, value.usd_per_hour) == ("b8", 2, pytest.approx(2 * 98.32))
    # and an untracked job's request has no such variable
    untracked = training_job_request(_spec(False), SETTINGS, DATA, enable_network_isolation=False)
    assert TRACKING_ENV not in untracked["Environment"]
    # a value SageMaker would refuse is an error here, not a failed CreateTrainingJob
    assert tracking.mlflow is not None
    long = tracking.model_copy(update={"mlflow": tracking.mlflow.model_copy(update={"experiment": "x" * 500})})
    with pytest.raises(ValueError, match="512"):
        training_job_request(spec.model_copy(update={"tracking": long}), SETTINGS, DATA, enable_network_isolation=False)
