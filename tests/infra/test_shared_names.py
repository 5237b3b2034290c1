"""The stack and the runtime agree on names (gpuscout.domain.names, defined once): every grant, lifecycle rule and
event rule of the synthesized template uses the shared S3 prefixes and job-name prefix, and the keys and job names
the runtime builds fall under them. A prefix written as another literal on either side fails here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuscout import paths
from gpuscout.cloud import control_plane, sagemaker_requests
from gpuscout.cloud.client import manifest_key
from gpuscout.cloud.job_code import code_prefix
from gpuscout.cloud.plan_items import ITEM_KINDS, items_key
from gpuscout.cloud.plan_step import data_source_of
from gpuscout.cloud.tuning_requests import search_target_key, tuning_job_name
from gpuscout.domain.catalog import load_catalog
from gpuscout.domain.manifest_loader import load_manifest
from gpuscout.domain.names import (
    CHECKPOINTS_PREFIX,
    CODE_PREFIX,
    JOB_NAME_PREFIX,
    MANIFESTS_PREFIX,
    OUTPUT_PREFIX,
    PLANS_PREFIX,
    PROCESSED_PREFIX,
    RAW_PREFIX,
    REJECTED_PREFIX,
    REPORTS_PREFIX,
    SEARCH_PREFIX,
)
from gpuscout.plan.planner import plan
from stacks.gpuscout_stack import JOB_RECORDERS, SEARCH_READERS
from tests.infra.conftest import Synthesized, as_list, managed_policy_statements, policy_statements

SAGEMAKER_JOB_KINDS = ("training-job", "processing-job", "hyper-parameter-tuning-job")


def _objects(synthesized: Synthesized, bucket: Any, prefix: str) -> dict[str, Any]:
    """The template's rendering of ``bucket.arn_for_objects(f"{prefix}*")``."""
    return {"Fn::Join": ["", [{"Fn::GetAtt": [synthesized.logical_id(bucket), "Arn"]}, f"/{prefix}*"]]}


def _statement(synthesized: Synthesized, role: Any, sid: str) -> dict[str, Any]:
    (statement,) = [s for s in policy_statements(synthesized, role) if s.get("Sid") == sid]
    return statement


def _lambda_grant(synthesized: Synthesized, function: str, sid: str) -> list[Any]:
    return as_list(_statement(synthesized, synthesized.stack.roles.lambdas[function], sid)["Resource"])


def test_the_lambdas_object_grants_use_the_shared_prefixes(synthesized: Synthesized) -> None:
    storage = synthesized.stack.storage
    data, artifacts = storage.data, storage.artifacts
    expected = {
        ("validate_manifest", "ReadManifests"): [_objects(synthesized, data, MANIFESTS_PREFIX)],
        ("validate_manifest", "WriteRejections"): [_objects(synthesized, data, REJECTED_PREFIX)],
        ("validate_manifest", "FindJobCode"): [_objects(synthesized, data, RAW_PREFIX)],
        ("plan_jobs", "FindProcessedData"): [_objects(synthesized, data, PROCESSED_PREFIX)],
        ("plan_jobs", "WritePlanItems"): [_objects(synthesized, artifacts, PLANS_PREFIX)],
        ("plan_jobs", "WriteSearchTargets"): [_objects(synthesized, artifacts, SEARCH_PREFIX)],
        ("analyze_run", "WriteReports"): [_objects(synthesized, data, REPORTS_PREFIX)],
        **{(name, "ReadJobOutput"): [_objects(synthesized, artifacts, OUTPUT_PREFIX)] for name in JOB_RECORDERS},
        **{(name, "ReadSearchTargets"): [_objects(synthesized, artifacts, SEARCH_PREFIX)] for name in SEARCH_READERS},
    }
    found = {key: _lambda_grant(synthesized, *key) for key in expected}
    assert found == expected


def test_the_state_machine_reads_its_request_lists_under_the_plans_prefix(synthesized: Synthesized) -> None:
    statements = policy_statements(synthesized, synthesized.stack.roles.state_machine)
    reads = [s["Resource"] for s in statements if "s3:GetObject" in as_list(s["Action"])]
    assert reads == [_objects(synthesized, synthesized.stack.storage.artifacts, PLANS_PREFIX)]


def test_the_run_roles_read_sources_under_raw_and_processed_only(synthesized: Synthesized) -> None:
    roles, data = synthesized.stack.roles, synthesized.stack.storage.data
    runtime = {s["Sid"]: s for s in managed_policy_statements(synthesized, roles.job_runtime_policy)}
    read = runtime["ReadDatasets"]["Resource"]
    assert read == [_objects(synthesized, data, RAW_PREFIX), _objects(synthesized, data, PROCESSED_PREFIX)]
    listing = runtime["ListDatasets"]["Condition"]
    assert listing == {"StringLike": {"s3:prefix": [f"{RAW_PREFIX}*", f"{PROCESSED_PREFIX}*"]}}
    write = _statement(synthesized, roles.processing, "WriteProcessedDatasets")["Resource"]
    assert write == _objects(synthesized, data, PROCESSED_PREFIX)  # data preparation's role, not the jobs'
    boundary = {s["Sid"]: s for s in managed_policy_statements(synthesized, roles.run_role_boundary)}
    artifacts = synthesized.stack.storage.artifacts
    assert boundary["RunArtifacts"]["Resource"] == [
        _objects(synthesized, artifacts, OUTPUT_PREFIX),
        _objects(synthesized, artifacts, CHECKPOINTS_PREFIX),
    ]


def test_every_sagemaker_job_grant_is_on_the_shared_job_name_prefix(synthesized: Synthesized) -> None:
    roles = synthesized.stack.roles
    rendered = [
        json.dumps(s["Resource"])
        for role in (roles.state_machine, *roles.lambdas.values())
        for s in policy_statements(synthesized, role)
        if any(a.startswith("sagemaker:") for a in as_list(s["Action"]))
    ]
    assert rendered
    for resource in rendered:
        kinds = [kind for kind in SAGEMAKER_JOB_KINDS if f":{kind}/" in resource]
        assert kinds and all(f":{kind}/{JOB_NAME_PREFIX}*" in resource for kind in kinds), resource
        # beside the job, a training job may be created on the user's training plans (test_iam checks that)
        assert resource.count(":sagemaker:") == len(kinds) + resource.count(":training-plan/*") + resource.count(
            ":reserved-capacity/*"
        ), resource


def test_the_event_rules_filter_on_the_shared_prefixes(synthesized: Synthesized) -> None:
    events = synthesized.stack.events
    resources = synthesized.template_json["Resources"]
    manifests = resources[synthesized.logical_id(events.manifest_uploaded)]["Properties"]["EventPattern"]
    wildcards = [f["wildcard"] for f in manifests["detail"]["object"]["key"]]
    assert wildcards and all(w.startswith(f"{MANIFESTS_PREFIX}*") for w in wildcards)
    jobs = resources[synthesized.logical_id(events.job_state_changed)]["Properties"]["EventPattern"]
    assert jobs["detail"]["TrainingJobName"] == [{"prefix": JOB_NAME_PREFIX}]


def test_the_lifecycle_rules_expire_the_shared_prefixes(synthesized: Synthesized) -> None:
    artifacts = synthesized.template_json["Resources"][synthesized.logical_id(synthesized.stack.storage.artifacts)]
    rules = {r["Id"]: r for r in artifacts["Properties"]["LifecycleConfiguration"]["Rules"]}
    assert rules["expire-plans"]["Prefix"] == PLANS_PREFIX
    assert rules["expire-checkpoints"]["Prefix"] == CHECKPOINTS_PREFIX


# -- the runtime side: the keys and names it builds fall under the prefixes the stack grants ---------------------


@pytest.fixture(scope="module")
def planned() -> Any:
    manifest = load_manifest(paths.CONFIG_DIR / "manifests" / "smoke-g5.yaml")
    return manifest, plan(manifest, load_catalog(), run_id="names-1")


def test_the_runtime_writes_and_reads_under_the_shared_prefixes(planned: Any, tmp_path: Path) -> None:
    manifest, _ = planned
    settings = sagemaker_requests.RequestSettings(
        role_arn="arn:aws:iam::1:role/r", training_image_uri="i", data_bucket="data", artifacts_bucket="artifacts"
    )
    assert manifest_key(manifest, Path("m.yaml")).startswith(MANIFESTS_PREFIX)
    assert code_prefix("m", "0" * 64).startswith(f"{RAW_PREFIX}{CODE_PREFIX}")
    assert all(items_key("r", kind).startswith(PLANS_PREFIX) for kind in ITEM_KINDS)
    assert search_target_key("r", tuning_job_name("r", 0)).startswith(SEARCH_PREFIX)
    data = data_source_of(manifest)
    assert data.processed_prefix().startswith(PROCESSED_PREFIX)
    assert sagemaker_requests.output_tar_key("r", "gs-j").startswith(OUTPUT_PREFIX)
    assert sagemaker_requests.output_uri(settings, "r") == f"s3://artifacts/{OUTPUT_PREFIX}r/"
    assert sagemaker_requests.checkpoint_uri(settings, "r", "gs-j").startswith(f"s3://artifacts/{CHECKPOINTS_PREFIX}")
    # the analysis' report upload
    (tmp_path / "report.md").write_text("# report")
    uploaded: list[str] = []

    class RecordingS3:
        def upload_file(self, filename: str, bucket: str, key: str, **_: Any) -> None:
            uploaded.append(key)

    uri = control_plane.S3ReportSink(RecordingS3(), "data").publish("r", tmp_path)
    assert uri == f"s3://data/{REPORTS_PREFIX}r/" and uploaded == [f"{REPORTS_PREFIX}r/report.md"]


def test_every_job_the_runtime_names_starts_with_the_shared_prefix(planned: Any) -> None:
    manifest, run_plan = planned
    names = [
        *(job.job_name for job in run_plan.jobs),
        sagemaker_requests.processing_job_name("names-1", data_source_of(manifest)),
        tuning_job_name("names-1", 0),
    ]
    assert len(names) >= 3
    assert all(name.startswith(JOB_NAME_PREFIX) for name in names), names
