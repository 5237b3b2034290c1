"""Prices per instance-hour: the catalog table, manifest overrides and the AWS Price List API.

Order of precedence for one instance type (highest first):

1. a manifest target's ``price_per_hour_usd`` / ``spot_price_per_hour_usd``;
2. the AWS Price List API (``refresh_from_aws``; cloud only, falls back to 2. with a logged reason on any error);
3. the catalog's price snapshot (``configs/pricing/sagemaker.json``, :mod:`gpuscout.domain.prices`), which
   ``gpuscout catalog --refresh`` rewrites from the Price List API (:func:`refresh_snapshot`).

Every price has a kind: ``snapshot``, ``live`` (the Price List API at analysis time) or ``manifest``.

Spot prices are not in the Price List API for SageMaker, so unless a target overrides them they are an
*assumption*: on-demand x (1 - discount) with the discount from ``configs/pricing/spot.json``. Every price keeps
its source, date and region, and ``PriceBook.snapshot()`` freezes them into a ``PriceSnapshot`` that is stored with
the result so a run can be re-priced later (``gpuscout.analysis.analyze.reprice``).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuscout import paths
from gpuscout.domain.prices import Component, ListedPrice, PriceFile, PriceKind
from gpuscout.domain.run_analysis import InstancePrice, PriceSnapshot, kind_of
from gpuscout.errors import PricingError

if TYPE_CHECKING:
    from gpuscout.analysis.terms import RunTerms

log = logging.getLogger(__name__)

PRICE_LIST_REGION = "us-east-1"  # the Price List API endpoint lives in us-east-1 (and ap-south-1)
SAGEMAKER_SERVICE_CODE = "AmazonSageMaker"


class SpotAssumption(BaseModel):
    """configs/pricing/spot.json: how spot prices are derived when nobody states one."""

    model_config = ConfigDict(extra="forbid")

    default_discount: float = Field(ge=0, lt=1)
    family_discounts: dict[str, float] = Field(default_factory=dict)  # e.g. {"ml.p5": 0.5}
    assumption: str
    source: str
    date: str

    def discount_for(self, instance_type: str) -> float:
        # Longest matching prefix wins, so "ml.p5e" can differ from "ml.p5".
        best = ""
        for prefix in self.family_discounts:
            if instance_type.startswith(prefix) and len(prefix) > len(best):
                best = prefix
        return self.family_discounts[best] if best else self.default_discount


def load_spot_assumption(path: Path | None = None) -> SpotAssumption:
    path = path or paths.PRICING_DIR / "spot.json"
    try:
        return SpotAssumption.model_validate_json(path.read_bytes())
    except (OSError, ValidationError) as err:
        raise PricingError(f"cannot read the spot price assumption {path}: {err}") from err


def _field(obj: object, name: str, default: object = None) -> object:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _catalog_entries(catalog: Any) -> Iterable[tuple[str, Any]]:
    """(instance_type, entry) pairs from a gpuscout.domain.catalog.Catalog, a mapping, or an iterable of entries."""
    if catalog is None:
        return []
    for attr in ("instances", "entries"):
        inner = getattr(catalog, attr, None)
        if inner is not None:
            catalog = inner
            break
    if isinstance(catalog, Mapping):
        return list(catalog.items())
    return [(str(_field(e, "instance_type")), e) for e in catalog]


class PriceBook:
    """On-demand and spot price per instance-hour, with where each number came from."""

    def __init__(
        self, prices: Mapping[str, InstancePrice] | None = None, *, spot: SpotAssumption | None = None
    ) -> None:
        self._prices: dict[str, InstancePrice] = dict(prices or {})
        self.spot = spot or load_spot_assumption()
        self.notes: list[str] = []

    # -- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_catalog(cls, catalog: Any, *, spot: SpotAssumption | None = None) -> PriceBook:
        """The catalog's prices: a Catalog's snapshot prices, or (tests) a mapping of type -> price fields."""
        book = cls(spot=spot)
        for instance_type, entry in _catalog_entries(catalog):
            listed = getattr(entry, "price", None)
            if listed is not None:
                book._prices[instance_type] = book._derived(
                    instance_type, listed.usd_per_hour, on_demand_source=f"catalog: {listed.source}",
                    date=listed.date, region=listed.region, kind=listed.kind,
                )  # fmt: skip
                continue
            on_demand = _field(entry, "on_demand_usd_per_hour")
            if not isinstance(on_demand, int | float):
                continue
            book._prices[instance_type] = book._derived(
                instance_type,
                float(on_demand),
                on_demand_source=f"catalog: {_field(entry, 'price_source', 'unknown source')}",
                date=str(_field(entry, "price_date", "")),
                region=str(_field(entry, "price_region", "")),
                kind="snapshot",
            )
        return book

    @classmethod
    def from_snapshot(cls, snapshot: PriceSnapshot | Mapping[str, Any]) -> PriceBook:
        snap = snapshot if isinstance(snapshot, PriceSnapshot) else PriceSnapshot.model_validate(snapshot)
        book = cls(snap.prices)
        book.notes = list(snap.notes)
        return book

    def _derived(
        self, instance_type: str, on_demand: float, *, on_demand_source: str, date: str, region: str,
        kind: PriceKind | None = None,
    ) -> InstancePrice:  # fmt: skip
        discount = self.spot.discount_for(instance_type)
        return InstancePrice(
            kind=kind or kind_of(on_demand_source),
            instance_type=instance_type,
            on_demand_usd_per_hour=on_demand,
            spot_usd_per_hour=on_demand * (1.0 - discount),
            on_demand_source=on_demand_source,
            spot_source=f"assumed {discount:.0%} discount on on-demand ({self.spot.source})",
            date=date,
            region=region,
        )

    def set_on_demand(self, instance_type: str, usd_per_hour: float, *, source: str, date: str, region: str) -> None:
        """Set an on-demand price; a spot price that was itself derived is re-derived, an override is kept."""
        old = self._prices.get(instance_type)
        new = self._derived(instance_type, usd_per_hour, on_demand_source=source, date=date, region=region)
        if old is not None and not old.spot_source.startswith("assumed"):
            new = new.model_copy(update={"spot_usd_per_hour": old.spot_usd_per_hour, "spot_source": old.spot_source})
        self._prices[instance_type] = new

    def with_manifest_overrides(self, terms: RunTerms) -> PriceBook:
        """Apply the manifest's targets[].price_per_hour_usd / spot_price_per_hour_usd (the run's terms)."""
        for target in terms.targets:
            instance_type = target.instance_type
            on_demand = target.price_per_hour_usd
            spot = target.spot_price_per_hour_usd
            if not instance_type or (on_demand is None and spot is None):
                continue
            if on_demand is not None:
                old = self._prices.get(instance_type)
                self.set_on_demand(
                    instance_type,
                    float(on_demand),
                    source="manifest override",
                    date=old.date if old else "",
                    region=old.region if old else "",
                )
            if spot is not None:
                current = self._prices.get(instance_type)
                if current is None:
                    raise PricingError(
                        f"{instance_type}: a spot price override needs an on-demand price too "
                        "(not in the catalog; set price_per_hour_usd on the target)"
                    )
                self._prices[instance_type] = current.model_copy(
                    update={"spot_usd_per_hour": float(spot), "spot_source": "manifest override"}
                )
        return self

    # -- lookup -------------------------------------------------------------------------------------------
    def __contains__(self, instance_type: object) -> bool:
        return instance_type in self._prices

    def get(self, instance_type: str) -> InstancePrice:
        try:
            return self._prices[instance_type]
        except KeyError as err:
            known = ", ".join(sorted(self._prices)) or "none"
            raise PricingError(f"no price for {instance_type!r} (priced: {known})") from err

    def ensure(self, instance_type: str, on_demand: float, spot: float | None, *, source: str) -> InstancePrice:
        """The book's price, or (when the book has none) one from a job spec's plan-time prices."""
        if instance_type not in self._prices:
            price = self._derived(instance_type, on_demand, on_demand_source=source, date="", region="")
            if spot is not None:
                price = price.model_copy(update={"spot_usd_per_hour": spot, "spot_source": source})
            self._prices[instance_type] = price
        return self._prices[instance_type]

    def setdefault(self, price: InstancePrice) -> InstancePrice:
        """Add ``price`` unless the book already prices that instance type; return the book's price."""
        return self._prices.setdefault(price.instance_type, price)

    def snapshot(self) -> PriceSnapshot:
        return PriceSnapshot(
            prices=dict(sorted(self._prices.items())),
            spot_assumption=self.spot.assumption,
            taken_at=datetime.now(UTC),
            notes=list(self.notes),
        )

    # -- AWS Price List API -------------------------------------------------------------------------------
    def refresh_from_aws(self, instance_types: Iterable[str], region: str, *, client: Any = None) -> PriceBook:
        """Replace on-demand prices with the Price List API's SageMaker Training prices for ``region``.

        Any error (no permission, throttling, no product, unparsable answer) keeps the table price and records
        the reason in ``notes`` (and the log); the analysis never fails because the Price List API did.
        """
        if client is None:
            try:
                import boto3

                client = boto3.client("pricing", region_name=PRICE_LIST_REGION)
            except Exception as err:  # boto3 raises many kinds here (no region, no credentials, ...)
                self._note(f"AWS Price List API unavailable ({err}); using the catalog table")
                return self
        for instance_type in sorted(set(instance_types)):
            try:
                usd, date = fetch_sagemaker_training_price(client, instance_type, region)
            except Exception as err:  # any failure falls back to the table, by design (see docstring)
                self._note(f"{instance_type}: Price List API lookup failed ({err}); using the catalog table price")
                continue
            current = self._prices.get(instance_type)
            if current is not None and current.on_demand_source == "manifest override":
                continue  # the user's own price outranks the list price
            self.set_on_demand(instance_type, usd, source="aws-price-list", date=date, region=region)
        return self

    def _note(self, message: str) -> None:
        log.warning(message)
        self.notes.append(message)


def fetch_sagemaker_training_price(
    client: Any, instance_type: str, region: str, component: str = "Training"
) -> tuple[float, str]:
    """On-demand USD per hour and effective date of SageMaker ``component`` (Training, Processing) on
    ``instance_type`` in ``region``."""
    pages = client.get_paginator("get_products").paginate(
        ServiceCode=SAGEMAKER_SERVICE_CODE,
        Filters=[
            {"Type": "TERM_MATCH", "Field": "instanceName", "Value": instance_type},
            {"Type": "TERM_MATCH", "Field": "regionCode", "Value": region},
            {"Type": "TERM_MATCH", "Field": "component", "Value": component},
        ],
        FormatVersion="aws_v1",
        MaxResults=10,
    )
    price_list = [entry for page in pages for entry in page.get("PriceList", [])]
    return parse_price_list(price_list, instance_type, component)


def refresh_snapshot(
    catalog: Any, *, region: str, client: Any, today: str, previous: PriceFile | None = None
) -> PriceFile:
    """A new price snapshot: the Price List API's on-demand rate for every cloud type in ``catalog`` (Training for
    training types, Processing for processing types). A type the API answers with no single rate is listed under
    ``unpriced`` with the answer. A type whose lookup failed (throttling, network) keeps its ``previous`` entry, with
    its old date. PricingError when not one rate came back (credentials, permission, region): the old snapshot is
    then kept rather than replaced by an empty one."""
    prices: dict[str, ListedPrice] = {}
    unpriced: dict[str, str] = {}
    errors: list[str] = []
    kept_types: list[str] = []  # failed lookups whose previous rate stays
    if previous is not None and previous.region != region:
        previous = None  # another region's rates are not this region's
    for inst in catalog:
        if inst.is_local:
            continue
        component: Component = "Processing" if inst.role == "processing" else "Training"
        try:
            usd, effective = fetch_sagemaker_training_price(client, inst.instance_type, region, component)
        except PricingError as err:  # the API answered, but with no single on-demand rate
            unpriced[inst.instance_type] = f"Price List API, {today}: {err}"
            continue
        except Exception as err:  # botocore's errors (credentials, AccessDenied, throttling) and network failures
            errors.append(f"{inst.instance_type}: {err}")
            if previous is not None and inst.instance_type in previous.prices:
                prices[inst.instance_type] = previous.prices[inst.instance_type]  # its old date says how old
                kept_types.append(inst.instance_type)
            elif previous is not None and inst.instance_type in previous.unpriced:
                unpriced[inst.instance_type] = previous.unpriced[inst.instance_type]
            else:
                unpriced[inst.instance_type] = f"Price List API lookup failed on {today}: {err}"
            continue
        prices[inst.instance_type] = ListedPrice(
            usd_per_hour=usd,
            component=component,
            date=today,
            effective_date=effective or None,
            source=(
                f"AWS Price List API (pricing:GetProducts, service {SAGEMAKER_SERVICE_CODE}, component {component}, "
                f"{region}), effective {effective or 'date not given'}"
            ),
        )
    read = len(prices) - len(kept_types)
    if read <= 0:
        first = errors[0] if errors else next(iter(unpriced.values()), "the catalog has no cloud types")
        raise PricingError(f"the AWS Price List API returned no rate for any type ({first}); snapshot not changed")
    kept = f"; {len(errors)} lookups failed, {len(kept_types)} kept their previous rate" if errors else ""
    return PriceFile(
        region=region,
        written=today,
        method=f"AWS Price List API refresh (`gpuscout catalog --refresh`, {read} rates read{kept})",
        prices=dict(sorted(prices.items())),
        unpriced=dict(sorted(unpriced.items())),
    )


def parse_price_list(price_list: list[str], instance_type: str, component: str = "Training") -> tuple[float, str]:
    """Parse get_products' PriceList (JSON strings) into (USD per hour, effective date).

    Only on-demand terms in USD per hour ("Hrs") for the requested instance and ``component`` count (the product's
    ``component`` attribute, or its usage type, e.g. ``USE1-Train:ml.p5.48xlarge``, where the attribute is absent).
    Several matching products with different prices are ambiguous and rejected.
    """
    found: set[tuple[float, str, str]] = set()  # (USD per hour, effective date, usage type)
    for raw in price_list:
        try:
            item = json.loads(raw)
        except (TypeError, json.JSONDecodeError) as err:
            raise PricingError(f"unparsable Price List entry for {instance_type}: {err}") from err
        attributes = item.get("product", {}).get("attributes", {})
        if attributes.get("instanceName", attributes.get("instanceType")) != instance_type:
            continue
        if not _is_component(attributes, component, instance_type):
            continue
        for term in item.get("terms", {}).get("OnDemand", {}).values():
            date = str(term.get("effectiveDate", ""))[:10]
            for dimension in term.get("priceDimensions", {}).values():
                if dimension.get("unit") not in ("Hrs", "Hours", "Hour"):
                    continue
                usd = dimension.get("pricePerUnit", {}).get("USD")
                if usd is None:
                    continue
                value = float(usd)
                if value > 0:
                    found.add((value, date, str(attributes.get("usagetype", ""))))
    if not found:
        raise PricingError(f"the Price List API has no on-demand {component} price for {instance_type}")
    prices = {usd for usd, _, _ in found}
    if len(prices) > 1:  # several usage types: keep the plain one (USE1-Train:<type>), not e.g. a spot or flex variant
        plain = {
            f for f in found if re.fullmatch(rf"[A-Z0-9]+-{_usage_word(component)}:{re.escape(instance_type)}", f[2])
        }
        if len({usd for usd, _, _ in plain}) == 1:
            found = plain
        else:
            usages = ", ".join(sorted({f"{usage or 'no usage type'} ${usd:g}" for usd, _, usage in found}))
            raise PricingError(f"ambiguous Price List answer for {instance_type}: {usages}")
    usd, date_, _ = max(found, key=lambda p: p[1])
    return usd, date_


USAGE_COMPONENTS = {"Training": "Train", "Processing": "Processing"}  # the usage type's word for each component


def _usage_word(component: str) -> str:
    return USAGE_COMPONENTS.get(component, component)


def _is_component(attributes: Mapping[str, Any], component: str, instance_type: str) -> bool:
    if "component" in attributes:
        return bool(attributes["component"] == component)
    usage = str(attributes.get("usagetype", ""))
    return usage.endswith(f"-{_usage_word(component)}:{instance_type}")
