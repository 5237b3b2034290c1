"""The baseline of benchmarks/hopper.py: a plain Hugging Face Trainer fine-tune, timed like train.py.

What a typical first attempt looks like: ``transformers.Trainer`` with per-device batch 4, gradient accumulation 2,
no packing (every document is its own row, padded to the block length by a data collator), the model's default
attention implementation, bf16 mixed precision on a GPU (fp32 on CPU), no gradient checkpointing, the Trainer's
default optimizer. The model is the same random-init Qwen2 preset train.py builds (same seed, same weights).

Same data as the optimized runs: the documents are the pieces of the prepared blocks (``segment_ids`` runs; a
document that did not fit in the rest of a block continues as a piece of the next one), so the baseline and the
packed, document-masked runs predict exactly the same target tokens and are validated on the same targets.

Timing (docs/performance.md): a TrainerCallback synchronizes the GPU and reads ``time.perf_counter`` at the end of
every optimizer step; a step's time is the interval since the previous step's end (data, forward, backward,
optimizer, logging), the first ``warmup`` steps are excluded, and tokens/s counts non-padding tokens only.

    python benchmarks/hf_trainer_baseline.py --data DATASET_DIR --model qwen2.5-1.5b --steps 120 --out baseline.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpuscout_data.dataset import DatasetSummary, load_split, load_summary, piece_spans
from gpuscout_train.metrics import default_warmup_steps, percentile

from gpuscout.domain import flops
from gpuscout.domain.disturbance import detect
from gpuscout.domain.hardware import detect_sku
from gpuscout.domain.intervals import ratio_ci95
from gpuscout.domain.models import PRESETS, Architecture

IGNORE_INDEX = -100


def documents(ids: np.ndarray, seg: np.ndarray) -> list[np.ndarray]:
    """The document pieces of packed blocks, in block order (padding dropped)."""
    rows, starts, ends = piece_spans(seg)
    return [ids[r, s:e].astype(np.int64) for r, s, e in zip(rows, starts, ends, strict=True)]


class Documents(torch.utils.data.Dataset[dict[str, list[int]]]):
    def __init__(self, pieces: list[np.ndarray]) -> None:
        self.pieces = pieces

    def __len__(self) -> int:
        return len(self.pieces)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.pieces[i].tolist()}


class PadToLength:
    """Data collator: pads (or truncates) every document to ``length`` tokens; padding is no target.

    Counts the non-padding tokens of each batch it builds into ``self.counts`` (a FIFO: the Trainer's data loader
    may build a batch before the step that uses it, so the timing callback pops counts in the order of use).
    """

    def __init__(self, length: int, pad_token_id: int) -> None:
        self.length, self.pad = length, pad_token_id
        self.counts: deque[int] = deque()

    def __call__(self, features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        n = len(features)
        input_ids = torch.full((n, self.length), self.pad, dtype=torch.long)
        attention_mask = torch.zeros((n, self.length), dtype=torch.long)
        for row, feature in enumerate(features):
            tokens = feature["input_ids"][: self.length]
            input_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            attention_mask[row, : len(tokens)] = 1
        labels = torch.where(attention_mask.bool(), input_ids, torch.full_like(input_ids, IGNORE_INDEX))
        self.counts.append(int(attention_mask.sum()))
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def build_model(preset_name: str, summary: DatasetSummary, seed: int) -> tuple[Any, Architecture]:
    """The random-init Qwen2 of train.build_model (same vocabulary rule, same seed: same weights), but with the
    attention implementation left at the transformers default."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    preset = PRESETS[preset_name]
    vocab = int(summary.tokenizer["vocab_size"])
    arch = preset.with_vocab(vocab if preset_name == "qwen2-tiny" else max(vocab, preset.vocab_size))
    torch.manual_seed(seed)
    config = Qwen2Config(
        **dict(arch.to_qwen2_config_kwargs()),  # type: ignore[arg-type]
        use_cache=False,
        eos_token_id=summary.tokenizer["eos_token_id"],
        pad_token_id=summary.tokenizer["pad_token_id"],
        bos_token_id=None,
    )
    return Qwen2ForCausalLM(config), arch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_timer_callback(collator: PadToLength, grad_accum: int) -> Any:
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Synchronized wall time and non-padding tokens of every optimizer step."""

        def __init__(self) -> None:
            self.last = 0.0
            self.steps: list[tuple[float, int, float | None]] = []  # (seconds, tokens, loss)
            self.loss: dict[int, float] = {}

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            _sync()
            self.last = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            _sync()
            now = time.perf_counter()
            tokens = sum(collator.counts.popleft() for _ in range(grad_accum))
            self.steps.append((now - self.last, tokens, None))
            self.last = now

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                self.loss[state.global_step] = float(logs["loss"])

    return StepTimer()


def validation_loss(model: Any, pieces: list[np.ndarray], collator: PadToLength, batch: int, device: Any) -> float:
    """Token-weighted mean next-token loss over every validation document (the targets train.py validates on)."""
    if not pieces:
        return float("nan")
    total, count = 0.0, 0
    model.eval()
    autocast: Any = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda" and torch.cuda.is_bf16_supported()
        else torch.autocast("cpu", enabled=False)
    )
    with torch.no_grad(), autocast:
        for start in range(0, len(pieces), batch):
            b = collator([{"input_ids": p.tolist()} for p in pieces[start : start + batch]])
            collator.counts.pop()
            logits = model(input_ids=b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device)).logits
            labels = b["labels"][:, 1:].to(device)
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                ignore_index=IGNORE_INDEX, reduction="sum",
            )  # fmt: skip
            total += float(loss)
            count += int((labels != IGNORE_INDEX).sum())
    return total / count if count else float("nan")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import transformers
    from transformers import Trainer, TrainingArguments

    summary = load_summary(args.data)
    train_pieces = documents(*load_split(args.data, "train"))
    # whole optimizer steps per epoch, so every step consumes exactly grad_accum batches (a few documents dropped)
    per_step = args.batch * args.grad_accum
    if len(train_pieces) < per_step:
        raise SystemExit(f"{args.data}: {len(train_pieces)} documents, fewer than one step's {per_step}")
    train_pieces = train_pieces[: len(train_pieces) - len(train_pieces) % per_step]
    val_pieces = documents(*load_split(args.data, "validation"))
    length = summary.sequence_length
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    bf16 = cuda and torch.cuda.is_bf16_supported()
    warmup = args.warmup if args.warmup is not None else default_warmup_steps(args.steps)
    model, arch = build_model(args.model, summary, args.seed)
    collator = PadToLength(length, int(summary.tokenizer["pad_token_id"]))
    timer = make_timer_callback(collator, args.grad_accum)
    training_args = TrainingArguments(
        output_dir=str(Path(args.out).parent / f".trainer-{Path(args.out).stem}"),
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=warmup,
        bf16=bf16,
        use_cpu=not cuda,
        seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=True,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=Documents(train_pieces),
        data_collator=collator,
        callbacks=[timer],
    )
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    peak_memory_gb = torch.cuda.max_memory_allocated() / 1e9 if cuda else None  # training only, not validation
    val = validation_loss(model, val_pieces, collator, 1, device)  # one row at a time: full logits are large

    timed = timer.steps[warmup:]
    seconds = sum(s for s, _, _ in timed)
    tokens = sum(t for _, t, _ in timed)
    tokens_per_s = tokens / seconds
    lengths = [min(len(p), length) for p in train_pieces]
    t_eff = flops.effective_context(lengths)
    model_flops = flops.model_flops_per_token(arch, t_eff)
    # executed FLOPs per non-padding token: every row computes all `length` positions, attention over `length`, and
    # the forward pass again when checkpointing recomputes it
    mean_len = sum(lengths) / len(lengths)
    executed = flops.hardware_flops_per_token(arch, float(length), activation_recompute=args.gradient_checkpointing)
    hardware_flops = executed * length / mean_len
    gpu_name = torch.cuda.get_device_name() if cuda else None
    peak = None
    if cuda:
        props = torch.cuda.get_device_properties(0)
        sku = detect_sku(props.name, props.total_memory / 1e9)
        peak = sku.peak_for("bf16" if bf16 else "fp16") if sku else None
    _, low, high = ratio_ci95([float(t) for _, t, _ in timed], [s for s, _, _ in timed])
    # the same judgment as train.py's: timed steps that did not run at one speed make tokens/s describe the disturbance
    steps = [{"step": i + 1, "seconds": sec, "tokens": tok, "timed": i >= warmup} for i, (sec, tok, _) in
             enumerate(timer.steps)]  # fmt: skip
    losses = [timer.loss[k] for k in sorted(timer.loss)]
    tail = losses[-max(1, math.ceil(0.1 * len(losses))) :]
    return {
        "status": "completed",
        "variant": "hf-trainer-baseline",
        "model": args.model,
        "gradient_checkpointing": args.gradient_checkpointing,
        "attention": str(model.config._attn_implementation),
        "optimizer": getattr(training_args.optim, "value", str(training_args.optim)),
        "precision": "bf16" if bf16 else "fp32",
        "per_device_batch_size": args.batch,
        "gradient_accumulation_steps": args.grad_accum,
        "sequence_length": length,
        "steps": len(timer.steps),
        "warmup_steps": warmup,
        "timed_steps": len(timed),
        "tokens_timed": tokens,
        "tokens_total": sum(t for _, t, _ in timer.steps),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_ci95": [low, high],
        "step_time_p50_s": percentile([s for s, _, _ in timed], 50),
        "disturbance": detect(steps),
        "padding_fraction_of_rows": 1 - mean_len / length,
        "t_eff": t_eff,
        "flops_per_token": model_flops,
        "hardware_flops_per_token": hardware_flops,
        "mfu": flops.mfu(tokens_per_s, model_flops, 1, peak) if peak else None,
        "hfu": flops.mfu(tokens_per_s, hardware_flops, 1, peak) if peak else None,
        "peak_memory_gb": peak_memory_gb,
        "loss_curve": losses,
        "final_train_loss": sum(tail) / len(tail) if tail else None,
        "final_validation_loss": val,
        "wall_time_s": wall,
        "device": gpu_name or f"cpu ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a dataset folder written by training/gpuscout_data/prepare.py")
    parser.add_argument("--model", required=True, choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default max(3, 10 %% of steps))")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute activations in backward (the plain-Trainer set-up a user tries when batch 4 does not fit)",
    )
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="JSON result file")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        result = run(args)
    except torch.OutOfMemoryError as err:
        # the peak reached before the failing allocation: how far over the card the set-up is
        peak = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None
        result = {
            "status": "failed",
            "variant": "hf-trainer-baseline",
            "failure_reason": f"CUDA out of memory: {str(err).splitlines()[0]}",
            "peak_memory_gb_at_failure": peak,
            "gradient_checkpointing": args.gradient_checkpointing,
        }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"[baseline] wrote {out} ({result['status']})", flush=True)
    return 0 if result["status"] == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
