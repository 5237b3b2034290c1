"""JobSpec -> SageMaker CreateTrainingJob / CreateProcessingJob request dicts (the Cloud contract).

The state machine passes these requests to SageMaker unchanged, so every top-level field it references is always
present. Paths (docs/internals.md):

- processed data   ``s3://<data>/processed/<sha256(source, tokenizer, sequence_length, max_documents)>/``
- job output       ``s3://<artifacts>/output/<run_id>/`` (SageMaker adds ``<job_name>/output/output.tar.gz``,
                   the tarred ``SM_OUTPUT_DATA_DIR`` that holds ``benchmark.json``)
- checkpoints      ``s3://<artifacts>/checkpoints/<run_id>/<job_name>/`` <-> ``/opt/ml/checkpoints``
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from gpuscout.domain.jobspec import JOB_NAME_RE, JobSpec
from gpuscout.domain.metric_lines import METRIC_DEFINITIONS
from gpuscout.domain.names import CHECKPOINTS_PREFIX, JOB_NAME_PREFIX, OUTPUT_PREFIX, PROCESSED_PREFIX
from gpuscout.domain.tracking import tracking_environment
from gpuscout.errors import GpuscoutError
from gpuscout.paths import DATA_PREPARATION_MODULE

CHECKPOINT_LOCAL_PATH = "/opt/ml/checkpoints"
PROCESSING_INPUT_DIR = "/opt/ml/processing/input/raw"
PROCESSING_OUTPUT_DIR = "/opt/ml/processing/output"
# The data preparation job's entry point in the training image, whose PYTHONPATH holds training/ (training/Dockerfile)
DATA_PREPARATION_ENTRYPOINT = ("python3", "-m", DATA_PREPARATION_MODULE)
DATASET_MANIFEST = "dataset.json"
DEFAULT_VOLUME_SIZE_GB = 100
PROCESSING_VOLUME_SIZE_GB = 50
PROCESSING_MAX_RUNTIME_SECONDS = 4 * 3600
# Spot: how long SageMaker may wait for capacity / resume after interruptions on top of the runtime itself.
SPOT_MIN_EXTRA_WAIT_SECONDS = 3600
MAX_WAIT_LIMIT_SECONDS = 28 * 24 * 3600  # SageMaker's upper bound for MaxWaitTimeInSeconds
MANAGED_TAG = {"Key": "gpuscout:managed", "Value": "true"}
RUN_ID_TAG = "gpuscout:run-id"


@dataclass(frozen=True)
class RequestSettings:
    """The account-specific parts of every request (from the Lambda environment, see gpuscout.cloud.settings)."""

    # the run's own role (gpuscout.cloud.run_roles): reads sources and prepared data, writes its run's artifacts only
    role_arn: str
    training_image_uri: str
    data_bucket: str
    artifacts_bucket: str
    processing_instance_type: str = "ml.m5.xlarge"
    processing_role_arn: str | None = None  # data preparation's role (writes processed/); the stack always sets it


@dataclass(frozen=True)
class DataSource:
    """What the data-preparation step turns into a processed dataset; its hash names the cache folder.

    The cache key covers (source, tokenizer, sequence_length, max_documents) and the other options that change the
    prepared bytes (tokenizer path / vocabulary size, text field, minimum length, validation split).
    """

    source: str  # s3://bucket/prefix or bundled:<name>
    tokenizer: str  # qwen | bpe | hf
    sequence_length: int
    max_documents: int | None = None
    tokenizer_path: str | None = None
    vocab_size: int | None = None
    text_field: str = "text"
    format: str = "auto"  # dataset.format
    min_characters: int = 20
    validation_fraction: float = 0.05

    @property
    def cache_key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()

    def processed_prefix(self) -> str:
        """Key prefix (no leading slash, trailing slash) in the data bucket."""
        return f"{PROCESSED_PREFIX}{self.cache_key}/"

    def dataset_manifest_key(self) -> str:
        return self.processed_prefix() + DATASET_MANIFEST


def processed_data_uri(settings: RequestSettings, data: DataSource) -> str:
    return f"s3://{settings.data_bucket}/{data.processed_prefix()}"


def output_uri(settings: RequestSettings, run_id: str) -> str:
    return f"s3://{settings.artifacts_bucket}/{OUTPUT_PREFIX}{run_id}/"


def output_tar_key(run_id: str, job_name: str) -> str:
    """Where SageMaker puts the tarred SM_OUTPUT_DATA_DIR (with benchmark.json) in the artifacts bucket."""
    return f"{OUTPUT_PREFIX}{run_id}/{job_name}/output/output.tar.gz"


def checkpoint_uri(settings: RequestSettings, run_id: str, job_name: str) -> str:
    return f"s3://{settings.artifacts_bucket}/{CHECKPOINTS_PREFIX}{run_id}/{job_name}/"


def _tags(run_id: str) -> list[dict[str, str]]:
    return [{"Key": RUN_ID_TAG, "Value": run_id}, dict(MANAGED_TAG)]


def max_wait_seconds(max_runtime_seconds: int, requested_seconds: int | None = None) -> int:
    """MaxWaitTimeInSeconds for a spot job: the manifest's max_wait_hours when given, else runtime + max(runtime,
    1 h); never less than runtime + 1 s (a spot job must be allowed to wait longer than it runs)."""
    wanted = requested_seconds or max_runtime_seconds + max(max_runtime_seconds, SPOT_MIN_EXTRA_WAIT_SECONDS)
    return min(max(wanted, max_runtime_seconds + 1), MAX_WAIT_LIMIT_SECONDS)


CODE_CHANNEL = "code"  # the user's source_dir (a job section), at /opt/ml/input/data/code in the container


def _s3_channel(name: str, uri: str) -> dict[str, Any]:
    source = {"S3DataType": "S3Prefix", "S3Uri": uri, "S3DataDistributionType": "FullyReplicated"}
    return {"ChannelName": name, "DataSource": {"S3DataSource": source}, "InputMode": "File"}


MODEL_CHANNEL = "model"


def _model_channel(spec: JobSpec, *, isolated: bool) -> list[dict[str, Any]]:
    """An S3 model (model.path) as the ``model`` input channel: SageMaker downloads it with the job's role before
    the container starts (train.py reads SM_CHANNEL_MODEL), so it loads under network isolation too.

    A canary with network (a ``canary_layers`` cut, not ``isolated``) gets no channel: the channel would download
    the whole checkpoint, and train.py reads only the part its layers need from S3
    (gpuscout_train/partial_checkpoint.py). Under network isolation the channel is the only way in, so its canary
    downloads all of it."""
    uri = spec.hyperparameters.get("model_name_or_path", "")
    if not uri.startswith("s3://") or (int(spec.hyperparameters.get("canary_layers") or 0) > 0 and not isolated):
        return []
    uri = uri if uri.endswith("/") else uri + "/"  # raw/models/q must not also pull raw/models/q-7b/
    return [_s3_channel(MODEL_CHANNEL, uri)]


def job_code_environment(spec: JobSpec) -> dict[str, str]:
    """What the image's launcher needs to run the user's code instead of train.py (training/gpuscout_train/launcher.py
    ``run_job_code``), and the gpuscout_report helper's settings."""
    code = spec.job_code
    assert code is not None
    env = {**code.environment, "GPUSCOUT_ENTRY_POINT": code.entry_point, "GPUSCOUT_DISTRIBUTION": code.distribution}
    if code.requirements:
        env["GPUSCOUT_REQUIREMENTS"] = code.requirements
    return env


def _input_channels(
    spec: JobSpec, settings: RequestSettings, data: DataSource | None, *, isolated: bool
) -> list[dict[str, Any]]:
    """The built-in job reads the processed dataset (``train``) and an S3 model (``model``); the user's own code
    gets its folder as the ``code`` channel and reads its own data."""
    if spec.job_code is not None:
        uri = spec.job_code.source_dir
        if not uri.startswith("s3://"):
            raise ValueError(f"job {spec.job_name}: source_dir {uri} is not in S3 (gpuscout submit uploads it)")
        return [_s3_channel(CODE_CHANNEL, uri if uri.endswith("/") else uri + "/")]
    if data is None:
        raise ValueError(f"job {spec.job_name}: the built-in job needs its processed data source")
    return [_s3_channel("train", processed_data_uri(settings, data)), *_model_channel(spec, isolated=isolated)]


def training_job_request(
    spec: JobSpec,
    settings: RequestSettings,
    data: DataSource | None,
    *,
    enable_network_isolation: bool,
    volume_size_gb: int = DEFAULT_VOLUME_SIZE_GB,
    environment: dict[str, str] | None = None,
    spot_max_wait_seconds: int | None = None,
) -> dict[str, Any]:
    """The full CreateTrainingJob request of one job (the built-in job with ``data``, or the user's own code)."""
    stopping: dict[str, int] = {"MaxRuntimeInSeconds": spec.max_runtime_seconds}
    if spec.spot:
        stopping["MaxWaitTimeInSeconds"] = max_wait_seconds(spec.max_runtime_seconds, spot_max_wait_seconds)
    env = {
        "GPUSCOUT_RUN_ID": spec.run_id,
        "GPUSCOUT_JOB_NAME": spec.job_name,
        "GPUSCOUT_CHECKPOINT_DIR": CHECKPOINT_LOCAL_PATH,
        **(job_code_environment(spec) if spec.job_code is not None else {}),
        **tracking_environment(spec),  # GPUSCOUT_TRACKING when the manifest tracks (gpuscout.domain.tracking)
        **(environment or {}),
    }
    return {
        "TrainingJobName": spec.job_name,
        "AlgorithmSpecification": {
            "TrainingImage": settings.training_image_uri,
            "TrainingInputMode": "File",
            "MetricDefinitions": [dict(d) for d in METRIC_DEFINITIONS],
        },
        "RoleArn": settings.role_arn,
        "HyperParameters": dict(spec.hyperparameters),
        "InputDataConfig": _input_channels(spec, settings, data, isolated=enable_network_isolation),
        "OutputDataConfig": {"S3OutputPath": output_uri(settings, spec.run_id)},
        "ResourceConfig": {
            "InstanceType": spec.instance_type,
            "InstanceCount": spec.instance_count,
            "VolumeSizeInGB": volume_size_gb,
            **({"TrainingPlanArn": spec.training_plan_arn} if spec.training_plan_arn else {}),
        },
        "StoppingCondition": stopping,
        "CheckpointConfig": {
            "S3Uri": checkpoint_uri(settings, spec.run_id, spec.job_name),
            "LocalPath": CHECKPOINT_LOCAL_PATH,
        },
        "EnableManagedSpotTraining": spec.spot,
        "EnableNetworkIsolation": enable_network_isolation,
        "Environment": env,
        "Tags": _tags(spec.run_id),
    }


def _processing_role(settings: RequestSettings) -> str:
    if settings.processing_role_arn is None:  # the training role cannot write processed/: the job would fail late
        raise GpuscoutError("no processing role: data preparation runs under the stack's PROCESSING_ROLE_ARN")
    return settings.processing_role_arn


def processing_job_name(run_id: str, data: DataSource) -> str:
    """A unique, valid ProcessingJobName: ``gs-prep-<cache key>-<run digest>`` (63 characters at most)."""
    run_digest = hashlib.sha256(run_id.encode()).hexdigest()[:10]
    name = f"{JOB_NAME_PREFIX}prep-{data.cache_key[:16]}-{run_digest}"
    if not JOB_NAME_RE.match(name):  # pragma: no cover - the pieces are hex digits by construction
        raise ValueError(f"invalid processing job name {name!r}")
    return name


def processing_job_request(run_id: str, settings: RequestSettings, data: DataSource) -> dict[str, Any]:
    """The CreateProcessingJob request that runs training/gpuscout_data/prepare.py on a CPU instance."""
    arguments = [
        "--input",
        PROCESSING_INPUT_DIR if data.source.startswith("s3://") else data.source,
        "--output",
        PROCESSING_OUTPUT_DIR,
        "--tokenizer",
        data.tokenizer,
        "--sequence-length",
        str(data.sequence_length),
        "--text-field",
        data.text_field,
        "--format",
        data.format,
        "--min-characters",
        str(data.min_characters),
        "--validation-fraction",
        str(data.validation_fraction),
    ]
    if data.max_documents is not None:
        arguments += ["--max-documents", str(data.max_documents)]
    if data.tokenizer_path is not None:
        arguments += ["--tokenizer-path", data.tokenizer_path]
    if data.vocab_size is not None:
        arguments += ["--vocab-size", str(data.vocab_size)]
    inputs: list[dict[str, Any]] = []
    if data.source.startswith("s3://"):
        inputs.append(
            {
                "InputName": "raw",
                "S3Input": {
                    "S3Uri": data.source,
                    "LocalPath": PROCESSING_INPUT_DIR,
                    "S3DataType": "S3Prefix",
                    "S3InputMode": "File",
                    "S3DataDistributionType": "FullyReplicated",
                },
            }
        )
    return {
        "ProcessingJobName": processing_job_name(run_id, data),
        "ProcessingResources": {
            "ClusterConfig": {
                "InstanceCount": 1,
                "InstanceType": settings.processing_instance_type,
                "VolumeSizeInGB": PROCESSING_VOLUME_SIZE_GB,
            }
        },
        "AppSpecification": {
            "ImageUri": settings.training_image_uri,
            "ContainerEntrypoint": list(DATA_PREPARATION_ENTRYPOINT),
            "ContainerArguments": arguments,
        },
        "RoleArn": _processing_role(settings),
        "ProcessingInputs": inputs,
        "ProcessingOutputConfig": {
            "Outputs": [
                {
                    "OutputName": "processed",
                    "S3Output": {
                        "S3Uri": processed_data_uri(settings, data),
                        "LocalPath": PROCESSING_OUTPUT_DIR,
                        "S3UploadMode": "EndOfJob",
                    },
                }
            ]
        },
        "StoppingCondition": {"MaxRuntimeInSeconds": PROCESSING_MAX_RUNTIME_SECONDS},
        "Environment": {"GPUSCOUT_RUN_ID": run_id, "GPUSCOUT_DATA_CACHE_KEY": data.cache_key},
        "Tags": _tags(run_id),
    }
