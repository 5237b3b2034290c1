"""The 2026 catalog as a user meets it: the new single-GPU types plan, types that cannot be predicted, bought on
demand or priced are refused with the fix, a training plan reaches CreateTrainingJob, and every plan says where its
prices come from."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import boto3
import botocore.session
import pytest
from botocore.stub import Stubber
from botocore.validate import ParamValidator
from rich.console import Console

from gpuscout.analysis.pricing import refresh_snapshot
from gpuscout.cli.local_view import price_lines, print_plan
from gpuscout.cloud.sagemaker_requests import DataSource, RequestSettings, training_job_request
from gpuscout.domain.catalog import load_catalog
from gpuscout.domain.manifest_loader import validate_manifest_data
from gpuscout.domain.prices import load_price_file, write_price_file
from gpuscout.errors import ManifestError, PlanError, PricingError
from gpuscout.paths import CONFIG_DIR, MANIFESTS_DIR
from gpuscout.plan.planner import plan

CATALOG = load_catalog()
PLAN_ARN = "arn:aws:sagemaker:us-east-1:123456789012:training-plan/p5e-reserved-week"
SAGEMAKER = botocore.session.get_session().get_service_model("sagemaker")


def manifest(targets: list[dict[str, Any]], catalog: Any = CATALOG, **over: Any) -> Any:
    data = {
        "name": "single-gpu",
        "model": {"preset": "qwen2.5-0.5b"},
        "dataset": {"source": "bundled:hebrew-bible"},
        "sequence_length": 2048,
        "training": {"max_steps": 50, "precision": "bf16"},
        "targets": targets,
        "variants": [{"name": "b2-a8", "per_device_batch_size": 2, "gradient_accumulation_steps": 8,
                      "gradient_checkpointing": True}],
        "constraints": {"budget_usd": 1000},
    }  # fmt: skip
    data.update(over)
    return validate_manifest_data(data, "test", catalog)


@pytest.mark.parametrize("itype", ["ml.p5.4xlarge", "ml.g6e.xlarge", "ml.g6.xlarge", "ml.g5.xlarge"])
def test_the_single_gpu_types_a_user_rents_plan_at_their_training_rate(itype: str) -> None:
    job = plan(manifest([{"instance_type": itype}]), CATALOG, run_id="r").jobs[0]
    price = CATALOG.get(itype).price
    assert price is not None and job.price == price
    assert job.price_per_hour_usd == price.usd_per_hour and job.gpus_per_instance == 1
    assert job.prediction.mfu_assumed is not None and job.prediction.cost_usd > 0
    assert "assumed utilization" in job.prediction.method


def test_a_gpu_without_a_published_dense_peak_is_refused_not_guessed() -> None:
    with pytest.raises(PlanError, match=r"ml\.g7e\.2xlarge: cannot predict throughput on RTX-PRO-6000.*gpuscout local"):
        plan(manifest([{"instance_type": "ml.g7e.2xlarge"}]), CATALOG, run_id="r")


def test_a_training_plan_only_type_needs_the_plan_and_its_price() -> None:
    with pytest.raises(ManifestError, match=r"only through SageMaker training plans.*set training_plan_arn"):
        manifest([{"instance_type": "ml.p5e.48xlarge"}])
    with pytest.raises(ManifestError, match=r"price_per_hour_usd: a job on a training plan is paid through"):
        manifest([{"instance_type": "ml.p5e.48xlarge", "training_plan_arn": PLAN_ARN}])
    with pytest.raises(ManifestError, match=r"price_per_hour_usd: a job on a training plan"):  # on-demand types too
        manifest([{"instance_type": "ml.p5.48xlarge", "training_plan_arn": PLAN_ARN}])
    priced = manifest([{"instance_type": "ml.p5e.48xlarge", "training_plan_arn": PLAN_ARN, "price_per_hour_usd": 50}])
    job = plan(priced, CATALOG, run_id="r").jobs[0]
    assert job.training_plan_arn == PLAN_ARN and job.price is not None and job.price.kind == "manifest"


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ({"instance_type": "ml.g6e.xlarge", "training_plan_arn": PLAN_ARN, "price_per_hour_usd": 2},
         "not offered through SageMaker training"),
        ({"instance_type": "ml.p6-b200.48xlarge", "spot": True, "price_per_hour_usd": 100},
         "not offered as Managed Spot Training"),
        ({"instance_type": "ml.p5.48xlarge", "spot": True, "training_plan_arn": PLAN_ARN, "price_per_hour_usd": 50},
         "not spot"),
        ({"instance_type": "local", "price_per_hour_usd": 1, "training_plan_arn": PLAN_ARN}, "runs on this machine"),
        ({"instance_type": "ml.p5.48xlarge", "training_plan_arn": "arn:aws:iam::123456789012:role/x" + "y" * 30},
         "training_plan_arn"),
    ],
)  # fmt: skip
def test_purchase_options_the_type_is_not_sold_with_are_refused(target: dict[str, Any], message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        manifest([target])


def test_an_unpriced_type_is_refused_with_the_reason_and_both_fixes() -> None:
    with pytest.raises(PlanError) as err:
        plan(manifest([{"instance_type": "ml.p6-b200.48xlarge"}]), CATALOG, run_id="r")
    text = str(err.value)
    assert "no SageMaker Training rate" in text and "price_per_hour_usd" in text and "catalog --refresh" in text


def test_the_training_plan_reaches_create_training_job_as_the_api_names_it() -> None:
    priced = manifest([{"instance_type": "ml.p5e.48xlarge", "training_plan_arn": PLAN_ARN, "price_per_hour_usd": 50}])
    job = plan(priced, CATALOG, run_id="r").jobs[0]
    settings = RequestSettings(
        role_arn="arn:aws:iam::123456789012:role/sm", data_bucket="d", artifacts_bucket="a",
        training_image_uri="123456789012.dkr.ecr.us-east-1.amazonaws.com/gpuscout:1",
    )  # fmt: skip
    data = DataSource(source="bundled:hebrew-bible", tokenizer="qwen", sequence_length=2048, max_documents=None)
    request = training_job_request(job, settings, data, enable_network_isolation=True)
    assert request["ResourceConfig"]["TrainingPlanArn"] == PLAN_ARN
    report = ParamValidator().validate(request, SAGEMAKER.operation_model("CreateTrainingJob").input_shape)
    assert not report.has_errors(), report.generate_report()
    assert re.fullmatch(SAGEMAKER.shape_for("TrainingPlanArn").metadata["pattern"], PLAN_ARN)
    on_demand = plan(manifest([{"instance_type": "ml.p5.4xlarge"}]), CATALOG, run_id="r").jobs[0]
    assert (
        "TrainingPlanArn"
        not in training_job_request(on_demand, settings, data, enable_network_isolation=True)["ResourceConfig"]
    )


def test_the_plan_shows_each_price_with_its_kind_and_date() -> None:
    the_plan = plan(
        manifest([{"instance_type": "ml.p5.4xlarge"}, {"instance_type": "ml.g6e.xlarge", "price_per_hour_usd": 2.0}]),
        CATALOG, run_id="r",
    )  # fmt: skip
    lines = price_lines(the_plan.jobs)
    p5 = CATALOG.get("ml.p5.4xlarge").price
    assert p5 is not None
    assert any(f"ml.p5.4xlarge $7.912/h on-demand (snapshot {p5.date} us-east-1" in line for line in lines)
    assert any("ml.g6e.xlarge $2.000/h on-demand (manifest" in line for line in lines)
    console = Console(record=True, width=200)
    print_plan(console, the_plan, for_run=False)
    assert "priced: ml.p5.4xlarge" in console.export_text()


def test_the_shipped_single_gpu_manifest_plans_every_target_but_the_one_it_cannot_predict() -> None:
    from gpuscout.domain.manifest_loader import load_manifest

    loaded = load_manifest(MANIFESTS_DIR / "single-gpu-2026.yaml", catalog=CATALOG)
    types = [t.instance_type for t in loaded.targets]
    assert types == ["ml.p5.4xlarge", "ml.g6e.xlarge", "ml.g6.xlarge", "ml.g5.xlarge"]
    jobs = plan(loaded, CATALOG, run_id="r").jobs
    assert {j.instance_type for j in jobs} == set(types)


# -- adding an instance type is one file: a temporary catalog, a Price List refresh, a plan ---------------------


def _price_record(instance: str, usd: str, component: str = "Training", usage: str | None = None) -> str:
    sku = "TESTSKU" + re.sub(r"[^A-Z0-9]", "", (usage or instance).upper())
    return json.dumps({
        "product": {"productFamily": "ML Instance", "sku": sku, "attributes": {
            "regionCode": "us-east-1", "instanceName": instance, "component": component,
            "usagetype": usage or f"USE1-{'Train' if component == 'Training' else component}:{instance}",
            "operation": "RunInstance", "servicecode": "AmazonSageMaker", "location": "US East (N. Virginia)"}},
        "serviceCode": "AmazonSageMaker",
        "terms": {"OnDemand": {f"{sku}.JRTCKXETXF": {
            "priceDimensions": {f"{sku}.JRTCKXETXF.6YS6EN2CT7": {
                "unit": "Hrs", "endRange": "Inf", "description": f"${usd} per Hour for {component} on {instance}",
                "appliesTo": [], "rateCode": f"{sku}.JRTCKXETXF.6YS6EN2CT7", "beginRange": "0",
                "pricePerUnit": {"USD": usd}}},
            "sku": sku, "effectiveDate": "2026-11-01T00:00:00Z", "offerTermCode": "JRTCKXETXF", "termAttributes": {}}}},
        "version": "20261101000000", "publicationDate": "2026-11-01T00:00:00Z",
    })  # fmt: skip


def _expected(instance: str, component: str) -> dict[str, Any]:
    return {
        "ServiceCode": "AmazonSageMaker",
        "Filters": [
            {"Type": "TERM_MATCH", "Field": "instanceName", "Value": instance},
            {"Type": "TERM_MATCH", "Field": "regionCode", "Value": "us-east-1"},
            {"Type": "TERM_MATCH", "Field": "component", "Value": component},
        ],
        "FormatVersion": "aws_v1",
        "MaxResults": 10,
    }


def _pricing_client() -> Any:
    return boto3.client("pricing", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")


def _stub_refresh(stub: Stubber, catalog: Any, answers: dict[str, str]) -> None:
    """One get_products answer per cloud type in catalog order: a rate where ``answers`` has one, else no product."""
    for inst in catalog:
        if inst.is_local:
            continue
        component = "Processing" if inst.role == "processing" else "Training"
        records = (
            [_price_record(inst.instance_type, answers[inst.instance_type], component)]
            if (inst.instance_type in answers)
            else []
        )
        stub.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": records},
                          _expected(inst.instance_type, component))  # fmt: skip


def test_an_instance_type_added_by_one_file_is_priced_by_a_refresh_and_planned(tmp_path: Path) -> None:
    config = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, config)
    new = json.loads((config / "instances" / "ml.g6e.xlarge.json").read_text())
    new.update(instance_type="ml.g6e.8xlarge", vcpus=32, memory_gib=256, nvme_gb=900, network_gbps=25)
    (config / "instances" / "ml.g6e.8xlarge.json").write_text(json.dumps(new))  # the one file
    with pytest.raises(Exception, match=r"ml\.g6e\.8xlarge is neither priced nor listed"):
        load_catalog(config)  # no price yet: the snapshot must say something about every type
    snapshot = load_price_file(config)
    write_price_file(snapshot.model_copy(update={"unpriced": {**snapshot.unpriced, "ml.g6e.8xlarge": "new"}}), config)
    catalog = load_catalog(config)
    assert catalog.get("ml.g6e.8xlarge").price is None
    client = _pricing_client()
    answers = {"ml.g6e.8xlarge": "4.5240000000", "ml.p5.48xlarge": "63.2960000000", "ml.m5.xlarge": "0.2300000000"}
    with Stubber(client) as stub:
        _stub_refresh(stub, catalog, answers)
        refreshed = refresh_snapshot(catalog, region="us-east-1", client=client, today="2026-11-27")
        stub.assert_no_pending_responses()
    write_price_file(refreshed, config)
    assert load_price_file(config) == refreshed  # the written snapshot round-trips
    catalog = load_catalog(config)
    price = catalog.get("ml.g6e.8xlarge").price
    assert price is not None and (price.usd_per_hour, price.kind, price.date) == (4.524, "snapshot", "2026-11-27")
    assert "AWS Price List API" in price.source and "effective 2026-11-01" in price.source
    processing = catalog.get("ml.m5.xlarge").price
    assert processing is not None and processing.component == "Processing"
    assert "no on-demand Training price" in refreshed.unpriced["ml.g6e.xlarge"]  # answered with no product
    job = plan(manifest([{"instance_type": "ml.g6e.8xlarge"}], catalog), catalog, run_id="r").jobs[0]
    assert job.price_per_hour_usd == 4.524 and job.prediction.cost_usd > 0 and job.price == price


def test_a_refresh_that_reads_no_rate_keeps_the_old_snapshot(tmp_path: Path) -> None:
    client = _pricing_client()
    with Stubber(client) as stub:
        for inst in CATALOG:
            if not inst.is_local:
                stub.add_client_error("get_products", "AccessDeniedException", "not authorized: pricing:GetProducts")
        with pytest.raises(PricingError, match=r"no rate for any type.*AccessDenied.*snapshot not changed"):
            refresh_snapshot(CATALOG, region="us-east-1", client=client, today="2026-11-27")


def test_a_search_cannot_run_on_a_training_plan() -> None:
    # a cloud search is a SageMaker tuning job, whose HyperParameterTuningResourceConfig has no TrainingPlanArn
    assert "TrainingPlanArn" not in SAGEMAKER.shape_for("HyperParameterTuningResourceConfig").members
    target = {"instance_type": "ml.p5e.48xlarge", "training_plan_arn": PLAN_ARN, "price_per_hour_usd": 50}
    with pytest.raises(ManifestError, match=r"targets\[0\]\.training_plan_arn: a settings search runs as a SageMaker"):
        manifest([target], variants=[], search={"max_trials": 2})


def _copy_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from gpuscout import paths

    config = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, config)
    monkeypatch.setattr(paths, "CONFIG_DIR", config)
    return config


def test_catalog_refresh_rewrites_the_snapshot_from_the_price_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from gpuscout.cli import app as cli

    config = _copy_config(tmp_path, monkeypatch)
    client = _pricing_client()
    stub = Stubber(client)
    _stub_refresh(stub, load_catalog(config), {"ml.p5.4xlarge": "7.9120000000", "ml.g6e.xlarge": "2.6100000000"})
    stub.activate()
    monkeypatch.setattr(boto3, "client", lambda service, **_: client if service == "pricing" else None)
    result = CliRunner().invoke(cli.app, ["catalog", "--refresh"])
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "2 rates" in result.stdout
    written = load_price_file(config)
    assert written.prices["ml.p5.4xlarge"].usd_per_hour == 7.912 and "ml.p5.48xlarge" in written.unpriced
    assert written.method.startswith("AWS Price List API refresh")
    stub.assert_no_pending_responses()


def test_catalog_refresh_without_credentials_fails_in_one_line_and_keeps_the_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from gpuscout.cli import app as cli

    config = _copy_config(tmp_path, monkeypatch)
    before = (config / "pricing" / "sagemaker.json").read_bytes()
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    result = CliRunner().invoke(cli.app, ["catalog", "--refresh"])
    assert result.exit_code != 0
    assert "no rate for any type" in result.stderr and "credentials" in result.stderr.lower()
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stdout + result.stderr
    assert (config / "pricing" / "sagemaker.json").read_bytes() == before


def test_a_canary_keeps_its_jobs_training_plan_only_on_its_jobs_type() -> None:
    from gpuscout.plan.canary import cloud_canaries

    priced = manifest(
        [{"instance_type": "ml.p5e.48xlarge", "training_plan_arn": PLAN_ARN, "price_per_hour_usd": 50}],
        model={"preset": "qwen2.5-0.5b"},
    )
    jobs = plan(priced, CATALOG, run_id="r").jobs
    [on_canary_type] = cloud_canaries(jobs, priced, CATALOG, "ml.g5.8xlarge")  # a 0.5B canary fits a g5
    assert on_canary_type.spec.instance_type == "ml.g5.8xlarge" and on_canary_type.spec.training_plan_arn is None
    assert on_canary_type.spec.price == CATALOG.get("ml.g5.8xlarge").price
    big = manifest(
        [{"instance_type": "ml.p5e.48xlarge", "training_plan_arn": PLAN_ARN, "price_per_hour_usd": 50}],
        model={"preset": "qwen2.5-7b"}, variants=[{"name": "z3", "deepspeed_stage": 3, "gradient_checkpointing": True}],
    )  # fmt: skip
    [on_job_type] = cloud_canaries(plan(big, CATALOG, run_id="r").jobs, big, CATALOG, "ml.g5.8xlarge")
    assert on_job_type.spec.instance_type == "ml.p5e.48xlarge" and on_job_type.spec.training_plan_arn == PLAN_ARN
    assert on_job_type.placement is not None and on_job_type.spec.price is not None
    assert on_job_type.spec.price.kind == "manifest"


def test_a_refresh_keeps_the_plain_training_rate_beside_other_usage_types_and_names_a_real_ambiguity() -> None:
    from gpuscout.analysis.pricing import parse_price_list

    plain = _price_record("ml.p5.48xlarge", "63.2960000000")
    flex = _price_record("ml.p5.48xlarge", "70.0000000000", usage="USE1-Train-Flex:ml.p5.48xlarge")
    assert parse_price_list([plain, flex], "ml.p5.48xlarge") == (63.296, "2026-11-01")
    other = _price_record("ml.p5.48xlarge", "64.0000000000", usage="USE1-Train:ml.p5.48xlarge")
    with pytest.raises(PricingError, match=r"ambiguous .*USE1-Train:ml\.p5\.48xlarge \$63\.296.*\$64"):
        parse_price_list([plain, other, flex], "ml.p5.48xlarge")


def test_a_failed_lookup_keeps_its_previous_rate_and_another_region_keeps_nothing() -> None:
    previous = load_price_file()
    client = _pricing_client()
    with Stubber(client) as stub:
        for inst in CATALOG:
            if inst.is_local:
                continue
            if inst.instance_type == "ml.g6e.xlarge":
                stub.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": [
                    _price_record("ml.g6e.xlarge", "2.6100000000")]})  # fmt: skip
            else:
                stub.add_client_error("get_products", "ThrottlingException", "Rate exceeded")
        fresh = refresh_snapshot(CATALOG, region="us-east-1", client=client, today="2026-11-27", previous=previous)
    assert fresh.prices["ml.g6e.xlarge"].date == "2026-11-27"
    assert fresh.prices["ml.p5.48xlarge"] == previous.prices["ml.p5.48xlarge"]  # throttled: the old rate, old date
    assert fresh.unpriced["ml.p6-b200.48xlarge"] == previous.unpriced["ml.p6-b200.48xlarge"]
    assert "1 rates read" in fresh.method and "kept their previous rate" in fresh.method
    client = _pricing_client()
    with Stubber(client) as stub:
        for inst in CATALOG:
            if not inst.is_local:
                stub.add_client_error("get_products", "ThrottlingException", "Rate exceeded")
        with pytest.raises(PricingError, match="no rate for any type"):  # kept rates are not new rates
            refresh_snapshot(CATALOG, region="us-east-1", client=client, today="2026-11-27", previous=previous)
    client = _pricing_client()
    with Stubber(client) as stub:
        for inst in CATALOG:
            if inst.instance_type == "ml.g6e.xlarge":
                stub.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": [
                    _price_record("ml.g6e.xlarge", "2.9000000000")]})  # fmt: skip
            elif not inst.is_local:
                stub.add_client_error("get_products", "ThrottlingException", "Rate exceeded")
        west = refresh_snapshot(CATALOG, region="us-west-2", client=client, today="2026-11-27", previous=previous)
    assert list(west.prices) == ["ml.g6e.xlarge"] and "lookup failed" in west.unpriced["ml.p5.48xlarge"]
