"""The records train.py's timed loop keeps: the progress a checkpoint saves and a resume restores (steps, tokens, loss
points, step records), the prepared splits, the parts the step loop drives, and one step's counters; and what a
checkpoint holds beside them (``training_state``, ``load_training_state``, ``restore_rng``).

Imported by trainer; may import metrics, checkpoints, packing and gpuscout.domain."""

from __future__ import annotations

import dataclasses
import random
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpuscout.domain.benchmark import LossPoint
from gpuscout.errors import TrainingError

from .checkpoints import DEEPSPEED, STATE, PartlyLoadedError
from .metrics import StepRecord
from .packing import CausalLMWithLoss


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


# -- what a checkpoint holds beside the model (checkpoints.py writes and verifies the folders)


def training_state(progress: Progress, parts: Parts) -> dict[str, Any]:
    """state.pt's content: the progress, the random generators, and without DeepSpeed the model, optimizer, scheduler
    and scaler (under DeepSpeed its engine saves those itself, on every rank)."""
    state: dict[str, Any] = {
        "progress": progress.to_state(),
        "rng": {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "python": random.getstate(),
        },
    }
    if parts.engine is None:
        state["model"] = trained_state(parts.model)
        state["optimizer"] = parts.optimizer.state_dict()
        state["scheduler"] = parts.scheduler.state_dict()
        state["scaler"] = parts.scaler.state_dict() if parts.scaler else None
    return state


def trained_state(model: torch.nn.Module) -> dict[str, Any]:
    """The model's state a checkpoint keeps: all of it, or an adapter run's trainable parameters alone (its frozen
    base is rebuilt as it was loaded: a 7B base is 15 GB a checkpoint need not write again, and a 4-bit base's
    quantization state could not be loaded back into bitsandbytes' layers)."""
    trainable = _adapter_keys(model)
    state = model.state_dict()
    return state if trainable is None else {k: state[k] for k in trainable}


def _adapter_keys(model: torch.nn.Module) -> set[str] | None:
    """The trainable parameters' names when some parameters are frozen (an adapter run), else None."""
    named = list(model.named_parameters())
    if all(p.requires_grad for _, p in named):
        return None
    return {name for name, p in named if p.requires_grad}


def load_trained_state(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """``trained_state`` back into ``model``: the whole state, or every trainable parameter; else TrainingError."""
    trainable = _adapter_keys(model)
    if trainable is None:
        model.load_state_dict(state)
        return
    unexpected, lost = sorted(set(state) - trainable), sorted(trainable - set(state))
    if unexpected or lost:
        raise TrainingError(f"the checkpoint's model state does not match this model: missing {lost[:5]}, "
                            f"unexpected {unexpected[:5]}")  # fmt: skip
    model.load_state_dict(state, strict=False)  # the frozen base's keys are absent by design


def load_training_state(folder: Path, parts: Parts) -> dict[str, Any]:
    """Read checkpoint ``folder`` into the model, optimizer and scheduler (or the engine); state.pt's content.
    Raises PartlyLoadedError once the model may have changed."""
    state: dict[str, Any] = torch.load(folder / STATE, map_location="cpu", weights_only=True)  # jobs write these
    # a corrupt or truncated state.pt raises above, before anything changed; from here on the model changes
    try:
        if parts.engine is not None:
            loaded, _ = parts.engine.load_checkpoint(str(folder.parent / DEEPSPEED), tag=folder.name)
            if loaded is None:  # DeepSpeed warns and returns None for a missing tag folder
                raise TrainingError(f"DeepSpeed found no checkpoint {folder.name} in {folder.parent / DEEPSPEED}")
        else:
            load_trained_state(parts.model, state["model"])
            parts.optimizer.load_state_dict(state["optimizer"])
            parts.scheduler.load_state_dict(state["scheduler"])
            if parts.scaler is not None and state.get("scaler"):
                parts.scaler.load_state_dict(state["scaler"])
    except Exception as err:
        raise PartlyLoadedError(f"{type(err).__name__}: {err}") from err
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """The random generators as the checkpoint left them."""
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    random.setstate(state["rng"]["python"])
