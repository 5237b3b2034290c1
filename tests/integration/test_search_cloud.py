"""A settings search in the cloud, on moto: plan_jobs turns it into one tuning job per target, job_events turns the
trials' state changes into rows (an early-stopped trial PRUNED), and the synthesized state machine runs the tuning
jobs and records every trial before Analyze ranks them.

moto 5.2.5 creates a tuning job (already Completed) and describes it, but runs no trials, sends no events and has
neither ListTrainingJobsForHyperParameterTuningJob nor StopHyperParameterTuningJob. Here the fake SageMaker (the
test's wrapper of moto's CreateHyperParameterTuningJob) runs trials the way SageMaker does: training jobs named
``<tuning job>-NNN-<8 hex>`` from the tuning job's definition, static hyperparameters plus ``search_candidate`` and
``_tuning_objective_metric``, the tuning job's tags, ``TuningJobArn`` on their description, and EventBridge-shaped
state changes (tests/fixtures/events/tuning_trial_*.json) through the real job_events handler. The two missing APIs
are served by small shims on moto's SageMaker responses (``_tuning_api_shims``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
from collections.abc import Iterator
from typing import Any, cast

import pytest
import test_state_machine as sm
from moto.core.responses import ActionResult
from moto.sagemaker.exceptions import ResourceNotFound, ValidationError
from moto.sagemaker.models import SageMakerModelBackend, sagemaker_backends
from moto.sagemaker.responses import SageMakerResponse

from gpuscout.cloud.control_plane import TUNING_JOB_VARIANT
from gpuscout.cloud.events import enforce_budget
from gpuscout.cloud.step_errors import ManifestRejected, PlanRefused
from gpuscout.cloud.tuning_requests import SearchTarget, search_target_key
from gpuscout.domain.metric_lines import OBJECTIVE_METRIC
from gpuscout.store.base import JobRecord, JobStatus, RunStatus
from lambdas.job_events import handler as job_events_handler
from lambdas.plan_jobs import handler as plan_handler
from lambdas.validate_manifest import handler as validate_handler
from tests.infra.conftest import Synthesized, synthesized  # noqa: F401 - fixture
from tests.integration.cloud_world import ARTIFACTS_BUCKET, REGION, Cloud, benchmark_for, load_event, raise_refusal

ACCOUNT = "123456789012"
# Two targets, 2 x 2 candidates each, 3 trials per tuning job; the search may spend $5 of the $50 budget.
MANIFEST = """\
name: search-smoke
model: {preset: qwen2-tiny}
tokenizer: {kind: bpe, vocab_size: 4096}
dataset: {source: "bundled:hebrew-bible", max_documents: 400}
sequence_length: 256
training: {max_steps: 30}
targets:
  - instance_type: ml.g5.12xlarge
  - instance_type: ml.p4d.24xlarge
    spot: true
constraints: {budget_usd: 50}
search:
  space:
    per_device_batch_size: [2, 4]
    gradient_checkpointing: [false, true]
  sequences_per_step: 8
  max_trials: 3
  max_cost_usd: 5
  max_parallel_trials: 3
"""


def _plan(cloud: Cloud, text: str = MANIFEST, name: str = "search-smoke") -> dict[str, Any]:
    validated = raise_refusal(validate_handler.handler(cloud.submit(text, name), cloud.context))
    planned: dict[str, Any] = raise_refusal(plan_handler.handler(validated, cloud.context))
    return planned


def _moto_tuning_job(name: str) -> Any:
    return sagemaker_backends[ACCOUNT][REGION].hyper_parameter_tuning_jobs[name]


def trial_event(
    fixture: str, *, run_id: str, tuning_name: str, trial: str, candidate: str, status: str | None = None
) -> dict[str, Any]:
    """A tuning trial's state-change event (tests/fixtures/events/tuning_trial_*.json) re-addressed to our trial."""
    event = copy.deepcopy(load_event(fixture))
    detail = event["detail"]
    arn = f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:training-job/{trial}"
    event["resources"] = [arn]
    detail.update(TrainingJobName=trial, TrainingJobArn=arn)
    detail["TuningJobArn"] = f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:hyper-parameter-tuning-job/{tuning_name}"
    detail["HyperParameters"].update(search_candidate=candidate, run_id=run_id, job_name=tuning_name)
    detail["Tags"]["gpuscout:run-id"] = run_id
    if status == "InProgress":  # the same trial earlier, while training
        detail.update(TrainingJobStatus="InProgress", SecondaryStatus="Training", LastModifiedTime=1741860200000)
        for key in ("TrainingEndTime", "TrainingTimeInSeconds", "BillableTimeInSeconds", "FinalMetricDataList"):
            detail.pop(key, None)
        detail["SecondaryStatusTransitions"] = detail["SecondaryStatusTransitions"][:3]
        detail["SecondaryStatusTransitions"][-1].pop("EndTime", None)
    return event


def test_plan_jobs_turns_a_search_into_one_tuning_job_per_target(cloud: Cloud) -> None:
    # When a search manifest is planned
    planned = _plan(cloud)
    run_id = planned["run_id"]
    # Then no training job is launched one by one: one tuning job per target, over that target's candidates
    assert cloud.items(planned) == [] and len(cloud.items(planned, "tunings")) == 2
    store = cloud.services.store
    run = store.get_run(run_id)
    assert run.status is RunStatus.PLANNED and run.search is not None
    assert store.list_jobs(run_id) == []  # trials get their rows as they start
    for index, tuning in enumerate(cloud.items(planned, "tunings")):
        request = tuning["request"]
        assert tuning["target_index"] == index and tuning["job_name"] == request["HyperParameterTuningJobName"]
        config = request["HyperParameterTuningJobConfig"]
        [candidates] = config["ParameterRanges"]["CategoricalParameterRanges"]
        assert candidates["Values"] == run.search.targets[index].candidates
        assert len(candidates["Values"]) == 4
        # search.max_parallel_trials (3) within the stack's 4 concurrent jobs (MAP_MAX_CONCURRENCY default) shared by
        # the 2 tuning jobs
        assert config["ResourceLimits"] == {"MaxNumberOfTrainingJobs": 3, "MaxParallelTrainingJobs": 2}
        # and the file job_events reads to give each trial its row: every candidate's JobSpec
        key = search_target_key(run_id, tuning["job_name"])
        body = cloud.s3.get_object(Bucket=ARTIFACTS_BUCKET, Key=key)["Body"].read()
        found = SearchTarget.model_validate_json(body)
        assert sorted(found.candidates) == sorted(candidates["Values"]) and found.early_stopping is True
        # SageMaker accepts the request as it is (botocore validates it before moto sees it)
        cloud.sagemaker.create_hyper_parameter_tuning_job(**request)
    assert cloud.items(planned, "tunings")[1]["request"]["TrainingJobDefinition"]["EnableManagedSpotTraining"] is True


def test_a_search_with_more_candidates_than_a_tuning_job_takes_is_refused_before_anything_runs(cloud: Cloud) -> None:
    text = MANIFEST.replace(
        "    gradient_checkpointing: [false, true]\n",
        "    gradient_checkpointing: [false, true]\n    torch_compile: [false, true]\n"
        "    fused_cross_entropy: [false, true]\n    dataloader_workers: [0, 1, 2]\n",
    )
    with pytest.raises(PlanRefused, match=r"search: targets\[0\] ml.g5.12xlarge has 48 candidates"):
        _plan(cloud, text, name="too-many")
    [run] = cloud.services.store.list_runs()
    assert run.status is RunStatus.REFUSED and run.error is not None and run.error.startswith("search: ")
    listed = cloud.s3.list_objects_v2(Bucket=ARTIFACTS_BUCKET, Prefix="search/")
    assert listed.get("KeyCount", 0) == 0


def test_trial_events_become_rows_and_an_early_stopped_trial_is_pruned(cloud: Cloud) -> None:
    # Given a planned search whose first tuning job SageMaker runs (early stopping Auto)
    planned = _plan(cloud)
    run_id, tuning = planned["run_id"], cloud.items(planned, "tunings")[0]
    name, request = tuning["job_name"], tuning["request"]
    cloud.sagemaker.create_hyper_parameter_tuning_job(**request)
    values = request["HyperParameterTuningJobConfig"]["ParameterRanges"]["CategoricalParameterRanges"][0]["Values"]
    store = cloud.services.store
    first, second, third = (f"{name}-00{k}-6d2e9f0{k}" for k in (1, 2, 3))
    cloud.upload_benchmark(run_id, first, benchmark_for(first, run_id, "ml.g5.12xlarge"))

    # When the first trial's events arrive: training, then completed (and the completion again)
    address = {"run_id": run_id, "tuning_name": name}
    out = job_events_handler.handler(
        trial_event("tuning_trial_completed", trial=first, candidate=values[0], status="InProgress", **address),
        cloud.context,
    )
    # Then its first event created its row from the candidate's JobSpec
    assert out["applied"] is True and out["status"] == "TRAINING"
    row = store.get_job(run_id, first)
    assert row is not None and row.status is JobStatus.TRAINING and row.variant_name == values[0]
    assert row.tuning_job_name == name and row.spec.job_name == first and row.spec.target_index == 0
    assert row.instance_type == "ml.g5.12xlarge" and row.spec.hyperparameters["job_name"] == first
    out = job_events_handler.handler(
        trial_event("tuning_trial_completed", trial=first, candidate=values[0], **address), cloud.context
    )
    assert out["status"] == "COMPLETED" and out["tokens_per_s"] > 0
    done = store.get_job(run_id, first)
    assert done is not None and done.benchmark is not None and done.billable_seconds == 705
    again = job_events_handler.handler(
        trial_event("tuning_trial_completed", trial=first, candidate=values[0], **address), cloud.context
    )
    assert again["applied"] is False

    # A trial SageMaker stopped while its tuning job (early stopping Auto) runs on: stopped early, PRUNED
    out = job_events_handler.handler(
        trial_event("tuning_trial_stopped", trial=second, candidate=values[1], **address), cloud.context
    )
    pruned = store.get_job(run_id, second)
    assert out["status"] == "PRUNED" and pruned is not None and pruned.status is JobStatus.PRUNED
    assert pruned.failure_reason is not None
    assert pruned.failure_reason.startswith(f"stopped early by tuning job {name}: its {OBJECTIVE_METRIC} was worse")
    # A trial that ran out of time while the tuning job runs on (Stopped / MaxRuntimeExceeded): STOPPED, not
    # pruned; and its event without TuningJobArn still finds the trial's tuning job from the trial's name
    timed_out = f"{name}-005-0a0b0c0d"
    event = trial_event("tuning_trial_stopped", trial=timed_out, candidate=values[3], **address)
    event["detail"]["SecondaryStatus"] = "MaxRuntimeExceeded"
    del event["detail"]["TuningJobArn"]
    out = job_events_handler.handler(event, cloud.context)
    row = store.get_job(run_id, timed_out)
    assert out["status"] == "STOPPED" and row is not None and row.tuning_job_name == name
    # A trial stopped with its tuning job (a person, or the budget guard, stopped it): STOPPED, not pruned
    _moto_tuning_job(name).hyper_parameter_tuning_job_status = "Stopped"
    out = job_events_handler.handler(
        trial_event("tuning_trial_stopped", trial=third, candidate=values[2], **address), cloud.context
    )
    assert out["status"] == "STOPPED" and store.get_job(run_id, third) is not None

    # A trial whose candidate is not one of the tuning job's is left alone
    out = job_events_handler.handler(
        trial_event("tuning_trial_stopped", trial=f"{name}-004-00000000", candidate="b64-a1-w0", **address),
        cloud.context,
    )
    assert out["applied"] is False and "b64-a1-w0" in out["ignored_reason"]
    assert len(store.list_jobs(run_id)) == 4


class RecordingSageMaker:
    """What the budget guard calls, recorded (moto has no StopHyperParameterTuningJob)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def stop_training_job(self, *, TrainingJobName: str) -> None:  # noqa: N803 - boto3 keyword names
        self.calls.append(("StopTrainingJob", TrainingJobName))

    def stop_hyper_parameter_tuning_job(self, *, HyperParameterTuningJobName: str) -> None:  # noqa: N803
        self.calls.append(("StopHyperParameterTuningJob", HyperParameterTuningJobName))

    def describe_hyper_parameter_tuning_job(self, *, HyperParameterTuningJobName: str) -> Any:  # noqa: N803
        raise AssertionError("the budget guard does not describe tuning jobs")


def test_the_budget_guard_stops_the_tuning_job_at_the_searchs_spend_cap(cloud: Cloud) -> None:
    # Given two live trials of one tuning job and a finished one that billed $7 (over max_cost_usd 5, under the
    # budget of 50)
    planned = _plan(cloud)
    run_id, name = planned["run_id"], cloud.items(planned, "tunings")[0]["job_name"]
    store = cloud.services.store
    target = SearchTarget.model_validate_json(
        cloud.s3.get_object(Bucket=ARTIFACTS_BUCKET, Key=search_target_key(run_id, name))["Body"].read()
    )
    statuses = ("TRAINING", "STARTING", "COMPLETED")
    for k, (candidate, status) in enumerate(zip(list(target.candidates)[:3], statuses, strict=True)):
        trial = f"{name}-00{k}-0000000{k}"
        store.put_job(
            JobRecord.from_spec(target.trial_spec(candidate, trial), JobStatus(status), tuning_job_name=name,
                                billable_seconds=int(7.0 / target.candidates[candidate].price_per_hour_usd * 3600)
                                if status == "COMPLETED" else None)
        )  # fmt: skip
    # When the guard runs, Then it stops the run's tuning jobs (which stop their trials and start no other), not a
    # trial: this one and the other target's, not started yet (the workflow's status check keeps it from starting)
    sagemaker = RecordingSageMaker()
    spend, budget, stopped = enforce_budget(store, sagemaker, run_id)
    assert budget == 5.0 and spend == pytest.approx(7.0, abs=0.01)
    every = sorted(t["job_name"] for t in cloud.items(planned, "tunings"))
    assert sagemaker.calls == [("StopHyperParameterTuningJob", n) for n in every] and stopped == every
    assert name in every
    assert store.get_run(run_id).status is RunStatus.STOPPED


def test_the_budget_guard_stops_a_tuning_job_between_its_trials(cloud: Cloud) -> None:
    # Given a search running one trial at a time whose only trial so far finished over the cap: no trial is live
    planned = _plan(cloud)
    run_id, name = planned["run_id"], cloud.items(planned, "tunings")[0]["job_name"]
    store = cloud.services.store
    target = SearchTarget.model_validate_json(
        cloud.s3.get_object(Bucket=ARTIFACTS_BUCKET, Key=search_target_key(run_id, name))["Body"].read()
    )
    candidate = next(iter(target.candidates))
    price = target.candidates[candidate].price_per_hour_usd
    store.put_job(
        JobRecord.from_spec(target.trial_spec(candidate, f"{name}-001-00000001"), JobStatus.COMPLETED,
                            tuning_job_name=name, billable_seconds=int(7.0 / price * 3600))
    )  # fmt: skip
    # When the guard runs, Then every tuning job of the run is stopped (it would launch the next trial otherwise)
    sagemaker = RecordingSageMaker()
    _, _, stopped = enforce_budget(store, sagemaker, run_id)
    assert name in stopped and ("StopHyperParameterTuningJob", name) in sagemaker.calls


# -- the synthesized state machine ---------------------------------------------------------------------------------


@pytest.fixture
def tuning_api_shims(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[dict[str, Any]]]]:
    """ListTrainingJobsForHyperParameterTuningJob (the trials the fake ran) and StopHyperParameterTuningJob on moto's
    SageMaker, which has neither."""
    trials: dict[str, list[dict[str, Any]]] = {}

    def list_trials(response: SageMakerResponse) -> ActionResult:
        name = response._get_param("HyperParameterTuningJobName")
        if name not in trials:
            raise ResourceNotFound(message=f"Amazon SageMaker can't find a tuning job with name {name}")
        return ActionResult({"TrainingJobSummaries": trials[name]})

    def stop_tuning(response: SageMakerResponse) -> ActionResult:
        name = response._get_param("HyperParameterTuningJobName")
        _moto_tuning_job(name).hyper_parameter_tuning_job_status = "Stopping"
        return ActionResult({})

    monkeypatch.setattr(SageMakerResponse, "list_training_jobs_for_hyper_parameter_tuning_job", list_trials,
                        raising=False)  # fmt: skip
    monkeypatch.setattr(SageMakerResponse, "stop_hyper_parameter_tuning_job", stop_tuning, raising=False)
    yield trials


def test_the_workflow_runs_one_tuning_job_per_target_and_ranks_every_trial(
    cloud: Cloud,
    synthesized: Synthesized,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tuning_api_shims: dict[str, list[dict[str, Any]]],
) -> None:
    # Given SageMaker runs three trials of the first target's tuning job (the first reported by events, the second
    # only by its description, the third stopped early), and refuses the second target's (account quota)
    create = SageMakerModelBackend.create_hyper_parameter_tuning_job
    lock = threading.Lock()
    ran: dict[str, str] = {}

    def run_trials(backend: SageMakerModelBackend, **kwargs: Any) -> Any:
        name = kwargs["hyper_parameter_tuning_job_name"]
        definition = kwargs["training_job_definition"]
        if definition["EnableManagedSpotTraining"]:
            raise ValidationError(message="ResourceLimitExceeded: ml.p4d.24xlarge for spot training job usage is 0")
        arn = create(backend, **kwargs)
        config = kwargs["hyper_parameter_tuning_job_config"]
        values = config["ParameterRanges"]["CategoricalParameterRanges"][0]["Values"]
        run_id = next(t["Value"] for t in kwargs["tags"] if t["Key"] == "gpuscout:run-id")
        with lock:
            tuning_api_shims[name] = []
            for k, candidate in enumerate(values[: config["ResourceLimits"]["MaxNumberOfTrainingJobs"]], start=1):
                trial = f"{name}-{k:03d}-{hashlib.sha256(candidate.encode()).hexdigest()[:8]}"
                objective = config["HyperParameterTuningJobObjective"]["MetricName"]
                hyperparameters = {**definition["StaticHyperParameters"], "search_candidate": candidate,
                                   "_tuning_objective_metric": objective}  # fmt: skip
                job = cast(Any, backend).create_training_job(  # uploads the trial's benchmark.json (sm._execute_live)
                    training_job_name=trial, hyper_parameters=hyperparameters,
                    algorithm_specification=dict(definition["AlgorithmSpecification"]), role_arn=definition["RoleArn"],
                    input_data_config=definition["InputDataConfig"], output_data_config=definition["OutputDataConfig"],
                    resource_config=definition["ResourceConfig"], vpc_config=None,
                    stopping_condition=definition["StoppingCondition"], tags=kwargs["tags"],
                    enable_network_isolation=definition["EnableNetworkIsolation"],
                    enable_inter_container_traffic_encryption=False,
                    enable_managed_spot_training=definition["EnableManagedSpotTraining"],
                    checkpoint_config=definition["CheckpointConfig"], debug_hook_config=None,
                    debug_rule_configurations=None, tensor_board_output_config=None, experiment_config=None,
                )  # fmt: skip
                job.tuning_job_arn = arn  # DescribeTrainingJob's TuningJobArn, which moto leaves out
                ran[trial] = candidate
                address = {"run_id": run_id, "tuning_name": name, "trial": trial, "candidate": candidate}
                if k == 3:  # stopped early: no benchmark.json (train.py was stopped mid-run)
                    job.training_job_status = job.secondary_status = "Stopped"
                    cloud.s3.delete_object(Bucket=ARTIFACTS_BUCKET, Key=f"output/{run_id}/{trial}/output/output.tar.gz")
                    job_events_handler.handler(trial_event("tuning_trial_stopped", **address), cloud.context)
                elif k == 1:
                    for status in ("InProgress", None):
                        job_events_handler.handler(
                            trial_event("tuning_trial_completed", status=status, **address), cloud.context
                        )
                summary = {"TrainingJobName": trial, "TrainingJobArn": job.arn, "CreationTime": job.creation_time,
                           "TrainingJobStatus": job.training_job_status}  # fmt: skip
                tuning_api_shims[name].append({**summary, "TunedHyperParameters": {"search_candidate": candidate}})
        return arn

    monkeypatch.setattr(SageMakerModelBackend, "create_hyper_parameter_tuning_job", run_trials)
    # When the search manifest's execution runs (every Lambda step its real handler)
    run = sm._execute_live(cloud, synthesized, monkeypatch, MANIFEST, name="search-smoke")
    assert run.described["status"] == "SUCCEEDED", json.dumps(run.events[-3:], default=str)[-3000:]
    [planned] = [out for name, out in run.lambdas.outputs if name == "plan_jobs"]
    first, second = cloud.items(planned, "tunings")

    # Then each target's tuning job was sent exactly as planned (.sync task; no training job of its own),
    sent = sm._scheduled(run.events, "createHyperParameterTuningJob")
    assert sorted(sent, key=lambda r: r["HyperParameterTuningJobName"]) == [first["request"], second["request"]]
    assert sm._scheduled(run.events, "createTrainingJob") == []
    order = [name for name, _ in run.lambdas.calls]
    assert order[:3] == ["validate_manifest", "plan_jobs", "run_role"] and order[-2:] == ["analyze_run", "run_role"]
    assert sorted(p["tuning_job_name"] for p in run.lambdas.called("record_job_result")) == sorted(
        [first["job_name"], second["job_name"]]
    )
    # the refused one was recorded as its own row (why the target has no trials), and the run went on
    [failure] = run.lambdas.called("record_job_failure")
    assert failure["job_name"] == second["job_name"]
    store = cloud.services.store
    rows = {j.job_name: j for j in store.list_jobs(run.run_id)}
    refused = rows.pop(second["job_name"])
    assert refused.variant_name == TUNING_JOB_VARIANT and refused.status is JobStatus.QUOTA
    assert refused.failure_reason is not None and "ResourceLimitExceeded" in refused.failure_reason
    # and every trial has its row: two completed with their benchmarks (one only through "Record trials"), one pruned
    assert sorted(rows) == sorted(ran)
    by_status = {j.status: j for j in rows.values()}
    assert sorted(j.status.value for j in rows.values()) == ["COMPLETED", "COMPLETED", "PRUNED"]
    assert all(j.tuning_job_name == first["job_name"] and j.variant_name == ran[j.job_name] for j in rows.values())
    assert all(j.benchmark is not None for j in rows.values() if j.status is JobStatus.COMPLETED)
    assert "stopped early by tuning job" in str(by_status[JobStatus.PRUNED].failure_reason)
    # Analyze ranked the completed trials like variants and kept the pruned one out, saying why
    assert store.get_run(run.run_id).status is RunStatus.SUCCEEDED
    result = store.get_result(run.run_id)
    assert result is not None
    analysed = {a["variant_name"]: a for a in result.analysis.model_dump(mode="json")["jobs"]}
    completed = [j.variant_name for j in rows.values() if j.status is JobStatus.COMPLETED]
    assert sorted(a["rank"] for v, a in analysed.items() if v in completed) == [1, 2]
    pruned = analysed[by_status[JobStatus.PRUNED].variant_name]
    assert pruned["rank"] is None and pruned["status"] == "PRUNED"


def test_a_cloud_search_with_checkpoints_is_rejected_before_anything_runs(cloud: Cloud) -> None:
    # Given a search with checkpoints on: its tuning job's trials would share one checkpoint prefix, and SageMaker
    # copies all of it to every trial at start
    text = MANIFEST.replace("training: {max_steps: 30}", "training: {max_steps: 30, checkpoint_interval: 10}")
    # Then validation rejects it, naming the field and what to do instead
    with pytest.raises(ManifestRejected, match=r"training.checkpoint_interval: a cloud search's trials share one"):
        raise_refusal(validate_handler.handler(cloud.submit(text, "search-ckpt"), cloud.context))
