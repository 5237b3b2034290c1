"""A settings search's candidates (docs/search.md): the manifest's ``search.space`` (with an instance type's own
ranges) expanded over the base variant, each candidate a named :class:`Variant`; candidates the memory model says
will not fit, or whose micro-batch does not divide the fixed sequences per step, are skipped with why and never
launched. Pure logic: the local driver (gpuscout.local.search) and the cloud tuning request
(gpuscout.cloud.tuning_requests) both start from here."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from gpuscout.domain.candidates import candidate_name
from gpuscout.domain.manifest import Manifest
from gpuscout.domain.manifest_search import SEARCH_DIMENSIONS, SearchSpace
from gpuscout.domain.manifest_targets import Target
from gpuscout.domain.manifest_training import LoraSpec, Variant
from gpuscout.domain.search_plan import SearchPlan, SkippedCandidate
from gpuscout.plan.device_fit import device_refusal


def target_space(manifest: Manifest, target: Target) -> SearchSpace:
    """The space searched on ``target``: ``search.space`` with the instance type's own ranges in place."""
    assert manifest.search is not None
    return manifest.search.space.merged(manifest.search.by_instance_type.get(target.instance_type))


def dimensions(space: SearchSpace, base: Variant, *, default_batch: int) -> dict[str, list[Any]]:
    """Every dimension's values: the space's, or the base variant's one value."""
    out: dict[str, list[Any]] = {}
    for name in SEARCH_DIMENSIONS:
        values = getattr(space, name)
        if values is None:
            value = (base.lora or LoraSpec()).rank if name == "lora_rank" else getattr(base, name)
            values = [default_batch if name == "per_device_batch_size" and value is None else value]
        out[name] = list(values)
    return out


def adapter_update(base: Variant, settings: dict[str, Any]) -> dict[str, Any]:
    """A candidate's settings as Variant fields: the searched rank replaces the base's (its other lora knobs kept);
    a full candidate has no adapters."""
    update = {k: v for k, v in settings.items() if k != "lora_rank"}
    update["lora"] = None
    if settings["method"] != "full":
        update["lora"] = (base.lora or LoraSpec()).model_copy(update={"rank": settings["lora_rank"]})
    return update


def expand(
    manifest: Manifest,
    target: Target,
    *,
    default_batch: int,
    default_accumulation: int,
    world: int,
    device: str,
    need_gb: Callable[[Variant, int], float],
    capacity_gb: float | None,
    usable_fraction: float,
) -> tuple[list[Variant], list[SkippedCandidate], dict[str, list[Any]]]:
    """Candidates for ``target`` in a stable order (the space's order), those skipped and why, and the searched
    dimensions. ``need_gb(variant, micro_batch)`` is the memory model's peak per GPU (host on CPU)."""
    assert manifest.search is not None
    base = manifest.base_variant
    dims = dimensions(target_space(manifest, target), base, default_batch=default_batch)
    base_batch = base.per_device_batch_size or default_batch
    per_step = manifest.search.sequences_per_step or base_batch * (
        base.gradient_accumulation_steps or default_accumulation
    )
    keep, skipped = [], []
    for values in itertools.product(*dims.values()):
        settings = dict(zip(dims, values, strict=True))
        if settings["method"] == "full":  # no adapters, no rank: one full candidate, not one per rank
            if settings["lora_rank"] != dims["lora_rank"][0]:
                continue
            del settings["lora_rank"]
        micro = settings["per_device_batch_size"]
        accumulation = per_step // micro if per_step % micro == 0 else 0
        name = candidate_name(settings, max(accumulation, 1))
        if not accumulation:
            why = f"micro-batch {micro} does not divide search.sequences_per_step {per_step}"
            skipped.append(SkippedCandidate(name=name, settings=settings, reason=why))
            continue
        refusal = device_refusal(
            deepspeed_stage=settings["deepspeed_stage"],
            attention=settings["attention"],
            device=device,
            world=world,
            method=settings["method"],
        )
        if refusal is not None:
            skipped.append(SkippedCandidate(name=name, settings=settings, reason=refusal))
            continue
        if settings["method"] != "full" and settings["deepspeed_stage"]:
            why = f"method {settings['method']} trains only the adapters, with deepspeed_stage 0"
            skipped.append(SkippedCandidate(name=name, settings=settings, reason=why))
            continue
        variant = base.model_copy(update={**adapter_update(base, settings), "name": name,
                                          "gradient_accumulation_steps": accumulation})  # fmt: skip
        if capacity_gb is not None:
            need = need_gb(variant, micro)
            if need > usable_fraction * capacity_gb:
                why = (
                    f"memory model: needs ~{need:.1f} GB per {'GPU' if device == 'cuda' else 'host'}, "
                    f"{usable_fraction:.0%} of {capacity_gb:.0f} GB is usable"
                )
                skipped.append(SkippedCandidate(name=name, settings=settings, reason=why))
                continue
        keep.append(variant)
    searched = {k: v for k, v in dims.items() if len(v) > 1}
    return keep, skipped, searched


def describe_plan(plan: SearchPlan) -> list[str]:
    """One line per target (candidates, skipped and why, trial budget), for the plan view and the run log."""
    lines = []
    for t in plan.targets:
        dims = ", ".join(f"{k} {v}" for k, v in t.dimensions.items()) or "no searched dimension"
        lines.append(
            f"search on {t.instance_type}: {len(t.candidates)} candidate(s) over {dims}; up to {t.max_trials} "
            f"trial(s); {len(t.skipped)} skipped before launch"
        )
        lines += [f"  skipped {s.name}: {s.reason}" for s in t.skipped]
    return lines
