"""train.py's data pipeline: the prepared blocks as a dataset, the sampler that hands each step its micro-batches
on every rank, collation, the train/validation split and where each rank's validation batches start.

Imported by train.py; may import gpuscout.errors and args / distributed."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from gpuscout.errors import TrainingError

from .args import Hyperparameters
from .distributed import Dist


class StepBatches(torch.utils.data.Sampler[list[int]]):
    """Block indices of this rank's micro-batches, step by step, from ``first_step`` to ``max_steps``.

    The order is a function of (seed, epoch) only, so a resumed run sees exactly the batches it would have seen.
    """

    def __init__(self, blocks: int, hp: Hyperparameters, dist: Dist, first_step: int) -> None:
        self.blocks, self.hp, self.dist, self.first_step = blocks, hp, dist, first_step
        self._perms: dict[int, np.ndarray] = {}

    def _block(self, k: int) -> int:
        epoch, pos = divmod(k, self.blocks)
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.hp.seed, epoch]).permutation(self.blocks)}
        return int(self._perms[epoch][pos])

    def __iter__(self) -> Iterator[list[int]]:
        b, ga, world = self.hp.per_device_train_batch_size, self.hp.gradient_accumulation_steps, self.dist.world_size
        for step in range(self.first_step, self.hp.max_steps + 1):
            for micro in range(ga):
                base = (((step - 1) * ga + micro) * world + self.dist.rank) * b
                yield [self._block(base + i) for i in range(b)]

    def __len__(self) -> int:
        return max(0, self.hp.max_steps - self.first_step + 1) * self.hp.gradient_accumulation_steps


class Blocks(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, ids: np.ndarray, seg: np.ndarray) -> None:
        self.ids, self.seg = ids, seg

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(self.ids[i]), torch.from_numpy(self.seg[i])


def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([i for i, _ in items]), torch.stack([s for _, s in items])


def split_blocks(ids: np.ndarray, seg: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of the dataset's length cut into rows of ``length`` (which must divide it)."""
    if length == ids.shape[1]:
        return ids, seg
    if ids.shape[1] % length:
        raise TrainingError(
            f"sequence_length {length} must equal or divide the prepared block length {ids.shape[1]}; "
            "prepare the data again with the wanted --sequence-length"
        )
    return ids.reshape(-1, length), seg.reshape(-1, length)


def token_counts(seg: torch.Tensor, packing: bool) -> tuple[int, int]:
    """(non-padding tokens, prediction targets) of a CPU micro-batch, without touching the device."""
    real = seg > 0
    tokens = int(real.sum())
    starts = seg[:, 1:] != seg[:, :-1] if packing else torch.zeros_like(seg[:, 1:], dtype=torch.bool)
    targets = int((real[:, 1:] & ~starts).sum())
    return tokens, targets


# ---------------------------------------------------------------- validation


def validation_starts(blocks: int, batch: int, world: int, rank: int, max_batches: int) -> list[int | None]:
    """The first block of each validation micro-batch of ``rank``; None where the rank has no real batch but must
    still run a forward. Every rank gets the same number of entries: the batches of the busiest rank."""
    per_round = batch * world
    rounds = min(max_batches, -(-blocks // per_round)) if blocks else 0
    starts: list[int | None] = []
    for r in range(rounds):
        start = (r * world + rank) * batch
        starts.append(start if start < blocks else None)
    return starts


def validation_batches(
    ids: np.ndarray, seg: np.ndarray, batch: int, *, world: int, rank: int, max_batches: int
) -> Iterator[tuple[bool, torch.Tensor, torch.Tensor, int]]:
    """This rank's validation forwards: (a batch of its own?, ids, segment ids, rows that count) each.

    Every forward has exactly ``batch`` rows (a rank with no batch of its own runs the split's first). A short last
    batch is filled up with copies of its own rows, whose targets the caller ignores: every validation forward on
    every rank has one shape, so a compiled model compiles one validation graph (not one more for the short batch),
    and under ZeRO-3 every rank gathers the parameters the same number of times (the chunked loss calls the head once
    per chunk of rows)."""
    for start in validation_starts(len(ids), batch, world, rank, max_batches):
        lo = start if start is not None else 0
        rows = np.arange(lo, min(lo + batch, len(ids)))
        take = np.resize(rows, batch)
        yield start is not None, torch.from_numpy(ids[take]), torch.from_numpy(seg[take]), len(rows)
