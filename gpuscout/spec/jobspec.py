"""JobSpec: one training job to run (a target x variant x repetition), the planner's output.

The same spec drives a SageMaker CreateTrainingJob in the cloud and a subprocess of training/train.py locally.
``hyperparameters`` is the contract with train.py: string values, as SageMaker passes them (it writes them to
/opt/ml/input/config/hyperparameters.json); train.py parses them with its dataclass arguments.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

JOB_NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")  # SageMaker TrainingJobName rule

Precision = Literal["bf16", "fp16", "fp32"]


class Prediction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens_per_s: float
    mfu_assumed: float | None  # None when the prediction is not from the FLOPs model (e.g. local CPU)
    training_seconds: float
    overhead_seconds: float  # provisioning + image pull + data download + upload
    cost_usd: float
    method: str  # how the prediction was made, in words


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

    @field_validator("job_name")
    @classmethod
    def _valid_job_name(cls, v: str) -> str:
        if not JOB_NAME_RE.match(v):
            raise ValueError("job names are 1-63 letters, digits and hyphens, starting and ending alphanumeric")
        return v
