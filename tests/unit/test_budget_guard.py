"""The hard budget cap: a run's spend projected to a fixed clock, and the scheduled check that stops
a running run whose projection crossed its budget. Runs against every ResultStore (SQLite, DynamoDB via moto).

Before the scheduled check, the guard counted only the billed seconds of finished jobs: a run whose one job trains on
for hours was at $0 until that job ended (``test_the_old_measured_guard_never_stops_a_long_job`` shows it)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from gpuscout.cloud.budget_guard import (
    BILLING_JOB_STATUSES,
    RUNTIME_MARGIN_S,
    billing_seconds_so_far,
    check_budgets,
    projected_spend,
    projected_spend_usd,
    running_spend_usd,
)
from gpuscout.cloud.events import SecondaryStatusTransition, enforce_budget, measured_spend_usd
from gpuscout.store.base import JobRecord, JobStatus, ResultStore, RunRecord, RunStatus
from tests.job_specs import job_spec
from tests.unit.store_factories import STORE_FACTORIES

NOW = datetime(2025, 3, 13, 20, 0, tzinfo=UTC)
P5_PRICE = 63.296  # an on-demand price per instance-hour, as a job's spec carries it


@pytest.fixture(params=sorted(STORE_FACTORIES))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ResultStore]:
    with STORE_FACTORIES[request.param](tmp_path) as s:
        yield s


def transitions(*steps: tuple[str, datetime]) -> list[dict[str, Any]]:
    """Secondary status transitions as job_events stores them (events._transition_dicts)."""
    return [
        SecondaryStatusTransition.model_validate({"Status": status, "StartTime": start}).model_dump(
            mode="json", by_alias=True, exclude_none=True
        )
        for status, start in steps
    ]


def job(name: str, status: JobStatus, *, price: float, run_id: str = "run-a", **fields: Any) -> JobRecord:
    return JobRecord.model_validate(
        {
            "run_id": run_id,
            "job_name": name,
            "status": status,
            "instance_type": "ml.p5.48xlarge",
            "variant_name": "b8",
            # a runtime limit far beyond these tests' hours, unless a test sets one
            "spec": job_spec(
                name,
                run_id,
                instance_type="ml.p5.48xlarge",
                variant_name="b8",
                price_per_hour_usd=price,
                spot=bool(fields.get("spot")),
                max_runtime_seconds=30 * 86400,
            ),
            **fields,
        }
    )


def started_hours_ago(hours: float) -> list[dict[str, Any]]:
    return transitions(("Starting", NOW - timedelta(hours=hours)))


def test_a_job_started_ten_hours_ago_projects_ten_hours_of_its_price() -> None:
    # Given a job training for 10 h by its transitions (Starting, then Downloading and Training later)
    long_job = job(
        "gs-long",
        JobStatus.TRAINING,
        price=P5_PRICE,
        secondary_status_transitions=transitions(
            ("Downloading", NOW - timedelta(hours=9, minutes=58)),
            ("Starting", NOW - timedelta(hours=10)),  # not first in the list: the earliest StartTime counts
            ("Training", NOW - timedelta(hours=9, minutes=55)),
        ),
    )
    # Then it started at SageMaker's "Starting" and has spent 10 h x $63.296 by now; nothing is billed yet
    assert billing_seconds_so_far(long_job, now=NOW) == 10 * 3600  # from the earliest StartTime, in order
    assert running_spend_usd(long_job, now=NOW) == pytest.approx(632.96)
    assert projected_spend_usd([long_job], now=NOW) == pytest.approx(632.96)
    assert measured_spend_usd([long_job]) == 0.0  # what the guard counted before


def test_projection_of_finished_running_unstarted_spot_and_canary_jobs() -> None:
    jobs = [
        # finished: its billed seconds, as before (1 h x $10 x 2 instances)
        job("gs-done", JobStatus.COMPLETED, price=10.0, instance_count=2, billable_seconds=3600,
            secondary_status_transitions=started_hours_ago(5)),
        # running: elapsed since Starting x price x instance count (10 h x $63.296 x 2)
        job("gs-run", JobStatus.TRAINING, price=P5_PRICE, instance_count=2,
            secondary_status_transitions=started_hours_ago(10)),
        # not started: no transitions, no event
        job("gs-planned", JobStatus.PLANNED, price=P5_PRICE),
        # spot: its hour of training at the on-demand price its spec carries (1 h x $8), never the (lower) spot bill;
        # the hour it waited in Starting for capacity is not counted
        job("gs-spot", JobStatus.TRAINING, price=8.0, spot=True, secondary_status_transitions=transitions(
            ("Starting", NOW - timedelta(hours=2)), ("Training", NOW - timedelta(hours=1)))),
        # a canary with no transitions recorded: since its last event while InProgress (30 min x $4)
        job("gs-canary", JobStatus.STARTING, price=4.0, canary_for=["gs-run"],
            last_event_time=NOW - timedelta(minutes=30)),
        # ended without a bill (no capacity): nothing
        job("gs-capacity", JobStatus.CAPACITY, price=P5_PRICE, last_event_time=NOW - timedelta(hours=3)),
        # being stopped: it bills until its final event brings the billed seconds (1 h x $1)
        job("gs-stopping", JobStatus.STOPPING, price=1.0, secondary_status_transitions=started_hours_ago(1)),
    ]  # fmt: skip
    assert measured_spend_usd(jobs) == pytest.approx(20.0)
    assert projected_spend_usd(jobs, now=NOW) == pytest.approx(20.0 + 2 * 632.96 + 8.0 + 2.0 + 1.0)
    by_name = {j.job_name: running_spend_usd(j, now=NOW) for j in jobs}
    assert by_name == pytest.approx(
        {"gs-done": 0.0, "gs-run": 1265.92, "gs-planned": 0.0, "gs-spot": 8.0, "gs-canary": 2.0, "gs-capacity": 0.0,
         "gs-stopping": 1.0}
    )  # fmt: skip
    assert {JobStatus.STARTING, JobStatus.TRAINING, JobStatus.STOPPING} == BILLING_JOB_STATUSES


def test_a_spot_job_waiting_for_capacity_spends_nothing_while_it_waits() -> None:
    # Given a spot job that waited 6 h for capacity, trained 1 h, was interrupted and has waited 3 h since
    waiting = job("gs-spot", JobStatus.TRAINING, price=P5_PRICE, spot=True, secondary_status_transitions=transitions(
        ("Starting", NOW - timedelta(hours=10)), ("Training", NOW - timedelta(hours=4)),
        ("Interrupted", NOW - timedelta(hours=3)), ("Starting", NOW - timedelta(hours=3)),
    ))  # fmt: skip
    # Then only its hour of training counts (10 h at the p5 price would stop a run over money never spent)
    assert running_spend_usd(waiting, now=NOW) == pytest.approx(P5_PRICE)
    # an on-demand job's "Starting" counts (minutes of provisioning, counted rather than missed): all 10 h here
    on_demand = waiting.model_copy(update={"spot": False})
    assert running_spend_usd(on_demand, now=NOW) == pytest.approx(P5_PRICE * 10)


def test_a_job_counts_at_its_planned_price_and_at_most_its_runtime() -> None:
    # a spot job planned at the manifest's spot price counts at that price (the plan's budget check did), not 3x it
    spot = job("gs-spot", JobStatus.TRAINING, price=30.0, spot=True, secondary_status_transitions=transitions(
        ("Training", NOW - timedelta(hours=2))))  # fmt: skip
    spot.spec.spot_price_per_hour_usd = 9.0
    assert running_spend_usd(spot, now=NOW) == pytest.approx(18.0)
    # a training-plan job waiting in Pending for its plan to start spends nothing while it waits
    queued = job("gs-plan", JobStatus.STARTING, price=P5_PRICE, secondary_status_transitions=transitions(
        ("Pending", NOW - timedelta(hours=30))))  # fmt: skip
    assert running_spend_usd(queued, now=NOW) == 0.0
    # a canary whose final event was lost counts its 30-minute MaxRuntime (and the margin), not 72 h
    lost = job("gs-canary", JobStatus.TRAINING, price=4.0, canary_for=["gs-x"],
               secondary_status_transitions=transitions(("Training", NOW - timedelta(hours=72))))  # fmt: skip
    lost.spec.max_runtime_seconds = 1800
    assert running_spend_usd(lost, now=NOW) == pytest.approx((1800 + RUNTIME_MARGIN_S) / 3600 * 4.0)


def test_the_projection_never_goes_below_the_measured_spend() -> None:
    # a job whose start lies after the clock (another machine's clock ahead) counts 0, not a negative amount
    ahead = job("gs-ahead", JobStatus.TRAINING, price=P5_PRICE, secondary_status_transitions=started_hours_ago(-1))
    done = job("gs-done", JobStatus.COMPLETED, price=10.0, billable_seconds=360)
    assert projected_spend_usd([ahead, done], now=NOW) == pytest.approx(1.0)
    # a naive clock is read as UTC, like the stores' times
    assert running_spend_usd(job("gs-x", JobStatus.TRAINING, price=1.0, secondary_status_transitions=started_hours_ago(
        2)), now=NOW.replace(tzinfo=None)) == pytest.approx(2.0)  # fmt: skip


def test_the_figure_says_it_is_projected_and_to_when() -> None:
    figure = projected_spend(NOW)([job("gs-run", JobStatus.TRAINING, price=P5_PRICE,
                                       secondary_status_transitions=started_hours_ago(10))])  # fmt: skip
    assert figure.usd == pytest.approx(632.96)
    assert figure.wording == "spend projected to 2025-03-13 20:00 UTC"


class RecordingSageMaker:
    """The SageMaker calls the guard makes, recorded; ``refuse`` names jobs whose stop fails (throttled)."""

    def __init__(self, refuse: frozenset[str] = frozenset()) -> None:
        self.calls: list[tuple[str, str]] = []
        self.refuse = refuse

    def _call(self, action: str, name: str) -> dict[str, Any]:
        if name in self.refuse:
            raise ClientError({"Error": {"Code": "ThrottlingException", "Message": "Rate exceeded"}}, action)
        self.calls.append((action, name))
        return {}

    def stop_training_job(self, *, TrainingJobName: str) -> dict[str, Any]:  # noqa: N803 - boto3 keyword names
        return self._call("StopTrainingJob", TrainingJobName)

    def stop_hyper_parameter_tuning_job(self, *, HyperParameterTuningJobName: str) -> dict[str, Any]:  # noqa: N803
        return self._call("StopHyperParameterTuningJob", HyperParameterTuningJobName)

    def describe_hyper_parameter_tuning_job(self, *, HyperParameterTuningJobName: str) -> Any:  # noqa: N803
        raise AssertionError("the budget guard does not describe tuning jobs")


def put_run(store: ResultStore, run_id: str, status: RunStatus, *, budget: float | None, minutes_ago: int) -> None:
    constraints = {} if budget is None else {"budget_usd": budget}
    store.put_run(
        RunRecord(
            run_id=run_id,
            name=run_id,
            status=status,
            created_at=NOW - timedelta(minutes=minutes_ago),
            manifest_source=f"s3://data/manifests/{run_id}.yaml",
            manifest={"name": run_id, "constraints": constraints},
        )
    )


def over_budget_run(store: ResultStore, run_id: str = "run-over", status: RunStatus = RunStatus.RUNNING) -> None:
    """A run with a $100 budget: one job training for 10 h at $63.296/h (no bill yet), a search trial training
    under its tuning job, one job finished for $10 and one not started."""
    put_run(store, run_id, status, budget=100.0, minutes_ago=600)
    store.put_jobs(
        [
            job(f"gs-{run_id}-long", JobStatus.TRAINING, price=P5_PRICE, run_id=run_id,
                secondary_status_transitions=started_hours_ago(10)),
            job(f"gs-{run_id}-t00-001-0000abcd", JobStatus.TRAINING, price=4.0, run_id=run_id,
                tuning_job_name=f"gs-{run_id}-t00", secondary_status_transitions=started_hours_ago(1)),
            job(f"gs-{run_id}-done", JobStatus.COMPLETED, price=10.0, run_id=run_id, billable_seconds=3600),
            job(f"gs-{run_id}-next", JobStatus.PLANNED, price=P5_PRICE, run_id=run_id),
        ]
    )  # fmt: skip


def under_budget_run(store: ResultStore, run_id: str = "run-under") -> None:
    """A run with a $100 budget whose one job has trained for 1 h at $10/h."""
    put_run(store, run_id, RunStatus.RUNNING, budget=100.0, minutes_ago=60)
    store.put_jobs([job(f"gs-{run_id}-one", JobStatus.TRAINING, price=10.0, run_id=run_id,
                        secondary_status_transitions=started_hours_ago(1))])  # fmt: skip


def test_the_old_measured_guard_never_stops_a_long_job(store: ResultStore) -> None:
    # Given a run whose one job has trained 10 h at $63.296/h against a $100 budget, and no job has ended but one
    over_budget_run(store)
    sagemaker = RecordingSageMaker()
    # When the guard runs on measured spend (what job_events does when a job ends), Then it sees $10 and stops nothing
    spend, budget, stopped = enforce_budget(store, sagemaker, "run-over")
    assert (spend, budget, stopped) == (pytest.approx(10.0), 100.0, [])
    assert sagemaker.calls == [] and store.get_run("run-over").status is RunStatus.RUNNING


def test_a_run_whose_projection_crossed_its_budget_is_stopped_once(store: ResultStore) -> None:
    # Given a run over its budget by projection and one under it
    over_budget_run(store)
    under_budget_run(store)
    sagemaker = RecordingSageMaker()
    # When the scheduled check runs
    outcome = check_budgets(store, sagemaker, now=NOW, default_budget_usd=100.0)
    # Then the long job and the trial's tuning job (which stops the trial and launches no other) are stopped, not the
    # trial itself, and nothing of the run under budget
    assert sagemaker.calls == [("StopTrainingJob", "gs-run-over-long"),
                               ("StopHyperParameterTuningJob", "gs-run-over-t00")]  # fmt: skip
    checked = {r.run_id: r for r in outcome.runs}
    assert set(checked) == {"run-over", "run-under"} and outcome.errors == []
    over, under = checked["run-over"], checked["run-under"]
    assert over.over_budget and over.budget_usd == 100.0
    assert over.projected_spend_usd == pytest.approx(632.96 + 4.0 + 10.0)
    assert over.stopped_jobs == ["gs-run-over-long", "gs-run-over-t00"]
    assert [r.run_id for r in outcome.stopped_runs] == ["run-over"]
    assert not under.over_budget and under.stopped_jobs == [] and under.projected_spend_usd == pytest.approx(10.0)
    # and the run is STOPPED with a reason that says the spend was projected, to when, and against what
    run = store.get_run("run-over")
    assert run.status is RunStatus.STOPPED
    assert run.error == (
        "budget guard: spend projected to 2025-03-13 20:00 UTC was $646.96, over the budget of $100.00; "
        "stopped 2 running job(s)"
    )
    assert store.get_run("run-under").status is RunStatus.RUNNING
    # When the next check runs (the job rows still say TRAINING: their Stopped events have not come yet)
    again = check_budgets(store, sagemaker, now=NOW + timedelta(minutes=5), default_budget_usd=100.0)
    # Then it stops nothing new and leaves the reason alone
    assert len(sagemaker.calls) == 2
    assert [r.run_id for r in again.runs] == ["run-under"] and again.stopped_runs == []
    assert store.get_run("run-over").error == run.error


def test_runs_that_are_not_running_are_skipped(store: ResultStore) -> None:
    # Given runs over budget by projection that are not RUNNING (ended, or not started by the run's status)
    for status in (RunStatus.SUCCEEDED, RunStatus.STOPPED, RunStatus.FAILED, RunStatus.PLANNED, RunStatus.ANALYZING):
        over_budget_run(store, run_id=f"run-{status.value.lower()}", status=status)
    sagemaker = RecordingSageMaker()
    outcome = check_budgets(store, sagemaker, now=NOW)
    # Then none is read, stopped or changed
    assert outcome.runs == [] and sagemaker.calls == []
    for status in (RunStatus.SUCCEEDED, RunStatus.STOPPED, RunStatus.FAILED, RunStatus.PLANNED, RunStatus.ANALYZING):
        run = store.get_run(f"run-{status.value.lower()}")
        assert run.status is status and run.error is None


def test_a_run_without_a_budget_is_held_to_the_stacks_default(store: ResultStore) -> None:
    put_run(store, "run-default", RunStatus.RUNNING, budget=None, minutes_ago=120)
    store.put_jobs([job("gs-default-one", JobStatus.TRAINING, price=P5_PRICE, run_id="run-default",
                        secondary_status_transitions=started_hours_ago(2))])  # fmt: skip
    sagemaker = RecordingSageMaker()
    # $126.59 projected: under a $200 default, over a $100 one
    assert check_budgets(store, sagemaker, now=NOW, default_budget_usd=200.0).stopped_runs == []
    outcome = check_budgets(store, sagemaker, now=NOW, default_budget_usd=100.0)
    assert [r.budget_usd for r in outcome.stopped_runs] == [100.0]
    assert sagemaker.calls == [("StopTrainingJob", "gs-default-one")]


def test_a_stop_that_fails_leaves_the_run_running_and_the_other_runs_checked(store: ResultStore) -> None:
    # Given two runs over budget, the first of whose jobs SageMaker will not stop now (throttled)
    over_budget_run(store, run_id="run-a")
    over_budget_run(store, run_id="run-b")
    sagemaker = RecordingSageMaker(refuse=frozenset({"gs-run-a-long"}))
    outcome = check_budgets(store, sagemaker, now=NOW)
    # Then that run stays RUNNING, named in the errors (the next check tries again), and the other one is stopped
    assert len(outcome.errors) == 1 and "run run-a" in outcome.errors[0] and "ThrottlingException" in outcome.errors[0]
    assert store.get_run("run-a").status is RunStatus.RUNNING
    assert [r.run_id for r in outcome.stopped_runs] == ["run-b"]
    assert store.get_run("run-b").status is RunStatus.STOPPED


def test_a_run_the_store_cannot_read_is_named_and_the_others_checked(
    store: ResultStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuscout.errors import StoreError

    over_budget_run(store, run_id="run-a")
    over_budget_run(store, run_id="run-b")
    real_list_jobs = store.list_jobs

    def flaky(run_id: str) -> Any:
        if run_id == "run-a":
            raise StoreError("result table: throttled")
        return real_list_jobs(run_id)

    monkeypatch.setattr(store, "list_jobs", flaky)
    outcome = check_budgets(store, RecordingSageMaker(), now=NOW)
    assert len(outcome.errors) == 1 and "run run-a" in outcome.errors[0] and "throttled" in outcome.errors[0]
    assert [r.run_id for r in outcome.stopped_runs] == ["run-b"]
