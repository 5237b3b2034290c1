"""The shipped price snapshot: configs/pricing/sagemaker.json, SageMaker on-demand USD per instance-hour.

One dated document, apart from the hardware facts (which do not change when AWS changes a price): for each instance
type the on-demand rate of the SageMaker component it is used for (Training for training types, Processing for the
data-preparation type), the date the rate was read from its source, and the source. ``gpuscout catalog --refresh``
rewrites the file from the AWS Price List API (gpuscout.analysis.pricing); a type whose rate could not be confirmed
is listed under ``unpriced`` with the reason, and a manifest must then state ``price_per_hour_usd``.

A price has a *kind* wherever it is shown: ``snapshot`` (this file), ``live`` (the Price List API at analysis time)
or ``manifest`` (a target's override). A snapshot price read more than :data:`STALE_AFTER_DAYS` days ago is stale:
shown with the command that refreshes it.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from gpuscout import paths
from gpuscout.domain.config_files import read_config_file, write_whole
from gpuscout.errors import CatalogError

STALE_AFTER_DAYS = 90
REFRESH_COMMAND = "gpuscout catalog --refresh"
PRICE_FILE = "sagemaker.json"
PriceKind = Literal["snapshot", "live", "manifest"]
Component = Literal["Training", "Processing"]


class ListedPrice(BaseModel):
    """One instance type's on-demand rate as read from its source."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    usd_per_hour: float = Field(gt=0)
    component: Component
    date: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$")  # the day the rate was read from its source
    source: str = Field(min_length=1)
    effective_date: str | None = Field(default=None, pattern=r"^\d{4}-\d{2}-\d{2}$")  # the Price List's own date


class PriceFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    region: str = Field(pattern=r"^[a-z]{2}(-[a-z]+)+-\d$")
    currency: Literal["USD"] = "USD"
    written: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$")
    method: str = Field(min_length=1)  # how the file was made: a Price List refresh, or curated public copies
    prices: dict[str, ListedPrice]
    unpriced: dict[str, str] = Field(default_factory=dict)  # instance type -> why no rate is listed


class CatalogPrice(BaseModel):
    """A catalog price as the planner and every display use it: the rate, its kind, region, date and source."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    usd_per_hour: float
    kind: PriceKind
    region: str
    date: str
    source: str
    component: Component = "Training"

    def stale(self, today: dt.date | None = None) -> bool:
        return stale_days(self.kind, self.date, today) is not None

    def label(self, today: dt.date | None = None) -> str:
        """'snapshot 2026-11-20 us-east-1', 'manifest', or when stale 'snapshot 2025-08-01 us-east-1 STALE (483 d)'."""
        if self.kind == "manifest":
            return "manifest"
        text = f"{self.kind} {self.date} {self.region}".strip()
        if (age := stale_days(self.kind, self.date, today)) is not None:
            text += f" STALE ({age} d)"
        return text


def stale_days(kind: str, date: str, today: dt.date | None = None) -> int | None:
    """How many days old a snapshot price read on ``date`` is by ``today`` (default: today, UTC), when that is more
    than STALE_AFTER_DAYS; None for a fresh one, another kind of price, or no readable date."""
    if kind != "snapshot":
        return None
    try:
        age = ((today or dt.datetime.now(dt.UTC).date()) - dt.date.fromisoformat(date)).days
    except ValueError:
        return None
    return age if age > STALE_AFTER_DAYS else None


def price_file_path(config_dir: Path | str | None = None) -> Path:
    base = Path(config_dir) if config_dir is not None else paths.CONFIG_DIR
    return (base / "pricing" / PRICE_FILE).resolve()


@functools.cache
def _load(path: str, stamp: tuple[int, int]) -> PriceFile:
    return read_config_file(Path(path), PriceFile, "price snapshot")


def load_price_file(config_dir: Path | str | None = None) -> PriceFile:
    """Load and validate the price snapshot (cached per path, modification time and size)."""
    path = price_file_path(config_dir)
    try:
        stat = path.stat()
    except OSError as err:
        raise CatalogError(f"{path}: cannot read the price snapshot: {err}; run `{REFRESH_COMMAND}`") from err
    return _load(str(path), (stat.st_mtime_ns, stat.st_size))


def catalog_price(prices: PriceFile, instance_type: str) -> CatalogPrice | None:
    listed = prices.prices.get(instance_type)
    if listed is None:
        return None
    return CatalogPrice(
        usd_per_hour=listed.usd_per_hour,
        kind="snapshot",
        region=prices.region,
        date=listed.date,
        source=listed.source,
        component=listed.component,
    )


def write_price_file(prices: PriceFile, config_dir: Path | str | None = None) -> Path:
    """Write the snapshot atomically (a temporary file renamed over the old one): a failed write keeps the old file."""
    path = price_file_path(config_dir)
    text = json.dumps(prices.model_dump(mode="json", exclude_none=True), indent=2, sort_keys=False) + "\n"
    try:
        write_whole(path, text)
    except OSError as err:
        raise CatalogError(f"cannot write the price snapshot {path}: {err}") from err
    return path
