"""Plan (state "Plan jobs"): the run's jobs come from the planner (``gpuscout.plan.planner.plan``: a PlanError when
the manifest cannot be planned); this step prices the run row and admits it under its budget (``within_budget``) and
makes its PLANNED job rows. The drivers add what is theirs: the local one detects this machine's hardware and has
a job section's variants calibrated first (``calibrate.py``); the cloud one prices its canaries in and writes the
SageMaker requests for the state machine's Maps (cloud/plan_step.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuscout.errors import BudgetExceededError
from gpuscout.store.base import JobRecord, JobStatus, ResultStore, RunRecord, RunStatus

if TYPE_CHECKING:
    from gpuscout.plan.jobs import Plan


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
