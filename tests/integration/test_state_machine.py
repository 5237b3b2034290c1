"""The synthesized state machine, executed by moto's Step Functions interpreter against moto SageMaker.

The ASL is the one `cdk synth` puts in the template (the stack synthesized once per session by the infra tests'
fixture). Four substitutions make it runnable here, and only these:

- Lambda Tasks -> Pass states. moto cannot run Python Lambdas without Docker, so each Lambda Task becomes a Pass
  state. For "Validate manifest", "Plan jobs" and "Analyze run" its ``Result`` is the real output of the real
  handler (lambdas/<name>/handler.py), called directly in the test with the input that state receives: the
  execution input for Validate, Validate's output for Plan, ``{"run_id"}`` (the state's Parameters) for Analyze.
  "Record job failure" is reached only through the Map's Catch, which never fires here (moto SageMaker accepts
  every request); its Pass state carries a fixed Result and the test asserts it was never entered. Each state
  keeps its Next/End, Parameters, ResultPath and OutputPath, so the data flow between states is the synthesized
  one; Retry and Catch are dropped (a Pass state may not have them), so this test covers the success path. The
  execution history is then checked: each Pass state was entered with the input its handler got. Analyze's
  handler runs before the execution (a Pass Result is fixed when the state machine is created); moto emits no
  SageMaker state-change events, so the analysis (no job completed) is the one the real Analyze step would
  compute. Analyze marks the run row FAILED, so the test puts the row's status back to what Plan left
  (PLANNED) before the execution: that is what the Map's "Read run status" step would find.
- The results table's ``Ref`` -> the moto table's name, and the ``${AWS::Partition}`` of the DynamoDB task's
  resource ARN -> ``aws`` (CloudFormation resolves both at deploy time).
- ``.sync`` -> request-response. moto runs SageMaker tasks only without ``.sync`` (it forwards the call to moto
  SageMaker, which creates the job as already Completed). ResultPath and OutputPath are untouched.
- The SageMaker tasks' ``"RoleArn"`` (a tuning job's: inside its TrainingJobDefinition), which the task names
  itself (the role's ``Fn::GetAtt``; a request cannot choose it), -> the test's role ARN: the training jobs' role,
  or data preparation's. Every other field is copied from the request by its JSONPath.

- The Distributed Maps' ItemReader: the artifacts bucket's ``Ref`` -> the moto bucket's name, and its resource's
  partition -> ``aws``. The requests it reads are the ones plan_jobs wrote to moto S3.

Four things are added to moto, none of which changes what the definition does:

- ``EveryEvent`` records the history events of the Distributed Maps' child workflows too (moto, like AWS, keeps them
  out of the parent's history), so the tests see the children's states and measure every payload.
- ``fail_map_runs_past_their_tolerance``: moto counts a failed child and lets the Distributed Map succeed; AWS fails
  the Map Run (States.ExceedToleratedFailureThreshold) when more children failed than it tolerates (none here).
- ``role_arn_paths_read_as_paths``: moto's parser reads the key ``"RoleArn.$"`` (the SageMaker tasks' run role, from
  the Map iteration's ``$.role_arn``) as a literal field; Step Functions, like for any ``<field>.$`` key, as a path.
- ``quicker_moto_interpreter`` parses each JSONPath once and reuses one boto3 client per service instead of building
  both for every state of every child (same results, a 1,000-child plan in seconds).

One serialization detail: moto's ASL lexer rejects JSON numbers with a negative exponent (``5e-05``, how Python
writes the manifest's learning rate inside the Pass Results), which Step Functions accepts. Such numbers are written
in positional notation (``0.00005``, the same value) when the definition is sent to moto.

moto's Map (ItemSelector with ``$$.Map.Item.Value``, MaxConcurrency, ResultPath null), Choice and Retry fields
(JitterStrategy, MaxDelaySeconds) run as synthesized; nothing else is rewritten.

Asserted: the execution SUCCEEDED; one processing job, and one training job per target x variant x repetition,
exist in moto SageMaker with the image, instance type and count, hyperparameters, input channels, output path,
stopping condition (MaxWaitTimeInSeconds for spot), checkpoint config and tags of the plan; the parameters each
SageMaker task sent (TaskScheduled events) equal the request plan_jobs built, field for field; every Map
iteration read the run's status first. With the run STOPPED (what the budget guard does), no training job starts.
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import boto3
import pytest
from moto import mock_aws
from moto.sagemaker.exceptions import ValidationError
from moto.sagemaker.models import SageMakerModelBackend
from moto.stepfunctions.parser.api import ExecutionFailedEventDetails, HistoryEventType
from moto.stepfunctions.parser.asl.component.common.error_name.failure_event import (
    FailureEvent,
    FailureEventException,
)
from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name import StatesErrorName
from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name_type import StatesErrorNameType
from moto.stepfunctions.parser.asl.component.common.path import result_path as moto_result_path
from moto.stepfunctions.parser.asl.component.common.payload.payloadvalue.payloadbinding.payload_binding import (
    PayloadBindingStringExpressionSimple,
)
from moto.stepfunctions.parser.asl.component.common.payload.payloadvalue.payloadvaluelit.payload_value_str import (
    PayloadValueStr,
)
from moto.stepfunctions.parser.asl.component.common.string.string_expression import StringJsonPath
from moto.stepfunctions.parser.asl.component.state.exec.state_map.item_reader.eval import (
    resource_eval_s3 as moto_item_reader,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.distributed_iteration_component import (
    DistributedIterationComponent,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_task import lambda_eval_utils
from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
    state_task_service_aws_sdk as moto_sdk_service,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
    state_task_service_dynamodb as moto_ddb_service,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
    state_task_service_unsupported as moto_unsupported_service,
)
from moto.stepfunctions.parser.asl.eval.event.event_detail import EventDetails
from moto.stepfunctions.parser.asl.eval.event.event_manager import EventManager
from moto.stepfunctions.parser.asl.parse.preprocessor import Preprocessor
from moto.stepfunctions.parser.asl.utils import boto_client as moto_boto_client
from moto.stepfunctions.parser.asl.utils import json_path as moto_json_path

from gpuscout.store.base import JobStatus, RunStatus
from gpuscout.workflow import STATES, STEPS
from lambdas.analyze_run import handler as analyze_handler
from lambdas.plan_jobs import handler as plan_handler
from lambdas.validate_manifest import handler as validate_handler
from tests.infra.conftest import Synthesized, state_machine_definition, synthesized  # noqa: F401 - fixture
from tests.integration.cloud_world import (
    ARTIFACTS_BUCKET,
    DATA_BUCKET,
    IMAGE_URI,
    PROCESSING_ROLE_ARN,
    REGION,
    TABLE,
    Cloud,
    benchmark_for,
    cloud_manifest,
    run_role_arn,
    wide_manifest,
)
from tests.workflow_walk import walked

SFN_ROLE_ARN = "arn:aws:iam::123456789012:role/gpuscout-state-machine"
# Pass states accept these fields of a Task; the rest (Resource, Retry, Catch, timeouts) exist only on Tasks.
PASS_FIELDS = ("Comment", "Next", "End", "InputPath", "Parameters", "ResultPath", "OutputPath")
REPETITIONS = 2


def _walk_states(definition: dict[str, Any], visit: Callable[[str, dict[str, Any]], dict[str, Any]]) -> None:
    """Replace every state (nested Map processors included) by ``visit(name, state)``."""
    states = definition["States"]
    for name in list(states):
        state = states[name]
        processor = state.get("ItemProcessor") or state.get("Iterator")
        if processor:
            _walk_states(processor, visit)
        states[name] = visit(name, state)


def runnable_in_moto(
    definition: dict[str, Any],
    results: dict[str, Any],
    table_name: str = TABLE,
    *,
    invoked: dict[str, str] | None = None,
    items_bucket: str = ARTIFACTS_BUCKET,
    processing_role_arn: str = PROCESSING_ROLE_ARN,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The substitutions of the module docstring. ``results`` maps a Lambda Task's resource placeholder
    ('<LogicalId.Arn>') to the handler output its Pass state returns; ``invoked`` maps a placeholder to a Lambda ARN
    instead: that Task stays a Task (Retry and Catch included) and is invoked in process (``InProcessLambdas``).
    ``processing_role_arn`` replaces data preparation's role (the training tasks pass the run's own role, $.role_arn);
    ``table_name`` replaces the results table's Ref in DynamoDB
    tasks (whose resource ARN's partition pseudo-parameter becomes ``aws``), ``items_bucket`` the artifacts bucket's
    Ref in the Distributed Maps' ItemReader. Returns the new ASL and state name -> placeholder."""
    rewritten = copy.deepcopy(definition)
    lambda_states: dict[str, str] = {}
    invoked = invoked or {}

    def visit(name: str, state: dict[str, Any]) -> dict[str, Any]:
        if "ItemReader" in state:  # a Distributed Map's reader: the artifacts bucket's Ref, the partition
            reader = copy.deepcopy(state["ItemReader"])
            assert reader["Resource"] == "arn:<AWS::Partition>:states:::s3:getObject"
            assert str(reader["Parameters"]["Bucket"]).startswith("<StorageArtifacts")
            reader["Resource"] = "arn:aws:states:::s3:getObject"
            reader["Parameters"] = {**reader["Parameters"], "Bucket": items_bucket}
            return {**state, "ItemReader": reader}
        if state.get("Type") != "Task":
            return state
        resource = str(state["Resource"])
        if resource in invoked:
            lambda_states[name] = resource
            return {**state, "Resource": invoked[resource]}
        if resource in results:
            lambda_states[name] = resource
            passed = {key: state[key] for key in PASS_FIELDS if key in state}
            return {"Type": "Pass", **passed, "Result": results[resource]}
        if resource.startswith("arn:<AWS::Partition>:states:::sagemaker:") and resource.endswith(".sync"):
            parameters = copy.deepcopy(state["Parameters"])
            holder = parameters.get("TrainingJobDefinition", parameters)  # a tuning job's role is in its definition
            # the task names its role itself (the run's own role, or data preparation's), never the request's
            if "createProcessingJob" in resource:
                named = str(holder.pop("RoleArn"))
                assert named.startswith("<RolesSageMakerProcessing"), named
                holder["RoleArn"] = processing_role_arn
            else:
                assert holder["RoleArn.$"] == "$.role_arn" and "RoleArn" not in holder, holder
            return {
                **state,
                "Resource": resource.removesuffix(".sync").replace("<AWS::Partition>", "aws"),
                "Parameters": parameters,
            }
        if resource == "arn:<AWS::Partition>:states:::aws-sdk:sagemaker:describeTrainingJob":
            return {**state, "Resource": resource.replace("<AWS::Partition>", "aws")}
        if resource == "arn:<AWS::Partition>:states:::dynamodb:getItem":
            assert str(state["Parameters"]["TableName"]).startswith("<ResultsTable")
            return {
                **state,
                "Resource": "arn:aws:states:::dynamodb:getItem",
                "Parameters": {**state["Parameters"], "TableName": table_name},
            }
        raise AssertionError(f"state {name!r}: no moto substitution for resource {resource}")

    _walk_states(rewritten, visit)
    assert "<" not in json.dumps(rewritten), "an unresolved CloudFormation reference is left in the definition"
    return rewritten, lambda_states


def asl_json(definition: dict[str, Any]) -> str:
    """JSON text of the definition with negative-exponent floats in positional notation (see the module docstring)."""
    positional: dict[str, str] = {}

    def swap(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [swap(v) for v in value]
        if isinstance(value, float) and "e-" in repr(value):
            marker = f"__gpuscout_float_{len(positional)}__"
            positional[marker] = format(Decimal(repr(value)), "f")
            return marker
        return value

    text = json.dumps(swap(definition))
    for marker, number in positional.items():
        text = text.replace(f'"{marker}"', number)
    assert json.loads(text) == definition
    return text


def _wait_for(sfn: Any, execution_arn: str, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        described: dict[str, Any] = sfn.describe_execution(executionArn=execution_arn)
        if described["status"] != "RUNNING" or time.monotonic() > deadline:
            return described
        time.sleep(0.1)


class EveryEvent:
    """Every history event of an execution and of its Distributed Maps' child workflows, in the order they happened.

    A Distributed Map's children are executions with their own histories (on AWS and in moto, where each child's
    events go to an EventManager of its own that the history API does not list): this records every event any
    EventManager creates, so the tests see what ran inside the children as they see the parent's states."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        create = EventManager._create_history_event

        def recorded(*args: Any, **kwargs: Any) -> Any:
            event = create(*args, **kwargs)
            with self._lock:  # a new event's details are not changed afterwards: a shallow copy keeps them
                self.events.append(dict(event))
            return event

        monkeypatch.setattr(EventManager, "_create_history_event", staticmethod(recorded))

    def payload_sizes(self) -> list[tuple[int, str, str]]:
        """(bytes, event type, state name) of every input, output and task parameters an event carries."""
        sizes = []
        for event in self.events:
            for key, details in event.items():
                if not key.endswith("EventDetails") or not isinstance(details, dict):
                    continue
                for field_name in ("input", "output", "parameters"):
                    if isinstance(details.get(field_name), str):
                        size = len(details[field_name].encode())
                        sizes.append((size, str(event["type"]), str(details.get("name", details.get("resource", "")))))
        return sizes


def role_arn_paths_read_as_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """What moto's ASL parser gets wrong: it lexes the key ``"RoleArn.$"`` as the keyword of a Task's Credentials
    field and so reads ``"RoleArn.$": "$.role_arn"`` inside Parameters as a literal field named ``RoleArn.$``. Step
    Functions reads it as every other ``<field>.$`` key: the field RoleArn, from the path. This reads it so too."""
    literal = Preprocessor.visitPayload_binding_value

    def path_binding(self: Any, ctx: Any) -> Any:
        binding = literal(self, ctx)
        if binding.field == "RoleArn.$" and isinstance(binding.payload_value, PayloadValueStr):
            return PayloadBindingStringExpressionSimple(
                field="RoleArn", string_expression_simple=StringJsonPath(json_path=binding.payload_value.val)
            )
        return binding

    monkeypatch.setattr(Preprocessor, "visitPayload_binding_value", path_binding)


def quicker_moto_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two costs of moto's interpreter that grow with every state a child workflow runs, removed without changing
    what runs: it builds a new JSONPath parser (jsonpath_ng's yacc tables) for every path it evaluates, and a new
    boto3 client for every service call. Each distinct path is parsed once, and one client per region and service
    (botocore clients are thread-safe) serves every call, so a 1,000-child plan runs in a test's time."""
    for module in (moto_json_path, moto_result_path):
        monkeypatch.setattr(module, "parse", functools.lru_cache(maxsize=None)(module.parse))
    clients: dict[tuple[str, str], Any] = {}
    lock = threading.Lock()
    make_client = moto_boto_client.boto_client_for

    def shared_client(region: str, service: str, state_credentials: Any = None) -> Any:
        with lock:
            key = (region, service)
            if key not in clients:
                clients[key] = make_client(region, service, state_credentials)
            return clients[key]

    for module in (moto_ddb_service, moto_sdk_service, moto_unsupported_service, moto_item_reader):
        assert module.boto_client_for is make_client
        monkeypatch.setattr(module, "boto_client_for", shared_client)


EXCEEDED_TOLERATED_FAILURES = "The specified tolerated failure threshold was exceeded"


def fail_map_runs_past_their_tolerance(monkeypatch: pytest.MonkeyPatch) -> None:
    """What moto leaves out of a Distributed Map: its Map Run fails (States.ExceedToleratedFailureThreshold) when
    more child workflows failed than it tolerates (ToleratedFailureCount/Percentage, both 0 unless set, as in every
    Map here). moto counts the failed children and lets the Map succeed; this adds AWS's check after the children
    ran, so a failed canary fails its Map as it does on AWS."""
    map_run = DistributedIterationComponent._map_run

    def with_threshold(self: Any, env: Any, eval_input: Any) -> None:
        map_run(self, env, eval_input)
        counts = eval_input.map_run_record.item_counter
        failed, total = counts.failed.get() + counts.timed_out.get() + counts.aborted.get(), counts.total.get()
        count_limit = eval_input.tolerated_failure_count or 0
        percent_limit = eval_input.tolerated_failure_percentage or 0
        if failed > count_limit or (total and 100 * failed / total > percent_limit):
            error = StatesErrorName(typ=StatesErrorNameType.StatesExceedToleratedFailureThreshold)
            details = ExecutionFailedEventDetails(error=error.error_name, cause=EXCEEDED_TOLERATED_FAILURES)
            raise FailureEventException(
                FailureEvent(
                    env, error, HistoryEventType.MapRunFailed, EventDetails(executionFailedEventDetails=details)
                )
            )

    monkeypatch.setattr(DistributedIterationComponent, "_map_run", with_threshold)


def _history(sfn: Any, execution_arn: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    kwargs: dict[str, Any] = {"executionArn": execution_arn, "maxResults": 1000}
    while True:
        page = sfn.get_execution_history(**kwargs)
        events += page["events"]
        if not page.get("nextToken"):
            return events
        kwargs["nextToken"] = page["nextToken"]


def _entered_inputs(events: list[dict[str, Any]], state_name: str) -> list[dict[str, Any]]:
    return [
        json.loads(e["stateEnteredEventDetails"]["input"])
        for e in events
        if "stateEnteredEventDetails" in e and e["stateEnteredEventDetails"]["name"] == state_name
    ]


def _scheduled(events: list[dict[str, Any]], resource: str) -> list[dict[str, Any]]:
    return [
        json.loads(e["taskScheduledEventDetails"]["parameters"])
        for e in events
        if e.get("taskScheduledEventDetails", {}).get("resource") == resource
    ]


@dataclass
class Executed:
    execution_input: dict[str, Any]
    validated: dict[str, Any]
    planned: dict[str, Any]
    analyzed: dict[str, Any]
    status_after_analyze: RunStatus
    described: dict[str, Any]
    events: list[dict[str, Any]]  # the execution's and its child workflows' (EveryEvent)
    history: list[dict[str, Any]]  # the execution's own, as GetExecutionHistory lists it
    recorder: EveryEvent


def _execute(
    cloud: Cloud,
    synthesized: Synthesized,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    *,
    stop_run_before_start: bool = False,
    manifest: str | None = None,
    timeout_s: float = 60.0,
    analyze: bool = True,
) -> Executed:
    """Submit a manifest, compute the Lambda outputs with the real handlers, run the rewritten ASL in moto."""
    if manifest is None:
        manifest = cloud_manifest(budget=80.0).replace("constraints:", f"repetitions: {REPETITIONS}\nconstraints:")
    execution_input = cloud.submit(manifest)

    validated = validate_handler.handler(dict(execution_input), cloud.context)
    planned = plan_handler.handler(copy.deepcopy(validated), cloud.context)
    run_id = planned["run_id"]
    status_when_planned = cloud.services.store.get_run(run_id).status
    assert planned["prepare"]["skip"] is False  # nothing processed yet: the Prepare data branch runs
    if analyze:
        analyzed = analyze_handler.handler({"run_id": run_id}, cloud.context)
        status_after_analyze = cloud.services.store.get_run(run_id).status
        # Analyze's output was computed ahead for its Pass state; put the run row back as the Map would find it.
        cloud.services.store.update_run(run_id, status=status_when_planned)
    else:  # the analysis's summary has this shape whatever the run's size (see the first test for a real one)
        analyzed = {"run_id": run_id, "recommendation": "not analysed here", "report_uri": None, "notified": False}
        status_after_analyze = status_when_planned

    functions = synthesized.stack.functions.functions
    placeholder = {name: f"<{synthesized.logical_id(fn)}.Arn>" for name, fn in functions.items()}
    results = {
        placeholder["validate_manifest"]: validated,
        placeholder["plan_jobs"]: planned,
        placeholder["analyze_run"]: analyzed,
        # Reached only through the Map's Catch; moto SageMaker accepts every request, so it is never entered here.
        placeholder["record_job_failure"]: {"run_id": run_id, "job_name": "", "status": "", "applied": False},
        # Its output is discarded (ResultPath null); what it records is covered by the in-process tests below.
        placeholder["record_job_result"]: {"run_id": run_id, "job_name": "", "status": "", "applied": False},
        # Reached only through the Catches after planning (and a failed canary's); never entered on this success path.
        placeholder["mark_run_failed"]: {"runs": []},
        # "Create run role" (the Maps pass its role_arn to every job) and "Delete run role" (output discarded);
        # creating and deleting run roles is covered by tests/unit/test_run_roles.py and the in-process tests below.
        placeholder["run_role"]: {"role_arn": run_role_arn(run_id)},
    }
    # data preparation under its own role (it writes the shared cache); every training request under the jobs' role
    assert planned["prepare"]["request"]["RoleArn"] == PROCESSING_ROLE_ARN
    assert {job["request"]["RoleArn"] for job in cloud.items(planned)} == {run_role_arn(run_id)}
    definition, lambda_states = runnable_in_moto(state_machine_definition(synthesized), results)
    assert sorted(lambda_states) == [
        "Analyze run",
        "Create run role",
        "Delete run role",
        "Mark run failed",
        "Mark run failed (canary)",  # inside the canaries' child workflows (no canary here: that list is empty)
        "Plan jobs",
        "Record job failure",
        "Record job result",
        "Record search failure",  # the search Map's (no search here: its list of tuning jobs is empty)
        "Record trials",
        "Validate manifest",
    ]
    if stop_run_before_start:
        # What job_events' budget guard does when measured spend crosses the budget.
        cloud.services.store.update_run(run_id, status=RunStatus.STOPPED, error="budget reached")

    recorder = EveryEvent(monkeypatch)
    fail_map_runs_past_their_tolerance(monkeypatch)
    quicker_moto_interpreter(monkeypatch)
    role_arn_paths_read_as_paths(monkeypatch)
    with mock_aws(config={"stepfunctions": {"execute_state_machine": True}}):
        sfn = boto3.client("stepfunctions", region_name=REGION)
        machine_arn = sfn.create_state_machine(
            name="gpuscout-test", definition=asl_json(definition), roleArn=SFN_ROLE_ARN
        )["stateMachineArn"]
        execution_arn = sfn.start_execution(stateMachineArn=machine_arn, input=json.dumps(execution_input))[
            "executionArn"
        ]
        described = _wait_for(sfn, execution_arn, timeout_s)
        history = _history(sfn, execution_arn)
    return Executed(
        execution_input, validated, planned, analyzed, status_after_analyze, described, recorder.events, history,
        recorder,
    )  # fmt: skip


def test_the_synthesized_state_machine_creates_every_planned_job(
    cloud: Cloud,
    synthesized: Synthesized,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = _execute(cloud, synthesized, monkeypatch)
    execution_input, validated, planned, analyzed = run.execution_input, run.validated, run.planned, run.analyzed
    described, events, run_id = run.described, run.events, run.planned["run_id"]

    assert described["status"] == "SUCCEEDED", json.dumps(events[-2:], default=str)[-3000:]
    assert json.loads(described["output"]) == analyzed

    # Each Pass state got exactly what its handler was called with.
    assert _entered_inputs(events, "Validate manifest") == [execution_input]
    assert _entered_inputs(events, "Plan jobs") == [validated]
    [analyze_input] = _entered_inputs(events, "Analyze run")
    assert analyze_input["run_id"] == run_id
    assert _entered_inputs(events, "Record job failure") == []
    assert _entered_inputs(events, "Mark run failed") == []
    assert _entered_inputs(events, "Skip job (run stopped)") == []

    # Data preparation: one processing job, sent exactly as planned.
    prepare_request = planned["prepare"]["request"]
    assert _scheduled(events, "createProcessingJob") == [prepare_request]
    processing = cloud.sagemaker.describe_processing_job(ProcessingJobName=prepare_request["ProcessingJobName"])
    assert processing["ProcessingJobName"].startswith("gs-")
    assert processing["RoleArn"] == PROCESSING_ROLE_ARN
    assert processing["AppSpecification"]["ImageUri"] == IMAGE_URI
    assert processing["StoppingCondition"] == prepare_request["StoppingCondition"]

    # Training: one job per target x variant x repetition, each sent exactly as planned.
    manifest_data = validated["manifest"]
    targets, variants = manifest_data["targets"], manifest_data["variants"]
    jobs = cloud.items(planned)
    assert len(jobs) == len(targets) * len(variants) * REPETITIONS == 8
    requests = {job["job_name"]: job["request"] for job in jobs}
    sent = {params["TrainingJobName"]: params for params in _scheduled(events, "createTrainingJob")}
    assert sent == requests
    listed = cloud.sagemaker.list_training_jobs(MaxResults=100)["TrainingJobSummaries"]
    assert sorted(s["TrainingJobName"] for s in listed) == sorted(requests)

    combos = set()
    for job in jobs:
        request = job["request"]
        described_job = cloud.sagemaker.describe_training_job(TrainingJobName=job["job_name"])
        spec = next(
            (t, v, r)
            for t in range(len(targets))
            for v in range(len(variants))
            for r in range(REPETITIONS)
            if f"-t{t}v{v}r{r}-" in job["job_name"]
        )
        combos.add(spec)
        target, variant = targets[spec[0]], variants[spec[1]]

        assert described_job["AlgorithmSpecification"]["TrainingImage"] == IMAGE_URI
        assert described_job["RoleArn"] == run_role_arn(run_id)  # the run's own role
        assert described_job["ResourceConfig"]["InstanceType"] == target["instance_type"]
        assert described_job["ResourceConfig"]["InstanceCount"] == target["instance_count"]
        assert described_job["HyperParameters"] == request["HyperParameters"]
        assert described_job["HyperParameters"]["per_device_train_batch_size"] == str(variant["per_device_batch_size"])
        assert described_job["InputDataConfig"] == request["InputDataConfig"]
        channel_uris = [c["DataSource"]["S3DataSource"]["S3Uri"] for c in described_job["InputDataConfig"]]
        assert channel_uris and all(uri.startswith(f"s3://{DATA_BUCKET}/processed/") for uri in channel_uris)
        output_path = described_job["OutputDataConfig"]["S3OutputPath"]
        assert output_path == request["OutputDataConfig"]["S3OutputPath"]
        assert output_path == f"s3://{ARTIFACTS_BUCKET}/output/{run_id}/"
        stopping = described_job["StoppingCondition"]
        assert stopping == request["StoppingCondition"]
        assert stopping["MaxRuntimeInSeconds"] > 0
        spot = bool(target.get("spot"))
        assert described_job["EnableManagedSpotTraining"] is spot
        if spot:
            assert stopping["MaxWaitTimeInSeconds"] > stopping["MaxRuntimeInSeconds"]
        else:
            assert "MaxWaitTimeInSeconds" not in stopping
        checkpoint = described_job["CheckpointConfig"]
        assert checkpoint == request["CheckpointConfig"]
        assert checkpoint["S3Uri"] == f"s3://{ARTIFACTS_BUCKET}/checkpoints/{run_id}/{job['job_name']}/"
        tags = {
            t["Key"]: t["Value"] for t in cloud.sagemaker.list_tags(ResourceArn=described_job["TrainingJobArn"])["Tags"]
        }
        assert tags["gpuscout:run-id"] == run_id and tags["gpuscout:managed"] == "true"
    assert len(combos) == len(jobs)  # every (target, variant, repetition) exactly once

    # Analyze ran (ahead, see _execute); moto emits no job events, so no job completed and the run FAILED.
    assert run.status_after_analyze is RunStatus.FAILED
    # Every iteration read the run row before launching and found it live.
    reads = _entered_inputs(events, "Run still going?")
    assert len(reads) == len(jobs) and all(r["run"] == {"status": "PLANNED"} for r in reads)


@pytest.mark.parametrize(
    "resource", ["arn:<AWS::Partition>:states:::sagemaker:createTrainingJob.sync", "arn:aws:lambda:x"]
)
def test_the_rewrite_touches_only_lambda_and_sync_tasks(resource: str) -> None:
    parameters = {"TrainingJobName.$": "$.request.TrainingJobName", "RoleArn.$": "$.role_arn"}
    state = {"Type": "Task", "Resource": resource, "Parameters": parameters, "End": True}
    definition = {"StartAt": "A", "States": {"A": state}}
    if resource.startswith("arn:aws:lambda"):
        with pytest.raises(AssertionError, match="no moto substitution"):
            runnable_in_moto(definition, {})
        return
    rewritten, lambda_states = runnable_in_moto(definition, {})
    assert rewritten["States"]["A"] == {
        "Type": "Task",
        "Resource": "arn:aws:states:::sagemaker:createTrainingJob",
        "Parameters": {"TrainingJobName.$": "$.request.TrainingJobName", "RoleArn.$": "$.role_arn"},
        "End": True,
    }
    assert lambda_states == {}


def test_a_run_stopped_by_the_budget_guard_launches_no_further_job(
    cloud: Cloud,
    synthesized: Synthesized,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given the budget guard marked the run STOPPED before the Map started its jobs,
    run = _execute(cloud, synthesized, monkeypatch, stop_run_before_start=True)
    # then every iteration read the run row, took the skip branch, and no training job was created.
    assert run.described["status"] == "SUCCEEDED", json.dumps(run.events[-2:], default=str)[-3000:]
    skipped = _entered_inputs(run.events, "Skip job (run stopped)")
    assert sorted(item["job_name"] for item in skipped) == sorted(job["job_name"] for job in cloud.items(run.planned))
    assert all(item["run"] == {"status": "STOPPED"} for item in skipped)
    assert _scheduled(run.events, "createTrainingJob") == []
    assert cloud.sagemaker.list_training_jobs(MaxResults=100)["TrainingJobSummaries"] == []


# ---------------------------------------------------------------------------------------------------------------
# Executions whose Lambda steps run for real, in process, while the execution runs.
#
# moto's interpreter invokes a Lambda Task through ``lambda_eval_utils._invoke_lambda_function`` (the Lambda Invoke
# API, which moto cannot serve without Docker). ``InProcessLambdas`` stands in for that one call: it calls the real
# handler (lambdas/<name>/handler.py) with the Task's payload and answers as the Invoke API does, a raised exception
# becoming FunctionError "Unhandled" with the Python runtime's payload ({"errorType": <class name>, ...}), so the
# synthesized Retry and Catch fields (which these Tasks keep) see the error names they see in AWS. Every other state
# runs as in the tests above. SageMaker still completes jobs instantly and sends no events: job_events never runs.

FUNCTION_ARN = "arn:aws:lambda:us-east-1:123456789012:function:gpuscout-{name}"

# The cloud manifest of conftest cut to one on-demand target and one variant: one job.
ONE_JOB_MANIFEST = (
    cloud_manifest(name="one-job")
    .replace("  - instance_type: ml.p4d.24xlarge\n    spot: true\n", "")
    .replace("  - name: b8\n    per_device_batch_size: 8\n", "")
)
assert ONE_JOB_MANIFEST.count("instance_type:") == 1 and ONE_JOB_MANIFEST.count("- name:") == 1


@dataclass
class InProcessLambdas:
    """The Lambda Invoke API of a running execution, served by the real handlers (one invocation at a time, as
    separate Lambda sandboxes would not share the handlers' module state)."""

    context: Any
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    outputs: list[tuple[str, Any]] = field(default_factory=list)  # what each successful invocation returned
    steps: list[str] = field(default_factory=list)  # the workflow steps the handlers entered, in order (walked)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, parameters: dict[str, Any], region: str, state_credentials: Any) -> dict[str, Any]:
        name = str(parameters["FunctionName"]).rsplit(":", 1)[-1].removeprefix("gpuscout-")
        payload = json.loads(parameters["Payload"])
        handler = importlib.import_module(f"lambdas.{name}.handler").handler
        with self._lock:
            self.calls.append((name, payload))
            try:
                with walked(self.steps):
                    output = handler(payload, self.context)
            except Exception as err:  # what the Python runtime reports for an unhandled exception
                error = {"errorType": type(err).__name__, "errorMessage": str(err)}
                return {"StatusCode": 200, "FunctionError": "Unhandled", "Payload": error}
            self.outputs.append((name, json.loads(json.dumps(output))))
        return {"StatusCode": 200, "Payload": json.loads(json.dumps(output))}

    def called(self, name: str) -> list[dict[str, Any]]:
        return [payload for called, payload in self.calls if called == name]


@dataclass
class LiveRun:
    execution_input: dict[str, str]
    described: dict[str, Any]
    events: list[dict[str, Any]]
    lambdas: InProcessLambdas

    @property
    def run_id(self) -> str:
        [planned] = self.lambdas.called("plan_jobs")
        return str(planned["run_id"])


def _execute_live(
    cloud: Cloud,
    synthesized: Synthesized,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    manifest: str,
    *,
    name: str = "one-job",
    execution_input: dict[str, str] | None = None,
    rewrite: Callable[[dict[str, Any]], None] | None = None,
    run_job: Callable[[InProcessLambdas, dict[str, Any]], dict[str, Any]] | None = None,
) -> LiveRun:
    """Run the synthesized state machine on moto with every Lambda step served by its real handler. Each training
    job SageMaker creates writes its benchmark.json where a real job's output lands (moto's jobs end at once):
    ``run_job(lambdas, create_training_job kwargs)`` makes it (default: a stored fixture benchmark)."""
    execution_input = execution_input or cloud.submit(manifest, name=name)
    functions = synthesized.stack.functions.functions
    invoked = {f"<{synthesized.logical_id(fn)}.Arn>": FUNCTION_ARN.format(name=n) for n, fn in functions.items()}
    synthesized_definition = state_machine_definition(synthesized)
    if rewrite is not None:
        rewrite(synthesized_definition)
    definition, lambda_states = runnable_in_moto(synthesized_definition, {}, invoked=invoked)
    assert "Record job result" in lambda_states
    lambdas = InProcessLambdas(cloud.context)
    assert callable(lambda_eval_utils._invoke_lambda_function)  # the one moto function replaced here
    monkeypatch.setattr(lambda_eval_utils, "_invoke_lambda_function", lambdas)

    create_training_job = SageMakerModelBackend.create_training_job

    def create_and_finish(backend: SageMakerModelBackend, *args: Any, **kwargs: Any) -> Any:
        job = create_training_job(backend, *args, **kwargs)
        job_name = str(kwargs.get("training_job_name") or args[0])
        run_id = next(t["Value"] for t in kwargs["tags"] if t["Key"] == "gpuscout:run-id")
        instance_type = kwargs["resource_config"]["InstanceType"]
        if run_job is None:
            benchmark = benchmark_for(job_name, run_id, instance_type)
        else:
            benchmark = run_job(lambdas, {**kwargs, "training_job_name": job_name})
        cloud.upload_benchmark(run_id, job_name, benchmark)
        return job

    monkeypatch.setattr(SageMakerModelBackend, "create_training_job", create_and_finish)
    recorder = EveryEvent(monkeypatch)
    fail_map_runs_past_their_tolerance(monkeypatch)
    quicker_moto_interpreter(monkeypatch)
    role_arn_paths_read_as_paths(monkeypatch)
    with mock_aws(config={"stepfunctions": {"execute_state_machine": True}}):
        sfn = boto3.client("stepfunctions", region_name=REGION)
        machine_arn = sfn.create_state_machine(
            name=f"gpuscout-live-{time.monotonic_ns()}", definition=asl_json(definition), roleArn=SFN_ROLE_ARN
        )["stateMachineArn"]
        execution_arn = sfn.start_execution(stateMachineArn=machine_arn, input=json.dumps(execution_input))[
            "executionArn"
        ]
        described = _wait_for(sfn, execution_arn)
    return LiveRun(execution_input, described, recorder.events, lambdas)


def _run_roles() -> list[str]:
    """The run roles left in the moto account."""
    roles = boto3.client("iam", region_name=REGION).list_roles(PathPrefix="/gpuscout/")["Roles"]
    return [str(role["RoleName"]) for role in roles]


def test_a_finished_job_is_recorded_before_analysis_even_when_job_events_has_not_run(
    cloud: Cloud,
    synthesized: Synthesized,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a one-job run whose job SageMaker finishes, and no job_events invocation before Analyze
    # (the .sync task returns on the same event that triggers job_events asynchronously),
    run = _execute_live(cloud, synthesized, monkeypatch, ONE_JOB_MANIFEST)
    assert run.described["status"] == "SUCCEEDED", json.dumps(run.events[-3:], default=str)[-3000:]
    assert run.lambdas.called("job_events") == []
    order = [name for name, _ in run.lambdas.calls]
    assert order == ["validate_manifest", "plan_jobs", "run_role", "record_job_result", "analyze_run", "run_role"]
    # the handlers drove the workflow's steps (gpuscout.workflow) in its order, each once; the job ran on SageMaker and
    # its row came from record_job_result (cloud/events.py), so no Lambda enters train_and_record
    assert run.lambdas.steps == ["validate", "plan", "canary", "analyze", "report", "close"]
    assert [s for s in STEPS if s in run.lambdas.steps] == run.lambdas.steps
    # the run's own role: created before its first job, which ran with it; deleted once the run was analysed
    assert [call["action"] for call in run.lambdas.called("run_role")] == ["create", "delete"]
    [(_, created), (_, deleted)] = [out for out in run.lambdas.outputs if out[0] == "run_role"]
    assert created == {"role_arn": run_role_arn(run.run_id)} and deleted == {"deleted": True}
    [job] = cloud.sagemaker.list_training_jobs(MaxResults=10)["TrainingJobSummaries"]
    assert (
        cloud.sagemaker.describe_training_job(TrainingJobName=job["TrainingJobName"])["RoleArn"] == created["role_arn"]
    )
    assert _run_roles() == []

    # then the Map recorded the job as COMPLETED with its benchmark before Analyze read it,
    store = cloud.services.store
    [job] = store.list_jobs(run.run_id)
    assert job.status is JobStatus.COMPLETED
    assert job.benchmark is not None and job.benchmark.job_name == job.job_name
    # and the run was analysed as a success with that job ranked.
    assert store.get_run(run.run_id).status is RunStatus.SUCCEEDED
    result = store.get_result(run.run_id)
    assert result is not None and result.report_uri == f"s3://{DATA_BUCKET}/reports/{run.run_id}/"
    assert job.job_name in result.analysis.model_dump_json()


def test_a_failed_data_preparation_marks_the_run_failed_and_fails_the_execution(
    cloud: Cloud,
    synthesized: Synthesized,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given SageMaker refuses the data-preparation job,
    def refuse(backend: SageMakerModelBackend, *args: Any, **kwargs: Any) -> Any:
        raise ValidationError(message="Processing job failed: AlgorithmError: exit code 2")

    monkeypatch.setattr(SageMakerModelBackend, "create_processing_job", refuse)
    run = _execute_live(cloud, synthesized, monkeypatch, ONE_JOB_MANIFEST)
    # then the Catch marked the run FAILED with the error and cause before the execution failed with that cause,
    assert run.described["status"] == "FAILED", json.dumps(run.events[-3:], default=str)[-3000:]
    calls = ["validate_manifest", "plan_jobs", "run_role", "mark_run_failed"]
    assert [name for name, _ in run.lambdas.calls] == calls
    # (the run's own role was created before data preparation, and deleted when the run was marked failed)
    [(_, failed)] = [out for out in run.lambdas.outputs if out[0] == "mark_run_failed"]
    assert [outcome["role_deleted"] for outcome in failed["runs"]] == [True]
    assert _run_roles() == []
    [caught] = run.lambdas.called("mark_run_failed")
    assert caught["run_id"] == run.run_id and caught["execution_arn"] == run.described["executionArn"]
    stored = cloud.services.store.get_run(run.run_id)
    assert stored.status is RunStatus.FAILED and stored.error is not None and "exit code 2" in stored.error
    assert stored.execution_arn == run.described["executionArn"]
    assert run.described["error"] == "RunFailed" and "exit code 2" in run.described["cause"]
    assert stored.error.startswith(f"{caught['error']['Error']}: ")
    # and no training job was launched.
    assert cloud.sagemaker.list_training_jobs(MaxResults=100)["TrainingJobSummaries"] == []


TWO_CONFIGURATIONS = ONE_JOB_MANIFEST.replace(
    "variants:\n  - name: b4\n    per_device_batch_size: 4\n",
    "variants:\n  - name: b4\n    per_device_batch_size: 4\n  - name: b4-ckpt\n    per_device_batch_size: 4\n"
    "    gradient_checkpointing: true\n  - name: b4-again\n    per_device_batch_size: 4\n",
)


def _training_jobs(cloud: Cloud) -> list[str]:
    summaries = cloud.sagemaker.list_training_jobs(MaxResults=100, SortBy="CreationTime", SortOrder="Ascending")
    return [s["TrainingJobName"] for s in summaries["TrainingJobSummaries"]]


def test_canaries_run_before_the_fan_out_one_per_configuration(
    with_canary: Cloud,
    synthesized: Synthesized,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given three variants of which two run the same settings (two configurations), When the run executes
    run = _execute_live(with_canary, synthesized, monkeypatch, TWO_CONFIGURATIONS, name="canaried")
    assert run.described["status"] == "SUCCEEDED", json.dumps(run.events[-3:], default=str)[-3000:]
    # Then two canaries ran first, on the canary instance, 2 steps of a 2-layer cut, and then the three jobs
    names = _training_jobs(with_canary)
    assert [n for n in names if "-canary" in n] == names[:2] and len(names) == 5
    canary = with_canary.sagemaker.describe_training_job(TrainingJobName=names[0])
    assert (
        canary["ResourceConfig"]["InstanceType"] == "ml.g5.8xlarge" and canary["ResourceConfig"]["InstanceCount"] == 1
    )
    hp = canary["HyperParameters"]
    assert (hp["max_steps"], hp["canary_layers"], hp["per_device_train_batch_size"]) == ("2", "2", "1")
    # and canaries are not benchmark jobs: the run's jobs are the three planned ones, all analysed; each canary has a
    # row of its own (its status in `gpuscout status`, its billed time in the budget guard) naming the jobs it covers
    rows = with_canary.services.store.list_jobs(run.run_id)
    jobs = [j for j in rows if not j.is_canary]
    assert sorted(j.variant_name for j in jobs) == ["b4", "b4-again", "b4-ckpt"]
    canary_rows = sorted((j for j in rows if j.is_canary), key=lambda j: j.job_name)
    assert [j.job_name for j in canary_rows] == sorted(names[:2])
    assert sorted(n for j in canary_rows for n in j.canary_for or []) == sorted(j.job_name for j in jobs)
    result = with_canary.services.store.get_result(run.run_id)
    assert result is not None and not any(
        "-canary" in a["job_name"] for a in result.analysis.model_dump(mode="json")["jobs"]
    )
    assert with_canary.services.store.get_run(run.run_id).status is RunStatus.SUCCEEDED


def test_a_failed_canary_fails_the_run_before_any_expensive_job(
    with_canary: Cloud,
    synthesized: Synthesized,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given SageMaker fails the checkpointing configuration's canary (an error in that code path, say)
    create = SageMakerModelBackend.create_training_job

    def fail_one_canary(backend: SageMakerModelBackend, *args: Any, **kwargs: Any) -> Any:
        name = str(kwargs.get("training_job_name") or args[0])
        if "-canary" in name and kwargs["hyper_parameters"].get("gradient_checkpointing") == "true":
            raise ValidationError(message="AlgorithmError: RuntimeError in checkpointed backward (canary)")
        return create(backend, *args, **kwargs)

    monkeypatch.setattr(SageMakerModelBackend, "create_training_job", fail_one_canary)
    run = _execute_live(with_canary, synthesized, monkeypatch, TWO_CONFIGURATIONS, name="canary-fails")
    # Then the run is FAILED with the canary's own cause (recorded inside its child workflow: the Distributed Map
    # itself fails only with "tolerated failure threshold exceeded") and no benchmark job was launched
    assert run.described["status"] == "FAILED", json.dumps(run.events[-3:], default=str)[-3000:]
    assert run.described["cause"] == EXCEEDED_TOLERATED_FAILURES
    stored = with_canary.services.store.get_run(run.run_id)
    assert stored.status is RunStatus.FAILED and stored.error is not None
    assert "checkpointed backward (canary)" in stored.error, stored.error
    # (the Map's Catch called mark_run_failed too; the run was already final, so the canary's cause stays)
    canary_mark, map_mark = run.lambdas.called("mark_run_failed")
    assert "checkpointed backward (canary)" in canary_mark["error"]["Cause"]
    assert map_mark["error"]["Error"] == "States.ExceedToleratedFailureThreshold"
    marks = (canary_mark, map_mark)
    assert all(m["execution_arn"] == run.described["executionArn"] for m in marks)
    assert all("-canary" in n for n in _training_jobs(with_canary))
    assert "record_job_result" not in [name for name, _ in run.lambdas.calls]


def test_a_lost_create_response_follows_the_job_that_was_launched(
    cloud: Cloud,
    synthesized: Synthesized,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from moto.sagemaker.exceptions import ResourceInUseException

    # Given SageMaker created the job but the response was lost, so the retried create says the name is in use
    create = SageMakerModelBackend.create_training_job

    def created_then_in_use(backend: SageMakerModelBackend, *args: Any, **kwargs: Any) -> Any:
        create(backend, *args, **kwargs)
        raise ResourceInUseException(message="Training job names must be unique within an AWS account and region")

    monkeypatch.setattr(SageMakerModelBackend, "create_training_job", created_then_in_use)

    def moto_error_names(definition: dict[str, Any]) -> None:
        # moto names every error of a SageMaker task States.Runtime (AWS: SageMaker.ResourceInUseException), so the
        # Catch is matched on moto's name here; everything after it runs as synthesized
        train = definition["States"]["Run jobs"]["ItemProcessor"]["States"]["Train"]  # a child workflow's state
        (catch,) = [c for c in train["Catch"] if c["ErrorEquals"] == ["SageMaker.ResourceInUseException"]]
        catch["ErrorEquals"] = ["States.Runtime"]

    run = _execute_live(
        cloud, synthesized, monkeypatch, ONE_JOB_MANIFEST, name="lost-response", rewrite=moto_error_names
    )
    # Then the iteration follows the launched job instead of recording a failure, and the run is analysed with it
    assert run.described["status"] == "SUCCEEDED", json.dumps(run.events[-3:], default=str)[-3000:]
    entered = {e["stateEnteredEventDetails"]["name"] for e in run.events if "stateEnteredEventDetails" in e}
    assert "Describe launched job" in entered and "Record job failure" not in entered
    [job] = cloud.services.store.list_jobs(run.run_id)
    assert job.status is JobStatus.COMPLETED
    assert cloud.services.store.get_run(run.run_id).status is RunStatus.SUCCEEDED


def _all_training_jobs(cloud: Cloud) -> list[str]:
    names: list[str] = []
    kwargs: dict[str, Any] = {"MaxResults": 100}
    while True:
        page = cloud.sagemaker.list_training_jobs(**kwargs)
        names += [s["TrainingJobName"] for s in page["TrainingJobSummaries"]]
        if not page.get("NextToken"):
            return names
        kwargs["NextToken"] = page["NextToken"]


@pytest.mark.parametrize(
    ("variants", "repetitions", "canaries", "requests"),
    [
        # near the request limit (1,000): 4 targets x 24 variants x 10 repetitions = 960 jobs + 32 canaries
        pytest.param(24, 10, True, 992, id="992-requests"),
        # 4 instance types x 25 settings x 3 repetitions, the sweep the 40-job cap refused
        pytest.param(25, 3, False, 300, id="300-jobs"),
    ],
)
def test_a_large_plan_runs_through_the_state_machine_with_every_payload_measured(
    cloud: Cloud,
    synthesized: Synthesized,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    variants: int,
    repetitions: int,
    canaries: bool,
    requests: int,
) -> None:
    from gpuscout.cloud.plan_items import MAX_REQUESTS_PER_RUN, STATE_PAYLOAD_LIMIT_BYTES

    if canaries:
        cloud = request.getfixturevalue("with_canary")
    # Given a plan of `requests` SageMaker jobs (with repetitions; canaries counted where the stack runs them)
    run = _execute(
        cloud, synthesized, monkeypatch, manifest=wide_manifest(variants, repetitions), timeout_s=300.0,
        analyze=False,  # moto's DynamoDB pages a 1,000-row query slowly; the analysis is not what is tested here
    )  # fmt: skip
    # When the synthesized state machine runs it, Then it succeeds and every request was sent, exactly once
    assert run.described["status"] == "SUCCEEDED", json.dumps(run.events[-3:], default=str)[-3000:]
    planned_names = [item["job_name"] for kind in ("canaries", "jobs") for item in cloud.items(run.planned, kind)]
    assert len(planned_names) == requests <= MAX_REQUESTS_PER_RUN
    assert sorted(_all_training_jobs(cloud)) == sorted(planned_names)
    assert len(_entered_inputs(run.events, "Run still going?")) == 4 * variants * repetitions
    # and every state's input, output and task parameters, in the parent and in all child workflows, was measured
    sizes = run.recorder.payload_sizes()
    assert len(sizes) > 10 * requests  # each child's states were seen, not only the parent's
    largest, event_type, state = max(sizes)
    assert largest < STATE_PAYLOAD_LIMIT_BYTES / 8, (largest, event_type, state)
    # A Distributed Map gathers its children's outputs even though its ResultPath drops them (over 256 KiB the execution
    # fails uncatchably): every child ends with its job name only, never its request
    child_ends = ("Canary", "Record job result")
    finals = [
        e["stateExitedEventDetails"]["output"]
        for e in run.events
        if e.get("stateExitedEventDetails", {}).get("name") in child_ends
    ]
    assert len(finals) == requests and max(len(output) for output in finals) < 80
    # The parent's own history does not grow with the plan (its children keep theirs)
    assert len(run.history) < 60, len(run.history)
    parent_sizes = [len(json.dumps(e, default=str)) for e in run.history]
    assert max(parent_sizes) < 16 * 1024, max(parent_sizes)


def test_a_rejected_manifest_ends_the_execution_with_its_cause_without_a_lambda_error(
    cloud: Cloud,
    synthesized: Synthesized,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a manifest that fails validation
    run = _execute_live(cloud, synthesized, monkeypatch, "name: broken\nsequence_length: -1\n", name="broken")
    # Then the execution fails as "Manifest rejected" with the validation's message as its cause,
    assert run.described["status"] == "FAILED", json.dumps(run.events[-3:], default=str)[-3000:]
    assert run.described["error"] == "ManifestRejected" and "is invalid" in run.described["cause"]
    # the handler returned the refusal (no Lambda error for the error alarm to count) and nothing else ran,
    [(name, output)] = run.lambdas.outputs
    assert name == "validate_manifest" and output["refused"]["Error"] == "ManifestRejected"
    assert [called for called, _ in run.lambdas.calls] == ["validate_manifest"]
    # and the run row says REJECTED, with why
    stored = cloud.services.store.get_run(output["run_id"])
    assert stored.status is RunStatus.REJECTED and stored.error is not None and "sequence_length" in stored.error


def test_a_manifest_the_planner_cannot_plan_becomes_a_refused_run_with_its_reason(
    cloud: Cloud,
    synthesized: Synthesized,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpuscout.cloud import plan_step
    from gpuscout.errors import PlanError

    # Given a valid manifest the planner refuses (e.g. a search whose candidates all exceed the GPU's memory)
    def cannot_plan(*args: Any, **kwargs: Any) -> Any:
        raise PlanError("targets[0] ml.g5.8xlarge: no search candidate can run (4 skipped: b8: needs 31 GB)")

    monkeypatch.setattr(plan_step, "plan", cannot_plan)
    run = _execute_live(cloud, synthesized, monkeypatch, ONE_JOB_MANIFEST, name="unplannable")
    # Then the execution ends as "Plan refused" with the planner's reason, no Lambda raised,
    assert run.described["status"] == "FAILED", json.dumps(run.events[-3:], default=str)[-3000:]
    assert run.described["error"] == "PlanRefused" and "no search candidate can run" in run.described["cause"]
    assert [name for name, _ in run.lambdas.outputs] == ["validate_manifest", "plan_jobs"]
    # and the run row is REFUSED with the reason (not a failed execution with no trace), nothing launched
    stored = cloud.services.store.get_run(run.run_id)
    assert stored.status is RunStatus.REFUSED and stored.error is not None
    assert stored.error.startswith("cannot plan: targets[0] ml.g5.8xlarge: no search candidate can run")
    assert stored.execution_arn == run.described["executionArn"]
    assert cloud.sagemaker.list_training_jobs(MaxResults=100)["TrainingJobSummaries"] == []


def test_every_state_the_workflow_steps_name_is_in_the_synthesized_state_machine(
    synthesized: Synthesized,  # noqa: F811
) -> None:
    names: set[str] = set()

    def collect(name: str, state: dict[str, Any]) -> dict[str, Any]:
        names.add(name)
        return state

    _walk_states(state_machine_definition(synthesized), collect)
    missing = {step: [s for s in states if s not in names] for step, states in STATES.items()}
    assert not any(missing.values()), missing


METHODS = ONE_JOB_MANIFEST.replace(
    "variants:\n  - name: b4\n    per_device_batch_size: 4\n",
    "variants:\n  - name: b4\n    per_device_batch_size: 4\n  - name: lora\n    per_device_batch_size: 4\n"
    "    method: lora\n    lora: {rank: 8, alpha: 16, target_modules: [q_proj, v_proj]}\n    learning_rate: 1.0e-3\n",
)


def test_each_method_reaches_its_training_job_and_canary_as_hyperparameters(
    with_canary: Cloud,
    synthesized: Synthesized,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a full and a LoRA variant (two configurations) on a GPU target, When the run executes
    run = _execute_live(with_canary, synthesized, monkeypatch, METHODS, name="methods")
    assert run.described["status"] == "SUCCEEDED", json.dumps(run.events[-3:], default=str)[-3000:]
    # Then every job and its canary carry the method and the adapters' knobs train.py reads (the full one none)
    for name in _training_jobs(with_canary):
        hp = with_canary.sagemaker.describe_training_job(TrainingJobName=name)["HyperParameters"]
        methods = {k: v for k, v in hp.items() if k.startswith(("method", "lora_"))}
        if hp["learning_rate"] != "0.001":
            assert methods == {}, name
        else:
            assert methods == {"method": "lora", "lora_rank": "8", "lora_alpha": "16", "lora_dropout": "0.0",
                               "lora_target_modules": "q_proj,v_proj"}, name  # fmt: skip
    names = _training_jobs(with_canary)
    assert len([n for n in names if "-canary" in n]) == 2 and len(names) == 4
