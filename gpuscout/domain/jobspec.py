"""JobSpec: one training job to run (a target x variant x repetition), the planner's output.

The same spec drives a SageMaker CreateTrainingJob in the cloud and a subprocess of gpuscout_train/train.py locally.
``hyperparameters`` is the contract with train.py: string values, as SageMaker passes them (it writes them to
/opt/ml/input/config/hyperparameters.json); train.py parses them with its dataclass arguments.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gpuscout.domain.manifest_search import TrackingSection
from gpuscout.domain.prices import CatalogPrice

JOB_NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")  # SageMaker TrainingJobName rule

Precision = Literal["bf16", "fp16", "fp32"]

# Hyperparameters that name a job rather than configure it: two variants that differ only in these run the same thing
NAME_HYPERPARAMETERS = frozenset({"run_id", "job_name", "variant_name", "variant"})
# train.py hyperparameters that steer gpuscout's own machinery, not the training a user compares
INTERNAL_HYPERPARAMETERS = frozenset(
    {"canary_layers", "search_candidate", "price_per_hour_usd", "objective_min_timed_steps", "checkpoint_keep",
     "host_allocator"}
)  # fmt: skip
# The steady-state stop rule's own settings: they mean something only under that rule
STEADY_STATE_HYPERPARAMETERS = ("ci_tolerance", "min_timed_steps", "min_timed_seconds")


def compared_settings(hyperparameters: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a user compares (what trackers log and the report's settings table shows): the hyperparameters
    without gpuscout's internal ones, the steady-state rule's settings under another rule, and unset values (None,
    "")."""
    rule = hyperparameters.get("stop_rule")
    return {
        key: value
        for key, value in hyperparameters.items()
        if key not in INTERNAL_HYPERPARAMETERS
        and value not in (None, "")
        and (key not in STEADY_STATE_HYPERPARAMETERS or rule == "steady_state")
    }


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
    price: CatalogPrice | None = None  # where price_per_hour_usd came from: kind, date, region, source
    spot_price_per_hour_usd: float | None = None
    training_plan_arn: str | None = None  # the target's SageMaker training plan (ResourceConfig.TrainingPlanArn)
    precision: Precision
    deepspeed_config: str | None = None  # file name under configs/deepspeed/, None = plain DDP / single device
    max_runtime_seconds: int = Field(ge=60)
    hyperparameters: dict[str, str]
    prediction: Prediction
    job_code: JobCode | None = None  # the user's own code; None = training/gpuscout_train/train.py
    # the manifest's experiment trackers, defaults resolved (gpuscout.domain.tracking); None = not tracked
    tracking: TrackingSection | None = None

    @property
    def predicted_usd_per_million(self) -> float | None:
        """The objective the analysis ranks by, predicted: dollars per million work units (``prediction.unit``) at
        the predicted rate, the billed hourly price (spot where planned) of all the job's instances; start-up and
        upload excluded, as the measured figure excludes them. None without a predicted rate."""
        rate = self.prediction.rate
        if rate <= 0:
            return None
        hourly = self.spot_price_per_hour_usd if self.spot_price_per_hour_usd is not None else self.price_per_hour_usd
        return hourly * self.instance_count / 3600.0 / rate * 1e6

    @field_validator("job_name")
    @classmethod
    def _valid_job_name(cls, v: str) -> str:
        if not JOB_NAME_RE.match(v):
            raise ValueError("job names are 1-63 letters, digits and hyphens, starting and ending alphanumeric")
        return v
