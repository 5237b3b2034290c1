"""Validation: the mean loss over the validation split's blocks, every rank running the same number of forwards.

Imported by trainer.py (after every eval_interval steps and once after the timed steps); may import the
components beside it."""

from __future__ import annotations

import torch

from .args import Hyperparameters
from .data import token_counts, validation_batches
from .distributed import Dist
from .packing import IGNORE_INDEX, eager_validation, make_inputs
from .state import Parts, Splits


def validation_loss(parts: Parts, data: Splits, hp: Hyperparameters, dist: Dist) -> float | None:
    """The loss per target token over up to ``hp.validation_batches`` batches of the validation split, summed over
    the ranks; None when there is nothing to validate. The model is back in training mode afterwards."""
    wrapped, ids, seg = parts.wrapped, data.val_ids, data.val_seg
    if hp.validation_batches == 0 or len(ids) == 0:
        return None
    loss_sum, target_sum = 0.0, 0
    wrapped.eval()
    with torch.no_grad(), eager_validation(hp.attention_implementation):
        # Every rank runs the same number of forwards (DDP broadcasts buffers and ZeRO-3 gathers parameters in each
        # forward: a rank that stops early leaves the others waiting for ever); a rank without a real batch of its
        # own runs the split's first blocks and counts nothing.
        batches = validation_batches(ids, seg, hp.per_device_train_batch_size, world=dist.world_size, rank=dist.rank,
                                     max_batches=hp.validation_batches)  # fmt: skip
        for real, ids_b, seg_b, counted in batches:
            _, targets = token_counts(seg_b[:counted], hp.packing)
            inputs = make_inputs(
                ids_b.to(dist.device), seg_b.to(dist.device), packing=hp.packing,
                attention=hp.attention_implementation, dtype=parts.compute_dtype,
            )  # fmt: skip
            inputs.labels[counted:] = IGNORE_INDEX  # the rows that fill up a short batch count for nothing
            with parts.autocast:
                loss = wrapped(inputs.input_ids, inputs.position_ids, inputs.attention_mask, inputs.labels)
            if real and targets > 0:
                loss_sum += float(loss) * targets
                target_sum += targets
    wrapped.train()
    total_loss, total_targets = dist.all_reduce_sum([loss_sum, float(target_sum)])
    return total_loss / total_targets if total_targets else None
