"""What `gpuscout plan` predicts for a shipped manifest, one row per target x variant (memory refusals included), as
a data file and the table docs/costs.md shows. Not a test; run it by hand after a price or catalog change:

    .venv/bin/python benchmarks/plan_table.py [--manifest configs/manifests/single-gpu-2026.yaml]
    .venv/bin/python benchmarks/plan_table.py --manifest configs/manifests/lora-vs-full-7b.yaml

Each row is planned on its own (one target, one variant), so a refusal on one row does not hide the others; every
variant is planned on every target, its ``instance_types`` aside (the table shows where a method does not fit).
Writes benchmarks/results/plan-<manifest name>.json and rewrites the table between the markers in docs/costs.md;
tests/unit/test_plan_table.py fails when either no longer matches what the planner says today.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import yaml

from gpuscout.domain.catalog import load_catalog
from gpuscout.domain.manifest_loader import validate_manifest_data
from gpuscout.errors import GpuscoutError
from gpuscout.paths import MANIFESTS_DIR, REPO_DIR
from gpuscout.plan.planner import architecture, memory_per_gpu_gb, plan

DEFAULT_MANIFEST = MANIFESTS_DIR / "single-gpu-2026.yaml"
RESULTS_DIR = REPO_DIR / "benchmarks" / "results"
DOC = REPO_DIR / "docs" / "costs.md"
# Variants planned beside a manifest's own, to show where memory refuses each GPU. The single-GPU manifest: the same
# micro-batch without the fused loss, and without checkpointing. The 7B methods: a full fine-tune on one GPU at the
# smallest micro-batch, with every memory saving.
EXTRA_VARIANTS: dict[str, list[dict[str, Any]]] = {
    "single-gpu-2026": [
        {"name": "b4-a4-ckpt", "per_device_batch_size": 4, "gradient_accumulation_steps": 4,
         "gradient_checkpointing": True, "packing": True, "attention": "sdpa"},
        {"name": "b4-a4", "per_device_batch_size": 4, "gradient_accumulation_steps": 4, "packing": True,
         "attention": "sdpa"},
    ],
    "lora-vs-full-7b": [
        {"name": "full-b1-ckpt", "per_device_batch_size": 1, "gradient_accumulation_steps": 16,
         "gradient_checkpointing": True, "fused_cross_entropy": True},
    ],
}  # fmt: skip


def rows(manifest_path: Path) -> list[dict[str, Any]]:
    """One row per target x variant: the prediction with its price, or the planner's refusal."""
    catalog = load_catalog()
    data = yaml.safe_load(manifest_path.read_text())
    extra = EXTRA_VARIANTS.get(data["name"], [])
    out = []
    for target in data["targets"]:
        for listed in [*data["variants"], *extra]:
            variant = {k: v for k, v in listed.items() if k != "instance_types"}
            one = {**data, "targets": [target], "variants": [variant], "repetitions": 1}
            row: dict[str, Any] = {"instance_type": target["instance_type"], "variant": variant["name"],
                                   "method": variant.get("method", "full")}  # fmt: skip
            try:
                manifest = validate_manifest_data(one, str(manifest_path), catalog)
                [job] = plan(manifest, catalog, run_id="table").jobs
            except GpuscoutError as err:
                row["refused"] = " ".join(str(err).split(": ", 1)[-1].split())
                out.append(row)
                continue
            [planned] = manifest.variants
            inst = catalog.get(job.instance_type)
            hp = job.hyperparameters
            memory = memory_per_gpu_gb(
                architecture(manifest), seq=manifest.builtin()[2], batch=int(hp["per_device_train_batch_size"]),
                precision=job.precision, stage=planned.deepspeed_stage, world=inst.gpu_count * job.instance_count,
                variant=planned, accumulation=int(hp["gradient_accumulation_steps"]),
            )  # fmt: skip
            p, price, sku = job.prediction, job.price, catalog.get(job.instance_type).sku
            tokens_per_s = p.tokens_per_s or 0.0
            row.update(
                gpu=sku.model if sku else None,
                tokens_per_s=round(tokens_per_s, 1),
                memory_gb=round(memory, 1),
                gpu_memory_gb=inst.gpu_memory_gb,
                mfu_assumed=p.mfu_assumed,
                training_seconds=round(p.training_seconds, 1),
                cost_usd=round(p.cost_usd, 4),
                usd_per_hour=job.price_per_hour_usd,
                usd_per_million_tokens=round(job.price_per_hour_usd / 3600 / tokens_per_s * 1e6, 4),
                price=price.model_dump(mode="json") if price else None,
            )
            out.append(row)
    return out


def table(result: list[dict[str, Any]]) -> str:
    lines = [
        "| instance | GPU | variant | method | pred. tokens/s | pred. GB per GPU | $/h (price date) "
        "| pred. $ per 1M tokens | plan says |",
        "|---|---|---|---|---:|---:|---|---:|---|",
    ]
    for row in result:
        if "refused" in row:
            lines.append(f"| {row['instance_type']} | | {row['variant']} | {row['method']} | | | | | refused: "
                         f"{_short(row['refused'])} |")  # fmt: skip
            continue
        price = row["price"] or {}
        when = f"{price.get('kind', '')} {price.get('date', '')}".strip()
        lines.append(
            f"| {row['instance_type']} | {row['gpu']} | {row['variant']} | {row['method']} "
            f"| {row['tokens_per_s']:,.0f} | {row['memory_gb']:.1f} of {row['gpu_memory_gb']:g} "
            f"| {row['usd_per_hour']:.3f} ({when}) | {row['usd_per_million_tokens']:.3f} | fits |"
        )
    return "\n".join(lines)


def _short(refusal: str) -> str:
    """A memory refusal in a table cell: what it needs, what there is, what would fit."""
    found = re.search(
        r"needs ~([\d.]+) GB .*? but (\d+) GB is available \((\d+)% usable\).*?; (would fit: .*)$", refusal
    )
    if not found:
        return refusal
    need, have, usable, fits = found.groups()
    return f"needs ~{need} GB per GPU, has {have} GB ({usable} % usable); {fits}"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- plan table {name}: generated by benchmarks/plan_table.py -->", f"<!-- end plan table {name} -->"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifest", type=Path, default=DEFAULT_MANIFEST)
    args = parser.parse_args()
    name = yaml.safe_load(args.manifest.read_text())["name"]
    result = rows(args.manifest)
    out = RESULTS_DIR / f"plan-{name}.json"
    out.write_text(
        json.dumps({"manifest": str(args.manifest.resolve().relative_to(REPO_DIR)), "rows": result}, indent=2) + "\n"
    )
    begin, end = markers(name)
    doc = DOC.read_text()
    if begin not in doc or end not in doc:
        raise SystemExit(f"{DOC}: add the markers {begin!r} and {end!r} where the table goes")
    head, rest = doc.split(begin, 1)
    tail = rest.split(end, 1)[1]
    DOC.write_text(f"{head}{begin}\n{table(result)}\n{end}{tail}")
    print(f"wrote {out} and the table in {DOC}")


if __name__ == "__main__":
    main()
