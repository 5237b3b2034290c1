"""Validate and Plan on this machine, the first two steps of the workflow (gpuscout.workflow) as ``gpuscout local``
drives them:

- ``validate``: the manifest file read and validated once (workflow.validate) with this face's checks (its paths
  resolved against its folder, a job's code on this machine, not in S3), and the runs folder found writable: both
  before the result store is opened or anything is planned;
- ``plan_jobs``: the plan against this machine's hardware (workflow.plan; the planner refuses what cannot run),
  16-bit precision checked against this CPU, and a job section's variants without an estimate calibrated first by a
  short run of the user's script (workflow.calibrate, its own step). The budget is checked by the runner.

May import: gpuscout.domain, gpuscout.plan, gpuscout.store, gpuscout.workflow and gpuscout.local.job_process /
startup."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpuscout.domain.catalog import LOCAL, Catalog, detect_local_hardware
from gpuscout.domain.manifest_loader import read_manifest_file, resolve_paths
from gpuscout.errors import GpuscoutError, ManifestError, Problem
from gpuscout.local.job_process import FolderLauncher
from gpuscout.local.startup import measure_startup_seconds
from gpuscout.plan.jobs import make_run_id
from gpuscout.plan.planner import plan
from gpuscout.workflow import calibrate as calibrate_step
from gpuscout.workflow import validate as validate_step

if TYPE_CHECKING:
    from gpuscout.domain.catalog import LocalHardware
    from gpuscout.domain.manifest import Manifest
    from gpuscout.plan.jobs import Plan


@dataclass(frozen=True)
class Validated:
    """A manifest file validated for a local run, and the runs folder (absolute) found writable."""

    path: Path
    manifest: Manifest
    runs_dir: Path


def validate(manifest_path: Path | str, *, runs_dir: Path, catalog: Catalog) -> Validated:
    """The Validate step of a local run: ManifestError with every problem, or GpuscoutError for a runs folder that
    cannot be written. Nothing is stored, planned or created."""
    path = Path(manifest_path)
    manifest = validate_step.validate(
        read_manifest_file(path),
        str(path),
        catalog=catalog,
        checks=[lambda m: resolve_paths(m, path), _code_on_this_machine(path)],
    )
    runs_dir = Path(runs_dir).resolve()  # train.py runs in its job folder: every path it gets must be absolute
    ensure_writable(runs_dir)
    return Validated(path=path, manifest=manifest, runs_dir=runs_dir)


def _code_on_this_machine(path: Path) -> validate_step.Check:
    def check(manifest: Manifest) -> Manifest:
        job = manifest.job
        if job is not None and job.in_s3:
            problem = Problem(
                "job.source_dir",
                f"{job.source_dir} is in S3; `gpuscout local` runs a local folder (aws s3 sync {job.source_dir} code/ "
                "and set job.source_dir: code)",
            )
            raise ManifestError(str(path), [problem])
        return manifest

    return check


def ensure_writable(folder: Path) -> None:
    """A runs folder that cannot be written is a clear error before anything is planned or prepared."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise GpuscoutError(f"--runs-dir {folder}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise GpuscoutError(f"--runs-dir {folder}: {existing} is not writable; choose another folder with --runs-dir")
    if folder.exists():
        return
    try:  # a folder some file systems refuse even so (/proc, a read-only mount): found now, not mid-run
        folder.mkdir(parents=True)
    except OSError as err:
        raise GpuscoutError(
            f"--runs-dir {folder}: cannot create it ({err.strerror or err}); choose another folder with --runs-dir"
        ) from err
    made = folder  # created only to try: a refused run leaves no folder behind
    while made != existing:
        made.rmdir()
        made = made.parent


def plan_jobs(
    manifest: Manifest,
    catalog: Catalog,
    *,
    run_id: str | None = None,
    on_message: Callable[[str], None] = lambda _message: None,
) -> Plan:
    """The Plan step of a local run (hardware detected when a target is ``local``; a job section without
    job.estimate calibrated first). Raises PlanError; the budget is *not* checked here."""
    local_hardware = None
    if any(t.instance_type == LOCAL for t in manifest.targets):
        local_hardware = detect_local_hardware().model_copy(update={"startup_s": measure_startup_seconds()})
    if local_hardware is not None:
        for warning in half_precision_warnings(manifest, local_hardware):
            on_message(warning)
    calibration = None
    if manifest.job is not None and manifest.job.estimate is None and local_hardware is not None:
        with tempfile.TemporaryDirectory(prefix="gpuscout-calibration-") as tmp:
            launcher = FolderLauncher(Path(tmp), data_dir=None)
            calibration = calibrate_step.calibrate(
                manifest, catalog, local_hardware, launcher=launcher, on_message=on_message
            )
    return plan(
        manifest, catalog, run_id=run_id or make_run_id(manifest.name), local_hardware=local_hardware,
        calibration=calibration,
    )  # fmt: skip


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
