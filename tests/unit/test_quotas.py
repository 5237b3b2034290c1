"""The quota pre-flight (gpuscout/cloud/quotas.py) on Service Quotas' real API shapes (botocore Stubber): the needs
of a plan, a zero quota refused with its name, code and console link, concurrency above a quota warned, the listing
paginated and cached, an unreadable listing a warning."""

from __future__ import annotations

import boto3
import pytest
from botocore.stub import Stubber

from gpuscout import paths
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


def _client() -> tuple[object, Stubber]:
    client = boto3.client("service-quotas", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(client)
    stub.activate()
    return client, stub


def _listing(stub: Stubber, applied: list[list[dict]], defaults: list[dict] | None) -> None:
    """One read: the applied values page by page, then (when asked) AWS's defaults."""
    for i, page in enumerate(applied):
        params = {"ServiceCode": "sagemaker", "MaxResults": 100, **({"NextToken": f"t{i}"} if i else {})}
        response = {"Quotas": page, **({"NextToken": f"t{i + 1}"} if i + 1 < len(applied) else {})}
        stub.add_response("list_service_quotas", response, params)
    if defaults is not None:
        stub.add_response(
            "list_aws_default_service_quotas", {"Quotas": defaults}, {"ServiceCode": "sagemaker", "MaxResults": 100}
        )


def _jobs():
    manifest = load_manifest(MANIFESTS_DIR / "p4d-to-p5.yaml", catalog=load_catalog())
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
    canary = next(i for i, n in enumerate(needs) if n.what == "the canaries")
    applied = [_quota(n.quota_name, f"L-{i:08d}", 100.0) for i, n in enumerate(needs)]
    applied[canary] = _quota(needs[canary].quota_name, "L-CANARY", 0.0)
    applied[-1] = _quota(needs[-1].quota_name, "L-BUSY", 1.0)
    # a new account: the first target's quota was never changed, so only AWS's default (0) lists it
    default = _quota(first.quota_name, "L-00000000", 0.0)
    client, stub = _client()
    for _ in range(2):  # a refusal is read again, not taken from the cache (a quota may have been raised since)
        _listing(stub, [applied[1:3], applied[3:]], defaults=[default, _quota(needs[1].quota_name, "L-X", 0.0)])
    # and a default-only value is confirmed: GetServiceQuota has no applied value for it
    stub.add_client_error(
        "get_service_quota",
        "NoSuchResourceException",
        "The request failed because the specified service quota does not exist.",
        expected_params={"ServiceCode": "sagemaker", "QuotaCode": "L-00000000"},
    )
    problems, warnings = check(needs, QuotaBook(client))
    stub.assert_no_pending_responses()
    assert [p.path for p in problems] == [first.what.split(" ")[0], "canary"]
    assert problems[0].message == (
        f"{first.what}: the account's quota '{first.quota_name}' (L-00000000) is 0 in us-east-1, and one job needs "
        f"{first.per_job} instance(s): it could never start; request an increase at "
        "https://us-east-1.console.aws.amazon.com/servicequotas/home/services/sagemaker/quotas/L-00000000"
    )
    assert "ml.g5.8xlarge for training job usage' (L-CANARY) is 0" in problems[1].message
    assert len(warnings) == 1 and warnings[0].startswith(f"{needs[-1].what}: the run would start 3 instance(s)")
    assert "so jobs wait for each other" in warnings[0]


def test_an_applied_value_found_by_get_service_quota_overrides_the_default_and_an_answer_is_cached():
    needs = plan_needs(_jobs()[:1], concurrency=1, canary_instance_type=None)
    client, stub = _client()
    default = _quota(needs[0].quota_name, "L-1", 0.0)
    _listing(stub, [[]], defaults=[default])
    _listing(stub, [[]], defaults=[default])
    stub.add_response(
        "get_service_quota",
        {"Quota": {**default, "Value": 4.0}},
        {"ServiceCode": "sagemaker", "QuotaCode": "L-1"},
    )
    assert check(needs, QuotaBook(client)) == ([], [])
    stub.assert_no_pending_responses()
    # quotas that allow the plan are cached for the region: asking again reads nothing (no response is queued)
    quotas._CACHE.clear()
    _listing(stub, [[_quota(needs[0].quota_name, "L-1", 8.0)]], defaults=None)
    book = QuotaBook(client)
    assert check(needs, book) == ([], []) and check(needs, book) == ([], [])
    stub.assert_no_pending_responses()


def test_an_unreadable_listing_or_an_unknown_type_warns_and_refuses_nothing():
    needs = plan_needs(_jobs(), concurrency=1, canary_instance_type=None)
    client = boto3.client("service-quotas", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(client)
    stub.add_client_error("list_service_quotas", "AccessDeniedException", "not authorized")
    stub.activate()
    problems, warnings = check(needs, QuotaBook(client))
    assert problems == [] and len(warnings) == 1
    assert warnings[0].startswith("could not read the account's SageMaker quotas in us-east-1")
    assert not quotas.all_checked(warnings)  # `plan --stack-name` then says "quotas not checked", not "allow it"
    client, stub = _client()
    _listing(stub, [[]], defaults=[])  # a region that lists none of these types
    problems, warnings = check(needs, QuotaBook(client))
    assert problems == [] and len(warnings) == len(needs) and "is the type offered there?" in warnings[0]
    assert not quotas.all_checked(warnings)
    assert quotas.all_checked(["targets[0]: the run would start 8 instance(s) at once; ... jobs wait for each other"])


def test_a_searchs_parallel_trials_over_the_quota_are_refused_naming_the_setting_and_the_number_that_fits():
    specs = [j for j in _jobs() if not j.spot][:1]
    one = specs[0]
    trials = [one.model_copy(update={"job_name": f"{one.job_name[:55]}-c{i}"}) for i in range(4)]  # 4 candidates
    needs = plan_needs(trials, concurrency=4, canary_instance_type=None, max_parallel_trials=3)
    assert len(needs) == 1 and needs[0].at_once == 3 * one.instance_count and needs[0].parallel_trials
    client, stub = _client()
    _listing(stub, [[_quota(needs[0].quota_name, "L-P", 2.0 * one.instance_count)]], defaults=None)
    problems, warnings = check(needs, QuotaBook(client))
    assert warnings == [] and [p.path for p in problems] == ["search.max_parallel_trials"]
    assert "a tuning trial over it fails instead of waiting: set search.max_parallel_trials to 2" in problems[0].message
    # the same jobs listed as variants only wait for each other: a warning
    quotas._CACHE.clear()
    client, stub = _client()
    _listing(stub, [[_quota(needs[0].quota_name, "L-P", 2.0 * one.instance_count)]], defaults=None)
    plain = plan_needs(trials, concurrency=3, canary_instance_type=None)
    problems, warnings = check(plain, QuotaBook(client))
    assert problems == [] and len(warnings) == 1 and "jobs wait for each other" in warnings[0]


def test_canaries_too_large_for_the_canary_type_need_their_jobs_types_on_demand_quota():
    from gpuscout.domain.catalog import load_catalog
    from gpuscout.domain.manifest_loader import load_manifest
    from gpuscout.plan.canary import cloud_canaries
    from gpuscout.plan.planner import plan

    catalog = load_catalog()
    manifest = load_manifest(paths.MANIFESTS_DIR / "p4d-to-p5.yaml", catalog=catalog)
    jobs = plan(manifest, catalog, run_id="r-7b").jobs
    canaries = [c.spec for c in cloud_canaries(jobs, manifest, catalog, "ml.g5.8xlarge")]
    needs = plan_needs(jobs, concurrency=4, canary_instance_type="ml.g5.8xlarge", canaries=canaries)
    # every canary runs on its job's type on demand (the 7B cut does not fit a g5's 24 GB): that quota is needed,
    # the canary type's is not
    canary_needs = [n for n in needs if n.what.startswith("canaries")]
    assert sorted(n.instance_type for n in canary_needs) == sorted({j.instance_type for j in jobs})
    assert all(not n.spot and n.per_job == 1 and n.at_once == 1 for n in canary_needs)
    assert all(n.instance_type != "ml.g5.8xlarge" for n in needs)
