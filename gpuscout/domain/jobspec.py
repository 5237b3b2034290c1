"""JobSpec: one training job to run (a target x variant x repetition), the planner's output.

The same spec drives a SageMaker CreateTrainingJob in the cloud and a subprocess of training/train.py locally.
``hyperparameters`` is the contract with train.py: string values, as SageMaker passes them (it writes them to
/opt/ml/input/config/hyperparameters.json); train.py parses them with its dataclass arguments.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gpuscout.domain.manifest_search import TrackingSection

JOB_NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")  # SageMaker TrainingJobName rule

Precision = Literal["bf16", "fp16", "fp32"]


Unit = Literal["tokens", "samples"]


class Prediction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens_per_s: float | None  # None for a samples job whose samples have no stated size
    samples_per_s: float | None = None  # samples jobs (the job section's unit)
    unit: Unit = "tokens"  # what the job counts as work; rate is per second of it
    mfu_assumed: float | None  # None when the prediction is not from the FLOPs model (e.g. local CPU)
    training_seconds: float
    overhead_seconds: float  # provisioning + image pull + data download + upload
    cost_usd: float
    method: str  # how the prediction was made, in words

    @property
    def rate(self) -> float:
        """Predicted work units (``unit``) per second."""
        value = self.samples_per_s if self.unit == "samples" else self.tokens_per_s
        return value or 0.0


class JobCode(BaseModel):
    """The user's own training code (a manifest's job section), run as ``python ENTRY_POINT --key value ...``."""

    model_config = ConfigDict(extra="forbid")

    source_dir: str  # absolute (resolved by load_manifest), or s3://bucket/prefix/ in the cloud
    entry_point: str  # relative to source_dir
    requirements: str | None = None  # relative to source_dir
    unit: Unit
    items_per_sample: float | None = None
    distribution: Literal["per_gpu", "single"] = "per_gpu"  # processes per host: one per GPU, or one
    canary_arguments: dict[str, str] = Field(default_factory=dict)  # the cloud canary's overrides
    # the gpuscout_report helper's settings (warm-up, stop rule), passed as GPUSCOUT_* environment variables
    environment: dict[str, str] = Field(default_factory=dict)


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_name: str
    run_id: str
    target_index: int = Field(ge=0)
    variant_name: str
    repetition: int = Field(ge=0)
    instance_type: str
    instance_count: int = Field(ge=1)
    gpus_per_instance: int = Field(ge=0)
    spot: bool
    price_per_hour_usd: float = Field(ge=0)  # on-demand price per instance-hour used for the plan
    spot_price_per_hour_usd: float | None = None
    precision: Precision
    deepspeed_config: str | None = None  # file name under configs/deepspeed/, None = plain DDP / single device
    max_runtime_seconds: int = Field(ge=60)
    hyperparameters: dict[str, str]
    prediction: Prediction
    job_code: JobCode | None = None  # the user's own code; None = training/train.py
    # the manifest's experiment trackers, defaults resolved (gpuscout.domain.tracking); None = not tracked
    tracking: TrackingSection | None = None

    @field_validator("job_name")
    @classmethod
    def _valid_job_name(cls, v: str) -> str:
        if not JOB_NAME_RE.match(v):
            raise ValueError("job names are 1-63 letters, digits and hyphens, starting and ending alphanumeric")
        return v
