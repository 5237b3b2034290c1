"""cdk-nag (no unacknowledged finding, every acknowledgment explained), cfn-lint, and the config model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import pytest
from cfnlint.api import ManualArgs, lint

import app as cdk_app
from gpuscout.domain.catalog import load_catalog
from stacks.config import ConfigError, load_config
from tests.infra.conftest import Synthesized

GENERIC_REASONS = {"needed", "required", "ok", "fine", "by design", "n/a", "todo", "false positive"}


def _acknowledgments(synthesized: Synthesized) -> dict[str, dict[str, str]]:
    found: dict[str, dict[str, str]] = {}
    for construct in synthesized.stack.node.find_all():
        for entry in construct.node.metadata:
            if entry.type == cdk.Validations.ACKNOWLEDGED_RULES_METADATA_KEY:
                found.setdefault(construct.node.path, {}).update(entry.data)
    return found


def test_cdk_nag_reports_no_finding(synthesized: Synthesized) -> None:
    report = json.loads((synthesized.outdir / "validation-report.json").read_text())
    (aws_solutions,) = [r for r in report["pluginReports"] if r["pluginName"] == "AwsSolutions"]
    assert aws_solutions["conclusion"] == "success"
    assert aws_solutions["violations"] == []


def test_every_acknowledgment_has_a_specific_reason(synthesized: Synthesized) -> None:
    acknowledgments = _acknowledgments(synthesized)
    assert acknowledgments, "expected the stack's cdk-nag acknowledgments in construct metadata"
    rule_ids = [rule for rules in acknowledgments.values() for rule in rules]
    assert all(rule.startswith("AwsSolutions::AwsSolutions-") for rule in rule_ids)
    for path, rules in acknowledgments.items():
        for rule, reason in rules.items():
            assert len(reason) >= 40 and reason.strip().lower().rstrip(".") not in GENERIC_REASONS, (path, rule)
    # bulk wildcards are never acknowledged: each IAM5 acknowledgment names one resource or action
    assert all("[" in r for r in rule_ids if "IAM5" in r)
    star_resources = [(p, r) for p, rules in acknowledgments.items() for r in rules if r.endswith("[Resource::*]")]
    for path, rule in star_resources:
        reason = acknowledgments[path][rule]
        assert "no resource-level permissions" in reason or "do not support resource-level" in reason, path


def test_cfn_lint_reports_no_error(synthesized: Synthesized) -> None:
    template = (synthesized.outdir / f"{synthesized.stack.stack_name}.template.json").read_text()
    matches = lint(template, config=ManualArgs(regions=["us-east-1"]))
    errors = [f"{m.rule.id} {m.message} ({'/'.join(map(str, m.path))})" for m in matches if m.rule.id.startswith("E")]
    assert errors == []


PRIVATE_DLC = "763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.8.0-gpu-py312"


def _context(**overrides: Any) -> dict[str, Any]:
    return {"allowed_instance_types": ["ml.g5.8xlarge"], **overrides}


def test_config_defaults_and_cli_strings() -> None:
    config = load_config(
        _context(
            map_max_concurrency="8", vpc='{"subnet_ids": ["subnet-0123abcd"], "security_group_ids": ["sg-0123abcd"]}'
        )
    )
    assert config.map_max_concurrency == 8
    assert config.vpc is not None and config.vpc.subnet_ids == ("subnet-0123abcd",)
    assert config.removal_policy == "retain" and config.processing_instance_type == "ml.m5.xlarge"
    assert load_config({"allowed_instance_types": "ml.g5.8xlarge, ml.p5.48xlarge"}).allowed_instance_types == (
        "ml.g5.8xlarge",
        "ml.p5.48xlarge",
    )
    # CDK's own context keys are not ours to judge
    assert load_config(_context(**{"@aws-cdk/core:newStyleStackSynthesis": True, "aws:cdk:enable-path-metadata": True}))


@pytest.mark.parametrize(
    ("context", "message"),
    [
        (_context(map_max_concurrency=0), "map_max_concurrency"),
        (_context(allowed_instance_types=["g5.8xlarge"]), "allowed_instance_types"),
        (_context(removal_policy="delete"), "removal_policy"),
        (_context(notification_email="not-an-address"), "notification_email"),
        (_context(vpc={"subnet_ids": ["subnet-1"], "security_group_ids": ["sg-0123abcd"]}), "vpc.subnet_ids"),
        (_context(log_retention_days=10), "log_retention_days"),
        (_context(quota_wait_hours=96), "quota_wait_hours .96. exceeds execution_timeout_hours"),
        (_context(training_image_base=PRIVATE_DLC), "training_image_base"),
        (
            _context(
                training_image_base="public.ecr.aws/deep-learning-containers/pytorch:2.12-cu130-amzn2023-sagemaker"
            ),
            r"brings torch 2\.12, but the image installs torch 2\.13\.0",
        ),
        (
            _context(training_image_base="public.ecr.aws/deep-learning-containers/pytorch:2.13-cpu-amzn2023-sagemaker"),
            "is a CPU image",
        ),
        (_context(processing_instance_type="ml.p4d.24xlarge"), "cannot run SageMaker Processing jobs"),
        (_context(stack_name="1-bad_name"), "stack_name"),
        (_context(map_max_concurrency=40), "25,000-event execution history"),
        (_context(map_max_concurency=4), "did you mean 'map_max_concurrency'"),
        (_context(allowed_instance_types=[]), "allowed_instance_types"),
    ],
)
def test_config_errors_name_the_key(context: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(context)


def test_every_training_type_of_the_catalog_is_allowed_by_default() -> None:
    # Given the catalog the stack is synthesized with (whatever types configs/instances/ holds)
    catalog = load_catalog()
    training = tuple(t.instance_type for t in catalog if t.role == "training")
    assert training and "local" not in training
    # When cdk.json leaves allowed_instance_types null, or a -c override nulls or omits it
    for context in (
        cdk_app.cdk_json_context(),
        {},
        {"allowed_instance_types": None},
        {"allowed_instance_types": "null"},
    ):
        config = load_config(context)
        # Then every training type is allowed, and nothing else (processing types, local)
        assert config.allowed_instance_types == training, context
        config.check_catalog(training_types=catalog.training_types, known_types=catalog.types)
    assert cdk_app.cdk_json_context()["allowed_instance_types"] is None
    # A list still narrows it
    assert load_config(_context()).allowed_instance_types == ("ml.g5.8xlarge",)


def test_the_canary_instance_is_on_by_default_and_null_turns_it_off() -> None:
    assert load_config(_context()).canary_instance_type == "ml.g5.8xlarge"
    assert load_config(_context(canary_instance_type=None)).canary_instance_type is None
    assert load_config(_context(canary_instance_type="null")).canary_instance_type is None  # -c key=null
    config = load_config(_context(canary_instance_type="ml.zz.nano"))
    with pytest.raises(ConfigError, match="canary_instance_type"):
        config.check_catalog(training_types=["ml.g5.8xlarge"], known_types=["ml.g5.8xlarge", "ml.m5.xlarge"])


def test_config_must_match_the_catalog() -> None:
    config = load_config(_context(allowed_instance_types=["ml.g5.8xlarge", "ml.zz.nano"]))
    with pytest.raises(ConfigError, match=r"ml\.zz\.nano"):
        config.check_catalog(training_types=["ml.g5.8xlarge"], known_types=["ml.g5.8xlarge", "ml.m5.xlarge"])


@pytest.mark.slow(seconds=10)
def test_vpc_destroy_and_email_variant_synthesizes_cleanly(tmp_path_factory: pytest.TempPathFactory) -> None:
    outdir = tmp_path_factory.mktemp("cdk.out.variant")
    context = cdk_app.cdk_json_context() | {
        "removal_policy": "destroy",
        "notification_email": "ops@example.com",
        "vpc": {"subnet_ids": ["subnet-0123abcd"], "security_group_ids": ["sg-0123abcd"]},
        "mlflow_tracking_servers": "team,nightly",  # as `-c mlflow_tracking_servers=team,nightly` passes it
    }
    app, stack = cdk_app.build_app(cdk.App(outdir=str(outdir), context=context))
    app.synth()  # cdk-nag would fail it on any unacknowledged finding
    template = json.loads((outdir / f"{stack.stack_name}.template.json").read_text())
    resources = template["Resources"].values()
    (machine,) = [r for r in resources if r["Type"] == "AWS::StepFunctions::StateMachine"]
    definition = json.dumps(machine["Properties"]["DefinitionString"])
    assert (
        '\\"VpcConfig\\":{\\"Subnets\\":[\\"subnet-0123abcd\\"],\\"SecurityGroupIds\\":[\\"sg-0123abcd\\"]}'
        in definition
    )
    assert '\\"NetworkConfig\\":{\\"VpcConfig\\"' in definition
    (subscription,) = [r for r in resources if r["Type"] == "AWS::SNS::Subscription"]
    assert subscription["Properties"]["Endpoint"] == "ops@example.com"
    assert any(r["Type"] == "Custom::S3AutoDeleteObjects" for r in resources)
    assert all(
        r.get("DeletionPolicy") == "Delete"
        for r in resources
        if r["Type"] in {"AWS::S3::Bucket", "AWS::DynamoDB::Table"}
    )
    actions = {
        a
        for r in resources
        if r["Type"] == "AWS::IAM::Policy"
        for s in r["Properties"]["PolicyDocument"]["Statement"]
        for a in (s["Action"] if isinstance(s["Action"], list) else [s["Action"]])
    }
    assert "ec2:CreateNetworkInterface" in actions
    # the named MLflow tracking servers, and only they, are the jobs' tracking grant; the validation learns them
    # (the run roles' runtime policy grants it, and their boundary allows the same)
    tracking, within_boundary = [
        s
        for r in resources
        if r["Type"] in ("AWS::IAM::Policy", "AWS::IAM::ManagedPolicy")
        for s in r["Properties"]["PolicyDocument"]["Statement"]
        if s.get("Sid") == "ExperimentTracking"
    ]
    assert tracking == within_boundary
    granted = [json.dumps(arn) for arn in tracking["Resource"]]
    assert len(granted) == 2 and ":mlflow-tracking-server/team" in granted[0] and "/nightly" in granted[1]
    assert "*" not in "".join(granted)
    functions = [r["Properties"] for r in resources if r["Type"] == "AWS::Lambda::Function"]
    environments = [f["Environment"]["Variables"] for f in functions if "Environment" in f]
    assert {env.get("MLFLOW_TRACKING_SERVERS") for env in environments if "TABLE_NAME" in env} == {"team,nightly"}


@pytest.mark.parametrize(
    ("servers", "message"),
    [
        (["arn:aws:sagemaker:us-east-1:123456789012:mlflow-tracking-server/team"], "the name, not the ARN"),
        (["team", "team"], "more than once"),
        (["-team"], "not MLflow tracking server names"),
    ],
)
def test_tracking_servers_must_be_names(servers: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(_context(mlflow_tracking_servers=servers))


def test_a_configured_image_base_becomes_the_dockerfile_build_arg(tmp_path: Path) -> None:
    from stacks.training_image import TrainingImage

    # Given context training_image_base (a public ECR image), When the image asset synthesizes
    base = "public.ecr.aws/deep-learning-containers/pytorch:2.13-cu133-amzn2023-sagemaker"  # a floating tag, same torch
    assert load_config(_context(training_image_base=base)).training_image_base == base
    app = cdk.App(outdir=str(tmp_path))
    TrainingImage(cdk.Stack(app, "ImageOnly"), "Image", base_image=base)
    assembly = app.synth()
    # Then docker builds with BASE_IMAGE set to it (and with no build args by default: the Dockerfile's own)
    (spec,) = json.loads(Path(assembly.directory, "ImageOnly.assets.json").read_text())["dockerImages"].values()
    assert spec["source"]["dockerBuildArgs"] == {"BASE_IMAGE": base}


def test_the_default_image_has_no_build_args(synthesized: Synthesized) -> None:
    assets = json.loads((synthesized.outdir / f"{synthesized.stack.stack_name}.assets.json").read_text())
    (spec,) = assets["dockerImages"].values()
    assert "dockerBuildArgs" not in spec["source"]


def test_a_second_stack_gets_its_own_name(tmp_path: Path) -> None:
    # Given context stack_name (one deployment per name, several per account and region)
    context = cdk_app.cdk_json_context() | {"stack_name": "GpuscoutTeamB"}
    _, stack = cdk_app.build_app(cdk.App(outdir=str(tmp_path), context=context))
    # Then the stack is named so (no resource has a fixed physical name to collide with the first stack's)
    assert stack.stack_name == "GpuscoutTeamB"
    assert load_config(cdk_app.cdk_json_context()).stack_name == cdk_app.STACK_NAME == "Gpuscout"


def test_the_quota_retry_interval_is_the_workflows() -> None:
    from stacks import config, workflow

    assert config.QUOTA_RETRY_MINUTES == workflow.QUOTA_RETRY_MINUTES
    assert load_config(_context()).map_max_concurrency == 4  # the default passes the history check
