"""IAM: least privilege per role, no '*' resource where the API offers resource-level permissions, PassRole."""

from __future__ import annotations

import json
from typing import Any

from gpuscout.cloud import run_roles
from gpuscout.cloud.settings import LambdaSettings
from tests.infra.conftest import (
    Synthesized,
    as_list,
    every_policy_document,
    managed_policy_statements,
    policy_statements,
)

# Actions whose APIs offer no resource-level permissions (Service Authorization Reference), and so may use "*".
NO_RESOURCE_LEVEL = {
    "xray:PutTraceSegments",
    "xray:PutTelemetryRecords",
    "xray:GetSamplingRules",
    "xray:GetSamplingTargets",
    "ecr:GetAuthorizationToken",
    "cloudwatch:PutMetricData",
    "pricing:GetProducts",
    "logs:CreateLogDelivery",
    "logs:GetLogDelivery",
    "logs:UpdateLogDelivery",
    "logs:DeleteLogDelivery",
    "logs:ListLogDeliveries",
    "logs:PutResourcePolicy",
    "logs:DescribeResourcePolicies",
    "logs:DescribeLogGroups",
    # Service Authorization Reference, Service Quotas: no resource types for these reads
    "servicequotas:ListServiceQuotas",
    "servicequotas:ListAWSDefaultServiceQuotas",
    "servicequotas:GetServiceQuota",  # IAM's reference lists no resource type for it: "*" or it is always denied
    "iam:ListRoles",  # the sweep of run roles left behind lists them by path prefix (a request parameter)
}


# this stack's run roles (gpuscout.cloud.run_roles): the path names the stack, the names start gs-run-
RUN_ROLES_ARN = {
    "Fn::Join": [
        "",
        [
            "arn:",
            {"Ref": "AWS::Partition"},
            ":iam::",
            {"Ref": "AWS::AccountId"},
            ":role/gpuscout/",
            {"Ref": "AWS::Region"},
            "/",
            {"Ref": "AWS::StackName"},
            "/gs-run-*",
        ],
    ]
}

TABLE_LOGS_AND_TRACES = {
    "dynamodb:GetItem",
    "dynamodb:PutItem",
    "dynamodb:BatchWriteItem",  # a plan's job rows, 25 per request
    "dynamodb:UpdateItem",
    "dynamodb:Query",
    "logs:CreateLogStream",
    "logs:PutLogEvents",
    "xray:PutTraceSegments",
    "xray:PutTelemetryRecords",
}


def test_star_resources_only_for_actions_without_resource_level_permissions(synthesized: Synthesized) -> None:
    for logical_id, policy in every_policy_document(synthesized):
        for statement in policy["PolicyDocument"]["Statement"]:
            if "*" in as_list(statement["Resource"]):
                actions = set(as_list(statement["Action"]))
                assert actions <= NO_RESOURCE_LEVEL, (logical_id, actions)


def test_cloudwatch_put_metric_data_is_namespace_conditioned(synthesized: Synthesized) -> None:
    roles = synthesized.stack.roles
    # the jobs' policies: the processing role's, and the run roles' runtime policy and boundary (managed)
    processing = synthesized.logical_id(roles.processing)
    for _, policy in every_policy_document(synthesized):
        for_jobs = "Roles" not in policy or {"Ref": processing} in policy["Roles"]
        for statement in policy["PolicyDocument"]["Statement"]:
            if "cloudwatch:PutMetricData" in as_list(statement["Action"]):
                namespaces = set(as_list(statement["Condition"]["StringEquals"]["cloudwatch:namespace"]))
                if for_jobs:  # a job's code may not write gpuscout's metrics (alarm, dashboard)
                    assert namespaces == {"/aws/sagemaker/TrainingJobs", "/aws/sagemaker/ProcessingJobs"}
                else:
                    assert namespaces == {"gpuscout"}


def test_no_managed_policies_and_no_admin_actions(synthesized: Synthesized) -> None:
    # no role of the stack has a managed policy; the two the stack defines are the run roles' (attached at run time)
    for role in synthesized.resources("AWS::IAM::Role").values():
        assert "ManagedPolicyArns" not in role["Properties"]
    roles = synthesized.stack.roles
    assert set(synthesized.resources("AWS::IAM::ManagedPolicy")) == {
        synthesized.logical_id(roles.job_runtime_policy),
        synthesized.logical_id(roles.run_role_boundary),
    }
    for _, policy in every_policy_document(synthesized):
        for statement in policy["PolicyDocument"]["Statement"]:
            for action in as_list(statement["Action"]):
                if action == "sagemaker-mlflow:*":  # the MLflow client's calls, on tracking servers only
                    assert ":mlflow-tracking-server/" in json.dumps(statement["Resource"])
                    continue
                assert action != "*" and not action.endswith(":*"), action


def test_pass_role_only_on_the_run_roles_and_data_preparations_only_to_sagemaker(synthesized: Synthesized) -> None:
    processing_role = synthesized.logical_id(synthesized.stack.roles.processing)
    passes = []
    for policy in synthesized.resources("AWS::IAM::Policy").values():
        for statement in policy["Properties"]["PolicyDocument"]["Statement"]:
            if "iam:PassRole" in as_list(statement["Action"]):
                passes.append((policy, statement))
    assert len(passes) == 1
    policy, statement = passes[0]
    assert policy["Properties"]["Roles"] == [{"Ref": synthesized.logical_id(synthesized.stack.roles.state_machine)}]
    run_roles_arn, processing = statement["Resource"]
    assert processing == {"Fn::GetAtt": [processing_role, "Arn"]}
    assert run_roles_arn == RUN_ROLES_ARN
    assert statement["Condition"] == {"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}}


def test_state_machine_role_runs_only_gs_jobs(synthesized: Synthesized) -> None:
    statements = policy_statements(synthesized, synthesized.stack.roles.state_machine)
    sagemaker = [s for s in statements if any(a.startswith("sagemaker:") for a in as_list(s["Action"]))]
    assert {a for s in sagemaker for a in as_list(s["Action"])} >= {
        "sagemaker:CreateTrainingJob",
        "sagemaker:DescribeTrainingJob",
        "sagemaker:StopTrainingJob",
        "sagemaker:CreateProcessingJob",
        "sagemaker:DescribeProcessingJob",
        "sagemaker:StopProcessingJob",
        "sagemaker:AddTags",
    }
    # creating a training or tuning job: only on the deployment's allowed instance types (the key must be present)
    # and within the planner's longest runtime, whatever the request says; a job on a training plan is created on the
    # plan and its reserved capacity too
    config = synthesized.stack.config
    launchable = sorted({*config.allowed_instance_types, config.canary_instance_type} - {None})
    creates = {s["Sid"]: s for s in sagemaker if s["Sid"] in ("CreateTrainingJobs", "CreateTuningJobs")}
    assert {a for s in sagemaker for a in as_list(s["Action"]) if a.startswith("sagemaker:Create")} == {
        "sagemaker:CreateTrainingJob", "sagemaker:CreateHyperParameterTuningJob", "sagemaker:CreateProcessingJob"
    }  # fmt: skip
    expected = {
        "CreateTrainingJobs": {
            "ForAllValues:StringEquals": {"sagemaker:InstanceTypes": launchable},
            "Null": {"sagemaker:InstanceTypes": "false"},
            "NumericLessThanEquals": {"sagemaker:MaxRuntimeInSeconds": 5 * 24 * 3600},
        },
        # which request fields fill a tuning job's keys is not documented: bounded where present, never refused
        "CreateTuningJobs": {
            "ForAllValues:StringEquals": {"sagemaker:InstanceTypes": launchable},
            "NumericLessThanEqualsIfExists": {"sagemaker:MaxRuntimeInSeconds": 5 * 24 * 3600},
        },
    }
    for sid, action in (
        ("CreateTrainingJobs", "CreateTrainingJob"),
        ("CreateTuningJobs", "CreateHyperParameterTuningJob"),
    ):
        statement = creates[sid]
        assert as_list(statement["Action"]) == [f"sagemaker:{action}"]
        assert statement["Condition"] == expected[sid]
        others = [s for s in sagemaker if f"sagemaker:{action}" in as_list(s["Action"]) and s is not statement]
        assert others == []  # no second, unconditioned grant of the same action
    rendered = json.dumps(creates["CreateTrainingJobs"]["Resource"])
    assert ":training-job/gs-*" in rendered and ":training-plan/*" in rendered and ":reserved-capacity/*" in rendered
    assert len(creates["CreateTrainingJobs"]["Resource"]) == 3
    for statement in sagemaker:
        rendered = json.dumps(statement["Resource"])
        assert any(
            f":{kind}/gs-*" in rendered for kind in ("training-job", "processing-job", "hyper-parameter-tuning-job")
        )
    # a settings search: one .sync tuning job per target
    (tuning,) = [s for s in sagemaker if "sagemaker:DescribeHyperParameterTuningJob" in as_list(s["Action"])]
    assert set(as_list(tuning["Action"])) == {
        "sagemaker:DescribeHyperParameterTuningJob",
        "sagemaker:StopHyperParameterTuningJob",
        "sagemaker:AddTags",
        "sagemaker:ListTags",
    }
    assert ":hyper-parameter-tuning-job/gs-*" in json.dumps(tuning["Resource"])
    (rules,) = [s for s in statements if "events:PutRule" in as_list(s["Action"])]
    rendered = json.dumps(rules["Resource"])
    assert "rule/StepFunctionsGetEventsForSageMakerTrainingJobsRule" in rendered
    assert "rule/StepFunctionsGetEventsForSageMakerProcessingJobsRule" in rendered
    assert "rule/StepFunctionsGetEventsForSageMakerTuningJobsRule" in rendered


def test_state_machine_reads_only_the_plans_request_lists_and_runs_its_own_child_executions(
    synthesized: Synthesized,
) -> None:
    statements = policy_statements(synthesized, synthesized.stack.roles.state_machine)
    artifacts = synthesized.logical_id(synthesized.stack.storage.artifacts)
    reads = [s for s in statements if any(a.startswith("s3:") for a in as_list(s["Action"]))]
    # the Distributed Maps' ItemReader: GetObject under plans/ of the artifacts bucket, nothing else of S3
    assert [(s["Action"], s["Resource"]) for s in reads] == [
        ("s3:GetObject", {"Fn::Join": ["", [{"Fn::GetAtt": [artifacts, "Arn"]}, "/plans/*"]]})
    ]
    machine = synthesized.logical_id(synthesized.stack.workflow.state_machine)
    states = [s for s in statements if any(a.startswith("states:") for a in as_list(s["Action"]))]
    (start,) = [s for s in states if "states:StartExecution" in as_list(s["Action"])]
    assert start["Resource"] == {"Ref": machine}  # child workflows are executions of this machine only
    for statement in states:
        if statement is not start:  # Describe/Stop/Redrive: executions of this machine (its name from its ARN)
            assert f'"Ref": "{machine}"' in json.dumps(statement["Resource"]) and ":execution:" in json.dumps(
                statement["Resource"]
            )


def test_state_machine_role_trusts_states_of_this_account_only(synthesized: Synthesized) -> None:
    role = synthesized.template_json["Resources"][synthesized.logical_id(synthesized.stack.roles.state_machine)]
    (trust,) = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    assert trust["Principal"] == {"Service": "states.amazonaws.com"}
    assert trust["Condition"]["StringEquals"] == {"aws:SourceAccount": {"Ref": "AWS::AccountId"}}
    assert ":stateMachine:*" in json.dumps(trust["Condition"]["ArnLike"]["aws:SourceArn"])


SETTINGS = LambdaSettings.model_validate(
    {
        "TABLE_NAME": "gs-table",
        "DATA_BUCKET": "gs-data",
        "ARTIFACTS_BUCKET": "gs-artifacts",
        "PROCESSING_ROLE_ARN": "arn:aws:iam::123456789012:role/gs-processing",
        "RUN_ROLE_PATH": "/gpuscout/us-east-1/Gpuscout/",
        "RUN_ROLE_BOUNDARY_ARN": "arn:aws:iam::123456789012:policy/gs-boundary",
        "JOB_RUNTIME_POLICY_ARN": "arn:aws:iam::123456789012:policy/gs-runtime",
        "TRAINING_IMAGE_URI": "123456789012.dkr.ecr.us-east-1.amazonaws.com/gpuscout:latest",
        "AWS_REGION": "eu-west-1",
    }
)


def test_a_run_role_trusts_sagemaker_jobs_of_this_account_and_region_only() -> None:
    (trust,) = run_roles.trust_policy(SETTINGS)["Statement"]
    assert trust["Principal"] == {"Service": "sagemaker.amazonaws.com"} and trust["Action"] == "sts:AssumeRole"
    assert trust["Condition"] == {
        "StringEquals": {"aws:SourceAccount": "123456789012"},
        "ArnLike": {"aws:SourceArn": "arn:aws:sagemaker:eu-west-1:123456789012:*"},
    }


def test_run_roles_are_the_runtime_policy_within_the_boundary_plus_their_runs_own_prefixes(
    synthesized: Synthesized,
) -> None:
    # a run's role: the untrusted code of that run (a user's script, any package it installs)
    roles = synthesized.stack.roles
    runtime = {s["Sid"]: s for s in managed_policy_statements(synthesized, roles.job_runtime_policy)}
    boundary = {s["Sid"]: s for s in managed_policy_statements(synthesized, roles.run_role_boundary)}
    data = synthesized.logical_id(synthesized.stack.storage.data)
    artifacts = synthesized.logical_id(synthesized.stack.storage.artifacts)
    read = json.dumps(runtime["ReadDatasets"]["Resource"])
    assert data in read and "/raw/*" in read and "/processed/*" in read and artifacts not in read
    assert runtime["ReadDatasets"]["Action"] == "s3:GetObject"
    assert runtime["ListDatasets"]["Condition"] == {"StringLike": {"s3:prefix": ["raw/*", "processed/*"]}}
    # the runtime policy writes nothing in S3; the boundary allows job output and checkpoints only (any run's): not
    # the prepared-data cache, not plans/ or search/ (launches), not reports
    for policy, writers in ((runtime, []), (boundary, ["RunArtifacts"])):
        written = [s for s in policy.values() if {"s3:PutObject", "s3:DeleteObject"} & set(as_list(s["Action"]))]
        assert [s["Sid"] for s in written] == writers
    assert {sid: st for sid, st in boundary.items() if sid not in ("RunArtifacts", "ListRunArtifacts")} == runtime
    rendered = json.dumps(boundary["RunArtifacts"]["Resource"])
    assert artifacts in rendered and data not in rendered
    assert (
        '"/output/*"' in rendered and '"/checkpoints/*"' in rendered and len(boundary["RunArtifacts"]["Resource"]) == 2
    )
    assert boundary["ListRunArtifacts"]["Condition"] == {"StringLike": {"s3:prefix": ["output/*", "checkpoints/*"]}}
    pull = runtime["PullTrainingImage"]
    assert "ecr:BatchGetImage" in pull["Action"] and "*" not in as_list(pull["Resource"])
    logs = json.dumps(runtime["JobLogs"]["Resource"])
    assert "log-group:/aws/sagemaker/TrainingJobs:*" in logs and "ProcessingJobs" not in logs
    # logs:CreateLogGroup is authorized on the group's own ARN (no ":*")
    assert 'log-group:/aws/sagemaker/TrainingJobs"' in logs
    assert "VpcNetworkInterfaces" not in runtime  # only with the vpc context set
    # no MLflow tracking server named in the context (cdk.json's default): no MLflow grant at all
    # (test_nag_lint_config's variant names two and finds exactly those)
    assert "ExperimentTracking" not in runtime
    # nothing here grants access to the manifests, reports, plans, searches or the table
    everything = json.dumps([*runtime.values(), *boundary.values()])
    for prefix in ("manifests/", "reports/", "plans/", "search/", "rejected/", "dynamodb"):
        assert prefix not in everything, prefix
    # each run role's inline policy: its own run's output and checkpoints, in the artifacts bucket only
    run = run_roles.run_policy(SETTINGS, "demo-0123abcd-r2")["Statement"]
    assert run == [
        {
            "Sid": "RunArtifacts",
            "Effect": "Allow",
            "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
            "Resource": [
                "arn:aws:s3:::gs-artifacts/output/demo-0123abcd-r2/*",
                "arn:aws:s3:::gs-artifacts/checkpoints/demo-0123abcd-r2/*",
            ],
        },
        {
            "Sid": "ListRunArtifacts",
            "Effect": "Allow",
            "Action": "s3:ListBucket",
            "Resource": "arn:aws:s3:::gs-artifacts",
            "Condition": {"StringLike": {"s3:prefix": ["output/demo-0123abcd-r2/*", "checkpoints/demo-0123abcd-r2/*"]}},
        },
    ]


def test_only_the_run_role_function_creates_run_roles_with_the_boundary_and_the_runtime_policy(
    synthesized: Synthesized,
) -> None:
    roles = synthesized.stack.roles
    boundary = {"Ref": synthesized.logical_id(roles.run_role_boundary)}
    runtime = {"Ref": synthesized.logical_id(roles.job_runtime_policy)}
    iam_grants: dict[str, dict[str, dict[str, Any]]] = {}
    for name, role in {"state_machine": roles.state_machine, **roles.lambdas}.items():
        for statement in policy_statements(synthesized, role):
            if any(a.startswith("iam:") for a in as_list(statement["Action"])):
                iam_grants.setdefault(name, {})[statement["Sid"]] = statement
    assert set(iam_grants) == {"run_role", "mark_run_failed", "budget_guard", "state_machine"}
    create = iam_grants["run_role"]
    with_boundary = {"StringEquals": {"iam:PermissionsBoundary": boundary}}
    # a role is created, its inline policy put, and any policy removed only where it carries this stack's boundary
    assert as_list(create["CreateRunRolesWithTheBoundary"]["Action"]) == ["iam:CreateRole", "iam:PutRolePolicy"]
    assert create["CreateRunRolesWithTheBoundary"]["Condition"] == with_boundary
    assert create["AttachTheJobRuntimePolicyOnly"]["Action"] == "iam:AttachRolePolicy"
    assert create["AttachTheJobRuntimePolicyOnly"]["Condition"] == {
        **with_boundary, "ArnEquals": {"iam:PolicyARN": runtime}
    }  # fmt: skip
    for grants in (create, iam_grants["mark_run_failed"]):
        assert grants["DeleteRunRolePolicies"]["Condition"] == with_boundary
        assert set(as_list(grants["DeleteRunRolePolicies"]["Action"])) == {
            "iam:DeleteRolePolicy",
            "iam:DetachRolePolicy",
        }
    granted = {a for s in create.values() for a in as_list(s["Action"])}
    listing = {"iam:ListRolePolicies", "iam:ListAttachedRolePolicies"}
    assert granted == {
        "iam:CreateRole",
        "iam:PutRolePolicy",
        "iam:TagRole",
        "iam:GetRole",
        "iam:AttachRolePolicy",
        "iam:DeleteRolePolicy",
        "iam:DetachRolePolicy",
        "iam:DeleteRole",
        *listing,
    }  # fmt: skip  (no boundary removal, no trust policy update, no other role)
    deleting = {a for s in iam_grants["mark_run_failed"].values() for a in as_list(s["Action"])}
    assert deleting == {"iam:DeleteRolePolicy", "iam:DetachRolePolicy", "iam:DeleteRole", *listing}
    # the scheduled sweep of roles runs left behind: the same deletion, and reading the roles' run tags
    sweep = iam_grants["budget_guard"]
    assert {a for s in sweep.values() for a in as_list(s["Action"])} == deleting | {"iam:ListRoles", "iam:ListRoleTags"}
    assert sweep["ListRoles"]["Resource"] == "*"  # no resource type (IAM's reference); the path is in the request
    del sweep["ListRoles"]
    for statements in (create, iam_grants["mark_run_failed"], sweep):
        assert all(s["Resource"] == RUN_ROLES_ARN for s in statements.values())
    assert [s["Action"] for s in iam_grants["state_machine"].values()] == ["iam:PassRole"]


def test_data_preparation_has_its_own_role_which_alone_writes_the_cache(synthesized: Synthesized) -> None:
    statements = {s["Sid"]: s for s in policy_statements(synthesized, synthesized.stack.roles.processing)}
    data = synthesized.logical_id(synthesized.stack.storage.data)
    artifacts = synthesized.logical_id(synthesized.stack.storage.artifacts)
    assert '"/raw/*"' in json.dumps(statements["ReadSources"]["Resource"])
    write = json.dumps(statements["WriteProcessedDatasets"]["Resource"])
    assert data in write and '"/processed/*"' in write
    everything = json.dumps(list(statements.values()))
    assert artifacts not in everything and "sagemaker-mlflow" not in everything
    logs = json.dumps(statements["JobLogs"]["Resource"])
    assert "log-group:/aws/sagemaker/ProcessingJobs" in logs and "TrainingJobs" not in logs
    role = synthesized.template_json["Resources"][synthesized.logical_id(synthesized.stack.roles.processing)]
    (trust,) = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    assert trust["Principal"] == {"Service": "sagemaker.amazonaws.com"}
    assert trust["Condition"]["StringEquals"] == {"aws:SourceAccount": {"Ref": "AWS::AccountId"}}


def test_each_lambda_has_its_own_role_with_only_what_it_calls(synthesized: Synthesized) -> None:
    functions = synthesized.stack.functions.functions
    role_refs = {
        json.dumps(synthesized.template_json["Resources"][synthesized.logical_id(f)]["Properties"]["Role"])
        for f in functions.values()
    }
    assert len(role_refs) == len(functions)

    def actions_of(name: str) -> dict[str, str]:
        role = synthesized.stack.roles.lambdas[name]
        resources: dict[str, str] = {}
        for statement in policy_statements(synthesized, role):
            for action in as_list(statement["Action"]):
                resources[action] = resources.get(action, "") + json.dumps(statement["Resource"])
        return resources

    for name in functions:
        actions = actions_of(name)
        assert {"dynamodb:GetItem", "dynamodb:PutItem", "dynamodb:UpdateItem", "dynamodb:Query"} <= set(actions)
        assert "dynamodb:Scan" not in actions and "dynamodb:DeleteItem" not in actions
        assert "/index/gsi1" in actions["dynamodb:Query"] and "/index/gsi2" in actions["dynamodb:Query"]
        assert "logs:PutLogEvents" in actions
        assert "sagemaker:CreateTrainingJob" not in actions
    assert "/manifests/*" in actions_of("validate_manifest")["s3:GetObject"]
    # a job section's code folder: Validate checks the entry point is there (read only, under raw/ only)
    assert "/raw/*" in actions_of("validate_manifest")["s3:GetObject"]
    assert "s3:ListBucket" not in actions_of("validate_manifest")
    assert "/rejected/*" in actions_of("validate_manifest")["s3:PutObject"]
    assert "/processed/*" in actions_of("plan_jobs")["s3:GetObject"]
    # only the analysis reprices from the Price List API (planning uses the catalog's prices)
    assert "pricing:GetProducts" in actions_of("analyze_run") and "pricing:GetProducts" not in actions_of("plan_jobs")
    assert "/reports/*" in actions_of("analyze_run")["s3:PutObject"]
    assert "sns:Publish" in actions_of("analyze_run")
    for recorder in ("job_events", "record_job_result"):
        assert ":training-job/gs-*" in actions_of(recorder)["sagemaker:StopTrainingJob"]
        assert "/output/*" in actions_of(recorder)["s3:GetObject"]
        assert "s3:PutObject" not in actions_of(recorder)
        # search trials: early stopped by their tuning job? the budget guard stops the tuning job
        for action in ("sagemaker:DescribeHyperParameterTuningJob", "sagemaker:StopHyperParameterTuningJob"):
            assert ":hyper-parameter-tuning-job/gs-*" in actions_of(recorder)[action]
        assert "/search/*" in actions_of(recorder)["s3:GetObject"]
    assert (
        ":hyper-parameter-tuning-job/gs-*"
        in actions_of("record_job_result")["sagemaker:ListTrainingJobsForHyperParameterTuningJob"]
    )
    assert "sagemaker:ListTrainingJobsForHyperParameterTuningJob" not in actions_of("job_events")
    # only what is called: record_job_result describes the job it records; job_events has it in its event; the
    # analysis reads the table, not job output
    assert ":training-job/gs-*" in actions_of("record_job_result")["sagemaker:DescribeTrainingJob"]
    assert "sagemaker:DescribeTrainingJob" not in actions_of("job_events")
    assert "/output/" not in actions_of("analyze_run").get("s3:GetObject", "")
    # plan_jobs writes each tuning job's candidates; record_job_failure reads them (a failed tuning job's row)
    assert "/search/*" in actions_of("plan_jobs")["s3:PutObject"]
    failure = actions_of("record_job_failure")
    assert set(failure) <= TABLE_LOGS_AND_TRACES | {"s3:GetObject"}
    assert "/search/*" in failure["s3:GetObject"] and "/output/" not in failure["s3:GetObject"]
    # mark_run_failed is also an EventBridge target: its failed async invocations go to the functions' DLQ; it
    # publishes the run summary of a run that failed before its analysis (the topic and its key only) and deletes
    # the run's own role (test_only_the_run_role_function_creates_run_roles_... checks on which roles).
    publish = {"sns:Publish", "kms:Decrypt", "kms:GenerateDataKey*"}
    delete_role = {
        "iam:DeleteRolePolicy", "iam:DetachRolePolicy", "iam:DeleteRole", "iam:ListRolePolicies",
        "iam:ListAttachedRolePolicies",
    }  # fmt: skip
    assert set(actions_of("mark_run_failed")) <= TABLE_LOGS_AND_TRACES | {"sqs:SendMessage"} | publish | delete_role
    topic = synthesized.logical_id(synthesized.stack.notifications.topic)
    assert actions_of("mark_run_failed")["sns:Publish"] == json.dumps({"Ref": topic})
    # the scheduled budget check: the table, and stopping gpuscout's training and tuning jobs, nothing more (no
    # Describe, no job output, no Create); its failed async invocations go to the functions' DLQ
    guard = actions_of("budget_guard")
    stops = {"sagemaker:StopTrainingJob", "sagemaker:StopHyperParameterTuningJob"}
    sweep = {"iam:ListRoles", "iam:ListRoleTags", *delete_role}  # run roles left behind (checked above)
    assert stops <= set(guard) and set(guard) <= TABLE_LOGS_AND_TRACES | {"sqs:SendMessage"} | stops | sweep
    assert ":training-job/gs-*" in guard["sagemaker:StopTrainingJob"]
    assert "hyper-parameter-tuning-job" not in guard["sagemaker:StopTrainingJob"]
    assert ":hyper-parameter-tuning-job/gs-*" in guard["sagemaker:StopHyperParameterTuningJob"]
    assert ":training-job/" not in guard["sagemaker:StopHyperParameterTuningJob"]
    dlq = synthesized.logical_id(synthesized.stack.functions.dead_letter_queue)
    assert guard["sqs:SendMessage"] == json.dumps({"Fn::GetAtt": [dlq, "Arn"]})


def test_every_service_role_but_lambdas_is_assumable_for_this_account_only(synthesized: Synthesized) -> None:
    # Confused-deputy protection: SageMaker, Step Functions and EventBridge assume their roles only on behalf of this
    # account (Lambda execution roles have no such key: the function's own configuration names them)
    roles = synthesized.resources("AWS::IAM::Role")
    services: dict[str, int] = {}
    for logical_id, role in roles.items():
        for statement in role["Properties"]["AssumeRolePolicyDocument"]["Statement"]:
            service = statement["Principal"]["Service"]
            services[service] = services.get(service, 0) + 1
            if service == "lambda.amazonaws.com":
                continue
            condition = statement.get("Condition", {})
            assert condition.get("StringEquals", {}).get("aws:SourceAccount") == {"Ref": "AWS::AccountId"}, logical_id
    assert services.get("events.amazonaws.com") == 1 and services.get("states.amazonaws.com") == 1
    assert services.get("sagemaker.amazonaws.com") == 1  # data preparation; the runs' roles: run_roles.trust_policy
    start = synthesized.logical_id(synthesized.stack.events.start_run_role)
    policies = [p["Properties"] for p in synthesized.resources("AWS::IAM::Policy").values()]
    statements = [s for p in policies if {"Ref": start} in p["Roles"] for s in p["PolicyDocument"]["Statement"]]
    assert [s["Action"] for s in statements] == ["states:StartExecution"]
    assert statements[0]["Resource"] == {"Ref": synthesized.logical_id(synthesized.stack.workflow.state_machine)}
