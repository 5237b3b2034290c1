"""The quota pre-flight (gpuscout/cloud/quotas.py) on Service Quotas' real API shapes (botocore Stubber): the needs
of a plan, a zero quota refused with its name, code and console link, concurrency above a quota warned, the listing
paginated and cached, an unreadable listing a warning."""

from __future__ import annotations

import boto3
import pytest
from botocore.stub import Stubber

from gpuscout.cloud import quotas
from gpuscout.cloud.quotas import QuotaBook, check, plan_needs
from gpuscout.domain.catalog import load_catalog
from gpuscout.domain.manifest_loader import load_manifest
from gpuscout.paths import MANIFESTS_DIR
from gpuscout.plan.planner import plan


def _quota(name: str, code: str, value: float) -> dict:
    return {"ServiceCode": "sagemaker", "QuotaName": name, "QuotaCode": code, "Value": value, "Adjustable": True}


@pytest.fixture(autouse=True)
def _empty_cache():
    quotas._CACHE.clear()
    yield
    quotas._CACHE.clear()


def _book(pages: list[list[dict]], defaults: list[dict] | None = None) -> tuple[QuotaBook, Stubber]:
    client = boto3.client("service-quotas", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(client)
    stub.add_response("list_aws_default_service_quotas", {"Quotas": defaults or []}, {"ServiceCode": "sagemaker"})
    for i, page in enumerate(pages):
        params = {"ServiceCode": "sagemaker", **({"NextToken": f"t{i}"} if i else {})}
        response = {"Quotas": page, **({"NextToken": f"t{i + 1}"} if i + 1 < len(pages) else {})}
        stub.add_response("list_service_quotas", response, params)
    stub.activate()
    return QuotaBook(client), stub


def _jobs():
    manifest = load_manifest(MANIFESTS_DIR / "p4d-to-p5en.yaml", catalog=load_catalog())
    return plan(manifest, load_catalog(), run_id="r").jobs


def test_a_plans_needs_name_every_type_its_spot_variant_and_the_canary():
    jobs = _jobs()
    needs = plan_needs(jobs, concurrency=4, canary_instance_type="ml.g5.8xlarge")
    names = {n.quota_name for n in needs}
    assert {f"{j.instance_type} for {'spot ' if j.spot else ''}training job usage" for j in jobs} <= names
    assert "ml.g5.8xlarge for training job usage" in names
    for need in needs:
        same = [j for j in jobs if (j.instance_type, j.spot) == (need.instance_type, need.spot)]
        if same:
            assert need.per_job == max(j.instance_count for j in same)
            assert need.per_job <= need.at_once <= 4 * need.per_job


def test_a_zero_quota_is_refused_with_its_name_code_and_link_and_a_small_one_warns():
    needs = plan_needs(_jobs(), concurrency=4, canary_instance_type="ml.g5.8xlarge")
    # and three jobs of one type at once where the quota allows one
    needs.append(quotas.Need("ml.g5.48xlarge", True, per_job=1, at_once=3, what="targets[9] ml.g5.48xlarge (spot)"))
    first = needs[0]
    listed = [_quota(n.quota_name, f"L-{i:08d}", 100.0) for i, n in enumerate(needs)]
    listed[0] = _quota(first.quota_name, "L-00000000", 0.0)  # a new account's GPU quota
    canary = next(i for i, n in enumerate(needs) if n.what == "the canaries")
    listed[canary] = _quota(needs[canary].quota_name, "L-CANARY", 0.0)
    busy = len(needs) - 1
    listed[busy] = _quota(needs[busy].quota_name, "L-BUSY", float(needs[busy].per_job))
    # a new account: the zero GPU quota was never changed, so only AWS's default lists it
    book, stub = _book([listed[1:3], listed[3:]], defaults=[listed[0], _quota(needs[1].quota_name, "L-X", 0.0)])
    problems, warnings = check(needs, book)
    stub.assert_no_pending_responses()
    assert [p.path for p in problems] == [first.what.split(" ")[0], "canary"]
    assert problems[0].message == (
        f"{first.what}: the account's quota '{first.quota_name}' (L-00000000) is 0 in us-east-1, and one job needs "
        f"{first.per_job} instance(s): it could never start; request an increase at "
        "https://us-east-1.console.aws.amazon.com/servicequotas/home/services/sagemaker/quotas/L-00000000"
    )
    assert "ml.g5.8xlarge for training job usage' (L-CANARY) is 0" in problems[1].message
    assert len(warnings) == 1 and warnings[0].startswith(f"{needs[busy].what}: the run would start")
    assert "so jobs wait for each other" in warnings[0]
    # the listing is cached for the region: a second check asks nothing (the stub has no response left)
    assert check(needs, book)[0] == problems


def test_an_unreadable_listing_or_an_unknown_type_warns_and_refuses_nothing():
    needs = plan_needs(_jobs(), concurrency=1, canary_instance_type=None)
    client = boto3.client("service-quotas", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(client)
    stub.add_client_error("list_aws_default_service_quotas", "AccessDeniedException", "not authorized")
    stub.activate()
    problems, warnings = check(needs, QuotaBook(client))
    assert problems == [] and len(warnings) == 1
    assert warnings[0].startswith("could not read the account's SageMaker quotas in us-east-1")
    book, _ = _book([[]])  # a region that lists none of these types
    problems, warnings = check(needs, book)
    assert problems == [] and len(warnings) == len(needs) and "is the type offered there?" in warnings[0]
