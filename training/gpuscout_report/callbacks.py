"""Drop-in callbacks for the HF Trainer and PyTorch Lightning: one ``step`` per optimizer step, ``done`` at the end.
Each imports its framework only when called."""

from __future__ import annotations

from typing import Any

from .reporter import reporter


def hf_trainer_callback(*, samples_per_step: int, tokens_per_step: int | None = None) -> Any:
    """A transformers ``TrainerCallback``: one ``step`` per optimizer step (``samples_per_step`` = global batch),
    the loss from the Trainer's logs, ``should_training_stop`` when gpuscout has measured enough, ``done`` at the
    end. Imports transformers only when called."""
    from transformers import TrainerCallback

    rep = reporter()
    rep.reporter_name = "hf_trainer"

    class GpuscoutCallback(TrainerCallback):
        def __init__(self) -> None:
            self.last_loss: float | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            rep._last = rep._now()

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                self.last_loss = float(logs["loss"])

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if rep.step(samples=samples_per_step, tokens=tokens_per_step, loss=self.last_loss):
                control.should_training_stop = True
            return control

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            rep.done()

    return GpuscoutCallback()


def lightning_callback(*, samples_per_step: int, tokens_per_step: int | None = None) -> Any:
    """A PyTorch Lightning ``Callback`` (lightning.pytorch or pytorch_lightning): one ``step`` per training batch,
    the loss from the step's output, ``trainer.should_stop`` when gpuscout has measured enough, ``done`` at the
    end."""
    try:
        from lightning.pytorch import Callback
    except ImportError:
        from pytorch_lightning import Callback

    rep = reporter()
    rep.reporter_name = "lightning"

    class GpuscoutLightningCallback(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            rep._last = rep._now()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            value = float(loss.detach().cpu()) if loss is not None and hasattr(loss, "detach") else None
            if rep.step(samples=samples_per_step, tokens=tokens_per_step, loss=value):
                trainer.should_stop = True

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            rep.done()

    return GpuscoutLightningCallback()
