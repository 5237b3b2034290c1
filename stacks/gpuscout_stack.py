"""The gpuscout stack: composes the constructs and makes every grant between them.

Every cdk-nag finding that remains after the fixes is acknowledged, at the construct it concerns, with the reason it
cannot be narrowed, in stacks/acknowledgments.py (called once everything is built).
"""

from __future__ import annotations

from typing import Any

from aws_cdk import CfnOutput, Duration, RemovalPolicy, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from constructs import Construct

from gpuscout.domain.names import (
    MANIFESTS_PREFIX,
    METRIC_NAMESPACE,
    OUTPUT_PREFIX,
    PLANS_PREFIX,
    PROCESSED_PREFIX,
    RAW_PREFIX,
    REJECTED_PREFIX,
    REPORTS_PREFIX,
    SEARCH_PREFIX,
)
from gpuscout.plan.jobs import MAX_RUNTIME_S
from stacks.acknowledgments import acknowledge_findings
from stacks.config import LOG_RETENTION_DAYS, RemovalMode, StackConfig
from stacks.events import EventRules
from stacks.functions import (
    FUNCTION_NAMES,
    JOB_RECORDERS,
    RUN_SUMMARY_PUBLISHERS,
    SEARCH_READERS,
    Functions,
)
from stacks.monitoring import Monitoring
from stacks.notifications import Notifications
from stacks.results_table import JOB_INDEX, RUNS_INDEX, ResultsTable
from stacks.roles import SERVICE_NAME, TRAINING_JOBS_ARN, TUNING_JOBS_ARN, Roles
from stacks.storage import Storage
from stacks.training_image import TrainingImage
from stacks.workflow import BenchmarkWorkflow


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
        acknowledge_findings(self)
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
