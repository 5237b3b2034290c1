#!/usr/bin/env python3
"""CDK entry point: validate cdk.json context, build the gpuscout stack, run cdk-nag (AWS Solutions) on it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import aws_cdk as cdk
from cdk_nag import AwsSolutionsChecks

from gpuscout.domain.catalog import load_catalog
from stacks.config import ConfigError, load_config
from stacks.gpuscout_stack import GpuscoutStack

STACK_NAME = "Gpuscout"  # the default; context stack_name overrides it
CDK_JSON = Path(__file__).resolve().parent / "cdk.json"


def cdk_json_context() -> dict[str, Any]:
    """The context block of cdk.json (the CLI passes it to the app; tests building an App pass it themselves)."""
    context: dict[str, Any] = json.loads(CDK_JSON.read_text())["context"]
    return context


def build_app(app: cdk.App | None = None) -> tuple[cdk.App, GpuscoutStack]:
    """The app with the stack and the cdk-nag plugin (tests call this with their own App)."""
    app = app or cdk.App()
    config = load_config(app.node.get_all_context())
    catalog = load_catalog()
    config.check_catalog(training_types=catalog.training_types, known_types=catalog.types)
    # Account and region come from the CLI's credentials/profile; unset, the stack stays environment-agnostic.
    account, region = os.environ.get("CDK_DEFAULT_ACCOUNT"), os.environ.get("CDK_DEFAULT_REGION")
    env = cdk.Environment(account=account, region=region) if account or region else None
    stack = GpuscoutStack(app, config.stack_name, config=config, env=env)
    cdk.Tags.of(stack).add("project", "gpuscout")
    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    return app, stack


def main() -> None:
    try:
        app, _ = build_app()
    except ConfigError as err:
        sys.exit(str(err))
    app.synth()


if __name__ == "__main__":
    main()
