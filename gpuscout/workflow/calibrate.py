"""Calibrate (before Plan, local only): a job section without ``job.estimate`` has no FLOPs model to predict from, so
each variant's script runs a few steps on this machine first and its measured rate becomes the plan's prediction.
The cloud asks for ``job.estimate`` instead (the planner says so), so its driver never calls this step."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gpuscout.domain.catalog import LOCAL
from gpuscout.domain.manifest_training import JobEstimate
from gpuscout.errors import PlanError
from gpuscout.plan.job_section import Calibration
from gpuscout.plan.planner import plan
from gpuscout.store.base import JobStatus
from gpuscout.workflow.ports import JobLauncher

if TYPE_CHECKING:
    from gpuscout.domain.catalog import Catalog, LocalHardware
    from gpuscout.domain.manifest import Manifest

CALIBRATION_TIMED_STEPS = 5
CALIBRATION_WARMUP_STEPS = 2
CALIBRATION_MAX_RUNTIME_S = 900  # a calibration's deadline: 7 steps of a script that needs longer are not a plan


def calibrate(
    manifest: Manifest,
    catalog: Catalog,
    local_hardware: LocalHardware,
    *,
    launcher: JobLauncher,
    on_message: Callable[[str], None] = lambda _message: None,
) -> dict[str, Calibration]:
    """Each variant's script runs CALIBRATION_WARMUP_STEPS + CALIBRATION_TIMED_STEPS steps through ``launcher``
    (stopped by the gpuscout_report helper), and its measured rate and step time become the plan's prediction
    (plan.job_section.Calibration). A variant whose calibration fails is a PlanError with the reason: nothing is
    planned or timed."""
    job = manifest.job
    if job is None:
        raise PlanError(f"manifest {manifest.name!r} has no job section: only a user's own script is calibrated")
    provisional = manifest.model_copy(update={"job": job.model_copy(update={"estimate": JobEstimate(units_per_s=1.0)})})
    specs = plan(provisional, catalog, run_id="calibration", local_hardware=local_hardware).jobs
    firsts = {s.variant_name: s for s in reversed(specs) if s.instance_type == LOCAL}  # first local job per variant
    steps = CALIBRATION_WARMUP_STEPS + CALIBRATION_TIMED_STEPS
    settings = {"GPUSCOUT_MAX_STEPS": str(steps), "GPUSCOUT_WARMUP_STEPS": str(CALIBRATION_WARMUP_STEPS),
                "GPUSCOUT_STOP_RULE": "fixed"}  # fmt: skip
    measured: dict[str, Calibration] = {}
    for variant in manifest.variants:
        spec = firsts[variant.name]
        assert spec.job_code is not None
        code = spec.job_code.model_copy(update={"environment": {**spec.job_code.environment, **settings}})
        deadline = min(spec.max_runtime_seconds, CALIBRATION_MAX_RUNTIME_S)
        name = f"calibration-{len(measured) + 1}"
        spec = spec.model_copy(update={"job_code": code, "job_name": name, "max_runtime_seconds": deadline})
        on_message(f"calibrating {variant.name!r}: {steps} steps on this machine (no job.estimate)")
        outcome = launcher.run(spec, "calibration")
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
