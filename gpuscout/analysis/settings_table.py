"""Each variant's training settings, as the report shows them: a column for every setting that differs between the
shown variants, and one line for the settings they all share. Read from each job's ``settings_key`` (what the job
actually ran: instance count, spot, precision and its hyperparameters), without the names, gpuscout's internal
fields, and the steady-state rule's settings under the fixed rule.

May import: gpuscout.domain.run_analysis and gpuscout.domain.jobspec."""

from __future__ import annotations

import json
from collections.abc import Sequence

from gpuscout.domain.jobspec import NAME_HYPERPARAMETERS, compared_settings
from gpuscout.domain.run_analysis import JobAnalysis

# A job's names and its instance type are in its row's label; compared_settings leaves out the internal ones
NAMES = NAME_HYPERPARAMETERS | {"instance_type"}
# The usual settings under the names docs/manifest.md uses, in the order a reader scans them; others follow by name
LABELS = {
    "instances": "instances",
    "spot": "spot",
    "per_device_train_batch_size": "micro-batch",
    "gradient_accumulation_steps": "accumulation",
    "sequence_length": "sequence",
    "precision": "precision",
    "packing": "packing",
    "attention_implementation": "attention",
    "gradient_checkpointing": "checkpointing",
    "deepspeed_stage": "ZeRO stage",
    "fused_cross_entropy": "fused loss",
    "cross_entropy_kernel": "loss kernel",
    "fused_adamw": "fused AdamW",
    "torch_compile": "compile",
    "dataloader_num_workers": "loader workers",
    "learning_rate": "learning rate",
    "weight_decay": "weight decay",
    "max_steps": "steps",
    "model_preset": "model",
    "model_name_or_path": "model",
    "seed": "seed",
    "stop_rule": "stop rule",
    "eval_interval": "validation every (steps)",
    "validation_batches": "validation batches",
    "checkpoint_interval": "checkpoint every (steps)",
}


def job_settings(job: JobAnalysis) -> dict[str, str] | None:
    """The settings a job ran with (LABELS' keys where known), None when its key is missing or unreadable."""
    try:
        _, count, spot, precision, _, hyperparameters = json.loads(job.settings_key or "")
    except (TypeError, ValueError):
        return None
    out = {"instances": str(count), "spot": "yes" if spot else "no", "precision": str(precision)}
    out |= {key: str(value) for key, value in compared_settings(hyperparameters or {}).items() if key not in NAMES}
    return out


def _order(key: str) -> tuple[int, str]:
    order = list(LABELS)
    return (order.index(key), "") if key in order else (len(order), key)


def settings_table(jobs: Sequence[JobAnalysis]) -> tuple[list[str], list[list[str]], str]:
    """(header, one row per job, the shared settings as one line): a column per setting whose value differs between
    the jobs (a job without it shows "–"); no rows when nothing differs (one variant, or repetitions only)."""
    known = [(job, s) for job in jobs if (s := job_settings(job)) is not None]
    if not known:
        return [], [], ""
    keys = sorted({key for _, s in known for key in s}, key=_order)
    differing = [k for k in keys if len({s.get(k) for _, s in known}) > 1]
    common = "; ".join(f"{LABELS.get(k, k)} {known[0][1][k]}" for k in keys if k not in differing)
    if not differing:
        return [], [], common
    header = ["instance / variant", *(LABELS.get(k, k) for k in differing)]
    rows = [[job.label, *(s.get(k, "–") for k in differing)] for job, s in known]
    return header, rows, common
