"""IAM roles: what each run's own role for its SageMaker training jobs (untrusted code) is made of, the
data-preparation job's role, one role per Lambda function and the state machine's role.

Each role gets only what its principal calls, scoped to this stack's resources and to job names starting with
``gs-`` (gpuscout.domain.names.JOB_NAME_PREFIX). Data-plane grants to the Lambda roles (table, bucket prefixes) are
made by the stack, which sees every resource; this file defines the roles and the statements that follow from the
SageMaker/Step Functions contracts. Every wildcard that remains is acknowledged in stacks/acknowledgments.py with the
reason, and listed in docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import Aws
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3
from constructs import Construct

from gpuscout.domain.names import (
    CHECKPOINTS_PREFIX,
    JOB_NAME_PREFIX,
    OUTPUT_PREFIX,
    PROCESSED_PREFIX,
    RAW_PREFIX,
    RUN_ARTIFACT_ACTIONS,
    RUN_ROLE_NAME_PREFIX,
    RUN_ROLE_PATH_PREFIX,
    SAGEMAKER_SERVICE,
)

SAGEMAKER_LOG_GROUPS = ("/aws/sagemaker/TrainingJobs", "/aws/sagemaker/ProcessingJobs")
# POWERTOOLS_SERVICE_NAME of every Lambda: Powertools adds it as the "service" dimension of every metric it emits.
SERVICE_NAME = "gpuscout"
# Namespaces the job roles may write metrics to: SageMaker's own (MetricDefinitions) only. Not gpuscout's, where a
# job's code could fire the failed-runs alarm or forge the dashboard's throughput; train.py emits no metrics itself.
SAGEMAKER_METRIC_NAMESPACES = ("/aws/sagemaker/TrainingJobs", "/aws/sagemaker/ProcessingJobs")
# The managed EventBridge rules Step Functions creates to learn that a .sync SageMaker job finished.
SYNC_RULES = (
    "StepFunctionsGetEventsForSageMakerTrainingJobsRule",
    "StepFunctionsGetEventsForSageMakerProcessingJobsRule",
    "StepFunctionsGetEventsForSageMakerTuningJobsRule",
)


def sagemaker_arn(resource_type: str, name_pattern: str = f"{JOB_NAME_PREFIX}*") -> str:
    """arn:aws:sagemaker:<region>:<account>:<type>/<pattern> of this account and region."""
    return f"arn:{Aws.PARTITION}:sagemaker:{Aws.REGION}:{Aws.ACCOUNT_ID}:{resource_type}/{name_pattern}"


TRAINING_JOBS_ARN = sagemaker_arn("training-job")
PROCESSING_JOBS_ARN = sagemaker_arn("processing-job")
TUNING_JOBS_ARN = sagemaker_arn("hyper-parameter-tuning-job")  # a settings search: one per target
# A job on a SageMaker training plan (ResourceConfig.TrainingPlanArn) is created "on" the plan and its reserved
# capacity too: AWS's "IAM for SageMaker training plans" grants a plan user sagemaker:CreateTrainingJob on both (as
# AmazonSageMakerFullAccess's AllowUseOfTrainingPlanResources does). The plans are the user's, named by them.
TRAINING_PLAN_ARNS = (sagemaker_arn("training-plan", "*"), sagemaker_arn("reserved-capacity", "*"))


class Roles(Construct):
    """`job_runtime_policy` and `run_role_boundary` (each run's role for its jobs, created at run time under
    `run_role_path`), `processing` (data preparation), `lambdas[name]` (one per function), `state_machine`."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        data_bucket: s3.IBucket,
        artifacts_bucket: s3.IBucket,
        image_repository: ecr.IRepository,
        lambda_names: Sequence[str],
        use_vpc: bool,
        launchable_types: Sequence[str],
        max_runtime_s: int,
        mlflow_tracking_servers: Sequence[str] = (),
    ) -> None:
        super().__init__(scope, construct_id)
        # each run's own role for its SageMaker jobs (gpuscout.cloud.run_roles): created per run under this path
        self.run_role_path = f"{RUN_ROLE_PATH_PREFIX}{Aws.REGION}/{Aws.STACK_NAME}/"
        self.run_roles_arn = (
            f"arn:{Aws.PARTITION}:iam::{Aws.ACCOUNT_ID}:role{self.run_role_path}{RUN_ROLE_NAME_PREFIX}*"
        )
        self._run_role_policies(
            data_bucket, artifacts_bucket, image_repository, use_vpc=use_vpc, mlflow_servers=mlflow_tracking_servers
        )
        self.processing = self._processing_role(data_bucket, image_repository, use_vpc=use_vpc)
        self.lambdas: dict[str, iam.Role] = {
            name: iam.Role(
                self,
                f"Lambda-{name}",
                assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
                description=f"gpuscout Lambda function {name}",
            )
            for name in lambda_names
        }
        self.state_machine = self._state_machine_role(launchable_types, max_runtime_s)

    def _job_role(self, construct_id: str, description: str) -> iam.Role:
        return iam.Role(
            self,
            construct_id,
            # Only the state machine may hand this role to SageMaker (iam:PassRole, see _state_machine_role), and
            # SageMaker may assume it only for jobs of this account and region (confused-deputy protection).
            assumed_by=iam.ServicePrincipal(
                SAGEMAKER_SERVICE,
                conditions={
                    "StringEquals": {"aws:SourceAccount": Aws.ACCOUNT_ID},
                    "ArnLike": {"aws:SourceArn": f"arn:{Aws.PARTITION}:sagemaker:{Aws.REGION}:{Aws.ACCOUNT_ID}:*"},
                },
            ),
            description=description,
        )

    @staticmethod
    def _list_datasets(data: s3.IBucket) -> iam.PolicyStatement:
        """Listing the data bucket, only under the sources and the prepared data (both job roles look there)."""
        return iam.PolicyStatement(
            sid="ListDatasets",
            actions=["s3:ListBucket"],
            resources=[data.bucket_arn],
            conditions={"StringLike": {"s3:prefix": [f"{RAW_PREFIX}*", f"{PROCESSED_PREFIX}*"]}},
        )

    @staticmethod
    def _job_runtime_statements(
        repository: ecr.IRepository, *, log_group: str, use_vpc: bool
    ) -> list[iam.PolicyStatement]:
        """What any gpuscout SageMaker job needs to run: the image, its log group, metrics, VPC interfaces."""
        statements = [
            iam.PolicyStatement(
                sid="PullTrainingImage",
                actions=["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"],
                resources=[repository.repository_arn],
            ),
            iam.PolicyStatement(sid="EcrLogin", actions=["ecr:GetAuthorizationToken"], resources=["*"]),
            iam.PolicyStatement(
                sid="JobLogs",
                actions=["logs:CreateLogGroup", "logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
                # CreateLogGroup is authorized on the log group's ARN itself, the stream actions on "<group>:*"
                resources=[
                    f"arn:{Aws.PARTITION}:logs:{Aws.REGION}:{Aws.ACCOUNT_ID}:log-group:{log_group}{suffix}"
                    for suffix in ("", ":*")
                ],
            ),
            iam.PolicyStatement(
                sid="JobMetrics",
                actions=["cloudwatch:PutMetricData"],
                resources=["*"],
                conditions={"StringEquals": {"cloudwatch:namespace": list(SAGEMAKER_METRIC_NAMESPACES)}},
            ),
        ]
        if use_vpc:
            statements.append(
                # What SageMaker needs to attach jobs to the configured subnets (VpcConfig).
                iam.PolicyStatement(
                    sid="VpcNetworkInterfaces",
                    actions=[
                        "ec2:CreateNetworkInterface",
                        "ec2:CreateNetworkInterfacePermission",
                        "ec2:DeleteNetworkInterface",
                        "ec2:DeleteNetworkInterfacePermission",
                        "ec2:DescribeNetworkInterfaces",
                        "ec2:DescribeVpcs",
                        "ec2:DescribeDhcpOptions",
                        "ec2:DescribeSubnets",
                        "ec2:DescribeSecurityGroups",
                    ],
                    resources=["*"],
                )
            )
        return statements

    def _run_role_policies(
        self,
        data: s3.IBucket,
        artifacts: s3.IBucket,
        repository: ecr.IRepository,
        *,
        use_vpc: bool,
        mlflow_servers: Sequence[str],
    ) -> None:
        """What each run's own role (gpuscout.cloud.run_roles, created by the run_role function) is made of: the job
        runtime managed policy every run role has attached (the image, logs, metrics, reading sources and prepared
        data, VPC interfaces, MLflow), and the permissions boundary every run role must carry, which caps it at that
        plus job output and checkpoints of any run. The role's inline policy, written per run, narrows the latter to
        the run's own ``output/<run_id>/`` and ``checkpoints/<run_id>/``. The runs' jobs are the untrusted code: none
        of this writes the prepared-data cache (the processing role's), plans/ or search/ (the workflow's launch
        requests), or reports."""
        runtime = [
            iam.PolicyStatement(
                sid="ReadDatasets",
                actions=["s3:GetObject"],
                resources=[data.arn_for_objects(f"{RAW_PREFIX}*"), data.arn_for_objects(f"{PROCESSED_PREFIX}*")],
            ),
            self._list_datasets(data),
            *self._job_runtime_statements(repository, log_group=SAGEMAKER_LOG_GROUPS[0], use_vpc=use_vpc),
        ]
        if mlflow_servers:
            # The SageMaker managed MLflow tracking servers this deployment names (context mlflow_tracking_servers):
            # a manifest's tracking.mlflow.tracking_uri may name only these (the validation refuses others), and a
            # job's code can reach no other. Artifacts go through the server's presigned URLs
            # (SAGEMAKER_PRESIGNED_URL_UPLOAD_ENABLED), so no grant on its artifact bucket.
            runtime.append(
                iam.PolicyStatement(
                    sid="ExperimentTracking",
                    actions=["sagemaker-mlflow:*"],
                    resources=[sagemaker_arn("mlflow-tracking-server", name) for name in mlflow_servers],
                )
            )
        job_prefixes = (OUTPUT_PREFIX, CHECKPOINTS_PREFIX)
        any_run_artifacts = [
            # Job output and checkpoints (SageMaker uploads the first, syncs the second both ways): only there, and
            # per run only under the run's own prefixes (the run role's inline policy).
            iam.PolicyStatement(
                sid="RunArtifacts",
                actions=list(RUN_ARTIFACT_ACTIONS),
                resources=[artifacts.arn_for_objects(f"{prefix}*") for prefix in job_prefixes],
            ),
            iam.PolicyStatement(
                sid="ListRunArtifacts",
                actions=["s3:ListBucket"],
                resources=[artifacts.bucket_arn],
                conditions={"StringLike": {"s3:prefix": [f"{prefix}*" for prefix in job_prefixes]}},
            ),
        ]
        self.job_runtime_policy = iam.ManagedPolicy(
            self,
            "JobRuntimePolicy",
            description="gpuscout: what every run's SageMaker jobs need besides their run's own artifacts",
            statements=runtime,
        )
        self.run_role_boundary = iam.ManagedPolicy(
            self,
            "RunRoleBoundary",
            description="gpuscout: the permissions boundary of every run's role (the most a run role may be granted)",
            statements=[*(iam.PolicyStatement.from_json(st.to_json()) for st in runtime), *any_run_artifacts],
        )

    def sweep_statements(self) -> list[iam.PolicyStatement]:
        """The scheduled sweep of run roles left behind (budget_guard): list this stack's run roles and their tags,
        then delete like mark_run_failed."""
        return [
            # ListRoles takes no resource (IAM's service authorization reference): the path prefix is in the call
            iam.PolicyStatement(sid="ListRoles", actions=["iam:ListRoles"], resources=["*"]),
            iam.PolicyStatement(sid="ReadRunRoleTags", actions=["iam:ListRoleTags"], resources=[self.run_roles_arn]),
            *self.run_role_statements(create=False),
        ]

    def run_role_statements(self, *, create: bool) -> list[iam.PolicyStatement]:
        """IAM calls on this stack's run roles (path /gpuscout/<region>/<stack name>/, names gs-run-*): deleting them
        (the run_role function, mark_run_failed and budget_guard's sweep), and with ``create`` creating them (the
        run_role function), only with the boundary and attaching only the job runtime policy. Every policy change is
        conditioned on the role carrying this stack's boundary (iam:PermissionsBoundary, as AWS's
        delegated-administration example does). Neither a boundary's removal nor a trust policy's update is granted."""
        with_boundary = {"StringEquals": {"iam:PermissionsBoundary": self.run_role_boundary.managed_policy_arn}}
        statements = [
            iam.PolicyStatement(
                sid="DeleteRunRolePolicies",
                actions=["iam:DeleteRolePolicy", "iam:DetachRolePolicy"],
                resources=[self.run_roles_arn],
                conditions=with_boundary,
            ),
            iam.PolicyStatement(
                sid="DeleteRunRoles",
                # the policies listed to be removed first; DeleteRole takes no boundary condition (it fails while a
                # policy is left, and only this stack's boundary-carrying roles' policies can be removed)
                actions=["iam:ListRolePolicies", "iam:ListAttachedRolePolicies", "iam:DeleteRole"],
                resources=[self.run_roles_arn],
            ),
        ]
        if create:
            statements += [
                iam.PolicyStatement(
                    sid="CreateRunRolesWithTheBoundary",
                    actions=["iam:CreateRole", "iam:PutRolePolicy"],
                    resources=[self.run_roles_arn],
                    conditions=with_boundary,
                ),
                iam.PolicyStatement(
                    sid="TagAndReadRunRoles",
                    # TagRole: CreateRole's Tags; GetRole: a retried create checks the role it finds
                    actions=["iam:TagRole", "iam:GetRole"],
                    resources=[self.run_roles_arn],
                ),
                iam.PolicyStatement(
                    sid="AttachTheJobRuntimePolicyOnly",
                    actions=["iam:AttachRolePolicy"],
                    resources=[self.run_roles_arn],
                    conditions={
                        **with_boundary,
                        "ArnEquals": {"iam:PolicyARN": self.job_runtime_policy.managed_policy_arn},
                    },
                ),
            ]
        return statements

    def _processing_role(self, data: s3.IBucket, repository: ecr.IRepository, *, use_vpc: bool) -> iam.Role:
        """The data-preparation job's role (gpuscout's own script, no user code): reads raw sources, writes the
        prepared-data cache under processed/, which the training jobs may only read."""
        role = self._job_role("SageMakerProcessing", "gpuscout SageMaker data-preparation (processing) jobs")
        statements = [
            iam.PolicyStatement(
                sid="ReadSources", actions=["s3:GetObject"], resources=[data.arn_for_objects(f"{RAW_PREFIX}*")]
            ),
            self._list_datasets(data),
            iam.PolicyStatement(
                sid="WriteProcessedDatasets",
                actions=["s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload"],
                resources=[data.arn_for_objects(f"{PROCESSED_PREFIX}*")],
            ),
            *self._job_runtime_statements(repository, log_group=SAGEMAKER_LOG_GROUPS[1], use_vpc=use_vpc),
        ]
        self.processing_policy = iam.Policy(self, "SageMakerProcessingPolicy", roles=[role], statements=statements)
        return role

    def _state_machine_role(self, launchable_types: Sequence[str], max_runtime_s: int) -> iam.Role:
        role = iam.Role(
            self,
            "StateMachine",
            # Confused-deputy guard (documented for Step Functions): only this account's state machines, in this region.
            assumed_by=iam.ServicePrincipal("states.amazonaws.com").with_conditions(
                {
                    "StringEquals": {"aws:SourceAccount": Aws.ACCOUNT_ID},
                    "ArnLike": {
                        "aws:SourceArn": f"arn:{Aws.PARTITION}:states:{Aws.REGION}:{Aws.ACCOUNT_ID}:stateMachine:*"
                    },
                }
            ),
            description="gpuscout benchmark state machine",
        )
        role.add_to_policy(
            iam.PolicyStatement(
                sid="PassSageMakerRoleToSageMakerOnly",
                actions=["iam:PassRole"],
                resources=[self.run_roles_arn, self.processing.role_arn],
                conditions={"StringEquals": {"iam:PassedToService": SAGEMAKER_SERVICE}},
            )
        )
        # Even a forged launch request cannot leave the deployment's bounds: the service's condition keys for
        # CreateTrainingJob / CreateHyperParameterTuningJob (IAM's service authorization reference) hold every job to
        # the allowed instance types (the key must be present) and to the planner's longest runtime.
        bounds = {
            "ForAllValues:StringEquals": {"sagemaker:InstanceTypes": sorted(launchable_types)},
            "Null": {"sagemaker:InstanceTypes": "false"},
            "NumericLessThanEquals": {"sagemaker:MaxRuntimeInSeconds": max_runtime_s},
        }
        # A tuning job's request holds its training jobs' definition: which of its fields fill these keys is not
        # documented (StoppingCondition or ResourceLimits' runtime), so the keys bound it where present (IfExists)
        # rather than refuse every search should one be absent. SageMaker launches the trials itself (not through
        # this role's CreateTrainingJob grant), so a tuning request that fills neither key is not bounded here: the
        # requests are plan_jobs' (jobs cannot write plans/ or search/), and the tests check their instance types.
        tuning_bounds = {
            "ForAllValues:StringEquals": {"sagemaker:InstanceTypes": sorted(launchable_types)},
            "NumericLessThanEqualsIfExists": {"sagemaker:MaxRuntimeInSeconds": max_runtime_s},
        }
        role.add_to_policy(
            iam.PolicyStatement(
                sid="CreateTrainingJobs", actions=["sagemaker:CreateTrainingJob"],
                resources=[TRAINING_JOBS_ARN, *TRAINING_PLAN_ARNS], conditions=bounds,
            )
        )  # fmt: skip
        role.add_to_policy(
            iam.PolicyStatement(
                sid="RunTrainingJobs",
                actions=[
                    "sagemaker:DescribeTrainingJob",
                    "sagemaker:StopTrainingJob",
                    "sagemaker:AddTags",
                    "sagemaker:ListTags",
                ],
                resources=[TRAINING_JOBS_ARN],
            )
        )
        role.add_to_policy(
            iam.PolicyStatement(
                sid="RunProcessingJobs",
                actions=[
                    "sagemaker:CreateProcessingJob",
                    "sagemaker:DescribeProcessingJob",
                    "sagemaker:StopProcessingJob",
                    "sagemaker:AddTags",
                    "sagemaker:ListTags",
                ],
                resources=[PROCESSING_JOBS_ARN],
            )
        )
        role.add_to_policy(
            iam.PolicyStatement(
                sid="CreateTuningJobs", actions=["sagemaker:CreateHyperParameterTuningJob"],
                resources=[TUNING_JOBS_ARN], conditions=tuning_bounds,
            )
        )  # fmt: skip
        role.add_to_policy(
            iam.PolicyStatement(
                sid="RunTuningJobs",
                actions=[
                    "sagemaker:DescribeHyperParameterTuningJob",
                    "sagemaker:StopHyperParameterTuningJob",
                    "sagemaker:AddTags",
                    "sagemaker:ListTags",
                ],
                resources=[TUNING_JOBS_ARN],
            )
        )
        role.add_to_policy(
            iam.PolicyStatement(
                sid="SyncIntegrationRules",
                actions=["events:PutTargets", "events:PutRule", "events:DescribeRule"],
                resources=[f"arn:{Aws.PARTITION}:events:{Aws.REGION}:{Aws.ACCOUNT_ID}:rule/{r}" for r in SYNC_RULES],
            )
        )
        return role
