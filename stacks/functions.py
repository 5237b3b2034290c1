"""The Lambda functions: one per lambdas/<name>/handler.py, sharing one dependency layer.

Bundling is local (no Docker): each function's asset is gpuscout/ + configs/ + lambdas/<name>/ copied as-is, so
imports inside the Lambda match the repository (handler ``lambdas.<name>.handler.handler``). Third-party packages
(lambdas/requirements.txt) go into one LayerVersion, installed by pip for the Lambda platform (manylinux, arm64,
CPython 3.12) under constraints.txt (every indirect dependency at the tests' version) and cached under
build/lambda-layer/<hash> so repeated synths reuse it.

Powertools is installed from PyPI into that layer rather than taken from AWS's public Powertools layer: the pin
then equals requirements.txt (the version the tests ran), one layer serves every dependency (pydantic, PyYAML,
matplotlib need a layer anyway), and the stack needs no cross-account layer ARN that differs per region.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsii
from aws_cdk import AssetHashType, BundlingOptions, DockerImage, Duration, ILocalBundling, RemovalPolicy
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sqs as sqs
from constructs import Construct

REPO_DIR = Path(__file__).resolve().parent.parent
LAMBDAS_DIR = REPO_DIR / "lambdas"
REQUIREMENTS = LAMBDAS_DIR / "requirements.txt"
# Every indirect dependency at the version the tests ran (make lock writes it): without it the layer took the index's
# newest of the day for what requirements.txt does not pin (contourpy 1.4.0 against the tests' 1.3.3, once)
CONSTRAINTS = REPO_DIR / "constraints.txt"
LAYER_CACHE_DIR = REPO_DIR / "build" / "lambda-layer"
# Copied into every function bundle beside lambdas/<name>/ (gpuscout.paths finds configs/ next to gpuscout/).
SHARED_SOURCE_DIRS = ("gpuscout", "configs")
PYTHON_VERSION = "3.12"
RUNTIME = lambda_.Runtime.PYTHON_3_12
# Graviton: about 20 % cheaper per GB-second, and every dependency ships manylinux aarch64 wheels.
ARCHITECTURE = lambda_.Architecture.ARM_64
PIP_PLATFORMS = ("manylinux2014_aarch64", "manylinux_2_28_aarch64")
# Never used: local bundling always succeeds or raises. CDK requires an image in BundlingOptions.
_UNUSED_BUNDLING_IMAGE = DockerImage.from_registry("public.ecr.aws/sam/build-python3.12")
_SKIP_NAMES = {"__pycache__", ".pytest_cache", ".mypy_cache"}


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    description: str
    memory_mb: int = 512
    timeout_minutes: int = 1
    invoked_async: bool = False  # EventBridge -> Lambda: give the function its own DLQ


FUNCTION_SPECS = (
    FunctionSpec("validate_manifest", "Parse and validate a submitted manifest; reject with every problem listed"),
    FunctionSpec(
        "plan_jobs",
        "Expand a manifest into priced SageMaker job requests; refuse over budget",
        timeout_minutes=2,
    ),
    FunctionSpec(
        "run_role",
        "Create a run's own SageMaker role before its first job (its output and checkpoints only); delete it after",
    ),
    FunctionSpec("record_job_failure", "Classify a failed job (capacity, quota, failure) into its JOB row"),
    FunctionSpec(
        "record_job_result",
        "Record a finished training job's status, timings and benchmark before the run is analyzed",
        timeout_minutes=2,
    ),
    FunctionSpec(
        "job_events",
        "Record SageMaker training job state changes and metrics; emit throughput metrics",
        timeout_minutes=2,
        invoked_async=True,
    ),
    FunctionSpec(
        "mark_run_failed",
        "Mark the run of a failed, timed-out or aborted workflow execution FAILED (Catch and EventBridge)",
        invoked_async=True,
    ),
    FunctionSpec(
        "budget_guard",
        "Every few minutes: project running runs' spend and stop the jobs of a run over its budget",
        timeout_minutes=2,
        invoked_async=True,
    ),
    FunctionSpec(
        "analyze_run",
        "Cost analysis, ranking, recommendation and report of a finished run",
        memory_mb=2048,
        timeout_minutes=10,
    ),
)
FUNCTION_NAMES = tuple(spec.name for spec in FUNCTION_SPECS)

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


def _source_files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*")):
        if path.is_file() and not (_SKIP_NAMES & set(path.relative_to(root).parts)) and path.suffix != ".pyc":
            yield path


def _bundle_sources(name: str) -> list[tuple[Path, Path]]:
    """(source file, path inside the bundle) for one function."""
    pairs = [(f, f.relative_to(REPO_DIR)) for d in SHARED_SOURCE_DIRS for f in _source_files(REPO_DIR / d)]
    pairs += [(f, f.relative_to(REPO_DIR)) for f in _source_files(LAMBDAS_DIR / name)]
    if (LAMBDAS_DIR / "__init__.py").is_file():
        pairs.append((LAMBDAS_DIR / "__init__.py", Path("lambdas/__init__.py")))
    return pairs


def function_source_hash(name: str) -> str:
    """Content hash of one function's bundle; the asset changes exactly when a bundled file changes."""
    digest = hashlib.sha256()
    for source, target in _bundle_sources(name):
        digest.update(str(target).encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()


def layer_hash() -> str:
    """Hash of what determines the layer's contents: requirements, constraints, target platform, Python version."""
    digest = hashlib.sha256(REQUIREMENTS.read_bytes() + b"\0" + CONSTRAINTS.read_bytes())
    digest.update(f"{PYTHON_VERSION}|{'|'.join(PIP_PLATFORMS)}".encode())
    return digest.hexdigest()


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system (e.g. a temporary cdk.out): copy instead
        shutil.copy2(source, target)


def build_layer_cache() -> Path:
    """build/lambda-layer/<hash>/python, installed once; concurrent builders race harmlessly (atomic rename)."""
    cached = LAYER_CACHE_DIR / layer_hash()
    if (cached / "python").is_dir():
        return cached
    LAYER_CACHE_DIR.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="building-", dir=LAYER_CACHE_DIR))
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile"]
    for platform in PIP_PLATFORMS:
        command += ["--platform", platform]
    command += ["--implementation", "cp", "--python-version", PYTHON_VERSION, "--only-binary=:all:"]
    command += ["--target", str(staging / "python"), "-r", str(REQUIREMENTS), "-c", str(CONSTRAINTS)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(
            f"pip could not install {REQUIREMENTS} for the Lambda platform ({PIP_PLATFORMS[0]}, Python "
            f"{PYTHON_VERSION}); PyPI must be reachable the first time:\n{result.stderr[-4000:]}"
        )
    try:
        staging.rename(cached)
    except OSError:  # another process finished first; its copy is identical
        shutil.rmtree(staging, ignore_errors=True)
    return cached


@jsii.implements(ILocalBundling)
class _FunctionSources:
    """Local bundling of one function: copy its sources into the asset folder."""

    def __init__(self, name: str) -> None:
        self._name = name

    def try_bundle(self, output_dir: str, *_options: Any, **_kw_options: Any) -> bool:
        out = Path(output_dir)
        for source, target in _bundle_sources(self._name):
            (out / target).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, out / target)
        return True


@jsii.implements(ILocalBundling)
class _LayerPackages:
    """Local bundling of the dependency layer: the cached pip install, linked (or copied) into python/."""

    def try_bundle(self, output_dir: str, *_options: Any, **_kw_options: Any) -> bool:
        cached = build_layer_cache()
        shutil.copytree(cached / "python", Path(output_dir) / "python", copy_function=_link_or_copy, dirs_exist_ok=True)
        return True


class Functions(Construct):
    """`functions[name]` for every FUNCTION_SPECS entry, plus `layer`, `log_groups` and `dead_letter_queue`."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        roles: Mapping[str, iam.Role],
        environment: Mapping[str, str],
        log_retention: logs.RetentionDays,
        removal_policy: RemovalPolicy,
    ) -> None:
        super().__init__(scope, construct_id)
        missing = [s.name for s in FUNCTION_SPECS if not (LAMBDAS_DIR / s.name / "handler.py").is_file()]
        if missing:
            raise FileNotFoundError(f"no handler.py for Lambda function(s) {missing} under {LAMBDAS_DIR}")
        self.layer = lambda_.LayerVersion(
            self,
            "Dependencies",
            code=lambda_.Code.from_asset(
                str(LAMBDAS_DIR),
                asset_hash=layer_hash(),
                asset_hash_type=AssetHashType.CUSTOM,
                bundling=BundlingOptions(image=_UNUSED_BUNDLING_IMAGE, local=_LayerPackages()),
            ),
            compatible_runtimes=[RUNTIME],
            compatible_architectures=[ARCHITECTURE],
            description=f"gpuscout Lambda dependencies ({REQUIREMENTS.relative_to(REPO_DIR)})",
            removal_policy=removal_policy,
        )
        # Async invocations (EventBridge -> job_events, mark_run_failed, budget_guard) that fail after Lambda's
        # retries land here.
        self.dead_letter_queue = sqs.Queue(
            self,
            "AsyncDeadLetters",
            encryption=sqs.QueueEncryption.SQS_MANAGED,
            enforce_ssl=True,
            retention_period=Duration.days(14),
            removal_policy=removal_policy,
        )
        self.functions: dict[str, lambda_.Function] = {}
        self.log_groups: dict[str, logs.LogGroup] = {}
        for spec in FUNCTION_SPECS:
            log_group = logs.LogGroup(self, f"{spec.name}-logs", retention=log_retention, removal_policy=removal_policy)
            role = roles[spec.name]
            function = lambda_.Function(
                self,
                spec.name,
                description=spec.description,
                runtime=RUNTIME,
                architecture=ARCHITECTURE,
                handler=f"lambdas.{spec.name}.handler.handler",
                code=lambda_.Code.from_asset(
                    str(LAMBDAS_DIR / spec.name),
                    asset_hash=function_source_hash(spec.name),
                    asset_hash_type=AssetHashType.CUSTOM,
                    bundling=BundlingOptions(image=_UNUSED_BUNDLING_IMAGE, local=_FunctionSources(spec.name)),
                ),
                layers=[self.layer],
                role=role,
                memory_size=spec.memory_mb,
                timeout=Duration.minutes(spec.timeout_minutes),
                environment=dict(environment),
                tracing=lambda_.Tracing.ACTIVE,
                log_group=log_group,
                logging_format=lambda_.LoggingFormat.JSON,
                dead_letter_queue=self.dead_letter_queue if spec.invoked_async else None,
                retry_attempts=2 if spec.invoked_async else None,
            )
            log_group.grant_write(role)
            self.functions[spec.name] = function
            self.log_groups[spec.name] = log_group
