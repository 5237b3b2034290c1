"""The canary: before anything is timed, each distinct configuration of a plan runs train.py for a few steps,
scaled down, on the same code path (same model, batch, attention, compile, ZeRO stage, precision, packing, loss,
checkpointing), so a configuration that cannot run fails in seconds instead of after the fan-out.

A configuration is what decides which code runs: the instance type and count, the precision, the DeepSpeed config
and every hyperparameter except names, step counts, intervals, the stop rule and the optimizer's numbers (those
change how long a job runs, not whether it can). Two variants that differ only in those share one canary.

The canary keeps the configuration and changes only: max_steps = CANARY_STEPS, one warm-up step, a fixed stop rule,
validation once at the end on one micro-batch, and, when the job checkpoints, a checkpoint at every step (so saving
and pruning run too). It is not a measurement: its numbers are never stored or analysed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from gpuscout.domain.jobspec import JobSpec

CANARY_STEPS = 2
CANARY_MAX_RUNTIME_S = 1800  # a canary that takes longer than this is stopped and counts as failed
# Hyperparameters that change how long a job runs or what it is called, not which code runs.
_NOT_CONFIGURATION = frozenset(
    {
        "run_id", "job_name", "variant_name", "variant", "max_steps", "warmup_steps", "stop_rule", "ci_tolerance",
        "min_timed_steps", "eval_interval", "checkpoint_interval", "validation_batches", "learning_rate",
        "weight_decay", "seed",
    }
)  # fmt: skip


def configuration_key(spec: JobSpec) -> str:
    """What decides the code path of a job (module docstring); equal keys share one canary. For the user's own code
    (a job section) every argument counts: gpuscout cannot tell which of them only change how long it runs."""
    if spec.job_code is not None:
        code = spec.job_code
        identity = [spec.instance_type, spec.instance_count, code.source_dir, code.entry_point, code.distribution,
                    spec.hyperparameters]  # fmt: skip
        return json.dumps(identity, sort_keys=True)
    settings = {k: v for k, v in spec.hyperparameters.items() if k not in _NOT_CONFIGURATION}
    identity = [spec.instance_type, spec.instance_count, spec.precision, spec.deepspeed_config, settings]
    return json.dumps(identity, sort_keys=True)


@dataclass(frozen=True)
class Canary:
    spec: JobSpec  # the scaled-down job to run
    covers: tuple[str, ...]  # the job names whose configuration it stands for


def _canary_name(spec: JobSpec, index: int) -> str:
    """``<job name>-canary<index>`` within SageMaker's 63 characters; a canary's own name is kept (the cloud canary is
    made from the canary of plan_canaries, which is named already)."""
    suffix = f"-canary{index}"
    if spec.job_name.endswith(suffix):
        return spec.job_name
    return spec.job_name[: 63 - len(suffix)].rstrip("-") + suffix


def _job_code_canary(spec: JobSpec, name: str, arguments: dict[str, str]) -> JobSpec:
    """The user's code, stopped after CANARY_STEPS steps by the gpuscout_report helper (its GPUSCOUT_* settings; a
    script that only prints metric lines cannot be stopped: job.canary_arguments can shorten it), ``arguments``
    over its own."""
    assert spec.job_code is not None
    environment = {
        **spec.job_code.environment,
        "GPUSCOUT_MAX_STEPS": str(CANARY_STEPS),
        "GPUSCOUT_WARMUP_STEPS": "1",
        "GPUSCOUT_STOP_RULE": "fixed",
        "GPUSCOUT_CANARY": "1",  # the script may read it to scale itself down
    }
    return spec.model_copy(
        update={
            "job_name": name,
            "repetition": 0,
            "hyperparameters": {**spec.hyperparameters, **arguments},
            "max_runtime_seconds": max(60, min(spec.max_runtime_seconds, CANARY_MAX_RUNTIME_S)),
            "job_code": spec.job_code.model_copy(update={"environment": environment}),
        }
    )


def canary_spec(spec: JobSpec, index: int) -> JobSpec:
    """The job scaled down to CANARY_STEPS steps on the same configuration (module docstring)."""
    if spec.job_code is not None:
        return _job_code_canary(spec, _canary_name(spec, index), {})
    hp = dict(spec.hyperparameters)
    checkpoints = int(hp.get("checkpoint_interval", "0") or 0) > 0
    name = _canary_name(spec, index)
    hp.update(
        {
            "job_name": name,
            "max_steps": str(CANARY_STEPS),
            "warmup_steps": "1",
            "stop_rule": "fixed",
            "eval_interval": "0",  # validation once, at the end
            "validation_batches": "1",
            "checkpoint_interval": "1" if checkpoints else "0",
        }
    )
    return spec.model_copy(
        update={
            "job_name": name,
            "repetition": 0,
            "hyperparameters": hp,
            "max_runtime_seconds": max(60, min(spec.max_runtime_seconds, CANARY_MAX_RUNTIME_S)),
        }
    )


def plan_canaries(specs: Sequence[JobSpec]) -> list[Canary]:
    """One canary per distinct configuration, in the order the configurations first appear."""
    groups: dict[str, list[JobSpec]] = {}
    for spec in specs:
        groups.setdefault(configuration_key(spec), []).append(spec)
    return [
        Canary(canary_spec(members[0], index), tuple(s.job_name for s in members))
        for index, members in enumerate(groups.values(), start=1)
    ]


# The cloud canary runs on one small instance (stack context canary_instance_type), so the model is cut to a few
# decoder layers and the micro-batch to 1: the same code path (attention, loss, compile, ZeRO stage, precision,
# packing, checkpointing, the image and its libraries), at a size any one-GPU instance holds.
CLOUD_CANARY_LAYERS = 2


def cloud_canary_spec(
    spec: JobSpec, index: int, *, instance_type: str, gpus_per_instance: int, price_per_hour_usd: float
) -> JobSpec:
    """The job's canary for the cloud workflow: canary_spec, on ``instance_type`` (one instance, on-demand),
    CLOUD_CANARY_LAYERS layers, micro-batch 1 without accumulation. The user's own code (a job section) runs with
    job.canary_arguments over its arguments instead (gpuscout does not know which of them size the job)."""
    if spec.job_code is not None:
        small = _job_code_canary(spec, _canary_name(spec, index), spec.job_code.canary_arguments)
        hp = small.hyperparameters
    else:
        small = canary_spec(spec, index)
        hp = {
            **small.hyperparameters,
            "instance_type": instance_type,
            "per_device_train_batch_size": "1",
            "gradient_accumulation_steps": "1",
            "canary_layers": str(CLOUD_CANARY_LAYERS),
        }
    return small.model_copy(
        update={
            "instance_type": instance_type,
            "instance_count": 1,
            "gpus_per_instance": gpus_per_instance,
            "spot": False,
            "spot_price_per_hour_usd": None,
            "price_per_hour_usd": price_per_hour_usd,
            "hyperparameters": hp,
        }
    )


def plan_cloud_canaries(
    specs: Sequence[JobSpec], *, instance_type: str, gpus_per_instance: int, price_per_hour_usd: float
) -> list[Canary]:
    """One cloud canary per distinct configuration (plan_canaries), on the canary instance."""
    return [
        Canary(
            cloud_canary_spec(
                c.spec, index, instance_type=instance_type, gpus_per_instance=gpus_per_instance,
                price_per_hour_usd=price_per_hour_usd,
            ),
            c.covers,
        )
        for index, c in enumerate(plan_canaries(specs), start=1)
    ]  # fmt: skip
