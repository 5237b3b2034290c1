"""State machine definition, EventBridge rules, Lambda functions, dashboard and alarms."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from aws_cdk.assertions import Match
from packaging.utils import canonicalize_name

from gpuscout.paths import REPO_DIR
from stacks.events import BUDGET_CHECK_INTERVAL_MINUTES
from stacks.workflow import (
    PROCESSING_REQUEST_FIELDS,
    TRAINING_REQUEST_FIELDS,
    TUNING_DEFINITION_FIELDS,
    TUNING_REQUEST_FIELDS,
)
from tests.infra.conftest import Synthesized, state_machine_definition

CONTRACT_ENV = {
    "TABLE_NAME",
    "DATA_BUCKET",
    "ARTIFACTS_BUCKET",
    "PROCESSING_ROLE_ARN",
    "RUN_ROLE_PATH",
    "RUN_ROLE_BOUNDARY_ARN",
    "JOB_RUNTIME_POLICY_ARN",
    "TRAINING_IMAGE_URI",
    "PROCESSING_INSTANCE_TYPE",
    "ALLOWED_INSTANCE_TYPES",
    "DEFAULT_BUDGET_USD",
    "MAP_MAX_CONCURRENCY",
    "POWERTOOLS_SERVICE_NAME",
    "NOTIFICATION_TOPIC_ARN",
}


@pytest.fixture(scope="module")
def asl(synthesized: Synthesized) -> dict[str, Any]:
    return state_machine_definition(synthesized)


def test_states_in_order(asl: dict[str, Any]) -> None:
    states = asl["States"]
    assert asl["StartAt"] == "Validate manifest"
    assert states["Validate manifest"]["Next"] == "Manifest valid?"
    assert states["Manifest valid?"]["Default"] == "Plan jobs"
    assert states["Plan jobs"]["Next"] == "Plan accepted?"
    assert states["Plan accepted?"]["Default"] == "Create run role"
    # the run's own role for its SageMaker jobs (gpuscout.cloud.run_roles), before any of them
    create = states["Create run role"]
    assert create["Parameters"] == {"run_id.$": "$.run_id", "action": "create"}
    assert create["ResultPath"] == "$.run_role" and create["Next"] == "Processed data cached?"
    assert create["Resource"] == states["Delete run role"]["Resource"]
    assert create["Catch"] == [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.error", "Next": "Mark run failed"}]
    choice = states["Processed data cached?"]
    assert choice["Type"] == "Choice"
    assert choice["Choices"] == [{"Variable": "$.prepare.skip", "BooleanEquals": True, "Next": "Any canaries?"}]
    assert choice["Default"] == "Prepare data"
    assert states["Prepare data"]["Next"] == "Any canaries?"
    # each fan-out runs only when the plan has items for it (no Map Run for an empty list), in this order:
    for kind, fan_out, after in (
        ("canaries", "Run canaries", "Any jobs?"),  # no expensive job before every canary passed
        ("jobs", "Run jobs", "Any tunings?"),
        ("tunings", "Run searches", "Analyze run"),  # a settings search's tuning jobs (none without one)
    ):
        any_items = states[f"Any {kind}?"]
        assert any_items["Choices"] == [{"Variable": f"$.plan.{kind}.count", "NumericGreaterThan": 0, "Next": fan_out}]
        assert any_items["Default"] == after and states[fan_out]["Next"] == after
    assert states["Analyze run"]["Next"] == "Delete run role"
    # the run has ended: its role goes; a failure to delete it does not fail the analysed run
    delete = states["Delete run role"]
    assert delete["Parameters"] == {"run_id.$": "$.run_id", "action": "delete"}
    assert delete["ResultPath"] is None and delete["Next"] == "Done"
    assert delete["Catch"] == [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.role_error", "Next": "Run role left"}]
    assert states["Run role left"]["Next"] == "Done"
    assert states["Done"]["Type"] == "Succeed"
    assert asl["TimeoutSeconds"] == 72 * 3600


def test_refusals_are_results_that_end_in_fail_states_with_the_cause(asl: dict[str, Any]) -> None:
    # A rejected manifest or refused plan is the handler's result (not a Lambda error, so no error alarm fires):
    # a Choice on $.refused ends the execution failed with the refusal's error and cause.
    states = asl["States"]
    for task, choice, error, fail in (
        ("Validate manifest", "Manifest valid?", "ManifestRejected", "Manifest rejected"),
        ("Plan jobs", "Plan accepted?", "PlanRefused", "Plan refused"),
    ):
        assert "Catch" not in states[task] and states[task]["Next"] == choice
        assert states[choice]["Choices"] == [{"Variable": "$.refused", "IsPresent": True, "Next": fail}]
        assert states[fail] == {"Type": "Fail", "Error": error, "CausePath": "$.refused.Cause"}
        assert states[task]["Resource"].startswith("<Functions")


def _assert_reads_plan_items(fan_out: dict[str, Any], kind: str, synthesized: Synthesized) -> None:
    """A Distributed Map of Standard child workflows over s3://<artifacts>/<key of $.plan.<kind>>, output dropped."""
    assert fan_out["Type"] == "Map" and "ItemsPath" not in fan_out and fan_out["ResultPath"] is None
    assert fan_out["ItemProcessor"]["ProcessorConfig"] == {"Mode": "DISTRIBUTED", "ExecutionType": "STANDARD"}
    artifacts = synthesized.logical_id(synthesized.stack.storage.artifacts)
    assert fan_out["ItemReader"] == {
        "Resource": "arn:<AWS::Partition>:states:::s3:getObject",
        "ReaderConfig": {"InputType": "JSON"},
        "Parameters": {"Bucket": f"<{artifacts}>", "Key.$": f"$.plan.{kind}.key"},
    }
    assert fan_out["MaxConcurrency"] == synthesized.stack.config.map_max_concurrency
    # none tolerated (AWS's default): a failed child fails the Map, whose Catch fails the run
    assert "ToleratedFailurePercentage" not in fan_out and "ToleratedFailureCount" not in fan_out


def test_the_canary_map_runs_each_configurations_canary_request(asl: dict[str, Any], synthesized: Synthesized) -> None:
    canaries = asl["States"]["Run canaries"]
    _assert_reads_plan_items(canaries, "canaries", synthesized)
    # the child gets this execution's ARN: mark_run_failed changes only the run this execution planned
    assert canaries["ItemSelector"] == {
        "run_id.$": "$.run_id",
        "job_name.$": "$$.Map.Item.Value.job_name",
        "request.$": "$$.Map.Item.Value.request",
        "role_arn.$": "$.run_role.role_arn",  # the run's own role, from "Create run role", never from an item
        "execution_arn.$": "$$.Execution.Id",
    }
    states = canaries["ItemProcessor"]["States"]
    canary = states["Canary"]
    assert canary["Resource"] == "arn:<AWS::Partition>:states:::sagemaker:createTrainingJob.sync"
    assert canary["Parameters"]["TrainingJobName.$"] == "$.request.TrainingJobName"
    assert canary["Parameters"]["RoleArn.$"] == "$.role_arn" and "RoleArn" not in canary["Parameters"]
    # a failed canary marks the run FAILED with its own cause (the Map reports only that a child failed), then fails
    assert canary["End"] is True
    assert canary["Catch"] == [
        {"ErrorEquals": ["States.ALL"], "ResultPath": "$.error", "Next": "Mark run failed (canary)"}
    ]
    mark = states["Mark run failed (canary)"]
    assert mark["Parameters"] == {"run_id.$": "$.run_id", "execution_arn.$": "$.execution_arn", "error.$": "$.error"}
    assert mark["ResultPath"] is None and mark["Next"] == "Canary failed"
    assert states["Canary failed"] == {"Type": "Fail", "Error": "CanaryFailed", "CausePath": "$.error.Cause"}
    quota = [r for r in canary["Retry"] if r["ErrorEquals"] == ["SageMaker.ResourceLimitExceededException"]]
    assert quota and quota[0]["IntervalSeconds"] * quota[0]["MaxAttempts"] == 3600


def test_every_failure_after_planning_marks_the_run_failed(asl: dict[str, Any]) -> None:
    # A failed data preparation, Map or analysis marks the run FAILED, then fails the execution with the cause.
    states = asl["States"]
    for state in ("Prepare data", "Run canaries", "Run jobs", "Run searches", "Analyze run"):
        assert states[state]["Catch"] == [
            {"ErrorEquals": ["States.ALL"], "ResultPath": "$.error", "Next": "Mark run failed"}
        ], state
    mark = states["Mark run failed"]
    assert mark["Parameters"] == {"run_id.$": "$.run_id", "execution_arn.$": "$$.Execution.Id", "error.$": "$.error"}
    assert mark["ResultPath"] is None and mark["Next"] == "Run failed"
    assert states["Run failed"] == {"Type": "Fail", "Error": "RunFailed", "CausePath": "$.error.Cause"}
    # Plan records which execution planned the run (mark_run_failed touches only that execution's run).
    assert states["Plan jobs"]["Parameters"]["execution_arn.$"] == "$$.Execution.Id"


def test_lambda_steps_retry_lambdas_transient_errors_and_the_status_read_retries_throttling(
    asl: dict[str, Any],
) -> None:
    states = dict(asl["States"])
    processor = states["Run jobs"]["ItemProcessor"]["States"]
    lambda_steps = {
        name: state
        for name, state in {**states, **processor}.items()
        if state.get("Type") == "Task" and str(state["Resource"]).startswith("<Functions")
    }
    assert len(lambda_steps) == 8
    canary_mark = asl["States"]["Run canaries"]["ItemProcessor"]["States"]["Mark run failed (canary)"]
    lambda_steps["Mark run failed (canary)"] = canary_mark
    for name, state in lambda_steps.items():
        [retry] = state["Retry"]
        assert {"Lambda.TooManyRequestsException", "Lambda.ServiceException"} <= set(retry["ErrorEquals"]), name
        assert "States.ALL" not in retry["ErrorEquals"] and retry["JitterStrategy"] == "FULL"
    [retry] = processor["Read run status"]["Retry"]
    assert "DynamoDB.ProvisionedThroughputExceededException" in retry["ErrorEquals"]


def test_failed_timed_out_and_aborted_executions_reach_mark_run_failed(synthesized: Synthesized) -> None:
    machine = synthesized.logical_id(synthesized.stack.workflow.state_machine)
    function = synthesized.logical_id(synthesized.stack.functions.functions["mark_run_failed"])
    queue = synthesized.logical_id(synthesized.stack.events.execution_failed_dead_letters)
    synthesized.template.has_resource_properties(
        "AWS::Events::Rule",
        {
            "EventPattern": {
                "source": ["aws.states"],
                "detail-type": ["Step Functions Execution Status Change"],
                "detail": {"status": ["FAILED", "TIMED_OUT", "ABORTED"], "stateMachineArn": [{"Ref": machine}]},
            },
            "State": "ENABLED",
            "Targets": [
                {
                    "Arn": {"Fn::GetAtt": [function, "Arn"]},
                    "Id": Match.any_value(),
                    "DeadLetterConfig": {"Arn": {"Fn::GetAtt": [queue, "Arn"]}},
                    "RetryPolicy": {"MaximumRetryAttempts": 8, "MaximumEventAgeInSeconds": 6 * 3600},
                }
            ],
        },
    )
    synthesized.template.has_resource_properties(
        "AWS::Lambda::Permission",
        {"Action": "lambda:InvokeFunction", "Principal": "events.amazonaws.com", "FunctionName": Match.any_value()},
    )


def test_prepare_data_is_a_sync_processing_job_built_from_the_plan(
    asl: dict[str, Any], synthesized: Synthesized
) -> None:
    prepare = asl["States"]["Prepare data"]
    assert prepare["Resource"] == "arn:<AWS::Partition>:states:::sagemaker:createProcessingJob.sync"
    copied = {f"{f}.$": f"$.prepare.request.{f}" for f in PROCESSING_REQUEST_FIELDS}
    assert prepare["Parameters"] == copied | {
        "RoleArn": f"<{synthesized.logical_id(synthesized.stack.roles.processing)}.Arn>"
    }
    assert "RoleArn" not in PROCESSING_REQUEST_FIELDS  # the task names its role; a request cannot choose one
    assert prepare["ResultPath"] == "$.prepare.job"  # keeps $.run_id and $.plan for the Maps


def test_map_trains_each_job_with_retry_and_records_failures(asl: dict[str, Any], synthesized: Synthesized) -> None:
    jobs = asl["States"]["Run jobs"]
    _assert_reads_plan_items(jobs, "jobs", synthesized)
    assert synthesized.stack.config.map_max_concurrency == 4
    assert jobs["ItemSelector"] == {
        "run_id.$": "$.run_id",
        "job_name.$": "$$.Map.Item.Value.job_name",
        "request.$": "$$.Map.Item.Value.request",
        "role_arn.$": "$.run_role.role_arn",
    }
    processor = jobs["ItemProcessor"]
    assert processor["StartAt"] == "Read run status"
    train = processor["States"]["Train"]
    assert train["Resource"] == "arn:<AWS::Partition>:states:::sagemaker:createTrainingJob.sync"
    # every field of the plan's request but the role: the run's own, which the Map's ItemSelector took from "Create
    # run role" (a request cannot choose it)
    assert train["Parameters"] == {f"{f}.$": f"$.request.{f}" for f in TRAINING_REQUEST_FIELDS} | {
        "RoleArn.$": "$.role_arn"
    }
    assert train["ResultSelector"] == {"TrainingJobArn.$": "$.TrainingJobArn"} and train["ResultPath"] == "$.job"
    # A finished job is recorded inside the Map (not only by job_events, which runs asynchronously).
    assert train["Next"] == "Record job result"
    recorded = processor["States"]["Record job result"]
    assert recorded["Parameters"] == {"run_id.$": "$.run_id", "job_name.$": "$.job_name"}
    assert recorded["ResultPath"] is None and recorded["OutputPath"] == "$.job_name" and recorded["End"] is True
    assert recorded["Catch"] == [
        {"ErrorEquals": ["States.ALL"], "ResultPath": "$.record_error", "Next": "Result left to job_events"}
    ]
    assert "EnableNetworkIsolation.$" in train["Parameters"]
    retries = {tuple(r["ErrorEquals"]): r for r in train["Retry"]}
    throttled = retries[("SageMaker.AmazonSageMakerException",)]
    assert throttled["BackoffRate"] == 2 and throttled["MaxAttempts"] >= 3 and throttled["JitterStrategy"] == "FULL"
    # Quota waits are long and flat (sibling jobs run 30+ minutes): every 5 minutes for quota_wait_hours (24).
    quota = retries[("SageMaker.ResourceLimitExceededException",)]
    assert quota["IntervalSeconds"] == 300 and quota["BackoffRate"] == 1
    assert quota["IntervalSeconds"] * quota["MaxAttempts"] == synthesized.stack.config.quota_wait_hours * 3600
    assert synthesized.stack.config.quota_wait_hours == 24
    assert train["Catch"] == [
        # a retried CreateTrainingJob whose first response was lost: the job exists and runs; follow it
        {"ErrorEquals": ["SageMaker.ResourceInUseException"], "ResultPath": "$.launch_error",
         "Next": "Describe launched job"},
        {"ErrorEquals": ["States.ALL"], "ResultPath": "$.error", "Next": "Record job failure"},
    ]  # fmt: skip
    states = processor["States"]
    describe = states["Describe launched job"]
    assert describe["Resource"] == "arn:<AWS::Partition>:states:::aws-sdk:sagemaker:describeTrainingJob"
    assert describe["Parameters"] == {"TrainingJobName.$": "$.job_name"} and describe["Next"] == (
        "Launched job still running?"
    )
    assert describe["Catch"][0]["Next"] == "Record job failure"
    choice = states["Launched job still running?"]
    assert {c["Next"] for c in choice["Choices"]} == {"Wait for launched job"}
    assert choice["Default"] == "Record job result"
    assert states["Wait for launched job"] == {"Type": "Wait", "Seconds": 98, "Next": "Describe launched job"}
    # the loop can follow its job for as long as the execution lives without filling the 25,000-event history
    # (9 events a round: 60 s polls filled it in ~46 h, under the default 72 h timeout before)
    rounds = asl["TimeoutSeconds"] / states["Wait for launched job"]["Seconds"]
    assert rounds * 9 < 25_000
    record = processor["States"]["Record job failure"]
    assert record["End"] is True
    assert record["Parameters"] == {"run_id.$": "$.run_id", "job_name.$": "$.job_name", "error.$": "$.error"}
    assert record["ResultPath"] is None
    assert asl["States"]["Analyze run"]["Parameters"] == {"run_id.$": "$.run_id"}


def test_map_launches_nothing_once_the_budget_guard_stopped_the_run(asl: dict[str, Any]) -> None:
    # Given job_events marks a run STOPPED when measured spend crosses the budget,
    # then every Map iteration reads the run row right before launching and skips the launch.
    states = asl["States"]["Run jobs"]["ItemProcessor"]["States"]
    read = states["Read run status"]
    assert read["Resource"] == "arn:<AWS::Partition>:states:::dynamodb:getItem"
    assert read["Parameters"]["Key"] == {"pk": {"S.$": "States.Format('RUN#{}', $.run_id)"}, "sk": {"S": "RUN"}}
    assert read["Parameters"]["ConsistentRead"] is True
    # "status" is reserved in DynamoDB expressions: it must go through an attribute name.
    assert read["Parameters"]["ProjectionExpression"] == "#status"
    assert read["Parameters"]["ExpressionAttributeNames"] == {"#status": "status"}
    assert read["ResultSelector"] == {"status.$": "$.Item.status.S"} and read["ResultPath"] == "$.run"
    assert read["Next"] == "Run still going?"
    choice = states["Run still going?"]
    stopped = {c["StringEquals"] for c in choice["Choices"][0]["Or"]}
    assert stopped == {"STOPPED", "FAILED"}
    assert choice["Choices"][0]["Next"] == "Skip job (run stopped)" and choice["Default"] == "Train"
    assert states["Skip job (run stopped)"]["Type"] == "Pass" and states["Skip job (run stopped)"]["End"] is True


def test_the_search_map_runs_one_sync_tuning_job_per_target_and_records_its_trials(
    asl: dict[str, Any], synthesized: Synthesized
) -> None:
    searches = asl["States"]["Run searches"]
    _assert_reads_plan_items(searches, "tunings", synthesized)
    assert searches["ItemSelector"] == {
        "run_id.$": "$.run_id",
        "job_name.$": "$$.Map.Item.Value.job_name",
        "request.$": "$$.Map.Item.Value.request",
        "role_arn.$": "$.run_role.role_arn",
    }
    states = searches["ItemProcessor"]["States"]
    assert searches["ItemProcessor"]["StartAt"] == "Read run status (search)"
    read = states["Read run status (search)"]
    assert read["Resource"] == "arn:<AWS::Partition>:states:::dynamodb:getItem" and read["Parameters"]["ConsistentRead"]
    choice = states["Run still going? (search)"]
    assert {c["StringEquals"] for c in choice["Choices"][0]["Or"]} == {"STOPPED", "FAILED"}
    assert choice["Choices"][0]["Next"] == "Skip search (run stopped)" and choice["Default"] == "Tune"
    tune = states["Tune"]
    assert tune["Resource"] == "arn:<AWS::Partition>:states:::sagemaker:createHyperParameterTuningJob.sync"
    # every field of the plan's request, the training job definition field by field (room for the stack's VPC)
    definition = {f"{f}.$": f"$.request.TrainingJobDefinition.{f}" for f in TUNING_DEFINITION_FIELDS}
    definition["RoleArn.$"] = "$.role_arn"  # the run's own role (the Map's ItemSelector), not the request's
    assert tune["Parameters"] == {
        **{f"{f}.$": f"$.request.{f}" for f in TUNING_REQUEST_FIELDS},
        "TrainingJobDefinition": definition,
    }
    assert tune["ResultSelector"] == {"HyperParameterTuningJobArn.$": "$.HyperParameterTuningJobArn"}
    retries = {tuple(r["ErrorEquals"]): r for r in tune["Retry"]}
    quota = retries[("SageMaker.ResourceLimitExceededException",)]
    assert quota["IntervalSeconds"] * quota["MaxAttempts"] == synthesized.stack.config.quota_wait_hours * 3600
    assert tune["Catch"] == [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.error", "Next": "Record search failure"}]
    failure = states["Record search failure"]
    assert failure["Parameters"] == {"run_id.$": "$.run_id", "job_name.$": "$.job_name", "error.$": "$.error"}
    assert failure["ResultPath"] is None and failure["Next"] == "Record trials"
    # success or failure, every trial the tuning job ran is recorded before Analyze reads the table
    assert tune["Next"] == "Record trials"
    record = states["Record trials"]
    functions = synthesized.stack.functions.functions
    assert record["Resource"] == f"<{synthesized.logical_id(functions['record_job_result'])}.Arn>"
    assert record["Parameters"] == {"run_id.$": "$.run_id", "tuning_job_name.$": "$.job_name"}
    assert record["ResultPath"] is None and record["End"] is True
    assert record["Catch"] == [
        {"ErrorEquals": ["States.ALL"], "ResultPath": "$.record_error", "Next": "Trials left to job_events"}
    ]
    assert failure["Resource"] == f"<{synthesized.logical_id(functions['record_job_failure'])}.Arn>"
    for name in ("Record trials", "Record search failure"):
        [retry] = states[name]["Retry"]
        assert "Lambda.TooManyRequestsException" in retry["ErrorEquals"] and "States.ALL" not in retry["ErrorEquals"]


def test_state_machine_logs_all_with_tracing(synthesized: Synthesized) -> None:
    props = synthesized.one("AWS::StepFunctions::StateMachine")["Properties"]
    assert props["StateMachineType"] == "STANDARD"
    assert props["TracingConfiguration"] == {"Enabled": True}
    logging = props["LoggingConfiguration"]
    assert logging["Level"] == "ALL" and logging["IncludeExecutionData"] is True
    group = synthesized.logical_id(synthesized.stack.workflow.log_group)
    assert logging["Destinations"] == [{"CloudWatchLogsLogGroup": {"LogGroupArn": {"Fn::GetAtt": [group, "Arn"]}}}]


def test_manifest_upload_starts_the_state_machine(synthesized: Synthesized) -> None:
    rule = synthesized.template_json["Resources"][synthesized.logical_id(synthesized.stack.events.manifest_uploaded)]
    pattern = rule["Properties"]["EventPattern"]
    data = synthesized.logical_id(synthesized.stack.storage.data)
    assert pattern == {
        "source": ["aws.s3"],
        "detail-type": ["Object Created"],
        "detail": {
            "bucket": {"name": [{"Ref": data}]},
            "object": {
                "key": [
                    {"wildcard": "manifests/*.yaml"},
                    {"wildcard": "manifests/*.yml"},
                    {"wildcard": "manifests/*.json"},
                ]
            },
        },
    }
    # EventBridge wildcard semantics ("*" matches any run of characters, the filters of a list are alternatives):
    # manifests start a run, a folder marker or a README does not
    filters = [re.compile(re.escape(f["wildcard"]).replace(r"\*", ".*")) for f in pattern["detail"]["object"]["key"]]
    keys = ("manifests/a.yaml", "manifests/b.yml", "manifests/team/c.json", "manifests/", "manifests/README.md",
            "raw/d.yaml", "manifests/e.yaml.bak")  # fmt: skip
    starts = {k: any(f.fullmatch(k) for f in filters) for k in keys}
    assert [k for k, v in starts.items() if v] == ["manifests/a.yaml", "manifests/b.yml", "manifests/team/c.json"]
    (target,) = rule["Properties"]["Targets"]
    machine = next(iter(synthesized.resources("AWS::StepFunctions::StateMachine")))
    assert target["Arn"] == {"Ref": machine}
    transformer = target["InputTransformer"]
    paths = transformer["InputPathsMap"]
    template = transformer["InputTemplate"]
    for name in paths:
        template = template.replace(f"<{name}>", f'"{paths[name]}"')
    assert json.loads(template) == {
        "bucket": "$.detail.bucket.name",
        "key": "$.detail.object.key",
        "etag": "$.detail.object.etag",
    }
    dlq = synthesized.logical_id(synthesized.stack.events.manifest_dead_letters)
    assert target["DeadLetterConfig"] == {"Arn": {"Fn::GetAtt": [dlq, "Arn"]}}
    assert target["RetryPolicy"]["MaximumRetryAttempts"] == 8


def test_job_state_changes_of_gs_jobs_reach_job_events(synthesized: Synthesized) -> None:
    rule = synthesized.template_json["Resources"][synthesized.logical_id(synthesized.stack.events.job_state_changed)]
    assert rule["Properties"]["EventPattern"] == {
        "source": ["aws.sagemaker"],
        "account": [{"Ref": "AWS::AccountId"}],  # this account's jobs only
        "detail-type": ["SageMaker Training Job State Change"],
        "detail": {"TrainingJobName": [{"prefix": "gs-"}]},
    }
    (target,) = rule["Properties"]["Targets"]
    function = synthesized.logical_id(synthesized.stack.functions.functions["job_events"])
    assert target["Arn"] == {"Fn::GetAtt": [function, "Arn"]}
    dlq = synthesized.logical_id(synthesized.stack.events.job_event_dead_letters)
    assert target["DeadLetterConfig"] == {"Arn": {"Fn::GetAtt": [dlq, "Arn"]}}
    assert target["RetryPolicy"]["MaximumRetryAttempts"] == 8


def test_the_budget_check_runs_every_five_minutes_with_a_dlq(synthesized: Synthesized) -> None:
    # Given the hard budget cap: a schedule invokes budget_guard, which stops a run whose projected spend crossed its
    # budget (gpuscout/cloud/budget_guard.py); a check that cannot be delivered before the next one is parked
    assert BUDGET_CHECK_INTERVAL_MINUTES == 5
    rule = synthesized.template_json["Resources"][synthesized.logical_id(synthesized.stack.events.budget_check)]
    assert rule["Properties"]["ScheduleExpression"] == "rate(5 minutes)" and rule["Properties"]["State"] == "ENABLED"
    assert "EventPattern" not in rule["Properties"]
    (target,) = rule["Properties"]["Targets"]
    function = synthesized.logical_id(synthesized.stack.functions.functions["budget_guard"])
    assert target["Arn"] == {"Fn::GetAtt": [function, "Arn"]} and "Input" not in target  # the Scheduled Event itself
    dlq = synthesized.logical_id(synthesized.stack.events.budget_check_dead_letters)
    assert target["DeadLetterConfig"] == {"Arn": {"Fn::GetAtt": [dlq, "Arn"]}}
    assert target["RetryPolicy"] == {"MaximumRetryAttempts": 2, "MaximumEventAgeInSeconds": 5 * 60}
    assert synthesized.stack.events.budget_check_dead_letters in synthesized.stack.events.dead_letter_queues
    synthesized.template.has_resource_properties(
        "AWS::Lambda::Permission",
        {"Action": "lambda:InvokeFunction", "Principal": "events.amazonaws.com",
         "FunctionName": {"Fn::GetAtt": [function, "Arn"]},
         "SourceArn": {"Fn::GetAtt": [synthesized.logical_id(synthesized.stack.events.budget_check), "Arn"]}},
    )  # fmt: skip


def test_functions_runtime_tracing_environment(synthesized: Synthesized) -> None:
    functions = synthesized.stack.functions.functions
    layer = synthesized.logical_id(synthesized.stack.functions.layer)
    assert set(functions) == {
        "validate_manifest",
        "plan_jobs",
        "run_role",
        "record_job_failure",
        "record_job_result",
        "mark_run_failed",
        "job_events",
        "budget_guard",
        "analyze_run",
    }
    for name, function in functions.items():
        props = synthesized.template_json["Resources"][synthesized.logical_id(function)]["Properties"]
        assert props["Runtime"] == "python3.12"
        assert props["Architectures"] == ["arm64"]
        assert props["Handler"] == f"lambdas.{name}.handler.handler"
        assert props["TracingConfig"] == {"Mode": "Active"}
        assert props["Layers"] == [{"Ref": layer}]
        env = props["Environment"]["Variables"]
        assert set(env) >= CONTRACT_ENV
        assert env["ALLOWED_INSTANCE_TYPES"] == ",".join(synthesized.stack.config.allowed_instance_types)
        assert env["PROCESSING_INSTANCE_TYPE"] == "ml.m5.xlarge"
        assert env["DEFAULT_BUDGET_USD"] == "100"
        assert env["POWERTOOLS_SERVICE_NAME"] == "gpuscout"
        assert env["POWERTOOLS_METRICS_NAMESPACE"] == "gpuscout"
        roles = synthesized.stack.roles
        assert env["RUN_ROLE_PATH"] == {
            "Fn::Join": ["", ["/gpuscout/", {"Ref": "AWS::Region"}, "/", {"Ref": "AWS::StackName"}, "/"]]
        }
        assert env["RUN_ROLE_BOUNDARY_ARN"] == {"Ref": synthesized.logical_id(roles.run_role_boundary)}
        assert env["JOB_RUNTIME_POLICY_ARN"] == {"Ref": synthesized.logical_id(roles.job_runtime_policy)}
        assert env["PROCESSING_ROLE_ARN"] == {
            "Fn::GetAtt": [synthesized.logical_id(synthesized.stack.roles.processing), "Arn"]
        }
        log_group = synthesized.logical_id(synthesized.stack.functions.log_groups[name])
        assert props["LoggingConfig"]["LogGroup"] == {"Ref": log_group}
    dlq = synthesized.logical_id(synthesized.stack.functions.dead_letter_queue)
    for name in ("job_events", "mark_run_failed", "budget_guard"):  # invoked by EventBridge: asynchronously
        props = synthesized.template_json["Resources"][synthesized.logical_id(functions[name])]["Properties"]
        assert props["DeadLetterConfig"] == {"TargetArn": {"Fn::GetAtt": [dlq, "Arn"]}}, name
    synthesized.template.has_resource_properties("AWS::Lambda::EventInvokeConfig", {"MaximumRetryAttempts": 2})


def test_log_groups_have_retention(synthesized: Synthesized) -> None:
    groups = synthesized.resources("AWS::Logs::LogGroup")
    assert len(groups) == len(synthesized.stack.functions.functions) + 1  # one per function + the state machine
    assert {g["Properties"]["RetentionInDays"] for g in groups.values()} == {90}


def test_function_bundles_hold_sources_and_the_layer_holds_dependencies(synthesized: Synthesized) -> None:
    assets = json.loads((synthesized.outdir / f"{synthesized.stack.stack_name}.assets.json").read_text())["files"]
    folders = [
        synthesized.outdir / a["source"]["path"] for a in assets.values() if a["source"].get("packaging") == "zip"
    ]
    bundles = [f for f in folders if (f / "lambdas").is_dir()]
    (layer,) = [f for f in folders if (f / "python").is_dir()]
    assert len(bundles) == len(synthesized.stack.functions.functions)
    for bundle in bundles:
        assert (bundle / "gpuscout" / "__init__.py").is_file()
        assert (bundle / "configs" / "instances").is_dir()
        (handler,) = list((bundle / "lambdas").glob("*/handler.py"))
        assert handler.parent.name in synthesized.stack.functions.functions
        assert not list(bundle.rglob("__pycache__"))
    for package in ("pydantic", "pydantic_core", "yaml", "aws_lambda_powertools", "matplotlib", "numpy"):
        assert (layer / "python" / package).is_dir(), package
    assert list((layer / "python" / "pydantic_core").glob("*aarch64*.so")), "layer must hold arm64 wheels"
    # every package in the layer at the version the tests ran (constraints.txt, make lock), indirect ones included
    from tests.pins import pins

    locked = pins(REPO_DIR / "constraints.txt")
    installed = {
        canonicalize_name(name): version
        for name, version in (d.name.removesuffix(".dist-info").rsplit("-", 1) for d in (layer / "python").glob(
            "*.dist-info"))
    }  # fmt: skip
    assert len(installed) > 20 and set(installed) <= set(locked), set(installed) - set(locked)
    assert {name: locked[name] for name in installed} == installed


def test_dashboard_and_alarms(synthesized: Synthesized) -> None:
    dashboard = synthesized.one("AWS::CloudWatch::Dashboard")
    body = json.dumps(dashboard["Properties"]["DashboardBody"])
    for needle in (
        "ExecutionsStarted",
        "ExecutionsSucceeded",
        "ExecutionsFailed",
        "TokensPerSecond",
        "InstanceType",
        "TrainingJobStatus",
        "Errors",
    ):
        assert needle in body, needle
    for instance_type in synthesized.stack.config.allowed_instance_types:
        assert instance_type in body
    # Powertools puts "service" on every metric it emits: the widgets query it too, or they stay empty
    flat = body.replace("\\", "")
    assert flat.count('"service","gpuscout"') == len(synthesized.stack.config.allowed_instance_types) + 5
    alarms = synthesized.resources("AWS::CloudWatch::Alarm").values()
    topic = synthesized.logical_id(synthesized.stack.notifications.topic)
    metrics = {a["Properties"]["MetricName"] for a in alarms}
    # a failed run (however its execution ended), a timed-out or aborted execution; not ExecutionsFailed, which
    # also counts rejected manifests and refused plans (the user's input, not an error of the stack)
    assert {"RunsMarkedFailed", "ExecutionsTimedOut", "ExecutionsAborted"} <= metrics
    assert {"ApproximateNumberOfMessagesVisible", "Errors"} <= metrics and "ExecutionsFailed" not in metrics
    (failed_runs,) = [a for a in alarms if a["Properties"]["MetricName"] == "RunsMarkedFailed"]
    assert failed_runs["Properties"]["Namespace"] == "gpuscout"
    assert failed_runs["Properties"]["Dimensions"] == [{"Name": "service", "Value": "gpuscout"}]
    assert failed_runs["Properties"]["Threshold"] == 1 and failed_runs["Properties"]["Statistic"] == "Sum"
    dlq_alarms = [a for a in alarms if a["Properties"]["MetricName"] == "ApproximateNumberOfMessagesVisible"]
    assert len(dlq_alarms) == 5  # the four EventBridge targets' and the functions' async DLQ
    # every function's errors alarm, the budget check's included
    errors = {
        a["Properties"]["Dimensions"][0]["Value"]["Ref"] for a in alarms if a["Properties"]["MetricName"] == "Errors"
    }
    functions = synthesized.stack.functions.functions
    assert errors == {synthesized.logical_id(f) for f in functions.values()} and "budget_guard" in functions
    for alarm in dlq_alarms:
        assert alarm["Properties"]["Threshold"] == 0
        assert alarm["Properties"]["ComparisonOperator"] == "GreaterThanThreshold"
    for alarm in alarms:
        assert alarm["Properties"]["AlarmActions"] == [{"Ref": topic}]


def test_stack_outputs_for_clients(synthesized: Synthesized) -> None:
    outputs = synthesized.template_json["Outputs"]
    assert {
        "DataBucketName",
        "ArtifactsBucketName",
        "ResultsTableName",
        "StateMachineArn",
        "NotificationTopicArn",
    } <= set(outputs)
    assert outputs["DataBucketName"]["Value"] == {"Ref": synthesized.logical_id(synthesized.stack.storage.data)}


def test_with_the_vpc_setting_the_tuning_jobs_trials_run_in_its_subnets() -> None:
    from stacks.config import VpcSettings
    from stacks.workflow import tuning_state_json

    vpc = VpcSettings(subnet_ids=("subnet-0123456789abcdef0",), security_group_ids=("sg-0123456789abcdef0",))
    definition = tuning_state_json(vpc)["Parameters"]["TrainingJobDefinition"]
    assert definition["RoleArn.$"] == "$.role_arn"
    assert definition["VpcConfig"] == {
        "Subnets": ["subnet-0123456789abcdef0"],
        "SecurityGroupIds": ["sg-0123456789abcdef0"],
    }
    assert "VpcConfig" not in tuning_state_json(None)["Parameters"]["TrainingJobDefinition"]


@pytest.mark.parametrize("fan_out", ["Run jobs", "Run searches"])
def test_no_single_step_of_a_fan_out_can_sink_the_other_jobs(asl: dict[str, Any], fan_out: str) -> None:
    # Every Task of a job's (or a search's) child workflow is retried and caught: a failure there, a recording step's
    # included, ends that iteration with the error recorded or in its output, never the Map (which would mark the
    # run FAILED and stop every other job). Only a Fail state may end an iteration as failed, and there is none.
    states = asl["States"][fan_out]["ItemProcessor"]["States"]
    tasks_ = {name: state for name, state in states.items() if state["Type"] == "Task"}
    assert len(tasks_) >= 4
    for name, state in tasks_.items():
        assert state.get("Retry"), f"{name} has no Retry"
        assert [c["ErrorEquals"] for c in state.get("Catch", [])][-1:] == [["States.ALL"]], f"{name}: no catch-all"
    assert not [name for name, state in states.items() if state["Type"] == "Fail"]
    # what a failed recording leaves: the error in the iteration's output, the job to job_events
    for name, state in states.items():
        for catch in state.get("Catch", []):
            assert catch["Next"] in states, (name, catch)


@pytest.mark.parametrize("hours", [1, 72, 24 * 30, 24 * 365])
def test_the_lost_response_loop_never_fills_the_execution_history(hours: int) -> None:
    from stacks.workflow import launched_poll_seconds

    poll = launched_poll_seconds(hours * 3600)
    assert poll >= 60 and hours * 3600 / poll * 9 <= 24_000
