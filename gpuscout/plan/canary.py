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
from dataclasses import dataclass, replace

from gpuscout.domain.catalog import Catalog
from gpuscout.domain.jobspec import JobSpec
from gpuscout.domain.manifest import Manifest
from gpuscout.domain.models import Architecture
from gpuscout.domain.prices import CatalogPrice
from gpuscout.plan import memory

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
    placement: str | None = None  # why a cloud canary runs on its job's instance type instead of the canary type


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
    spec: JobSpec,
    index: int,
    *,
    instance_type: str,
    gpus_per_instance: int,
    price_per_hour_usd: float,
    spot: bool = False,
    spot_price_per_hour_usd: float | None = None,
    price: CatalogPrice | None = None,
) -> JobSpec:
    """The job's canary for the cloud workflow: canary_spec, on ``instance_type`` (one instance, on-demand),
    CLOUD_CANARY_LAYERS layers, micro-batch 1 without accumulation. It keeps its job's training plan only on its
    job's own type (a plan is for one instance type); ``price`` says where ``price_per_hour_usd`` came from. The
    user's own code (a job section) runs with job.canary_arguments over its arguments instead (gpuscout does not know
    which of them size the job)."""
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
            # on demand on the canary type; on its job's type (too large for the canary type) as its job buys it,
            # so it needs no quota the job does not need
            "spot": spot,
            "spot_price_per_hour_usd": spot_price_per_hour_usd if spot else None,
            "price_per_hour_usd": price_per_hour_usd,
            "price": price,
            "training_plan_arn": spec.training_plan_arn if instance_type == spec.instance_type else None,
            "hyperparameters": hp,
        }
    )


def cloud_canary_memory_gb(arch: Architecture, spec: JobSpec, *, world: int) -> float:
    """Peak GPU memory of ``spec``'s cloud canary by the planner's memory model (gpuscout.plan.memory): the model cut
    to CLOUD_CANARY_LAYERS decoder layers (embedding and head whole: they dominate a cut model), micro-batch 1, with
    the job's precision, attention, checkpointing, loss, packing and ZeRO stage, on ``world`` GPUs."""
    hp = spec.hyperparameters
    settings = memory.StepSettings(
        precision=spec.precision,
        attention=hp.get("attention_implementation", "sdpa"),
        gradient_checkpointing=hp.get("gradient_checkpointing") == "true",
        fused_cross_entropy=hp.get("fused_cross_entropy") == "true",
        packing=hp.get("packing", "true") == "true",
        deepspeed_stage=int(hp.get("deepspeed_stage", "0") or 0),
        cross_entropy_kernel=hp.get("cross_entropy_kernel", "chunked"),
        torch_compile=hp.get("torch_compile") == "true",
        gradient_accumulation_steps=int(hp.get("gradient_accumulation_steps", "1") or 1),
    )
    cut = replace(arch, num_hidden_layers=min(CLOUD_CANARY_LAYERS, arch.num_hidden_layers))
    seq = int(hp.get("sequence_length", "0") or 0)
    return memory.estimate(cut, seq=seq, batch=1, settings=settings, world=max(world, 1)).total_gb


def plan_cloud_canaries(
    specs: Sequence[JobSpec],
    *,
    instance_type: str,
    gpus_per_instance: int,
    price_per_hour_usd: float,
    gpu_memory_gb: float | None = None,
    arch: Architecture | None = None,
    usable_fraction: float = 0.90,
    price: CatalogPrice | None = None,
) -> list[Canary]:
    """One cloud canary per distinct configuration (plan_canaries), on the canary instance. With the model's ``arch``
    and the canary GPU's memory, each built-in canary is checked against the memory model first: one that would not
    fit (``usable_fraction`` of it) runs on one instance of its own job's type, on demand, where the whole job fits,
    and says so (``placement``). The user's own code (a job section) has no model to check: it runs as sized by
    job.canary_arguments."""
    canaries = []
    for index, c in enumerate(plan_canaries(specs), start=1):
        placed: tuple[str, int, float, bool, float | None] = (
            instance_type, gpus_per_instance, price_per_hour_usd, False, None
        )  # fmt: skip
        why, placed_price = None, price
        if arch is not None and gpu_memory_gb and c.spec.job_code is None:
            need = cloud_canary_memory_gb(arch, c.spec, world=gpus_per_instance)
            if need > usable_fraction * gpu_memory_gb:
                job = c.spec
                placed = (job.instance_type, job.gpus_per_instance, job.price_per_hour_usd, job.spot,
                          job.spot_price_per_hour_usd)  # fmt: skip
                placed_price = job.price
                why = (
                    f"needs ~{need:.1f} GB per GPU ({CLOUD_CANARY_LAYERS} layers, micro-batch 1) but {instance_type} "
                    f"has {gpu_memory_gb:.0f} GB ({usable_fraction:.0%} usable): runs on one {c.spec.instance_type}"
                    + (" (spot, as its job)" if c.spec.spot else "")
                )
        spec = cloud_canary_spec(
            c.spec, index, instance_type=placed[0], gpus_per_instance=placed[1], price_per_hour_usd=placed[2],
            spot=placed[3], spot_price_per_hour_usd=placed[4], price=placed_price,
        )  # fmt: skip
        canaries.append(Canary(spec, c.covers, placement=why))
    return canaries


def cloud_canaries(
    specs: Sequence[JobSpec], manifest: Manifest, catalog: Catalog, instance_type: str | None
) -> list[Canary]:
    """The cloud canaries of a plan's ``specs`` on the stack's canary ``instance_type`` (none without one), each
    placed where the memory model says it fits (plan_cloud_canaries)."""
    if not instance_type or not specs:
        return []
    from gpuscout.plan.planner import MEMORY_USABLE_FRACTION, architecture  # the planner imports this module

    instance = catalog.get(instance_type)
    return plan_cloud_canaries(
        specs,
        instance_type=instance.instance_type,
        gpus_per_instance=instance.gpu_count,
        price_per_hour_usd=instance.on_demand_usd_per_hour or 0.0,
        gpu_memory_gb=instance.gpu_memory_gb,
        arch=architecture(manifest) if manifest.job is None else None,
        usable_fraction=MEMORY_USABLE_FRACTION,
        price=instance.price,
    )


def canary_model_note(manifest: Manifest) -> str | None:
    """How the cloud canaries get an S3 or hub model, when they cannot read only their layers' part of it (the
    training image's partial_checkpoint does, by byte range, given network)."""
    if manifest.job is not None:
        return None
    model, _, _ = manifest.builtin()
    if model.path and model.path.startswith("s3://") and manifest.network_isolation:
        return (
            f"each canary downloads the whole model {model.path} (network_isolation: true allows only the model "
            f"input channel, which copies all of it), though it keeps {CLOUD_CANARY_LAYERS} layers"
        )
    return None


def predicted_canary_cost_usd(canaries: Sequence[Canary]) -> float:
    """What the canaries are predicted to cost: each is billed like the start of the job it covers (the prediction's
    overhead_seconds: the planner's provisioning, image pull and data download, 360 s for a cloud job) on its own
    instance at its price (on demand, or spot where it runs as its spot job); its CANARY_STEPS steps of a
    CLOUD_CANARY_LAYERS-layer cut add seconds, not counted. Not measured on AWS yet: the same start-up assumption
    as every cloud job's prediction."""
    from gpuscout.plan.jobs import CLOUD_OVERHEAD_S

    total = 0.0
    for canary in canaries:
        spec = canary.spec
        seconds = spec.prediction.overhead_seconds if spec.prediction is not None else CLOUD_OVERHEAD_S
        price = spec.spot_price_per_hour_usd if spec.spot and spec.spot_price_per_hour_usd else spec.price_per_hour_usd
        total += seconds / 3600.0 * price * spec.instance_count
    return total
