"""A settings-search candidate's name and back (docs/search.md "Candidates"): ``candidate_name`` writes the slug
the planner gives a candidate (gpuscout.plan.search), ``parse_candidate_name`` reads it back. In domain/ because
the training image needs the reverse: a SageMaker tuning trial gets only the name (its ``search_candidate``
hyperparameter) and train.py turns it into settings."""

from __future__ import annotations

from typing import Any

# How a searched value shows in a candidate's name (b4-a2-z2-ckpt-compile-fce-eager-w0).
_FLAGS = {"gradient_checkpointing": "ckpt", "torch_compile": "compile", "fused_cross_entropy": "fce"}


def candidate_name(settings: dict[str, Any], accumulation: int) -> str:
    """A short slug that tells candidates apart: micro-batch and accumulation always, the rest when not default (an
    adapter method with its rank: ``lora-r16``)."""
    parts = [f"b{settings['per_device_batch_size']}", f"a{accumulation}"]
    if settings["deepspeed_stage"]:
        parts.append(f"z{settings['deepspeed_stage']}")
    parts += [flag for key, flag in _FLAGS.items() if settings[key]]
    if settings["attention"] != "sdpa":
        parts.append(settings["attention"])
    if settings.get("method", "full") != "full":
        parts += [settings["method"], f"r{settings['lora_rank']}"]
    parts.append(f"w{settings['dataloader_workers']}")
    return "-".join(parts)


def parse_candidate_name(name: str) -> dict[str, Any]:
    """The settings a candidate name stands for (the inverse of :func:`candidate_name`): every search dimension
    plus ``gradient_accumulation_steps``; what the name leaves out has its default (no ZeRO, flags off, sdpa).
    Raises ValueError for a name ``candidate_name`` cannot have written. A SageMaker tuning trial gets only the
    name (its ``search_candidate`` hyperparameter); train.py turns it back into settings with this."""
    numbers = {"b": "per_device_batch_size", "a": "gradient_accumulation_steps", "z": "deepspeed_stage",
               "w": "dataloader_workers", "r": "lora_rank"}  # fmt: skip
    flags = {flag: key for key, flag in _FLAGS.items()}
    settings: dict[str, Any] = {"deepspeed_stage": 0, **dict.fromkeys(_FLAGS, False), "attention": "sdpa",
                                "method": "full"}  # fmt: skip
    for part in name.split("-"):
        if part[:1] in numbers and part[1:].isdigit():
            settings[numbers[part[:1]]] = int(part[1:])
        elif part in flags:
            settings[flags[part]] = True
        elif part in ("eager", "flex"):
            settings["attention"] = part
        elif part in ("lora", "qlora"):
            settings["method"] = part
        else:
            raise ValueError(f"{name!r} is not a search candidate name (unknown part {part!r})")
    required = ("per_device_batch_size", "gradient_accumulation_steps", "dataloader_workers")
    written = None
    if all(key in settings for key in required) and (settings["method"] == "full") == ("lora_rank" not in settings):
        written = candidate_name(settings, settings["gradient_accumulation_steps"])
    if written != name:  # a part missing, repeated or out of order
        raise ValueError(f"{name!r} is not a search candidate name (candidate_name never writes it so)")
    return settings
