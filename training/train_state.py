"""The records train.py's timed loop keeps: the progress a checkpoint saves and a resume restores (steps, tokens, loss
points, step records), the prepared splits, the parts the step loop drives, and one step's counters.

Imported by train_loop; may import benchmark_callback and gpuscout.domain."""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from benchmark_callback import StepRecord
from packing import CausalLMWithLoss

from gpuscout.domain.benchmark import LossPoint


@dataclass
class Progress:
    step: int = 0
    tokens: int = 0  # cumulative non-padding tokens, all ranks
    train_time_s: float = 0.0
    train_loss: list[LossPoint] = field(default_factory=list)
    validation_loss: list[LossPoint] = field(default_factory=list)
    records: list[StepRecord] = field(default_factory=list)

    def to_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens": self.tokens,
            "train_time_s": self.train_time_s,
            "train_loss": [p.model_dump() for p in self.train_loss],
            "validation_loss": [p.model_dump() for p in self.validation_loss],
            "records": [dataclasses.asdict(r) for r in self.records],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Progress:
        return cls(
            step=state["step"],
            tokens=state["tokens"],
            train_time_s=state["train_time_s"],
            train_loss=[LossPoint(**p) for p in state["train_loss"]],
            validation_loss=[LossPoint(**p) for p in state["validation_loss"]],
            records=[StepRecord(**r) for r in state["records"]],
        )


@dataclass
class Splits:
    """The prepared blocks (token ids, document segment ids) in the sequence length trained on."""

    train_ids: np.ndarray
    train_seg: np.ndarray
    val_ids: np.ndarray
    val_seg: np.ndarray


@dataclass
class Parts:
    """What the step loop drives and checkpoints save."""

    model: CausalLMWithLoss  # the module checkpoints save
    wrapped: Any  # what the forward runs through: the model, DDP or the DeepSpeed engine
    optimizer: Any
    scheduler: Any
    warmup: int  # benchmark warmup steps (also the LR warmup length)
    engine: Any = None  # DeepSpeed's engine, which owns optimizer and scheduler steps
    scaler: Any = None  # fp16 without DeepSpeed
    autocast: Any = field(default_factory=nullcontext)
    compute_dtype: torch.dtype = torch.float32


@dataclass
class StepWork:
    """One rank's counters of one optimizer step."""

    loss_sum: torch.Tensor
    tokens: int = 0
    samples: int = 0
    wait: float = 0.0
    grad_norm: float | None = None
    lr: float | None = None  # the learning rate this step's update used (read before the scheduler steps)
    usage: dict[str, Any] = field(default_factory=dict)  # rank 0's StepRecord usage fields (ResourceMeter.since)
