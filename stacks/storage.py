"""S3: the data bucket (manifests in, reports out), the artifacts bucket (job output, checkpoints), access logs.

Encryption is SSE-S3 on all three, by choice: the buckets hold datasets, tokenized shards, checkpoints of randomly
initialised or public models and benchmark numbers, no secrets; access is controlled by IAM and the bucket
policies. SSE-KMS would add a KMS request per object to every multi-GB shard read and checkpoint write of every
training job and couple the SageMaker role to a key policy, for no confidentiality gain here. (Server access log
targets support SSE-S3 only anyway.)
"""

from __future__ import annotations

from aws_cdk import Duration, RemovalPolicy
from aws_cdk import aws_s3 as s3
from constructs import Construct

# The buckets' key prefixes are gpuscout.domain.names's, shared with the code that writes the keys.
from gpuscout.domain.names import CHECKPOINTS_PREFIX, PLANS_PREFIX

REDRIVE_WINDOW_DAYS = 14  # Step Functions redrives an execution up to 14 days after it ended


def plans_expiry_days(execution_timeout_hours: int) -> int:
    """A run's request lists are read while its execution runs and again if it is redriven: kept a day longer."""
    return -(-execution_timeout_hours // 24) + REDRIVE_WINDOW_DAYS + 1


class Storage(Construct):
    """Three buckets, all private, versioned, encrypted, TLS-only; the two working buckets log to the third."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        removal_policy: RemovalPolicy,
        checkpoint_expiry_days: int,
        execution_timeout_hours: int,
    ) -> None:
        super().__init__(scope, construct_id)
        destroy = removal_policy == RemovalPolicy.DESTROY
        common = {
            "encryption": s3.BucketEncryption.S3_MANAGED,
            "enforce_ssl": True,
            "block_public_access": s3.BlockPublicAccess.BLOCK_ALL,
            "object_ownership": s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            "versioned": True,
            "removal_policy": removal_policy,
            "auto_delete_objects": destroy,
        }
        self.access_logs = s3.Bucket(
            self,
            "AccessLogs",
            # Server access log delivery needs ACL-free ownership and SSE-S3; keep logs a year.
            lifecycle_rules=[
                s3.LifecycleRule(
                    id="expire-access-logs",
                    expiration=Duration.days(365),
                    noncurrent_version_expiration=Duration.days(30),
                )
            ],
            **common,  # type: ignore[arg-type]
        )
        self.data = s3.Bucket(
            self,
            "Data",
            server_access_logs_bucket=self.access_logs,
            server_access_logs_prefix="data/",
            # Object Created events for manifests/ reach EventBridge (see events.py). Enabled on the CfnBucket
            # below instead of event_bridge_enabled=True, which would add a custom-resource Lambda for nothing.
            lifecycle_rules=[
                s3.LifecycleRule(
                    id="expire-plans",
                    prefix=PLANS_PREFIX,
                    expiration=Duration.days(plans_expiry_days(execution_timeout_hours)),
                    noncurrent_version_expiration=Duration.days(1),
                ),
                s3.LifecycleRule(id="expire-noncurrent-versions", noncurrent_version_expiration=Duration.days(30)),
                s3.LifecycleRule(
                    id="abort-incomplete-uploads", abort_incomplete_multipart_upload_after=Duration.days(7)
                ),
            ],
            **common,  # type: ignore[arg-type]
        )
        cfn_data = self.data.node.default_child
        assert isinstance(cfn_data, s3.CfnBucket)
        cfn_data.notification_configuration = s3.CfnBucket.NotificationConfigurationProperty(
            event_bridge_configuration=s3.CfnBucket.EventBridgeConfigurationProperty(event_bridge_enabled=True)
        )
        self.artifacts = s3.Bucket(
            self,
            "Artifacts",
            server_access_logs_bucket=self.access_logs,
            server_access_logs_prefix="artifacts/",
            lifecycle_rules=[
                # Checkpoints only serve resumption after a spot interruption; they are dead weight afterwards.
                s3.LifecycleRule(
                    id="expire-checkpoints",
                    prefix=CHECKPOINTS_PREFIX,
                    expiration=Duration.days(checkpoint_expiry_days),
                    noncurrent_version_expiration=Duration.days(1),
                ),
                s3.LifecycleRule(
                    id="expire-plans",
                    prefix=PLANS_PREFIX,
                    expiration=Duration.days(plans_expiry_days(execution_timeout_hours)),
                    noncurrent_version_expiration=Duration.days(1),
                ),
                s3.LifecycleRule(id="expire-noncurrent-versions", noncurrent_version_expiration=Duration.days(30)),
                s3.LifecycleRule(
                    id="abort-incomplete-uploads", abort_incomplete_multipart_upload_after=Duration.days(7)
                ),
            ],
            **common,  # type: ignore[arg-type]
        )
