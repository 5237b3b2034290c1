"""A complete JobSpec for tests that care about a few of its fields (a job row holds the spec as the model, so a test's
row must have a whole one): a one-instance CPU job of the built-in trainer, its prediction left unstated (rate 0)."""

from __future__ import annotations

from typing import Any

from gpuscout.domain.jobspec import JobSpec, Prediction

UNSTATED = Prediction(
    tokens_per_s=0.0, mfu_assumed=None, training_seconds=0.0, overhead_seconds=0.0, cost_usd=0.0, method="test"
)


def job_spec(job_name: str = "gs-test-r0", run_id: str = "run-a", **fields: Any) -> JobSpec:
    """The spec with ``fields`` replacing any of its fields (``prediction`` as a Prediction or its fields)."""
    data: dict[str, Any] = {
        "job_name": job_name,
        "run_id": run_id,
        "target_index": 0,
        "variant_name": "v",
        "repetition": 0,
        "instance_type": "local",
        "instance_count": 1,
        "gpus_per_instance": 0,
        "spot": False,
        "price_per_hour_usd": 0.0,
        "precision": "fp32",
        "max_runtime_seconds": 3600,
        "hyperparameters": {},
        "prediction": UNSTATED,
        **fields,
    }
    return JobSpec.model_validate(data)
