"""The timed loop's parts, each built by one function (as torchtitan's trainer builds its components): the data
splits, the model with its loss, the optimizer and learning-rate schedule, the engine that drives them (DeepSpeed,
DDP or the model itself) and the step loader. Each records in ``facts`` (train_result.RunFacts) what the result
reports about it: the dataset, the sequence length, T_eff, the architecture and the optimizations in use.

Imported by trainer.py; may import gpuscout.domain and gpuscout.errors, and the components beside it."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from gpuscout_data.dataset import load_split, load_summary, piece_lengths

from gpuscout.domain import flops
from gpuscout.domain.adapters import QLORA_ON_CPU
from gpuscout.errors import TrainingError

from .adapters import add_adapters, qlora_load, trainable_parameters
from .args import Hyperparameters
from .data import Blocks, StepBatches, collate, split_blocks
from .distributed import Dist
from .metrics import default_warmup_steps
from .model import build_model, deepspeed_collectives_through_torch, deepspeed_config, import_deepspeed
from .packing import CausalLMWithLoss, unpack_blocks
from .result import RunFacts
from .state import Parts, Splits


def build_splits(data_dir: Path, hp: Hyperparameters, facts: RunFacts) -> Splits:
    """The prepared train and validation blocks (one padded row per document piece without packing)."""
    facts.summary = load_summary(data_dir)
    train_ids, train_seg = load_split(data_dir, "train")
    val_ids, val_seg = load_split(data_dir, "validation")
    facts.sequence_length = hp.sequence_length or facts.summary.sequence_length
    train_ids, train_seg = split_blocks(train_ids, train_seg, facts.sequence_length)
    val_ids, val_seg = split_blocks(val_ids, val_seg, facts.sequence_length)
    if not hp.packing:  # one padded row per document piece; padding is neither counted nor a target
        train_ids, train_seg = unpack_blocks(train_ids, train_seg)
        val_ids, val_seg = unpack_blocks(val_ids, val_seg)
    if len(train_ids) == 0:
        raise TrainingError(f"{data_dir}: the train split is empty")
    # Each token attends within its own document piece either way (document mask or a row of its own).
    facts.t_eff = flops.effective_context(piece_lengths(train_seg))
    return Splits(train_ids, train_seg, val_ids, val_seg)


def warmup_steps(hp: Hyperparameters) -> int:
    """The untimed first steps: the hyperparameter, or the default for max_steps; at least one step stays timed."""
    warmup = hp.warmup_steps if hp.warmup_steps is not None else default_warmup_steps(hp.max_steps)
    if warmup >= hp.max_steps:
        raise TrainingError(f"warmup_steps={warmup} leaves no timed step with max_steps={hp.max_steps}")
    return warmup


def build_model_with_loss(hp: Hyperparameters, dist: Dist, facts: RunFacts) -> CausalLMWithLoss:
    """The causal LM (preset, path, channel or S3) with its loss, gradient checkpointing and compilation as asked."""
    assert facts.summary is not None
    quantized = None
    if hp.method == "qlora":
        if dist.device.type != "cuda":
            raise TrainingError(QLORA_ON_CPU)
        quantized = qlora_load({"fp16": torch.float16, "fp32": torch.float32}.get(facts.precision, torch.bfloat16),
                               dist.device)  # fmt: skip
    frozen = frozen_dtype(dist, facts.precision) if hp.method == "lora" else None  # read in it: no fp32 host copy
    with tempfile.TemporaryDirectory(prefix="gpuscout-model-") as work:
        lm, facts.arch, facts.model_name = build_model(hp, facts.summary, Path(work), quantized=quantized, dtype=frozen)
    facts.params_total = lm.num_parameters()  # a 4-bit weight counts as its parameters, not its packed bytes
    adapter = hp.adapter()
    if adapter is not None:
        facts.adapter_model = add_adapters(lm, adapter, frozen_dtype=frozen)
        facts.params_trainable = sum(p.numel() for p in trainable_parameters(lm))
        facts.optimizations.append(f"{adapter.method}_r{adapter.rank}")
    else:
        facts.params_trainable = facts.params_total
    if hp.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        facts.optimizations.append("gradient_checkpointing")
    loss_kind = "plain"
    if hp.fused_cross_entropy:
        from .packing import fused_loss

        try:
            loss_kind = fused_loss(hp.cross_entropy_kernel, device_type=dist.device.type,
                                   zero3=hp.deepspeed_stage == 3)  # fmt: skip
        except ValueError as err:
            raise TrainingError(str(err)) from err
        facts.optimizations.append(f"{loss_kind}_cross_entropy")
    model = CausalLMWithLoss(lm, loss=loss_kind)
    if hp.method != "qlora":  # a 4-bit model is placed on its GPU as it loads (model.py)
        model = model.to(dist.device)
    if hp.torch_compile:
        model.compile()
        facts.optimizations.append("torch_compile")
    return model


def frozen_dtype(dist: Dist, precision: str) -> torch.dtype | None:
    """An adapter run's frozen base on CUDA in bf16 (a frozen weight needs no fp32 master, and autocast then makes no
    copy of it); None (fp32) on a CPU, where train.py computes in fp32, and under fp16, whose residual stream
    overflows in Qwen2 when the embedding is stored in fp16 (autocast copies the fp32 base instead)."""
    return torch.bfloat16 if dist.device.type == "cuda" and precision == "bf16" else None


def build_optimizer(
    model: CausalLMWithLoss, hp: Hyperparameters, dist: Dist, facts: RunFacts, warmup: int
) -> tuple[Any, Any]:
    """AdamW over the trainable parameters (every one, or an adapter run's adapters; no weight decay on biases and
    norms) and a linear learning-rate warm-up over the warm-up steps."""
    cuda = dist.device.type == "cuda"
    trained = trainable_parameters(model)
    decay = [p for p in trained if p.ndim >= 2]
    no_decay = [p for p in trained if p.ndim < 2]
    adam_kwargs: dict[str, Any] = {"lr": hp.learning_rate, "betas": (0.9, 0.95), "eps": 1e-8}
    if hp.fused_adamw:
        adam_kwargs["fused" if cuda else "foreach"] = True
        facts.optimizations.append("fused_adamw" if cuda else "foreach_adamw")
    else:
        adam_kwargs["foreach"] = False
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        **adam_kwargs,
    )
    lr_warmup = max(1, warmup)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / lr_warmup))
    return optimizer, scheduler


def build_parts(
    model: CausalLMWithLoss, optimizer: Any, scheduler: Any, warmup: int, *, hp: Hyperparameters, dist: Dist,
    facts: RunFacts,
) -> Parts:  # fmt: skip
    """What the step loop drives: DeepSpeed's engine (it owns optimizer and scheduler), DDP across ranks, or the model
    itself; with the autocast and compute dtype of the precision."""
    parts = _wrapped(model, optimizer, scheduler, warmup, hp=hp, dist=dist, facts=facts)
    if dist.device.type == "cuda" and facts.precision != "fp32" and parts.engine is None:
        half = torch.bfloat16 if facts.precision == "bf16" else torch.float16
        parts.autocast = torch.autocast("cuda", dtype=half)
    parts.compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(facts.precision, torch.float32)
    return parts


def _wrapped(
    model: CausalLMWithLoss, optimizer: Any, scheduler: Any, warmup: int, *, hp: Hyperparameters, dist: Dist,
    facts: RunFacts,
) -> Parts:  # fmt: skip
    if hp.deepspeed_stage:
        deepspeed = import_deepspeed()
        if dist.device.type == "cpu":
            deepspeed_collectives_through_torch()
        assert facts.arch is not None
        facts.optimizations.append(f"deepspeed_zero{hp.deepspeed_stage}")
        ds_config = deepspeed_config(hp, facts.precision, dist.world_size, facts.arch.hidden_size)
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        return Parts(model, engine, optimizer, scheduler, warmup, engine=engine)
    wrapped: Any = model
    if dist.world_size > 1:
        # gradients as views of DDP's buckets: no second copy (4 B/param), as plan/memory.py state_bytes assumes
        devices = [dist.local_rank] if dist.device.type == "cuda" else None
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=devices, gradient_as_bucket_view=True)
    scaler = torch.amp.GradScaler("cuda") if facts.precision == "fp16" else None
    return Parts(model, wrapped, optimizer, scheduler, warmup, scaler=scaler)


def build_loader(
    data: Splits, hp: Hyperparameters, dist: Dist, facts: RunFacts, first_step: int
) -> torch.utils.data.DataLoader[Any]:
    """The train blocks in the order of StepBatches from ``first_step`` on (a resumed job continues its order)."""
    pinned = hp.pin_memory and dist.device.type == "cuda"
    if pinned:  # with pageable memory a non_blocking host-to-device copy is synchronous
        facts.optimizations.append("pinned_memory")
    return torch.utils.data.DataLoader(
        Blocks(data.train_ids, data.train_seg),
        batch_sampler=StepBatches(len(data.train_ids), hp, dist, first_step),
        num_workers=hp.dataloader_num_workers,
        collate_fn=collate,
        pin_memory=pinned,
        persistent_workers=False,
    )
