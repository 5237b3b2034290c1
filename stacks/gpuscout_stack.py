"""The gpuscout stack: composes the constructs and makes every grant between them.

Every cdk-nag finding that remains after the fixes is acknowledged here, at the construct it concerns, with the
reason it cannot be narrowed (docs/architecture.md, "Security model", lists them too).
"""

from __future__ import annotations

import json
from typing import Any

from aws_cdk import Acknowledgment, CfnElement, CfnOutput, Duration, RemovalPolicy, Stack, Token, Validations
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from constructs import Construct, IConstruct

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
from gpuscout.plan.jobs import MAX_RUNTIME_S
from stacks.config import LOG_RETENTION_DAYS, RemovalMode, StackConfig
from stacks.events import EventRules
from stacks.functions import FUNCTION_NAMES, Functions
from stacks.monitoring import Monitoring
from stacks.notifications import Notifications
from stacks.results_table import JOB_INDEX, RUNS_INDEX, ResultsTable
from stacks.roles import METRIC_NAMESPACE, SERVICE_NAME, TRAINING_JOBS_ARN, TUNING_JOBS_ARN, Roles
from stacks.storage import Storage
from stacks.training_image import TrainingImage
from stacks.workflow import BenchmarkWorkflow

# The functions that record a finished training job (same code path, same grants).
JOB_RECORDERS = ("job_events", "record_job_result")
# The functions that read a settings search's candidates, which plan_jobs writes per tuning job under SEARCH_PREFIX
# (gpuscout.cloud.tuning_requests), to give a tuning job's trials (or its failure) their rows.
SEARCH_READERS = (*JOB_RECORDERS, "record_job_failure")
# The functions the state machine invokes (everything but the EventBridge targets).
WORKFLOW_FUNCTIONS = (
    "validate_manifest",
    "plan_jobs",
    "run_role",
    "record_job_failure",
    "record_job_result",
    "mark_run_failed",
    "analyze_run",
)

# publish to the topic: the run summary (analyze_run, mark_run_failed) or why a run never started (the other two)
RUN_SUMMARY_PUBLISHERS = ("analyze_run", "mark_run_failed", "validate_manifest", "plan_jobs")


def acknowledge(scope: IConstruct, rule_id: str, reason: str) -> None:
    """One cdk-nag acknowledgment, on the construct it concerns."""
    Validations.of(scope).acknowledge(Acknowledgment(id=f"AwsSolutions::{rule_id}", reason=reason))


class GpuscoutStack(Stack):
    def __init__(self, scope: Construct, construct_id: str, *, config: StackConfig, **kwargs: Any) -> None:
        super().__init__(scope, construct_id, description="gpuscout: GPU instance benchmarks on SageMaker", **kwargs)
        self.config = config
        removal = RemovalPolicy.DESTROY if config.removal_policy is RemovalMode.DESTROY else RemovalPolicy.RETAIN
        retention: logs.RetentionDays = getattr(logs.RetentionDays, LOG_RETENTION_DAYS[config.log_retention_days])

        self.storage = Storage(
            self,
            "Storage",
            removal_policy=removal,
            checkpoint_expiry_days=config.checkpoint_expiry_days,
            execution_timeout_hours=config.execution_timeout_hours,
        )
        self.results = ResultsTable(self, "Results", removal_policy=removal)
        self.image = TrainingImage(self, "TrainingImage", base_image=config.training_image_base)
        self.notifications = Notifications(
            self, "Notifications", email=config.notification_email, removal_policy=removal
        )
        self.roles = Roles(
            self,
            "Roles",
            data_bucket=self.storage.data,
            artifacts_bucket=self.storage.artifacts,
            image_repository=self.image.repository,
            lambda_names=FUNCTION_NAMES,
            use_vpc=config.vpc is not None,
            # the types a job or canary may run on, and the planner's longest runtime (gpuscout.plan.jobs)
            launchable_types=sorted({*config.allowed_instance_types, *filter(None, [config.canary_instance_type])}),
            max_runtime_s=MAX_RUNTIME_S,
            mlflow_tracking_servers=config.mlflow_tracking_servers,
        )
        environment = {
            "TABLE_NAME": self.results.table.table_name,
            "DATA_BUCKET": self.storage.data.bucket_name,
            "ARTIFACTS_BUCKET": self.storage.artifacts.bucket_name,
            "PROCESSING_ROLE_ARN": self.roles.processing.role_arn,
            "RUN_ROLE_PATH": self.roles.run_role_path,
            "RUN_ROLE_BOUNDARY_ARN": self.roles.run_role_boundary.managed_policy_arn,
            "JOB_RUNTIME_POLICY_ARN": self.roles.job_runtime_policy.managed_policy_arn,
            "TRAINING_IMAGE_URI": self.image.image_uri,
            "PROCESSING_INSTANCE_TYPE": config.processing_instance_type,
            "CANARY_INSTANCE_TYPE": config.canary_instance_type or "",
            "EXECUTION_TIMEOUT_HOURS": str(config.execution_timeout_hours),
            "ALLOWED_INSTANCE_TYPES": config.allowed_instance_types_csv,
            "MLFLOW_TRACKING_SERVERS": config.mlflow_tracking_servers_csv,
            "DEFAULT_BUDGET_USD": f"{config.default_budget_usd:g}",
            "MAP_MAX_CONCURRENCY": str(config.map_max_concurrency),
            "NOTIFICATION_TOPIC_ARN": self.notifications.topic.topic_arn,
            "POWERTOOLS_SERVICE_NAME": SERVICE_NAME,
            "POWERTOOLS_METRICS_NAMESPACE": METRIC_NAMESPACE,
            "MPLBACKEND": "Agg",
            "MPLCONFIGDIR": "/tmp/matplotlib",  # Lambda's only writable folder
        }
        self.functions = Functions(
            self,
            "Functions",
            roles=self.roles.lambdas,
            environment=environment,
            log_retention=retention,
            removal_policy=removal,
        )
        self.workflow = BenchmarkWorkflow(
            self,
            "Workflow",
            functions=self.functions.functions,
            table=self.results.table,
            plan_bucket=self.storage.artifacts,
            role=self.roles.state_machine,
            processing_role_arn=self.roles.processing.role_arn,
            map_max_concurrency=config.map_max_concurrency,
            quota_wait_hours=config.quota_wait_hours,
            vpc=config.vpc,
            timeout=Duration.hours(config.execution_timeout_hours),
            log_retention=retention,
            removal_policy=removal,
        )
        self.events = EventRules(
            self,
            "Events",
            data_bucket=self.storage.data,
            state_machine=self.workflow.state_machine,
            job_events_function=self.functions.functions["job_events"],
            mark_run_failed_function=self.functions.functions["mark_run_failed"],
            budget_guard_function=self.functions.functions["budget_guard"],
            removal_policy=removal,
        )
        self.monitoring = Monitoring(
            self,
            "Monitoring",
            state_machine=self.workflow.state_machine,
            functions=self.functions.functions,
            dead_letter_queues=[*self.events.dead_letter_queues, self.functions.dead_letter_queue],
            topic=self.notifications.topic,
            instance_types=config.allowed_instance_types,
        )
        self._grant()
        self._acknowledge()
        # What a client needs to submit manifests and read results (`aws cloudformation describe-stacks`).
        for name, value in {
            "DataBucketName": self.storage.data.bucket_name,
            "ArtifactsBucketName": self.storage.artifacts.bucket_name,
            "ResultsTableName": self.results.table.table_name,
            "StateMachineArn": self.workflow.state_machine.state_machine_arn,
            "NotificationTopicArn": self.notifications.topic.topic_arn,
            # for the CLI's quota pre-flight (gpuscout/cloud/quotas.py): what the canaries and the Map will ask for
            "CanaryInstanceType": config.canary_instance_type or "none",
            "MapMaxConcurrency": str(config.map_max_concurrency),
        }.items():
            CfnOutput(self, name, value=value)

    # ------------------------------------------------------------------ grants
    def _grant(self) -> None:
        data, artifacts = self.storage.data, self.storage.artifacts
        table = self.results.table
        lambdas = self.roles.lambdas
        table_statement = iam.PolicyStatement(
            sid="ResultsTable",
            # BatchWriteItem: a plan's job rows in batches of 25 (DynamoDbStore.put_jobs)
            actions=[
                "dynamodb:GetItem",
                "dynamodb:PutItem",
                "dynamodb:BatchWriteItem",
                "dynamodb:UpdateItem",
                "dynamodb:Query",
            ],
            resources=[
                table.table_arn,
                f"{table.table_arn}/index/{RUNS_INDEX}",
                f"{table.table_arn}/index/{JOB_INDEX}",
            ],
        )
        for role in lambdas.values():
            role.add_to_policy(table_statement)

        lambdas["validate_manifest"].add_to_policy(
            iam.PolicyStatement(
                sid="ReadManifests", actions=["s3:GetObject"], resources=[data.arn_for_objects(f"{MANIFESTS_PREFIX}*")]
            )
        )
        lambdas["validate_manifest"].add_to_policy(
            iam.PolicyStatement(
                sid="WriteRejections", actions=["s3:PutObject"], resources=[data.arn_for_objects(f"{REJECTED_PREFIX}*")]
            )
        )
        # A job section's code folder (under raw/): Validate checks its entry point is there.
        lambdas["validate_manifest"].add_to_policy(
            iam.PolicyStatement(
                sid="FindJobCode", actions=["s3:GetObject"], resources=[data.arn_for_objects(f"{RAW_PREFIX}*")]
            )
        )
        # The quota pre-flight (gpuscout/cloud/quotas.py): the account's SageMaker training quotas, read only.
        lambdas["validate_manifest"].add_to_policy(
            iam.PolicyStatement(
                sid="ReadQuotas",
                # a quota only AWS's default lists is confirmed with GetServiceQuota before it refuses a run. IAM's
                # service authorization reference lists no resource type for these three reads: a quota ARN in the
                # Resource would never match, and GetServiceQuota would be denied (a zero quota then only warned)
                actions=[
                    "servicequotas:ListServiceQuotas",
                    "servicequotas:ListAWSDefaultServiceQuotas",
                    "servicequotas:GetServiceQuota",
                ],
                resources=["*"],
            )
        )
        # plan_jobs checks whether processed data exists (HEAD needs ListBucket to tell 404 from 403).
        lambdas["plan_jobs"].add_to_policy(
            iam.PolicyStatement(
                sid="FindProcessedData",
                actions=["s3:GetObject"],
                resources=[data.arn_for_objects(f"{PROCESSED_PREFIX}*")],
            )
        )
        lambdas["plan_jobs"].add_to_policy(
            iam.PolicyStatement(sid="TellMissingFromForbidden", actions=["s3:ListBucket"], resources=[data.bucket_arn])
        )
        lambdas["plan_jobs"].add_to_policy(
            iam.PolicyStatement(
                sid="WriteSearchTargets",
                actions=["s3:PutObject"],
                resources=[artifacts.arn_for_objects(f"{SEARCH_PREFIX}*")],
            )
        )
        # The plan's request lists (gpuscout.cloud.plan_items), which the state machine's Distributed Maps read.
        lambdas["plan_jobs"].add_to_policy(
            iam.PolicyStatement(
                sid="WritePlanItems",
                actions=["s3:PutObject"],
                resources=[artifacts.arn_for_objects(f"{PLANS_PREFIX}*")],
            )
        )
        for name in SEARCH_READERS:
            lambdas[name].add_to_policy(
                iam.PolicyStatement(
                    sid="ReadSearchTargets",
                    actions=["s3:GetObject"],
                    resources=[artifacts.arn_for_objects(f"{SEARCH_PREFIX}*")],
                )
            )
        # job_events (SageMaker's events) and record_job_result (inside the Map, describing the job) record finished
        # jobs with the same code: both read benchmark.json from job output, stop jobs when measured spend crosses
        # the budget and emit throughput metrics; record_job_result also describes the job it records.
        for name in JOB_RECORDERS:
            lambdas[name].add_to_policy(
                iam.PolicyStatement(
                    sid="ReadJobOutput",
                    actions=["s3:GetObject"],
                    resources=[artifacts.arn_for_objects(f"{OUTPUT_PREFIX}*")],
                )
            )
            lambdas[name].add_to_policy(
                iam.PolicyStatement(
                    sid="BudgetGuard",
                    # record_job_result also describes the job it records; job_events has the job in its event
                    actions=[
                        "sagemaker:StopTrainingJob",
                        *(["sagemaker:DescribeTrainingJob"] if name == "record_job_result" else []),
                    ],
                    resources=[TRAINING_JOBS_ARN],
                )
            )
            # A search trial: was it stopped early by its tuning job? The budget guard stops the tuning job.
            lambdas[name].add_to_policy(
                iam.PolicyStatement(
                    sid="SearchTrials",
                    actions=[
                        "sagemaker:DescribeHyperParameterTuningJob",
                        "sagemaker:StopHyperParameterTuningJob",
                        *(
                            ["sagemaker:ListTrainingJobsForHyperParameterTuningJob"]
                            if name == "record_job_result"
                            else []
                        ),
                    ],
                    resources=[TUNING_JOBS_ARN],
                )
            )
            lambdas[name].add_to_policy(
                iam.PolicyStatement(
                    sid="ThroughputMetrics",
                    actions=["cloudwatch:PutMetricData"],
                    resources=["*"],
                    conditions={"StringEquals": {"cloudwatch:namespace": METRIC_NAMESPACE}},
                )
            )
        # The scheduled budget check (gpuscout.cloud.budget_guard) reads runs and jobs from the table and stops the
        # jobs of a run over its budget: its training jobs, and its tuning jobs (which stop their trials). Nothing
        # else: no Describe (the rows say what runs), no job output.
        lambdas["budget_guard"].add_to_policy(
            iam.PolicyStatement(
                sid="StopTrainingJobsOverBudget", actions=["sagemaker:StopTrainingJob"], resources=[TRAINING_JOBS_ARN]
            )
        )
        lambdas["budget_guard"].add_to_policy(
            iam.PolicyStatement(
                sid="StopTuningJobsOverBudget",
                actions=["sagemaker:StopHyperParameterTuningJob"],
                resources=[TUNING_JOBS_ARN],
            )
        )
        lambdas["analyze_run"].add_to_policy(
            iam.PolicyStatement(
                sid="WriteReports", actions=["s3:PutObject"], resources=[data.arn_for_objects(f"{REPORTS_PREFIX}*")]
            )
        )
        # Only the analysis reprices with today's list prices; planning uses the catalog's.
        lambdas["analyze_run"].add_to_policy(
            iam.PolicyStatement(sid="PriceList", actions=["pricing:GetProducts"], resources=["*"])
        )
        # Each run's own role for its SageMaker jobs (gpuscout.cloud.run_roles): run_role creates it (with the
        # boundary, the runtime policy attached) and deletes it after the analysis; mark_run_failed deletes it when the
        # run ends any other way; budget_guard sweeps what is left an hour after its run ended.
        for statement in self.roles.run_role_statements(create=True):
            lambdas["run_role"].add_to_policy(statement)
        for statement in self.roles.run_role_statements(create=False):
            lambdas["mark_run_failed"].add_to_policy(statement)
        for statement in self.roles.sweep_statements():  # what runs leave behind, every budget check
            lambdas["budget_guard"].add_to_policy(statement)
        # The run summary: analyze_run for an analysed run, mark_run_failed for a run that failed before it.
        for name in RUN_SUMMARY_PUBLISHERS:
            self.notifications.topic.grant_publish(lambdas[name])
            self.notifications.key.grant(lambdas[name], "kms:Decrypt", "kms:GenerateDataKey*")

    # --------------------------------------------------------- acknowledgments
    def _acknowledge(self) -> None:
        data, artifacts = self.storage.data, self.storage.artifacts
        data_ref = f"<{self.get_logical_id(_cfn(data))}.Arn>"
        artifacts_ref = f"<{self.get_logical_id(_cfn(artifacts))}.Arn>"
        account_arn = "arn:<AWS::Partition>:{service}:<AWS::Region>:<AWS::AccountId>"
        training_jobs = account_arn.format(service="sagemaker") + f":training-job/{JOB_NAME_PREFIX}*"
        processing_jobs = account_arn.format(service="sagemaker") + f":processing-job/{JOB_NAME_PREFIX}*"
        tuning_jobs = account_arn.format(service="sagemaker") + f":hyper-parameter-tuning-job/{JOB_NAME_PREFIX}*"
        xray = "X-Ray trace and sampling APIs (Put*/GetSampling*) support no resource-level permissions (tracing is on)"
        job_names = (
            f"SageMaker job names are generated per run; {JOB_NAME_PREFIX}* limits the grant to gpuscout's own jobs"
        )

        acknowledge(
            self.storage.access_logs,
            "AwsSolutions-S1",
            "This is the server access log target bucket; logging it into itself would loop.",
        )
        for queue in self.events.dead_letter_queues:
            acknowledge(
                queue, "AwsSolutions-SQS3", "This queue is itself the dead-letter queue of an EventBridge target."
            )
        for function in self.functions.functions.values():
            acknowledge(
                function,
                "AwsSolutions-L1",
                "Pinned to Python 3.12: the dependency layer is built for CPython 3.12 wheels and the tests run the "
                "same pins; move runtime and layer together (stacks/functions.py PYTHON_VERSION).",
            )

        self._acknowledge_job_policies(data_ref, artifacts_ref, account_arn)

        lambdas = self.roles.lambdas
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
            self.roles.state_machine,
            f"AwsSolutions-IAM5[{run_roles}]",
            "Passes each run's own role, created at run time, to SageMaker only (iam:PassedToService).",
        )
        state_machine_role = self.roles.state_machine
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
        machine = self.workflow.state_machine
        region = "<AWS::Region>" if Token.is_unresolved(self.region) else self.region
        machine_ref = json.dumps({"Ref": self.get_logical_id(_cfn(machine))}, separators=(",", ":"))
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
            function = self.functions.functions[name]
            acknowledge(
                state_machine_role,
                f"AwsSolutions-IAM5[Resource::<{self.get_logical_id(_cfn(function))}.Arn>:*]",
                f"Invoke permission on versions and aliases of {name} only (CDK's LambdaInvoke grant).",
            )

    def _acknowledge_job_policies(self, data_ref: str, artifacts_ref: str, account_arn: str) -> None:
        """The SageMaker jobs' policies: each run role's runtime policy and boundary, data preparation's."""
        runtime_policy, boundary = self.roles.job_runtime_policy, self.roles.run_role_boundary
        processing_policy = self.roles.processing_policy
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
        for managed in (runtime_policy, boundary) if self.config.mlflow_tracking_servers else ():
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
                    if self.config.vpc is not None
                    else ""
                ),
            )


def _cfn(construct: IConstruct) -> CfnElement:
    child = construct.node.default_child
    assert isinstance(child, CfnElement)
    return child
