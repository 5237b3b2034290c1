"""PriceBook: catalog table, spot assumption, manifest overrides, snapshots and the AWS Price List API (Stubber)."""

from __future__ import annotations

import json
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from gpuscout.analysis import pricing
from gpuscout.analysis.pricing import PriceBook, SpotAssumption
from gpuscout.analysis.terms import RunTerms
from gpuscout.domain.catalog import load_catalog
from gpuscout.errors import PricingError

SPOT = SpotAssumption(default_discount=0.6, assumption="test: 60 % off", source="test", date="2026-11-01")

CATALOG = {
    "ml.p4d.24xlarge": {
        "on_demand_usd_per_hour": 40.0,
        "price_region": "us-east-1",
        "price_date": "2026-01-01",
        "price_source": "table",
    },
    "ml.g5.2xlarge": {
        "on_demand_usd_per_hour": 1.5,
        "price_region": "us-east-1",
        "price_date": "2026-01-01",
        "price_source": "table",
    },
    "local": {"on_demand_usd_per_hour": None, "price_source": "none"},
}


def _product(instance: str, usd: str, *, unit: str = "Hrs", component: str = "Training") -> str:
    """One PriceList entry shaped like get_products' answer for AmazonSageMaker (SKU codes illustrative)."""
    sku = "8Y6QXJBPD6YG3QXW"
    return json.dumps(
        {
            "product": {
                "productFamily": "ML Instance",
                "attributes": {
                    "regionCode": "us-east-1",
                    "computeType": "Training",
                    "instanceName": instance,
                    "vCpu": "96",
                    "memory": "1152 GiB",
                    "locationType": "AWS Region",
                    "usagetype": f"USE1-Train:{instance}",
                    "gpu": "8",
                    "operation": "RunInstance",
                    "component": component,
                    "location": "US East (N. Virginia)",
                    "instanceType": instance,
                    "servicecode": "AmazonSageMaker",
                    "instanceFamily": "Accelerated Computing",
                    "servicename": "Amazon SageMaker",
                },
                "sku": sku,
            },
            "serviceCode": "AmazonSageMaker",
            "terms": {
                "OnDemand": {
                    f"{sku}.JRTCKXETXF": {
                        "priceDimensions": {
                            f"{sku}.JRTCKXETXF.6YS6EN2CT7": {
                                "unit": unit,
                                "endRange": "Inf",
                                "description": f"${usd} per Hour for Training on {instance} in US East (N. Virginia)",
                                "appliesTo": [],
                                "rateCode": f"{sku}.JRTCKXETXF.6YS6EN2CT7",
                                "beginRange": "0",
                                "pricePerUnit": {"USD": usd},
                            }
                        },
                        "sku": sku,
                        "effectiveDate": "2025-06-01T00:00:00Z",
                        "offerTermCode": "JRTCKXETXF",
                        "termAttributes": {},
                    }
                }
            },
            "version": "20250601000000",
            "publicationDate": "2025-06-01T00:00:00Z",
        }
    )


def _expected_params(instance: str, region: str = "us-east-1") -> dict[str, Any]:
    return {
        "ServiceCode": "AmazonSageMaker",
        "Filters": [
            {"Type": "TERM_MATCH", "Field": "instanceName", "Value": instance},
            {"Type": "TERM_MATCH", "Field": "regionCode", "Value": region},
            {"Type": "TERM_MATCH", "Field": "component", "Value": "Training"},
        ],
        "FormatVersion": "aws_v1",
        "MaxResults": 10,
    }


@pytest.fixture
def client() -> Any:
    return boto3.client("pricing", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")


def test_catalog_table_and_derived_spot() -> None:
    book = PriceBook.from_catalog(CATALOG, spot=SPOT)
    p4d = book.get("ml.p4d.24xlarge")
    # spot = 40.00 x (1 - 0.6) = 16.00
    assert (p4d.on_demand_usd_per_hour, p4d.spot_usd_per_hour) == (40.0, pytest.approx(16.0))
    assert p4d.on_demand_source == "catalog: table"
    assert p4d.spot_source.startswith("assumed 60% discount")
    assert (p4d.date, p4d.region) == ("2026-01-01", "us-east-1")
    assert "local" not in book  # no price in the table: nothing invented


def test_real_catalog_and_spot_file_load() -> None:
    book = PriceBook.from_catalog(load_catalog())
    price = book.get("ml.p4d.24xlarge")
    discount = pricing.load_spot_assumption().default_discount
    assert price.spot_usd_per_hour == pytest.approx(price.on_demand_usd_per_hour * (1 - discount))


def test_unknown_instance_is_a_pricing_error() -> None:
    with pytest.raises(PricingError, match=r"ml\.p5\.48xlarge"):
        PriceBook.from_catalog(CATALOG, spot=SPOT).get("ml.p5.48xlarge")


def test_family_discount_longest_prefix_wins() -> None:
    spot = SpotAssumption(
        default_discount=0.6, family_discounts={"ml.p5": 0.5, "ml.p5e": 0.3}, assumption="a", source="s", date="d"
    )
    assert spot.discount_for("ml.p5e.48xlarge") == 0.3
    assert spot.discount_for("ml.p5.48xlarge") == 0.5
    assert spot.discount_for("ml.g5.2xlarge") == 0.6


def test_manifest_overrides() -> None:
    manifest = {
        "targets": [
            {"instance_type": "ml.g5.2xlarge", "price_per_hour_usd": 2.0},  # spot re-derived: 2.0 x 0.4 = 0.8
            {"instance_type": "ml.p4d.24xlarge", "spot": True, "spot_price_per_hour_usd": 12.5},
            {"instance_type": "local", "price_per_hour_usd": 3.2},  # the local machine's stated cost
        ]
    }
    book = PriceBook.from_catalog(CATALOG, spot=SPOT).with_manifest_overrides(RunTerms.stored(manifest))
    g5 = book.get("ml.g5.2xlarge")
    assert (g5.on_demand_usd_per_hour, g5.spot_usd_per_hour, g5.on_demand_source) == (
        2.0,
        pytest.approx(0.8),
        "manifest override",
    )
    p4d = book.get("ml.p4d.24xlarge")
    assert (p4d.on_demand_usd_per_hour, p4d.spot_usd_per_hour, p4d.spot_source) == (40.0, 12.5, "manifest override")
    assert book.get("local").on_demand_usd_per_hour == 3.2


def test_spot_override_without_any_on_demand_price_is_refused() -> None:
    manifest = {"targets": [{"instance_type": "ml.p5.48xlarge", "spot_price_per_hour_usd": 30.0}]}
    with pytest.raises(PricingError, match="needs an on-demand price"):
        PriceBook.from_catalog(CATALOG, spot=SPOT).with_manifest_overrides(RunTerms.stored(manifest))


def test_snapshot_round_trip() -> None:
    book = PriceBook.from_catalog(CATALOG, spot=SPOT)
    snap = book.snapshot()
    again = PriceBook.from_snapshot(json.loads(snap.model_dump_json()))
    assert again.get("ml.p4d.24xlarge") == book.get("ml.p4d.24xlarge")
    assert snap.spot_assumption == "test: 60 % off"


def test_parse_price_list() -> None:
    usd, date = pricing.parse_price_list([_product("ml.p4d.24xlarge", "37.6880000000")], "ml.p4d.24xlarge")
    assert (usd, date) == (37.688, "2025-06-01")


def test_parse_price_list_skips_other_products_and_units() -> None:
    entries = [
        _product("ml.p4d.24xlarge", "0.1400000000", unit="GB-Mo"),  # storage, not an hourly rate
        _product("ml.p4d.24xlarge", "45.0000000000", component="Hosting"),  # inference endpoint
        _product("ml.p4de.24xlarge", "47.0000000000"),  # another instance
        _product("ml.p4d.24xlarge", "37.6880000000"),
    ]
    assert pricing.parse_price_list(entries, "ml.p4d.24xlarge")[0] == 37.688


def test_parse_price_list_rejects_ambiguity_and_absence() -> None:
    two = [_product("ml.p4d.24xlarge", "37.688"), _product("ml.p4d.24xlarge", "39.0")]
    with pytest.raises(PricingError, match="ambiguous"):
        pricing.parse_price_list(two, "ml.p4d.24xlarge")
    with pytest.raises(PricingError, match="no on-demand"):
        pricing.parse_price_list([], "ml.p4d.24xlarge")
    with pytest.raises(PricingError, match="unparsable"):
        pricing.parse_price_list(["{not json"], "ml.p4d.24xlarge")


def test_refresh_from_price_list_api(client: Any) -> None:
    book = PriceBook.from_catalog(CATALOG, spot=SPOT)
    with Stubber(client) as stub:
        stub.add_response(
            "get_products",
            {"FormatVersion": "aws_v1", "PriceList": [_product("ml.p4d.24xlarge", "37.6880000000")]},
            _expected_params("ml.p4d.24xlarge"),
        )
        book.refresh_from_aws(["ml.p4d.24xlarge"], "us-east-1", client=client)
        stub.assert_no_pending_responses()
    price = book.get("ml.p4d.24xlarge")
    # spot re-derived from the new list price: 37.688 x 0.4 = 15.0752
    assert (price.on_demand_usd_per_hour, price.on_demand_source, price.date) == (
        37.688,
        "aws-price-list",
        "2025-06-01",
    )
    assert price.spot_usd_per_hour == pytest.approx(15.0752)
    assert book.notes == []


def test_refresh_falls_back_to_the_table_on_errors(client: Any) -> None:
    book = PriceBook.from_catalog(CATALOG, spot=SPOT)
    with Stubber(client) as stub:
        stub.add_client_error("get_products", "AccessDeniedException", "not authorized to perform pricing:GetProducts")
        stub.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": []})
        book.refresh_from_aws(["ml.g5.2xlarge", "ml.p4d.24xlarge"], "us-east-1", client=client)
    assert book.get("ml.g5.2xlarge").on_demand_usd_per_hour == 1.5
    assert book.get("ml.p4d.24xlarge").on_demand_usd_per_hour == 40.0
    assert len(book.notes) == 2
    assert "AccessDenied" in book.notes[0] and "catalog table" in book.notes[0]
    assert "no on-demand Training price" in book.notes[1]
    assert book.snapshot().notes == book.notes  # the reason travels with the stored result


def test_refresh_keeps_manifest_overrides(client: Any) -> None:
    book = PriceBook.from_catalog(CATALOG, spot=SPOT).with_manifest_overrides(
        RunTerms.stored({"targets": [{"instance_type": "ml.p4d.24xlarge", "price_per_hour_usd": 20.0}]})
    )
    with Stubber(client) as stub:
        stub.add_response(
            "get_products", {"FormatVersion": "aws_v1", "PriceList": [_product("ml.p4d.24xlarge", "37.688")]}
        )
        book.refresh_from_aws(["ml.p4d.24xlarge"], "us-east-1", client=client)
    assert book.get("ml.p4d.24xlarge").on_demand_usd_per_hour == 20.0
