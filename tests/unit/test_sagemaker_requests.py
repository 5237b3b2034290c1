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
from gpuscout.spec.jobspec import JobSpec, Prediction
from gpuscout.spec.metric_lines import METRIC_DEFINITIONS

SETTINGS = RequestSettings(
    role_arn="arn:aws:iam::123456789012:role/sm",
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
