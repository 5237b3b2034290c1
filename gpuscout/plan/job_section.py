"""Planning a job section (the user's own training code): the arguments each variant's script gets and their text,
the environment it runs with, and its prediction, from the user's estimate or from a calibration run on this machine.

May import: gpuscout.domain, gpuscout.errors and gpuscout.plan.jobs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

from gpuscout.domain.catalog import Catalog, InstanceType, LocalHardware, detect_local_hardware
from gpuscout.domain.jobspec import JobCode, JobSpec, Prediction
from gpuscout.domain.manifest import Manifest
from gpuscout.domain.manifest_targets import Target
from gpuscout.domain.manifest_training import Variant
from gpuscout.errors import PlanError
from gpuscout.plan.jobs import (
    CLOUD_OVERHEAD_S,
    LOCAL_OVERHEAD_S,
    MAX_RUNTIME_S,
    MIN_RUNTIME_S,
    RUNTIME_MARGIN_S,
    RUNTIME_SAFETY_FACTOR,
    Plan,
    flag_value,
    planned_price,
    repeated_specs,
    same_arguments,
)


def argument_text(value: object) -> str:
    if isinstance(value, bool):
        return flag_value(value)
    return repr(value) if isinstance(value, float) else str(value)


def job_section_environment(manifest: Manifest, *, max_steps: int) -> dict[str, str]:
    """What the gpuscout_report helper reads (training/gpuscout_report): the unit, warm-up and stop rule."""
    t = manifest.training
    assert manifest.job is not None
    env = {
        "GPUSCOUT_UNIT": manifest.job.unit,
        "GPUSCOUT_MAX_STEPS": str(max_steps),
        "GPUSCOUT_STOP_RULE": t.stop_rule.kind,
        "GPUSCOUT_CI_TOLERANCE": repr(t.stop_rule.ci_tolerance),
        "GPUSCOUT_MIN_TIMED_STEPS": str(t.stop_rule.min_timed_steps),
    }
    if t.warmup_steps is not None:
        env["GPUSCOUT_WARMUP_STEPS"] = str(t.warmup_steps)
    if manifest.job.items_per_sample is not None:
        env["GPUSCOUT_ITEMS_PER_SAMPLE"] = repr(manifest.job.items_per_sample)
    return env


def _job_target_devices(
    target: Target, inst: InstanceType, local_hardware: LocalHardware | None, *, single: bool
) -> tuple[int, int, LocalHardware | None]:
    """(GPUs per instance, devices the job uses in all, the local hardware) of a target. ``single``: one process
    per host (job.distribution), which uses one device of each host."""
    if inst.is_local:
        hw = local_hardware or detect_local_hardware()
        gpus = hw.gpu_count if hw.device == "cuda" else 0
        return gpus, 1 if single else max(gpus, 1), hw
    per_host = 1 if single else max(inst.gpu_count, 1)
    return inst.gpu_count, per_host * target.instance_count, local_hardware


def rate_text(value: float) -> str:
    """20,000 / 412 / 3.75: whole numbers with separators from 100 up, three significant digits below."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


@dataclass(frozen=True)
class Calibration:
    """A short run of one variant of the user's code on this machine (gpuscout.workflow.calibrate)."""

    rate: float  # work units per second (the job's unit), the whole job
    step_seconds: float  # mean timed optimizer step
    timed_steps: int


def _calibrated_prediction(
    where: str, variant: Variant, calibration: Mapping[str, Calibration] | None, *, unit: str, max_steps: int
) -> tuple[float, float, str]:
    """(rate, training seconds, method) of a local target without job.estimate, from its variant's calibration."""
    measured = (calibration or {}).get(variant.name)
    if measured is None:
        raise PlanError(
            f"{where}, variant {variant.name!r}: no job.estimate and no calibration run; `gpuscout local` and "
            "`gpuscout plan` calibrate a local target by running a few steps first"
        )
    method = (
        f"calibrated: {rate_text(measured.rate)} {unit}/s, {measured.step_seconds:.3g} s/step measured over "
        f"{measured.timed_steps} timed steps of this variant on this machine"
    )
    return measured.rate, max_steps * measured.step_seconds, method


def plan_job_section(
    manifest: Manifest,
    catalog: Catalog,
    *,
    run_id: str,
    local_hardware: LocalHardware | None = None,
    calibration: Mapping[str, Calibration] | None = None,
) -> Plan:
    """A job section's JobSpecs. There is no FLOPs model for the user's code, so the prediction is the user's own
    estimate (job.estimate: units/s per device, per instance type when given) x devices, or, with no estimate, a
    calibration: a few steps of each variant measured on this machine (local targets only); the method says which."""
    job = manifest.job
    assert job is not None
    max_steps = manifest.training.max_steps or 0
    estimate = job.estimate
    env = job_section_environment(manifest, max_steps=max_steps)
    jobs: list[JobSpec] = []
    for ti, target in enumerate(manifest.targets):
        inst = catalog.get(target.instance_type)
        gpus, devices, local_hardware = _job_target_devices(
            target, inst, local_hardware, single=job.distribution == "single"
        )
        precision = manifest.resolved_precision(target, catalog, local_hardware if inst.is_local else None)
        listed = planned_price(target, inst, f"targets[{ti}] {target.instance_type}", catalog)
        price = listed.usd_per_hour
        spot_price = target.spot_price_per_hour_usd if target.spot else None
        billed_price = spot_price if spot_price is not None else price
        where = f"targets[{ti}] {target.instance_type}"
        if estimate is None and not inst.is_local:
            raise PlanError(
                f"{where}: job.estimate is required for a cloud target: there is no FLOPs model for your code and "
                "gpuscout cannot measure an instance before launching it; state units_per_s per GPU (`gpuscout "
                "local` on a machine with that GPU measures it)"
            )
        overhead_s = CLOUD_OVERHEAD_S
        if inst.is_local:
            hw = local_hardware
            overhead_s = hw.startup_s if hw is not None and hw.startup_s is not None else LOCAL_OVERHEAD_S
        for vi, variant in enumerate(manifest.variants):
            if estimate is None:
                rate, training_s, method = _calibrated_prediction(
                    where, variant, calibration, unit=job.unit, max_steps=max_steps
                )
            else:
                per_device = estimate.units_per_s_by_instance_type.get(target.instance_type, estimate.units_per_s)
                typed = (
                    " for this instance type" if target.instance_type in estimate.units_per_s_by_instance_type else ""
                )
                rate = per_device * devices
                units_per_step = manifest.units_per_step(variant) * devices  # per device (process) x devices
                training_s = max_steps * units_per_step / rate
                method = (
                    f"user's estimate (job.estimate{typed}): {rate_text(per_device)} {job.unit}/s per device x "
                    f"{devices} device{'s' if devices != 1 else ''}; {units_per_step:g} {job.unit}/step; no FLOPs "
                    "model for your own code"
                )
            cost = (training_s + overhead_s) / 3600.0 * billed_price * target.instance_count
            runtime = int(RUNTIME_SAFETY_FACTOR * training_s + overhead_s + RUNTIME_MARGIN_S)
            runtime = min(max(runtime, MIN_RUNTIME_S), MAX_RUNTIME_S)
            if job.unit == "samples":
                tokens_rate = rate * job.items_per_sample if job.items_per_sample else None
                rates: dict[str, float | None] = {"samples_per_s": rate, "tokens_per_s": tokens_rate}
            else:
                rates = {"tokens_per_s": rate}
            args = {**job.arguments, **variant.hyperparameters}
            arguments = {k: argument_text(v) for k, v in args.items()}
            jobs += repeated_specs(
                manifest, run_id, ti=ti, target=target, vi=vi, variant=variant,
                hyperparameters_for=partial(same_arguments, arguments),
                gpus_per_instance=gpus,
                price_per_hour_usd=price,
                price=listed,
                spot_price_per_hour_usd=spot_price,
                precision=precision,
                max_runtime_seconds=runtime,
                prediction=Prediction(
                    **rates,
                    unit=job.unit,
                    mfu_assumed=None,
                    training_seconds=training_s,
                    overhead_seconds=overhead_s,
                    cost_usd=cost,
                    method=method,
                ),
                job_code=JobCode(
                    source_dir=job.source_dir,
                    entry_point=job.entry_point,
                    requirements=job.requirements,
                    unit=job.unit,
                    items_per_sample=job.items_per_sample,
                    distribution=job.distribution,
                    canary_arguments={k: argument_text(v) for k, v in job.canary_arguments.items()},
                    environment=env,
                ),
            )  # fmt: skip
    jobs.sort(key=lambda j: j.repetition)
    return Plan(run_id=run_id, manifest_name=manifest.name, budget_usd=manifest.constraints.budget_usd, jobs=jobs)
