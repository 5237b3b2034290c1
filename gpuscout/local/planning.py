"""Plan a local run: the manifest planned against this machine's hardware (the planner refuses what cannot run or is
over budget), 16-bit precision checked against this CPU, and a job section's variants without an estimate calibrated
here by a short run of the user's script.

May import: gpuscout.domain, gpuscout.plan, gpuscout.store and gpuscout.local.job_process / startup."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuscout.domain.catalog import LOCAL, Catalog, load_catalog
from gpuscout.local.job_process import JobFolders, run_job
from gpuscout.local.startup import measure_startup_seconds
from gpuscout.store.base import (
    JobStatus,
)

if TYPE_CHECKING:
    from gpuscout.domain.catalog import LocalHardware
    from gpuscout.domain.manifest import Manifest
    from gpuscout.plan.jobs import Plan


def plan_manifest(
    manifest_path: Path | str,
    catalog: Catalog | None = None,
    *,
    run_id: str | None = None,
    on_message: Callable[[str], None] = lambda _message: None,
) -> tuple[Manifest, Plan]:
    """Load and validate a manifest, then plan it (hardware detected when a target is ``local``; a job section
    without job.estimate calibrated first, ``calibrate_job``).

    Returns ``(manifest, plan)``; raises ManifestError / PlanError. The budget is *not* checked here.
    """
    from gpuscout.domain.catalog import detect_local_hardware
    from gpuscout.domain.manifest_loader import load_manifest
    from gpuscout.plan.jobs import make_run_id
    from gpuscout.plan.planner import plan

    catalog = catalog or load_catalog()
    manifest = load_manifest(manifest_path, catalog=catalog)
    local_hardware = None
    if any(t.instance_type == LOCAL for t in manifest.targets):
        local_hardware = detect_local_hardware().model_copy(update={"startup_s": measure_startup_seconds()})
    if local_hardware is not None:
        for warning in half_precision_warnings(manifest, local_hardware):
            on_message(warning)
    calibration = None
    if manifest.job is not None and manifest.job.estimate is None and local_hardware is not None:
        calibration = calibrate_job(manifest, catalog, local_hardware, on_message=on_message)
    the_plan = plan(
        manifest, catalog, run_id=run_id or make_run_id(manifest.name), local_hardware=local_hardware,
        calibration=calibration,
    )  # fmt: skip
    return manifest, the_plan


def half_precision_warnings(manifest: Manifest, local_hardware: LocalHardware) -> list[str]:
    """One warning per variant of a job section whose arguments ask its script for bf16/fp16 when the jobs run on a
    CPU without native bf16 (gpuscout.domain.cpu): there its matmuls run at about 1 % of fp32 speed, and the run
    would measure that. The built-in training job trains in fp32 on a CPU (the planner refuses 16 bits there)."""
    from gpuscout.domain.cpu import half_precision_argument

    if manifest.job is None or local_hardware.device != "cpu" or local_hardware.cpu_bf16_native is not False:
        return []
    if not any(t.instance_type == LOCAL for t in manifest.targets):
        return []
    out = []
    for variant in manifest.variants:
        asked = half_precision_argument({**manifest.job.arguments, **variant.hyperparameters})
        if asked:
            out.append(
                f"warning: variant {variant.name!r} passes {asked} to its script on this CPU, and "
                f"{local_hardware.cpu_bf16_reason}: 16-bit matmuls run at about 1 % of fp32 speed here, so its "
                "figures would measure that; pass fp32 on a CPU (set it per variant) or run it on a GPU"
            )
    return out


CALIBRATION_TIMED_STEPS = 5
CALIBRATION_WARMUP_STEPS = 2
CALIBRATION_MAX_RUNTIME_S = 900  # a calibration's deadline: 7 steps of a script that needs longer are not a plan


def calibrate_job(
    manifest: Manifest,
    catalog: Catalog,
    local_hardware: Any,
    *,
    on_message: Callable[[str], None] = lambda _message: None,
) -> dict[str, Any]:
    """A job section without job.estimate: each variant's script runs CALIBRATION_WARMUP_STEPS +
    CALIBRATION_TIMED_STEPS steps on this machine (stopped by the gpuscout_report helper, a temporary folder), and
    its measured rate and step time become the plan's prediction (plan.job_section.Calibration). A variant whose
    calibration fails is a PlanError with the reason: nothing is planned or timed."""
    import tempfile

    from gpuscout.domain.manifest_training import JobEstimate
    from gpuscout.errors import PlanError
    from gpuscout.plan.job_section import Calibration
    from gpuscout.plan.planner import plan

    job = manifest.job
    if job is None:
        raise PlanError(f"manifest {manifest.name!r} has no job section: only a user's own script is calibrated")
    provisional = manifest.model_copy(update={"job": job.model_copy(update={"estimate": JobEstimate(units_per_s=1.0)})})
    specs = plan(provisional, catalog, run_id="calibration", local_hardware=local_hardware).jobs
    firsts = {s.variant_name: s for s in reversed(specs) if s.instance_type == LOCAL}  # first local job per variant
    steps = CALIBRATION_WARMUP_STEPS + CALIBRATION_TIMED_STEPS
    settings = {"GPUSCOUT_MAX_STEPS": str(steps), "GPUSCOUT_WARMUP_STEPS": str(CALIBRATION_WARMUP_STEPS),
                "GPUSCOUT_STOP_RULE": "fixed"}  # fmt: skip
    measured: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpuscout-calibration-") as tmp:
        for variant in manifest.variants:
            spec = firsts[variant.name]
            assert spec.job_code is not None
            code = spec.job_code.model_copy(update={"environment": {**spec.job_code.environment, **settings}})
            deadline = min(spec.max_runtime_seconds, CALIBRATION_MAX_RUNTIME_S)
            name = f"calibration-{len(measured) + 1}"
            spec = spec.model_copy(update={"job_code": code, "job_name": name, "max_runtime_seconds": deadline})
            on_message(f"calibrating {variant.name!r}: {steps} steps on this machine (no job.estimate)")
            outcome = run_job(spec, JobFolders.create(Path(tmp) / spec.job_name, spec, None))
            bench = outcome.benchmark
            timing, throughput = (bench.timing, bench.throughput) if bench else (None, None)
            rate = None
            if throughput is not None:
                rate = throughput.samples_per_s if job.unit == "samples" else throughput.tokens_per_s
            timed = timing.timed_steps if timing else 0
            if outcome.status is not JobStatus.COMPLETED or not rate or not timed or timing is None:
                reason = outcome.failure_reason or "the script reported no timed steps"
                raise PlanError(
                    f"variant {variant.name!r}: its calibration ({steps} steps on this machine) failed: {reason}"
                )
            measured[variant.name] = Calibration(rate, timing.train_time_s / timed, timed)
    return measured
