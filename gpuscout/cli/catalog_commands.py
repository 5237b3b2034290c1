"""The ``gpuscout catalog`` command: the instance types gpuscout knows, one type in full with every source, and
``--refresh`` of the price snapshot from the AWS Price List API.

``register(app)`` adds it to the main typer app (gpuscout/cli/app.py), whose command group turns every GpuscoutError
into one red line and an exit code. boto3 is imported only by ``--refresh``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from gpuscout.cli.console_style import Column, fit_piped_width, number_cell, responsive_table
from gpuscout.domain.prices import REFRESH_COMMAND, STALE_AFTER_DAYS, CatalogPrice
from gpuscout.errors import PricingError

if TYPE_CHECKING:
    from gpuscout.domain.catalog import Catalog, InstanceType

console = Console()


def catalog_cmd(
    instance_type: Annotated[
        str | None,
        typer.Argument(help="Show one instance type in full: every fact with its source, and its price's source."),
    ] = None,
    refresh: Annotated[
        bool,
        typer.Option(
            "--refresh",
            help="Read every type's SageMaker on-demand rate from the AWS Price List API (needs AWS credentials with "
            "pricing:GetProducts) and rewrite the price snapshot, configs/pricing/sagemaker.json.",
        ),
    ] = False,
    region: Annotated[
        str, typer.Option("--region", help="The region whose rates --refresh reads.", metavar="REGION")
    ] = "us-east-1",
) -> None:
    """List the instance types gpuscout knows: GPUs, memory, peak TFLOPS, how each is sold, and its on-demand price
    with the price's kind, date and source."""
    from gpuscout.domain.catalog import load_catalog

    fit_piped_width(console)

    catalog = load_catalog()
    if refresh:
        catalog = _refresh_prices(catalog, region)
    if instance_type is not None:
        _print_instance(catalog.get(instance_type), catalog)
        return
    columns = [
        Column("instance type", whole=True),
        Column("GPUs", justify="right", whole=True),
        Column("GPU"),
        Column("GPU mem GB", justify="right", whole=True),
        Column("bf16 TFLOPS/GPU", justify="right", whole=True),
        Column("vCPU", justify="right", whole=True),
        Column("RAM GiB", justify="right", whole=True),
        Column("links"),
        Column("sold as"),
        Column("$/h on-demand", justify="right", whole=True),
        Column("price"),
    ]
    cells = []
    stale = 0
    for inst in catalog:
        sku = inst.sku
        peak = sku.peak_for("bf16") if sku else None
        price = inst.price
        stale += bool(price and price.stale())
        links = "EFA" if inst.efa else ""
        if inst.interconnect:
            links = f"{inst.interconnect.replace('nvlink', 'NVLink').replace('pcie', 'PCIe')} {links}".strip()
        cells.append([
            inst.instance_type,
            str(inst.gpu_count),
            escape(sku.model) if sku else "-",
            number_cell(inst.gpu_memory_gb, "{:.0f}"),
            number_cell(peak, "{:.0f}") if sku else "-",
            number_cell(inst.vcpus, "{}"),
            number_cell(inst.memory_gib, "{:.0f}"),
            links or "-",
            _sold_as(inst),
            number_cell(price.usd_per_hour, "{:.3f}") if price else "-",
            _price_label(price, inst.is_local),
        ])  # fmt: skip
    responsive_table(console, "Instance catalog", columns, cells, key=0)
    if catalog.prices is not None:
        console.print(f"Prices: {escape(catalog.prices.method)}", soft_wrap=True)
        for unpriced_type, why in catalog.prices.unpriced.items():
            console.print(
                f"  {unpriced_type}: no price ({escape(why)}); a manifest targeting it states price_per_hour_usd",
                soft_wrap=True,
            )
    if stale:
        console.print(
            f"[yellow]{stale} STALE price(s), read more than {STALE_AFTER_DAYS} days ago: refresh with "
            f"`{REFRESH_COMMAND}`[/]",
            soft_wrap=True,
        )


def _sold_as(inst: InstanceType) -> str:
    """How the type is bought ("on demand, spot, training plan"); ``local`` is this machine."""
    return "this machine" if inst.is_local else ", ".join(o.replace("_", " ") for o in inst.purchase_options)


def _print_instance(inst: InstanceType, catalog: Catalog) -> None:
    """One instance type in full: hardware facts, what is unconfirmed, how it is sold, its GPU and price, sources."""
    sku = inst.sku
    console.print(f"[bold]{inst.instance_type}[/] ({inst.role})")
    facts = {
        "GPUs": f"{inst.gpu_count} x {sku.model}, {inst.gpu_memory_gb:g} GB each" if sku else "none",
        "GPU interconnect": inst.interconnect or ("-" if inst.gpu_count < 2 else "unconfirmed"),
        "vCPU": inst.vcpus, "memory GiB": inst.memory_gib, "local NVMe GB": inst.nvme_gb,
        "network Gbps": inst.network_gbps, "EFA": "yes" if inst.efa else "no",
        "sold as": _sold_as(inst),
    }  # fmt: skip
    for name, value in facts.items():
        console.print(f"  {name}: {escape(str('unconfirmed' if value is None else value))}", soft_wrap=True)
    if inst.unconfirmed:
        console.print(f"  unconfirmed (left unknown): {', '.join(inst.unconfirmed)}", soft_wrap=True)
    for source in inst.sources:
        console.print(f"  source ({inst.sources_date}): {escape(source)}", soft_wrap=True)
    if sku is not None:
        peaks = ", ".join(f"{k} {v:g}" for k, v in sku.peak_tflops.items()) or "none published"
        mfu = (
            f"{sku.assumed_mfu:g} ({sku.assumed_mfu_basis})" if sku.assumed_mfu else "none: not predictable from FLOPs"
        )
        console.print(f"  GPU {sku.sku}: dense TFLOPS {peaks}; assumed utilization {escape(mfu)}", soft_wrap=True)
        for source in sku.sources:
            console.print(f"  GPU source ({sku.source_date}): {escape(source)}", soft_wrap=True)
    price = inst.price
    if price is not None:
        console.print(
            f"  price: ${price.usd_per_hour:,.4f}/h on-demand SageMaker {price.component} ({price.label()}); "
            f"source: {escape(price.source)}",
            soft_wrap=True,
        )
    elif not inst.is_local:
        why = catalog.prices.unpriced.get(inst.instance_type, "not listed") if catalog.prices else "no snapshot"
        console.print(f"  price: unknown ({escape(why)}); a target states price_per_hour_usd", soft_wrap=True)
    if inst.notes:
        console.print(f"  notes: {escape(inst.notes)}", soft_wrap=True)


def _price_label(price: CatalogPrice | None, local: bool) -> str:
    if local:
        return "the manifest states it"
    if price is None:
        return "unknown (below)"
    text = price.label()
    return f"[yellow]{escape(text)}[/]" if price.stale() else escape(text)


def _refresh_prices(catalog: Catalog, region: str) -> Catalog:
    """Rewrite the snapshot from the Price List API; the old file stays when no rate could be read."""
    from datetime import UTC, datetime

    import boto3
    import botocore.config
    import botocore.exceptions

    from gpuscout.analysis.pricing import PRICE_LIST_REGION, refresh_snapshot
    from gpuscout.domain.catalog import load_catalog
    from gpuscout.domain.prices import write_price_file

    try:  # standard retries ride out the Price List API's throttling over a few dozen calls
        config = botocore.config.Config(retries={"mode": "standard", "max_attempts": 10})
        client = boto3.client("pricing", region_name=PRICE_LIST_REGION, config=config)
    except botocore.exceptions.BotoCoreError as err:
        raise PricingError(f"cannot reach the AWS Price List API: {err}") from err
    today = datetime.now(UTC).date().isoformat()
    cloud_types = sum(1 for inst in catalog if not inst.is_local)
    with console.status(f"reading {cloud_types} rates from the AWS Price List API ({region})"):
        snapshot = refresh_snapshot(catalog, region=region, client=client, today=today, previous=catalog.prices)
    path = write_price_file(snapshot)
    console.print(
        f"wrote {path}: {len(snapshot.prices)} rates, {len(snapshot.unpriced)} types without one", soft_wrap=True
    )
    for instance_type, why in snapshot.unpriced.items():
        console.print(f"  [yellow]{instance_type}[/]: {escape(why)}", soft_wrap=True)
    return load_catalog()


def register(app: typer.Typer) -> None:
    """Add the catalog command to the gpuscout app."""
    app.command("catalog")(catalog_cmd)
