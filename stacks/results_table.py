"""DynamoDB single table for runs, jobs and results (keys and indexes: docs/internals.md, Cloud contract).

The shape must equal gpuscout.store.dynamodb.table_definition(), which the store's tests create in moto;
tests/infra compares the two.
"""

from __future__ import annotations

from aws_cdk import RemovalPolicy
from aws_cdk import aws_dynamodb as dynamodb
from constructs import Construct

RUNS_INDEX = "gsi1"  # gsi1pk="RUNS", gsi1sk=<created_at>#<run_id>: runs newest first (projects everything)
JOB_INDEX = "gsi2"  # gsi2pk="JOB#<job_name>": a job's run from a SageMaker event (keys suffice)


class ResultsTable(Construct):
    """On-demand, point-in-time recovery, encrypted with the AWS managed key (key use visible in CloudTrail)."""

    def __init__(self, scope: Construct, construct_id: str, *, removal_policy: RemovalPolicy) -> None:
        super().__init__(scope, construct_id)
        string = dynamodb.AttributeType.STRING
        self.table = dynamodb.Table(
            self,
            "Table",
            partition_key=dynamodb.Attribute(name="pk", type=string),
            sort_key=dynamodb.Attribute(name="sk", type=string),
            billing_mode=dynamodb.BillingMode.PAY_PER_REQUEST,
            encryption=dynamodb.TableEncryption.AWS_MANAGED,
            point_in_time_recovery_specification=dynamodb.PointInTimeRecoverySpecification(
                point_in_time_recovery_enabled=True
            ),
            deletion_protection=removal_policy == RemovalPolicy.RETAIN,
            removal_policy=removal_policy,
        )
        self.table.add_global_secondary_index(
            index_name=RUNS_INDEX,
            partition_key=dynamodb.Attribute(name="gsi1pk", type=string),
            sort_key=dynamodb.Attribute(name="gsi1sk", type=string),
            projection_type=dynamodb.ProjectionType.ALL,
        )
        self.table.add_global_secondary_index(
            index_name=JOB_INDEX,
            partition_key=dynamodb.Attribute(name="gsi2pk", type=string),
            projection_type=dynamodb.ProjectionType.KEYS_ONLY,
        )
