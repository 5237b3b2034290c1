"""The first-run smoke manifests (docs/deploy.md, "First run"): one cheap job per instance family, cloud-valid, and the
costs the guide quotes are what the planner predicts."""

from __future__ import annotations

import re

import pytest

from gpuscout.cloud.sources import cloud_problems
from gpuscout.domain.catalog import load_catalog
from gpuscout.domain.manifest_loader import load_manifest
from gpuscout.paths import MANIFESTS_DIR, REPO_DIR
from gpuscout.plan.canary import cloud_canaries, predicted_canary_cost_usd
from gpuscout.plan.planner import plan

SMOKES = {"smoke-g5.yaml": "ml.g5.8xlarge", "smoke-p4d.yaml": "ml.p4d.24xlarge", "smoke-p5.yaml": "ml.p5.48xlarge"}


@pytest.mark.parametrize(("name", "instance_type"), SMOKES.items())
def test_a_smoke_manifest_is_one_cheap_cloud_job_and_the_guide_quotes_its_predicted_cost(
    name: str, instance_type: str
) -> None:
    catalog = load_catalog()
    manifest = load_manifest(MANIFESTS_DIR / name, catalog=catalog)
    assert cloud_problems(manifest, data_bucket="gpuscout-data-123456789012") == []
    the_plan = plan(manifest, catalog, run_id="smoke")
    [job] = the_plan.jobs
    assert job.instance_type == instance_type and job.instance_count == 1 and not job.spot
    assert the_plan.predicted_cost_usd < 12 and the_plan.predicted_cost_usd <= the_plan.budget_usd
    canary_cost = predicted_canary_cost_usd(cloud_canaries(the_plan.jobs, manifest, catalog, "ml.g5.8xlarge"))
    guide = (REPO_DIR / "docs" / "deploy.md").read_text()
    row = next(line for line in guide.splitlines() if f"`configs/manifests/{name}`" in line)
    assert f"${the_plan.predicted_cost_usd:,.2f}" in row and f"canary ~${canary_cost:,.2f}" in row
    assert re.search(rf"\| {re.escape(instance_type)} \|", row)
