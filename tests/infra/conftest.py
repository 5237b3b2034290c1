"""One synthesized app per test session (jsii is slow): the template, the stack and the cloud assembly folder."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")

import aws_cdk as cdk
from aws_cdk.assertions import Template

import app as cdk_app
from stacks.gpuscout_stack import GpuscoutStack


@dataclass(frozen=True)
class Synthesized:
    app: cdk.App
    stack: GpuscoutStack
    outdir: Path
    template_json: dict[str, Any]
    template: Template

    def resources(self, resource_type: str) -> dict[str, dict[str, Any]]:
        return {k: v for k, v in self.template_json["Resources"].items() if v["Type"] == resource_type}

    def one(self, resource_type: str) -> dict[str, Any]:
        found = list(self.resources(resource_type).values())
        assert len(found) == 1, f"expected one {resource_type}, found {len(found)}"
        return found[0]

    def logical_id(self, construct: Any) -> str:
        return str(self.stack.get_logical_id(construct.node.default_child))


@pytest.fixture(scope="session")
def synthesized(tmp_path_factory: pytest.TempPathFactory) -> Synthesized:
    outdir = tmp_path_factory.mktemp("cdk.out")
    app = cdk.App(outdir=str(outdir), context=cdk_app.cdk_json_context())
    app, stack = cdk_app.build_app(app)
    app.synth()  # raises when cdk-nag reports an unacknowledged finding
    template_json = json.loads((outdir / f"{stack.stack_name}.template.json").read_text())
    return Synthesized(app, stack, outdir, template_json, Template.from_json(template_json))


def state_machine_definition(synthesized: Synthesized) -> dict[str, Any]:
    """The state machine's ASL with CloudFormation references replaced by placeholders: '<LogicalId.Attr>' for
    Fn::GetAtt, '<LogicalId>' for Ref."""
    machine = synthesized.one("AWS::StepFunctions::StateMachine")
    parts = machine["Properties"]["DefinitionString"]["Fn::Join"][1]

    def placeholder(part: str | dict[str, Any]) -> str:
        if isinstance(part, str):
            return part
        if "Ref" in part:
            return f"<{part['Ref']}>"
        return "<{}.{}>".format(*part["Fn::GetAtt"])

    text = "".join(placeholder(p) for p in parts)
    definition: dict[str, Any] = json.loads(text)
    return definition


def policy_statements(synthesized: Synthesized, role_construct: Any) -> list[dict[str, Any]]:
    """Every statement of every AWS::IAM::Policy attached to the role."""
    role_id = synthesized.logical_id(role_construct)
    statements: list[dict[str, Any]] = []
    for policy in synthesized.resources("AWS::IAM::Policy").values():
        if {"Ref": role_id} in policy["Properties"].get("Roles", []):
            statements += policy["Properties"]["PolicyDocument"]["Statement"]
    return statements


def managed_policy_statements(synthesized: Synthesized, policy_construct: Any) -> list[dict[str, Any]]:
    """The statements of one AWS::IAM::ManagedPolicy (the run roles' runtime policy or boundary)."""
    policy = synthesized.template_json["Resources"][synthesized.logical_id(policy_construct)]
    assert policy["Type"] == "AWS::IAM::ManagedPolicy"
    return list(policy["Properties"]["PolicyDocument"]["Statement"])


def every_policy_document(synthesized: Synthesized) -> list[tuple[str, dict[str, Any]]]:
    """(logical id, properties) of every identity policy in the template: inline AWS::IAM::Policy and managed."""
    return [
        (logical_id, resource["Properties"])
        for kind in ("AWS::IAM::Policy", "AWS::IAM::ManagedPolicy")
        for logical_id, resource in synthesized.resources(kind).items()
    ]


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]
