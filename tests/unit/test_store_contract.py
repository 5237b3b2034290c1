"""The ResultStore contract (gpuscout/store/base.py), run against every store in store_factories.STORE_FACTORIES."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from store_factories import STORE_FACTORIES

from gpuscout.domain.benchmark import BenchmarkResult
from gpuscout.errors import RunExistsError, RunNotFoundError, StoreError
from gpuscout.store.base import (
    JOB_STATUS_RANK,
    JobRecord,
    JobStatus,
    ResultRecord,
    ResultStore,
    RunRecord,
    RunStatus,
)
from tests.benchmark_results import benchmark_result
from tests.job_specs import job_spec
from tests.run_analyses import run_analysis

T0 = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
PLUS_TWO = timezone(timedelta(hours=2))


@pytest.fixture(params=sorted(STORE_FACTORIES))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ResultStore]:
    with STORE_FACTORIES[request.param](tmp_path) as s:
        yield s


def make_run(run_id: str = "run-a", *, created_at: datetime = T0, **kw: object) -> RunRecord:
    return RunRecord.model_validate(
        {
            "run_id": run_id,
            "name": "demo",
            "status": RunStatus.PLANNED,
            "created_at": created_at,
            "manifest_source": "configs/manifests/quickstart.yaml",
            "manifest": {"name": "demo", "sequence_length": 256},
            "predicted_cost_usd": 0.01,
            **kw,
        }
    )


def make_job(job_name: str = "gs-run-a-local-v0-r0", run_id: str = "run-a", **kw: object) -> JobRecord:
    return JobRecord.model_validate(
        {
            "run_id": run_id,
            "job_name": job_name,
            "status": JobStatus.PLANNED,
            "instance_type": "ml.g5.xlarge",
            "variant_name": "bs4",
            "spec": job_spec(
                job_name, run_id, instance_type="ml.g5.xlarge", variant_name="bs4", hyperparameters={"max_steps": "10"}
            ),
            **kw,
        }
    )


def test_the_store_satisfies_the_protocol(store: ResultStore) -> None:
    assert isinstance(store, ResultStore)


def test_run_round_trip(store: ResultStore) -> None:
    run = make_run(problems=[{"path": "targets[0]", "message": "unknown"}], run_dir="/tmp/runs/run-a")
    store.put_run(run)
    assert store.get_run("run-a") == run


def test_unknown_run_raises_run_not_found(store: ResultStore) -> None:
    with pytest.raises(RunNotFoundError) as info:
        store.get_run("nope")
    assert info.value.run_id == "nope"
    with pytest.raises(RunNotFoundError):
        store.update_run("nope", status=RunStatus.RUNNING)


def test_list_runs_is_newest_first_and_limited(store: ResultStore) -> None:
    for i, run_id in enumerate(["run-old", "run-new", "run-mid"]):
        offset = {"run-old": 0, "run-mid": 1, "run-new": 2}[run_id]
        store.put_run(make_run(run_id, created_at=T0 + timedelta(hours=offset), name=f"n{i}"))
    assert [r.run_id for r in store.list_runs()] == ["run-new", "run-mid", "run-old"]
    assert [r.run_id for r in store.list_runs(limit=2)] == ["run-new", "run-mid"]


def test_list_runs_reads_every_page(store: ResultStore, monkeypatch: pytest.MonkeyPatch) -> None:
    # DynamoDB returns at most 1 MB a query, and run items carry their manifest: a page may hold fewer runs than
    # asked for. Given pages of two runs, list_runs still returns as many as asked (the budget check reads them).
    for hour in range(5):
        store.put_run(make_run(f"run-{hour}", created_at=T0 + timedelta(hours=hour)))
    client = getattr(store, "_client", None)
    if client is not None:
        real_query = client.query
        monkeypatch.setattr(client, "query", lambda **kw: real_query(**{**kw, "Limit": min(kw["Limit"], 2)}))
    assert [r.run_id for r in store.list_runs(limit=5)] == [f"run-{h}" for h in range(4, -1, -1)]
    assert [r.run_id for r in store.list_runs(limit=3)] == ["run-4", "run-3", "run-2"]


def test_update_run_sets_fields_and_updated_at(store: ResultStore) -> None:
    run = make_run(updated_at=T0)
    store.put_run(run)
    updated = store.update_run("run-a", status=RunStatus.SUCCEEDED, error=None, run_dir="runs/run-a")
    assert updated.status is RunStatus.SUCCEEDED
    assert updated.run_dir == "runs/run-a"
    assert updated.updated_at > T0
    assert updated.created_at == run.created_at
    assert store.get_run("run-a") == updated


def test_update_run_writes_only_its_fields(store: ResultStore, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given two writers that both read the run before either wrote (the budget guard and the analysis, say)
    store.put_run(make_run())
    stale = store.get_run("run-a")
    store.update_run("run-a", error="budget guard: measured spend $51 > $50")
    monkeypatch.setattr(store, "get_run", lambda _run_id: stale)  # the second writer still sees the old row
    store.update_run("run-a", run_dir="s3://reports/run-a/")
    monkeypatch.undo()
    # Then neither write lost the other's field
    got = store.get_run("run-a")
    assert got.error == "budget guard: measured spend $51 > $50" and got.run_dir == "s3://reports/run-a/"
    store.update_run("run-a", error=None)
    assert store.get_run("run-a").error is None and store.get_run("run-a").run_dir == "s3://reports/run-a/"


def test_update_run_unless_status_leaves_a_final_status_alone(store: ResultStore) -> None:
    # Given a run the budget guard already STOPPED
    store.put_run(make_run(status=RunStatus.STOPPED, error="budget"))
    # When the analysis would mark it SUCCEEDED unless it was stopped
    got = store.update_run("run-a", unless_status=(RunStatus.STOPPED,), status=RunStatus.SUCCEEDED)
    # Then it stays STOPPED, and the current row is returned
    assert got.status is RunStatus.STOPPED and store.get_run("run-a").status is RunStatus.STOPPED
    store.put_run(make_run(status=RunStatus.RUNNING))
    assert store.update_run("run-a", unless_status=(RunStatus.STOPPED,), status=RunStatus.SUCCEEDED).status is (
        RunStatus.SUCCEEDED
    )


def test_create_run_lets_exactly_one_planner_win(store: ResultStore) -> None:
    store.create_run(make_run())
    with pytest.raises(RunExistsError) as info:
        store.create_run(make_run(status=RunStatus.RUNNING))
    assert info.value.status == "PLANNED" and store.get_run("run-a").status is RunStatus.PLANNED
    # a FAILED run may be planned again when the caller says so
    store.update_run("run-a", status=RunStatus.FAILED, error="data preparation failed")
    store.create_run(make_run(), replace=(RunStatus.FAILED, RunStatus.REFUSED))
    assert store.get_run("run-a").status is RunStatus.PLANNED and store.get_run("run-a").error is None
    with pytest.raises(RunExistsError):
        store.create_run(make_run(), replace=(RunStatus.FAILED,))


def test_put_run_replaces(store: ResultStore) -> None:
    store.put_run(make_run())
    store.put_run(make_run(status=RunStatus.REFUSED, error="over budget"))
    got = store.get_run("run-a")
    assert got.status is RunStatus.REFUSED
    assert got.error == "over budget"
    assert len(store.list_runs()) == 1


def test_put_jobs_writes_a_plans_rows_in_batches(store: ResultStore) -> None:
    # 60 rows: more than one DynamoDB batch (25), a canary's among them
    store.put_run(make_run())
    rows = [make_job(f"gs-run-a-{i:03d}") for i in range(59)]
    rows.append(make_job("gs-run-a-000-canary1").model_copy(update={"canary_for": ["gs-run-a-000"]}))
    store.put_jobs(rows)
    stored = store.list_jobs("run-a")
    assert [j.job_name for j in stored] == sorted(j.job_name for j in rows)
    [canary] = [j for j in stored if j.is_canary]
    assert canary.canary_for == ["gs-run-a-000"] and not stored[0].is_canary


def test_job_round_trip_and_order(store: ResultStore) -> None:
    store.put_run(make_run())
    store.put_run(make_run("run-b", created_at=T0 + timedelta(minutes=1)))
    names = ["gs-run-a-c", "gs-run-a-a", "gs-run-a-b"]
    for name in names:
        store.put_job(make_job(name, benchmark=benchmark_result(throughput={"tokens_per_s": 12.5})))
    store.put_job(make_job("gs-run-b-a", run_id="run-b"))
    jobs = store.list_jobs("run-a")
    assert [j.job_name for j in jobs] == sorted(names)
    assert jobs[0].benchmark == BenchmarkResult.model_validate(benchmark_result(throughput={"tokens_per_s": 12.5}))
    assert store.get_job("run-a", "gs-run-a-b") == make_job(
        "gs-run-a-b",
        benchmark=benchmark_result(throughput={"tokens_per_s": 12.5}),
        updated_at=jobs[1].updated_at,
    )
    assert store.get_job("run-a", "missing") is None
    assert store.get_job("run-b", "gs-run-a-a") is None
    assert [j.job_name for j in store.list_jobs("run-b")] == ["gs-run-b-a"]
    assert store.list_jobs("run-zzz") == []


def test_put_job_replaces(store: ResultStore) -> None:
    store.put_job(make_job())
    store.put_job(make_job(status=JobStatus.FAILED, failure_reason="boom"))
    [job] = store.list_jobs("run-a")
    assert job.status is JobStatus.FAILED
    assert job.failure_reason == "boom"


def test_create_job_writes_only_a_row_that_is_not_there(store: ResultStore) -> None:
    # A search trial's row is created by whichever of its first events comes first; the others change nothing.
    first = make_job(tuning_job_name="gs-0123456789ab-t00")
    assert store.create_job(first) is True
    assert store.apply_job_event("run-a", first.job_name, JobStatus.TRAINING, T0) is True
    assert store.create_job(make_job(variant_name="other")) is False
    [job] = store.list_jobs("run-a")
    assert job.status is JobStatus.TRAINING and job.variant_name == "bs4"
    assert job.tuning_job_name == "gs-0123456789ab-t00"


def test_result_round_trip(store: ResultStore) -> None:
    assert store.get_result("run-a") is None
    result = ResultRecord(
        run_id="run-a",
        created_at=T0,
        analysis=run_analysis("run-a", summary="pick gs-x"),
        report_uri="runs/run-a/report",
        price_snapshot=run_analysis("run-a").price_snapshot,
    )
    store.put_result(result)
    assert store.get_result("run-a") == result
    assert store.get_result("run-b") is None


def test_a_row_another_version_stored_is_a_clear_error_that_says_what_to_do(store: ResultStore) -> None:
    # Given a RESULT row whose analysis another gpuscout version wrote (a field this version requires is missing),
    # and a job row whose spec another version wrote (a field this version does not know)
    store.put_run(make_run())
    store.put_job(make_job())
    store.put_result(ResultRecord(run_id="run-a", created_at=T0, analysis=run_analysis("run-a")))
    client = getattr(store, "_client", None)
    if client is not None:  # DynamoDB: the rows' attributes rewritten
        table = store.table_name  # type: ignore[attr-defined]
        client.update_item(
            TableName=table, Key={"pk": {"S": "RUN#run-a"}, "sk": {"S": "RESULT"}},
            UpdateExpression="SET analysis = :a", ExpressionAttributeValues={":a": {"M": {"jobs": {"L": []}}}},
        )  # fmt: skip
        client.update_item(
            TableName=table, Key={"pk": {"S": "RUN#run-a"}, "sk": {"S": "JOB#gs-run-a-local-v0-r0"}},
            UpdateExpression="SET spec.newer_field = :v", ExpressionAttributeValues={":v": {"S": "x"}},
        )  # fmt: skip
        remedy = r"invoke the stack's analyze_run function with \{\"run_id\": \"run-a\"\}"
    else:  # SQLite: the rows' payloads rewritten
        with store._transaction() as conn:  # type: ignore[attr-defined]
            conn.execute("UPDATE results SET payload = ?", ('{"run_id": "run-a", "analysis": {"jobs": []}}',))
            payload = conn.execute("SELECT payload FROM jobs").fetchone()[0]
            conn.execute("UPDATE jobs SET payload = ?", (payload.replace('"spec":{', '"spec":{"newer_field":1,'),))
        remedy = r"analyse it again with `gpuscout analyze run-a` \(and the same --db\)"
    # When they are read, Then the store says which row, that its format is another version's, and what to do
    with pytest.raises(StoreError, match=r"run run-a: its stored analysis is not in this version's format .*" + remedy):
        store.get_result("run-a")
    with pytest.raises(StoreError, match=r"JobRecord row .*(not in this version's format|invalid)"):
        store.list_jobs("run-a")


# Job events: at-least-once, unordered delivery.


def _event_store(store: ResultStore) -> ResultStore:
    store.put_run(make_run())
    store.put_job(make_job())
    return store


def _job(store: ResultStore) -> JobRecord:
    job = store.get_job("run-a", "gs-run-a-local-v0-r0")
    assert job is not None
    return job


def test_first_event_applies_and_records_time_and_rank(store: ResultStore) -> None:
    _event_store(store)
    assert store.apply_job_event("run-a", "gs-run-a-local-v0-r0", JobStatus.STARTING, T0) is True
    job = _job(store)
    assert job.status is JobStatus.STARTING
    assert job.last_event_time == T0
    assert job.status_rank == JOB_STATUS_RANK[JobStatus.STARTING]


def test_newer_event_applies_with_fields(store: ResultStore) -> None:
    _event_store(store)
    store.apply_job_event("run-a", "gs-run-a-local-v0-r0", JobStatus.TRAINING, T0)
    changed = store.apply_job_event(
        "run-a",
        "gs-run-a-local-v0-r0",
        JobStatus.FAILED,
        T0 + timedelta(minutes=5),
        failure_reason="AlgorithmError: exit 1",
        billable_seconds=312,
    )
    assert changed is True
    job = _job(store)
    assert (job.status, job.failure_reason, job.billable_seconds) == (JobStatus.FAILED, "AlgorithmError: exit 1", 312)


def test_older_event_after_newer_does_nothing(store: ResultStore) -> None:
    _event_store(store)
    store.apply_job_event("run-a", "gs-run-a-local-v0-r0", JobStatus.STOPPING, T0 + timedelta(minutes=2))
    before = _job(store)
    changed = store.apply_job_event(
        "run-a", "gs-run-a-local-v0-r0", JobStatus.TRAINING, T0 + timedelta(minutes=1), billable_seconds=5
    )
    assert changed is False
    assert _job(store) == before


def test_duplicate_event_is_a_no_op(store: ResultStore) -> None:
    _event_store(store)
    assert store.apply_job_event("run-a", "gs-run-a-local-v0-r0", JobStatus.TRAINING, T0) is True
    before = _job(store)
    assert store.apply_job_event("run-a", "gs-run-a-local-v0-r0", JobStatus.TRAINING, T0) is False
    assert _job(store) == before


def test_same_time_higher_rank_wins_lower_rank_loses(store: ResultStore) -> None:
    _event_store(store)
    assert store.apply_job_event("run-a", "gs-run-a-local-v0-r0", JobStatus.STARTING, T0) is True
    assert store.apply_job_event("run-a", "gs-run-a-local-v0-r0", JobStatus.TRAINING, T0) is True
    assert _job(store).status is JobStatus.TRAINING
    assert store.apply_job_event("run-a", "gs-run-a-local-v0-r0", JobStatus.STARTING, T0) is False
    assert _job(store).status is JobStatus.TRAINING


def test_terminal_status_is_never_regressed(store: ResultStore) -> None:
    _event_store(store)
    store.apply_job_event("run-a", "gs-run-a-local-v0-r0", JobStatus.COMPLETED, T0, billable_seconds=100)
    later = T0 + timedelta(hours=1)
    for live in (JobStatus.STARTING, JobStatus.TRAINING, JobStatus.STOPPING):
        assert store.apply_job_event("run-a", "gs-run-a-local-v0-r0", live, later) is False
    job = _job(store)
    assert job.status is JobStatus.COMPLETED
    assert job.billable_seconds == 100


def test_terminal_row_written_by_put_job_is_not_regressed_by_an_event(store: ResultStore) -> None:
    store.put_job(make_job(status=JobStatus.COMPLETED, status_rank=JOB_STATUS_RANK[JobStatus.COMPLETED]))
    assert store.apply_job_event("run-a", "gs-run-a-local-v0-r0", JobStatus.TRAINING, T0) is False
    assert _job(store).status is JobStatus.COMPLETED


def test_event_times_compare_across_time_zones(store: ResultStore) -> None:
    _event_store(store)
    store.apply_job_event("run-a", "gs-run-a-local-v0-r0", JobStatus.TRAINING, T0)
    earlier_elsewhere = (T0 - timedelta(seconds=1)).astimezone(PLUS_TWO)
    assert store.apply_job_event("run-a", "gs-run-a-local-v0-r0", JobStatus.STOPPING, earlier_elsewhere) is False
    later_elsewhere = (T0 + timedelta(seconds=1)).astimezone(PLUS_TWO)
    assert store.apply_job_event("run-a", "gs-run-a-local-v0-r0", JobStatus.STOPPING, later_elsewhere) is True


def test_event_for_unknown_job_changes_nothing(store: ResultStore) -> None:
    _event_store(store)
    assert store.apply_job_event("run-a", "gs-not-planned", JobStatus.TRAINING, T0) is False
    assert store.get_job("run-a", "gs-not-planned") is None
    assert [j.job_name for j in store.list_jobs("run-a")] == ["gs-run-a-local-v0-r0"]


def test_dynamodb_put_jobs_sends_throttled_rows_again_and_says_when_they_stay_unprocessed() -> None:
    from gpuscout.errors import StoreError
    from gpuscout.store.dynamodb import BATCH_WRITE_ATTEMPTS, DynamoDbStore

    class Throttling:
        """BatchWriteItem that leaves the last row of each call unprocessed ``times`` times."""

        def __init__(self, times: int) -> None:
            self.times, self.calls = times, []

        def batch_write_item(self, RequestItems: dict[str, list[object]]) -> dict[str, object]:  # noqa: N803
            [(table, requests)] = RequestItems.items()
            self.calls.append(len(requests))
            if self.times > 0:
                self.times -= 1
                return {"UnprocessedItems": {table: requests[-1:]}}
            return {"UnprocessedItems": {}}

    slept: list[float] = []
    client = Throttling(times=2)
    store = DynamoDbStore("t", client=client, sleep=slept.append)
    store.put_jobs([make_job(f"gs-run-a-{i:02d}") for i in range(30)])
    assert client.calls == [25, 1, 1, 5] and len(slept) == 2  # the throttled row twice again, then the rest
    stubborn = Throttling(times=10**6)
    with pytest.raises(StoreError, match=r"left 1 row\(s\) unprocessed after 8 attempts"):
        DynamoDbStore("t", client=stubborn, sleep=lambda _s: None).put_jobs([make_job("gs-run-a-x")])
    assert len(stubborn.calls) == BATCH_WRITE_ATTEMPTS == 8
