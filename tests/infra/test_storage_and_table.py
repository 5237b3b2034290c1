"""Buckets (encryption, versioning, public access, TLS-only, logging, lifecycle) and the results table."""

from __future__ import annotations

import json
from typing import Any

from gpuscout.store.dynamodb import table_definition
from tests.infra.conftest import Synthesized


def _bucket(synthesized: Synthesized, construct: Any) -> dict[str, Any]:
    return synthesized.template_json["Resources"][synthesized.logical_id(construct)]["Properties"]


def _buckets(synthesized: Synthesized) -> dict[str, Any]:
    storage = synthesized.stack.storage
    return {"data": storage.data, "artifacts": storage.artifacts, "access_logs": storage.access_logs}


def test_three_buckets_all_private_versioned_encrypted(synthesized: Synthesized) -> None:
    assert len(synthesized.resources("AWS::S3::Bucket")) == 3
    for name, bucket in _buckets(synthesized).items():
        props = _bucket(synthesized, bucket)
        assert props["VersioningConfiguration"] == {"Status": "Enabled"}, name
        assert props["PublicAccessBlockConfiguration"] == {
            "BlockPublicAcls": True,
            "BlockPublicPolicy": True,
            "IgnorePublicAcls": True,
            "RestrictPublicBuckets": True,
        }, name
        encryption = props["BucketEncryption"]["ServerSideEncryptionConfiguration"]
        assert encryption == [{"ServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}], name
        assert props["OwnershipControls"]["Rules"] == [{"ObjectOwnership": "BucketOwnerEnforced"}], name


def test_every_bucket_denies_plain_http(synthesized: Synthesized) -> None:
    policies = synthesized.resources("AWS::S3::BucketPolicy").values()
    for name, bucket in _buckets(synthesized).items():
        ref = {"Ref": synthesized.logical_id(bucket)}
        (policy,) = [p for p in policies if p["Properties"]["Bucket"] == ref]
        denies = [
            s
            for s in policy["Properties"]["PolicyDocument"]["Statement"]
            if s["Effect"] == "Deny" and s.get("Condition") == {"Bool": {"aws:SecureTransport": "false"}}
        ]
        assert denies and denies[0]["Action"] == "s3:*" and denies[0]["Principal"] == {"AWS": "*"}, name


def test_working_buckets_log_to_the_log_bucket(synthesized: Synthesized) -> None:
    log_bucket = {"Ref": synthesized.logical_id(synthesized.stack.storage.access_logs)}
    storage = synthesized.stack.storage
    for bucket, prefix in ((storage.data, "data/"), (storage.artifacts, "artifacts/")):
        logging = _bucket(synthesized, bucket)["LoggingConfiguration"]
        assert logging == {"DestinationBucketName": log_bucket, "LogFilePrefix": prefix}
    assert "LoggingConfiguration" not in _bucket(synthesized, storage.access_logs)


def test_data_bucket_sends_events_to_eventbridge_without_custom_resource(synthesized: Synthesized) -> None:
    props = _bucket(synthesized, synthesized.stack.storage.data)
    assert props["NotificationConfiguration"] == {"EventBridgeConfiguration": {"EventBridgeEnabled": True}}
    assert not synthesized.resources("Custom::S3BucketNotifications")


def test_the_plans_request_lists_expire_after_any_execution_and_its_redrive_window(synthesized: Synthesized) -> None:
    artifacts = synthesized.template_json["Resources"][synthesized.logical_id(synthesized.stack.storage.artifacts)]
    rules = artifacts["Properties"]["LifecycleConfiguration"]["Rules"]
    (plans,) = [r for r in rules if r["Id"] == "expire-plans"]
    assert plans["Prefix"] == "plans/" and plans["Status"] == "Enabled"
    # the execution timeout (72 hours here) plus Step Functions' 14-day redrive window, and a day
    assert synthesized.stack.config.execution_timeout_hours == 72
    assert plans["ExpirationInDays"] == 3 + 14 + 1


def test_checkpoints_expire(synthesized: Synthesized) -> None:
    rules = _bucket(synthesized, synthesized.stack.storage.artifacts)["LifecycleConfiguration"]["Rules"]
    (checkpoints,) = [r for r in rules if r["Id"] == "expire-checkpoints"]
    assert checkpoints["Prefix"] == "checkpoints/"
    assert checkpoints["Status"] == "Enabled"
    assert checkpoints["ExpirationInDays"] == synthesized.stack.config.checkpoint_expiry_days == 14


def test_buckets_and_table_are_retained_by_default(synthesized: Synthesized) -> None:
    for bucket in _buckets(synthesized).values():
        resource = synthesized.template_json["Resources"][synthesized.logical_id(bucket)]
        assert resource["DeletionPolicy"] == "Retain"
    table = synthesized.one("AWS::DynamoDB::Table")
    assert table["DeletionPolicy"] == "Retain"
    assert table["Properties"]["DeletionProtectionEnabled"] is True


def test_table_keys_and_indexes_match_the_store(synthesized: Synthesized) -> None:
    props = synthesized.one("AWS::DynamoDB::Table")["Properties"]
    expected = table_definition("ignored")
    assert props["BillingMode"] == expected["BillingMode"] == "PAY_PER_REQUEST"
    assert props["KeySchema"] == expected["KeySchema"]
    assert sorted(props["AttributeDefinitions"], key=lambda a: a["AttributeName"]) == sorted(
        expected["AttributeDefinitions"], key=lambda a: a["AttributeName"]
    )
    indexes = {i["IndexName"]: i for i in props["GlobalSecondaryIndexes"]}
    assert set(indexes) == {"gsi1", "gsi2"}
    for index in expected["GlobalSecondaryIndexes"]:
        assert indexes[index["IndexName"]]["KeySchema"] == index["KeySchema"]
        assert indexes[index["IndexName"]]["Projection"] == index["Projection"]


def test_table_has_pitr_and_encryption(synthesized: Synthesized) -> None:
    synthesized.template.has_resource_properties(
        "AWS::DynamoDB::Table",
        {
            "PointInTimeRecoverySpecification": {"PointInTimeRecoveryEnabled": True},
            "SSESpecification": {"SSEEnabled": True},
        },
    )


def test_topic_is_encrypted_tls_only_and_cloudwatch_may_use_its_key(synthesized: Synthesized) -> None:
    notifications = synthesized.stack.notifications
    key_id = synthesized.logical_id(notifications.key)
    synthesized.template.has_resource_properties("AWS::SNS::Topic", {"KmsMasterKeyId": {"Fn::GetAtt": [key_id, "Arn"]}})
    synthesized.template.has_resource_properties("AWS::KMS::Key", {"EnableKeyRotation": True})
    key_statements = synthesized.template_json["Resources"][key_id]["Properties"]["KeyPolicy"]["Statement"]
    # CloudWatch may use the key only for this account's alarms (confused-deputy conditions, as on the topic)
    (use_key,) = [s for s in key_statements if s["Principal"] == {"Service": "cloudwatch.amazonaws.com"}]
    assert set(use_key["Action"]) == {"kms:Decrypt", "kms:GenerateDataKey*"}
    assert use_key["Condition"]["StringEquals"] == {"aws:SourceAccount": {"Ref": "AWS::AccountId"}}
    assert ":alarm:*" in json.dumps(use_key["Condition"]["ArnLike"]["aws:SourceArn"])
    topic_policy = synthesized.one("AWS::SNS::TopicPolicy")["Properties"]["PolicyDocument"]["Statement"]
    assert any(
        s["Effect"] == "Deny" and s.get("Condition") == {"Bool": {"aws:SecureTransport": "false"}} for s in topic_policy
    )
    # the resource policy replaces SNS's default one: CloudWatch alarms need their own Allow, for this account only
    (allow,) = [st for st in topic_policy if st["Effect"] == "Allow"]
    assert allow["Principal"] == {"Service": "cloudwatch.amazonaws.com"} and allow["Action"] == "sns:Publish"
    assert set(allow["Condition"]) == {"StringEquals", "ArnLike"}
    assert allow["Condition"]["StringEquals"] == {"aws:SourceAccount": {"Ref": "AWS::AccountId"}}
    # no address configured in cdk.json: no subscription
    assert not synthesized.resources("AWS::SNS::Subscription")


def test_training_image_asset_uses_the_training_dockerfile_and_a_narrow_context(synthesized: Synthesized) -> None:
    assets = (synthesized.outdir / f"{synthesized.stack.stack_name}.assets.json").read_text()
    images = json.loads(assets)["dockerImages"]
    (image,) = images.values()
    assert image["source"]["dockerFile"] == "training/Dockerfile"
    context = synthesized.outdir / image["source"]["directory"]
    top_level = {p.name for p in context.iterdir()}
    assert top_level <= {"gpuscout", "configs", "training", ".dockerignore"}, top_level
    assert {"gpuscout", "configs", "training"} <= top_level
    assert not list(context.rglob("__pycache__"))


def test_dlqs_are_encrypted_and_tls_only(synthesized: Synthesized) -> None:
    queues = synthesized.resources("AWS::SQS::Queue")
    assert len(queues) == 5  # one per EventBridge target (4) and the functions' async DLQ
    for queue in queues.values():
        assert queue["Properties"]["SqsManagedSseEnabled"] is True
        assert queue["Properties"]["MessageRetentionPeriod"] == 14 * 24 * 3600
    for policy in synthesized.resources("AWS::SQS::QueuePolicy").values():
        statements = policy["Properties"]["PolicyDocument"]["Statement"]
        assert any(
            s["Effect"] == "Deny" and s.get("Condition") == {"Bool": {"aws:SecureTransport": "false"}}
            for s in statements
        )
    assert len(synthesized.resources("AWS::SQS::QueuePolicy")) == 5
