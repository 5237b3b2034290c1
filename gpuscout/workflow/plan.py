"""Plan (state "Plan jobs"): a valid manifest -> the run's jobs (``gpuscout.plan.planner``), and the run row priced
and admitted under its budget. The drivers add what is theirs: the local one detects this machine's hardware and has
a job section's variants calibrated first (``calibrate.py``); the cloud one prices its canaries in and writes the
SageMaker requests for the state machine's Maps (cloud/plan_step.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from gpuscout.errors import BudgetExceededError
from gpuscout.plan.planner import plan
from gpuscout.store.base import JobRecord, JobStatus, ResultStore, RunRecord, RunStatus

if TYPE_CHECKING:
    from gpuscout.domain.catalog import Catalog, LocalHardware
    from gpuscout.domain.manifest import Manifest
    from gpuscout.plan.job_section import Calibration
    from gpuscout.plan.jobs import Plan


def plan_run(
    manifest: Manifest,
    catalog: Catalog,
    *,
    run_id: str,
    local_hardware: LocalHardware | None = None,
    calibration: Mapping[str, Calibration] | None = None,
) -> Plan:
    """The run's jobs (or its settings search); a PlanError (a GpuscoutError) when the manifest cannot be planned.
    The budget is not checked here: ``within_budget`` does, once the driver has priced what it adds."""
    return plan(manifest, catalog, run_id=run_id, local_hardware=local_hardware, calibration=calibration)


def within_budget(the_plan: Plan, run: RunRecord, *, store: ResultStore, extra_cost_usd: float = 0.0) -> RunRecord:
    """The run row with the plan's predicted cost (plus ``extra_cost_usd``, what the driver adds: the cloud's
    canaries) and its search; over the manifest's budget, that row is stored REFUSED with why and
    BudgetExceededError raised (nothing runs)."""
    run = run.model_copy(
        update={
            "predicted_cost_usd": the_plan.predicted_cost_usd + extra_cost_usd,
            "search": the_plan.search,
        }
    )
    try:
        the_plan.check_budget(extra_cost_usd)
    except BudgetExceededError as err:
        store.put_run(run.model_copy(update={"status": RunStatus.REFUSED, "error": str(err), "run_dir": None}))
        raise
    return run


def planned_rows(the_plan: Plan) -> list[JobRecord]:
    """The plan's JOB rows (PLANNED), written with the run row. A search's rows appear as its trials start."""
    return [JobRecord.from_spec(spec, JobStatus.PLANNED) for spec in (the_plan.jobs if the_plan.search is None else ())]
