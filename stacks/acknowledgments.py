"""Every cdk-nag finding that remains after the fixes, acknowledged at the construct it concerns with the reason it
cannot be narrowed (docs/architecture.md, "Security model", lists them too). The stack calls ``acknowledge_findings``
once everything is built; synthesis fails on a finding that is not acknowledged here.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from aws_cdk import Acknowledgment, CfnElement, Token, Validations
from constructs import IConstruct

from gpuscout.domain.names import (
    CHECKPOINTS_PREFIX,
    JOB_NAME_PREFIX,
    MANIFESTS_PREFIX,
    OUTPUT_PREFIX,
    PLANS_PREFIX,
    PROCESSED_PREFIX,
    RAW_PREFIX,
    REJECTED_PREFIX,
    REPORTS_PREFIX,
    RUN_ROLE_NAME_PREFIX,
    RUN_ROLE_PATH_PREFIX,
    SEARCH_PREFIX,
)
from stacks.functions import JOB_RECORDERS, RUN_SUMMARY_PUBLISHERS, SEARCH_READERS, WORKFLOW_FUNCTIONS

if TYPE_CHECKING:
    from stacks.gpuscout_stack import GpuscoutStack


def acknowledge(scope: IConstruct, rule_id: str, reason: str) -> None:
    """One cdk-nag acknowledgment, on the construct it concerns."""
    Validations.of(scope).acknowledge(Acknowledgment(id=f"AwsSolutions::{rule_id}", reason=reason))


def acknowledge_findings(stack: GpuscoutStack) -> None:
    """Every cdk-nag finding left after the fixes, acknowledged at its construct with why it stays."""
    data, artifacts = stack.storage.data, stack.storage.artifacts
    data_ref = f"<{stack.get_logical_id(_cfn(data))}.Arn>"
    artifacts_ref = f"<{stack.get_logical_id(_cfn(artifacts))}.Arn>"
    account_arn = "arn:<AWS::Partition>:{service}:<AWS::Region>:<AWS::AccountId>"
    training_jobs = account_arn.format(service="sagemaker") + f":training-job/{JOB_NAME_PREFIX}*"
    processing_jobs = account_arn.format(service="sagemaker") + f":processing-job/{JOB_NAME_PREFIX}*"
    tuning_jobs = account_arn.format(service="sagemaker") + f":hyper-parameter-tuning-job/{JOB_NAME_PREFIX}*"
    xray = "X-Ray trace and sampling APIs (Put*/GetSampling*) support no resource-level permissions (tracing is on)"
    job_names = f"SageMaker job names are generated per run; {JOB_NAME_PREFIX}* limits the grant to gpuscout's own jobs"

    acknowledge(
        stack.storage.access_logs,
        "AwsSolutions-S1",
        "This is the server access log target bucket; logging it into itself would loop.",
    )
    for queue in stack.events.dead_letter_queues:
        acknowledge(queue, "AwsSolutions-SQS3", "This queue is itself the dead-letter queue of an EventBridge target.")
    for function in stack.functions.functions.values():
        acknowledge(
            function,
            "AwsSolutions-L1",
            "Pinned to Python 3.12: the dependency layer is built for CPython 3.12 wheels and the tests run the "
            "same pins; move runtime and layer together (stacks/functions.py PYTHON_VERSION).",
        )

    _acknowledge_job_policies(stack, data_ref, artifacts_ref, account_arn)

    lambdas = stack.roles.lambdas
    for name, role in lambdas.items():
        extra = {
            "analyze_run": "; pricing:GetProducts (AWS Price List API) has no resource-level permissions",
            "budget_guard": "; iam:ListRoles (the sweep of run roles left behind, listed by this stack's path "
            "prefix) has no resource-level permissions",
            "validate_manifest": "; servicequotas:ListServiceQuotas, ListAWSDefaultServiceQuotas and "
            "GetServiceQuota (the quota pre-flight reads the account's SageMaker quotas) have no resource-level "
            "permissions",
            **{
                recorder: "; cloudwatch:PutMetricData has none either and is limited by a cloudwatch:namespace "
                "condition to the gpuscout namespace"
                for recorder in JOB_RECORDERS
            },
        }.get(name, "")
        acknowledge(role, "AwsSolutions-IAM5[Resource::*]", xray + extra + ".")
    acknowledge(
        lambdas["validate_manifest"],
        f"AwsSolutions-IAM5[Resource::{data_ref}/{MANIFESTS_PREFIX}*]",
        f"Reads the manifest that triggered the run; any key under {MANIFESTS_PREFIX} may start one.",
    )
    acknowledge(
        lambdas["validate_manifest"],
        f"AwsSolutions-IAM5[Resource::{data_ref}/{REJECTED_PREFIX}*]",
        f"Writes {REJECTED_PREFIX}<manifest name>.error.json for whichever manifest was rejected.",
    )
    acknowledge(
        lambdas["validate_manifest"],
        f"AwsSolutions-IAM5[Resource::{data_ref}/{RAW_PREFIX}*]",
        "Checks that a job section's entry point exists in its code folder, which the manifest names anywhere "
        f"under {RAW_PREFIX} (the only prefix the SageMaker role reads); read only, never listed.",
    )
    acknowledge(
        lambdas["plan_jobs"],
        f"AwsSolutions-IAM5[Resource::{data_ref}/{PROCESSED_PREFIX}*]",
        f"Checks whether {PROCESSED_PREFIX}<content hash>/dataset.json exists to skip data preparation; the "
        "hash is computed at run time.",
    )
    for name in JOB_RECORDERS:
        acknowledge(
            lambdas[name],
            f"AwsSolutions-IAM5[Resource::{artifacts_ref}/{OUTPUT_PREFIX}*]",
            f"Reads {OUTPUT_PREFIX}<run_id>/<job_name>/output/output.tar.gz (benchmark.json) of jobs named at "
            "run time.",
        )
    for name in JOB_RECORDERS:
        acknowledge(
            lambdas[name],
            f"AwsSolutions-IAM5[Resource::{training_jobs}]",
            f"Describes the finished job and, as budget guard, stops running training jobs of a run. {job_names}.",
        )
        acknowledge(
            lambdas[name],
            f"AwsSolutions-IAM5[Resource::{tuning_jobs}]",
            "Describes a search trial's tuning job (was the trial stopped early by it?), lists its trials and, "
            f"as budget guard, stops it. {job_names}.",
        )
    acknowledge(
        lambdas["budget_guard"],
        f"AwsSolutions-IAM5[Resource::{training_jobs}]",
        "The scheduled budget check stops the running training jobs of a run whose projected spend crossed its "
        f"budget (StopTrainingJob only). {job_names}.",
    )
    acknowledge(
        lambdas["budget_guard"],
        f"AwsSolutions-IAM5[Resource::{tuning_jobs}]",
        "The scheduled budget check stops the tuning jobs of a search over its budget, which stops their trials "
        f"and launches no further one (StopHyperParameterTuningJob only). {job_names}.",
    )
    acknowledge(
        lambdas["plan_jobs"],
        f"AwsSolutions-IAM5[Resource::{artifacts_ref}/{PLANS_PREFIX}*]",
        f"Writes {PLANS_PREFIX}<run_id>/<canaries|jobs|tunings>.json, the run's SageMaker requests the state "
        "machine's Distributed Maps read, for a run_id generated at run time.",
    )
    acknowledge(
        lambdas["plan_jobs"],
        f"AwsSolutions-IAM5[Resource::{artifacts_ref}/{SEARCH_PREFIX}*]",
        f"Writes {SEARCH_PREFIX}<run_id>/<tuning job>.json, the candidates of a settings search's tuning job, "
        "for a run and tuning job named at run time.",
    )
    for name in SEARCH_READERS:
        acknowledge(
            lambdas[name],
            f"AwsSolutions-IAM5[Resource::{artifacts_ref}/{SEARCH_PREFIX}*]",
            f"Reads {SEARCH_PREFIX}<run_id>/<tuning job>.json to give a tuning job's trials (or its failure) "
            "their rows; run and tuning job are named at run time.",
        )
    acknowledge(
        lambdas["analyze_run"],
        f"AwsSolutions-IAM5[Resource::{data_ref}/{REPORTS_PREFIX}*]",
        f"Writes {REPORTS_PREFIX}<run_id>/ (report.md, .html, .json, charts) for a run_id generated at run time.",
    )
    for name in RUN_SUMMARY_PUBLISHERS:
        acknowledge(
            lambdas[name],
            "AwsSolutions-IAM5[Action::kms:GenerateDataKey*]",
            "Publishing to the KMS-encrypted topic needs GenerateDataKey (CDK's grant uses the documented "
            "GenerateDataKey* family), on the topic key only.",
        )

    run_roles = (
        "Resource::arn:<AWS::Partition>:iam::<AWS::AccountId>:"
        f"role{RUN_ROLE_PATH_PREFIX}<AWS::Region>/<AWS::StackName>/{RUN_ROLE_NAME_PREFIX}*"
    )
    acknowledge(
        lambdas["run_role"],
        f"AwsSolutions-IAM5[{run_roles}]",
        "Creates and deletes each run's own role for its SageMaker jobs, named from the run id at run time, "
        "under this stack's path only; CreateRole, PutRolePolicy and policy removal only on roles with the "
        "stack's permissions boundary, AttachRolePolicy only of the job runtime policy.",
    )
    acknowledge(
        lambdas["mark_run_failed"],
        f"AwsSolutions-IAM5[{run_roles}]",
        "Deletes the own role of a run that ended failed, timed out or aborted (named from the run id at run "
        "time, under this stack's path only): lists and removes its policies (only of roles with this stack's "
        "boundary), then DeleteRole.",
    )
    acknowledge(
        lambdas["budget_guard"],
        f"AwsSolutions-IAM5[{run_roles}]",
        "Sweeps the run roles runs left behind (named from run ids at run time, under this stack's path only): "
        "reads their tags, removes their policies (only of roles with this stack's boundary), then DeleteRole.",
    )
    acknowledge(
        stack.roles.state_machine,
        f"AwsSolutions-IAM5[{run_roles}]",
        "Passes each run's own role, created at run time, to SageMaker only (iam:PassedToService).",
    )
    state_machine_role = stack.roles.state_machine
    acknowledge(
        state_machine_role,
        "AwsSolutions-IAM5[Resource::*]",
        f"{xray}; the CloudWatch Logs delivery APIs Step Functions logging needs (logs:CreateLogDelivery, "
        "GetLogDelivery, UpdateLogDelivery, DeleteLogDelivery, ListLogDeliveries, PutResourcePolicy, "
        "DescribeResourcePolicies, DescribeLogGroups) do not support resource-level permissions.",
    )
    acknowledge(
        state_machine_role,
        f"AwsSolutions-IAM5[Resource::{training_jobs}]",
        f"Creates, describes and stops the benchmark's training jobs (.sync). {job_names}.",
    )
    for kind in ("training-plan", "reserved-capacity"):
        acknowledge(
            state_machine_role,
            f"AwsSolutions-IAM5[Resource::{account_arn.format(service='sagemaker')}:{kind}/*]",
            "A job on a SageMaker training plan (a manifest target's training_plan_arn) is created on the plan and "
            "its reserved capacity too (AWS: IAM for SageMaker training plans); the plans are the user's, named "
            "in the manifest, so no narrower name is known at deploy time. The action is CreateTrainingJob only.",
        )
    acknowledge(
        state_machine_role,
        f"AwsSolutions-IAM5[Resource::{processing_jobs}]",
        f"Creates, describes and stops the data-preparation processing job (.sync). {job_names}.",
    )
    acknowledge(
        state_machine_role,
        f"AwsSolutions-IAM5[Resource::{tuning_jobs}]",
        f"Creates, describes and stops a settings search's tuning jobs (.sync), one per target. {job_names}.",
    )
    acknowledge(
        state_machine_role,
        f"AwsSolutions-IAM5[Resource::{artifacts_ref}/{PLANS_PREFIX}*]",
        f"The Distributed Maps' ItemReader reads {PLANS_PREFIX}<run_id>/<canaries|jobs|tunings>.json, the run's "
        "requests plan_jobs wrote, for a run_id generated at run time.",
    )
    # CDK's DistributedMap policy: the Map starts its child workflows as executions of this state machine, and
    # describes, stops and redrives them; their names are generated by Step Functions.
    machine = stack.workflow.state_machine
    region = "<AWS::Region>" if Token.is_unresolved(stack.region) else stack.region
    machine_ref = json.dumps({"Ref": stack.get_logical_id(_cfn(machine))}, separators=(",", ":"))
    machine_name = f'{{"Fn::Select":[6,{{"Fn::Split":[":",{machine_ref}]}}]}}'
    executions = f"arn:<AWS::Partition>:states:{region}:<AWS::AccountId>:execution:{machine_name}"
    for pattern in (f"{executions}:*", f"{executions}/*:*"):
        acknowledge(
            machine,
            f"AwsSolutions-IAM5[Resource::{pattern}]",
            "A Distributed Map runs each item as a child execution of this state machine, named by Step "
            "Functions at run time; CDK's grant limits Describe/Stop/RedriveExecution to this machine's "
            "executions.",
        )
    for name in WORKFLOW_FUNCTIONS:
        function = stack.functions.functions[name]
        acknowledge(
            state_machine_role,
            f"AwsSolutions-IAM5[Resource::<{stack.get_logical_id(_cfn(function))}.Arn>:*]",
            f"Invoke permission on versions and aliases of {name} only (CDK's LambdaInvoke grant).",
        )


def _acknowledge_job_policies(stack: GpuscoutStack, data_ref: str, artifacts_ref: str, account_arn: str) -> None:
    """The SageMaker jobs' policies: each run role's runtime policy and boundary, data preparation's."""
    runtime_policy, boundary = stack.roles.job_runtime_policy, stack.roles.run_role_boundary
    processing_policy = stack.roles.processing_policy
    for managed in (runtime_policy, boundary):
        for prefix in (RAW_PREFIX, PROCESSED_PREFIX):
            acknowledge(
                managed,
                f"AwsSolutions-IAM5[Resource::{data_ref}/{prefix}*]",
                f"Training jobs read dataset, model and code objects under {prefix} of the data bucket (read "
                "only); object keys are content hashes known only at run time, so the grant is scoped to the "
                "prefix.",
            )
    for prefix, what in ((OUTPUT_PREFIX, "upload their output archive"), (CHECKPOINTS_PREFIX, "sync checkpoints")):
        acknowledge(
            boundary,
            f"AwsSolutions-IAM5[Resource::{artifacts_ref}/{prefix}*]",
            f"The boundary of every run's role: training jobs {what} under {prefix}<run_id>/<job_name>/, named at "
            "run time. Each run role's own inline policy narrows this to its run's prefix; nothing else in the "
            "artifacts bucket (not the workflow's plans/ or search/ requests) is within the boundary.",
        )
    acknowledge(
        processing_policy,
        f"AwsSolutions-IAM5[Resource::{data_ref}/{RAW_PREFIX}*]",
        f"Data preparation reads the user's sources under {RAW_PREFIX} (read only), named in the manifest.",
    )
    acknowledge(
        processing_policy,
        f"AwsSolutions-IAM5[Resource::{data_ref}/{PROCESSED_PREFIX}*]",
        f"Data preparation writes the prepared-data cache under {PROCESSED_PREFIX}<cache key>/, a hash computed at "
        "run time; only this role writes it (training jobs read it).",
    )
    for managed in (runtime_policy, boundary) if stack.config.mlflow_tracking_servers else ():
        acknowledge(
            managed,
            "AwsSolutions-IAM5[Action::sagemaker-mlflow:*]",
            "The MLflow client calls many sagemaker-mlflow actions (runs, metrics, params, artifacts' presigned "
            "URLs); AWS documents sagemaker-mlflow:* for a job that logs to a tracking server, limited here to the "
            "tracking servers named in context mlflow_tracking_servers.",
        )
    job_policies = (
        (runtime_policy, "TrainingJobs"),
        (boundary, "TrainingJobs"),
        (processing_policy, "ProcessingJobs"),
    )
    for policy, group in job_policies:
        acknowledge(
            policy,
            f"AwsSolutions-IAM5[Resource::{account_arn.format(service='logs')}:log-group:/aws/sagemaker/{group}:*]",
            f"SageMaker writes job logs to the fixed log group /aws/sagemaker/{group} with one stream per job "
            "host, named at run time; the grant is limited to that group.",
        )
        acknowledge(
            policy,
            "AwsSolutions-IAM5[Resource::*]",
            "ecr:GetAuthorizationToken has no resource-level permissions (image pulls themselves are limited to "
            "the training image repository); cloudwatch:PutMetricData has none either and is restricted by a "
            "cloudwatch:namespace condition to SageMaker's job namespaces."
            + (
                " With the vpc setting, SageMaker's EC2 network-interface calls (Create/Delete/Describe "
                "NetworkInterfaces, DescribeVpcs/Subnets/SecurityGroups/DhcpOptions) act on interfaces it creates "
                "at run time, so they cannot be scoped to known ARNs."
                if stack.config.vpc is not None
                else ""
            ),
        )


def _cfn(construct: IConstruct) -> CfnElement:
    child = construct.node.default_child
    assert isinstance(child, CfnElement)
    return child
