"""LoRA and QLoRA adapters on the causal LM (a variant's ``method``), built with peft: the frozen base at its storage
precision, the adapters trainable in fp32 (gpuscout.domain.adapters has the numbers the planner uses).

Storage of the frozen base (build.py frozen_dtype): on CUDA in bf16 (a frozen weight needs no fp32 master copy, and
autocast then makes no per-step copy of it), 4-bit NF4 for QLoRA's decoder linears (bitsandbytes, loaded by
model.py); in fp32 under fp16 (an fp16 residual stream overflows in Qwen2) and on a CPU, as train.py computes there.
peft keeps the adapters in fp32 (``autocast_adapter_dtype``), so their AdamW states and updates are fp32 as a full
fine-tune's are.

Imported by build.py (and benchmarks/memory_probe.py, the FLOPs tests); may import gpuscout.domain."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from gpuscout.domain.adapters import Adapter


def lora_config(adapter: Adapter) -> Any:
    """peft's LoraConfig for ``adapter``: no bias training, the causal-LM task."""
    from peft import LoraConfig

    return LoraConfig(
        r=adapter.rank,
        lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout,
        target_modules=list(adapter.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def add_adapters(lm: torch.nn.Module, adapter: Adapter, *, frozen_dtype: torch.dtype | None = None) -> Any:
    """Freeze ``lm`` (cast to ``frozen_dtype`` when given and not quantized) and inject ``adapter`` into it in place;
    returns peft's PeftModel around it (what saves the adapters alone). ``lm`` keeps its class and forward:
    CausalLMWithLoss wraps it as it wraps a fully trained model."""
    from peft import get_peft_model

    if frozen_dtype is not None and adapter.method == "lora":
        lm.to(frozen_dtype)
    with warnings.catch_warnings():
        # peft reads transformers' is_gradient_checkpointing, which transformers 5 deprecates in favour of
        # is_activation_checkpointing; the value is the same
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(lm, lora_config(adapter), autocast_adapter_dtype=True)


def qlora_load(compute_dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """from_pretrained's arguments for QLoRA's base (Dettmers et al. 2023): decoder linears in 4-bit NormalFloat with
    double-quantized block scales, computing in ``compute_dtype``; the embedding, norms and lm_head in that dtype
    (transformers keeps the head unquantized); the model on ``device``. Not prepare_model_for_kbit_training: it casts
    every unquantized weight, the embedding included, to fp32, which the planner does not count and QLoRA does not
    need (the adapters train in fp32 either way)."""
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )
    return {"quantization_config": config, "dtype": compute_dtype, "device_map": {"": device}}


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates (all of a full fine-tune's; only the adapters' otherwise)."""
    return [p for p in model.parameters() if p.requires_grad]
