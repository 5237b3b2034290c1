"""The SNS topic for alarms and finished runs, encrypted with a customer-managed key CloudWatch may use."""

from __future__ import annotations

from aws_cdk import Aws, Duration, RemovalPolicy
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subscriptions
from constructs import Construct


class Notifications(Construct):
    """`topic` (+ `key`); an e-mail subscription when an address is configured."""

    def __init__(
        self, scope: Construct, construct_id: str, *, email: str | None, removal_policy: RemovalPolicy
    ) -> None:
        super().__init__(scope, construct_id)
        # SNS's AWS managed key cannot be used by CloudWatch alarms, so the topic gets its own key.
        self.key = kms.Key(
            self,
            "Key",
            description="gpuscout notifications topic",
            enable_key_rotation=True,
            pending_window=Duration.days(7),
            removal_policy=removal_policy,
        )
        # Only this account's alarms may use the key (confused-deputy protection; CloudWatch passes the alarm as
        # aws:SourceArn when it publishes to an encrypted topic, as it does for sns:Publish below).
        alarms = {
            "StringEquals": {"aws:SourceAccount": Aws.ACCOUNT_ID},
            "ArnLike": {"aws:SourceArn": f"arn:{Aws.PARTITION}:cloudwatch:{Aws.REGION}:{Aws.ACCOUNT_ID}:alarm:*"},
        }
        self.key.add_to_resource_policy(
            iam.PolicyStatement(
                sid="CloudWatchAlarmsUseKey",
                principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
                actions=["kms:Decrypt", "kms:GenerateDataKey*"],
                resources=["*"],  # in a key policy, "*" is this key
                conditions=alarms,
            )
        )
        self.topic = sns.Topic(self, "Topic", display_name="gpuscout", master_key=self.key, enforce_ssl=True)
        # enforce_ssl gives the topic a resource policy, which replaces SNS's default one: without this Allow,
        # CloudWatch alarms (a service principal, no identity policy) could not publish. Only this account's alarms.
        self.topic.add_to_resource_policy(
            iam.PolicyStatement(
                sid="CloudWatchAlarmsPublish",
                principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
                actions=["sns:Publish"],
                resources=[self.topic.topic_arn],
                conditions=alarms,
            )
        )
        if email:
            self.topic.add_subscription(subscriptions.EmailSubscription(email))
