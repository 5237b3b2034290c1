"""LoRA and QLoRA: what a variant's ``method`` trains, in the numbers the planner's memory model, the FLOPs count and
train.py share (docs/metrics.md "Adapters").

A LoRA adapter on a linear layer ``W`` (``in_features -> out_features``) adds ``B @ A`` with ``A: in -> rank`` and
``B: rank -> out``, scaled by ``alpha / rank`` (Hu et al. 2021); only A and B train, ``W`` stays frozen. QLoRA
(Dettmers et al. 2023) stores the frozen decoder linears in 4-bit NormalFloat with double-quantized block scales and
trains the same adapters in the compute dtype; it needs bitsandbytes on CUDA.

May import: gpuscout.domain.models."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from gpuscout.domain.models import Architecture

Method = Literal["full", "lora", "qlora"]
AdapterMethod = Literal["lora", "qlora"]
# The decoder block's linear layers, in the order a token meets them (Qwen2 and Llama name them alike).
LinearModule = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LINEAR_MODULES: tuple[LinearModule, ...] = get_args(LinearModule)
# Every linear layer of the block: the QLoRA paper's finding (adapters on all of them match full fine-tuning; on
# q and v alone they do not), and what most recipes for the Qwen and Llama families use.
DEFAULT_TARGET_MODULES = LINEAR_MODULES
DEFAULT_RANK = 16
DEFAULT_ALPHA = 32
DEFAULT_DROPOUT = 0.0  # peft's default; a dropout saves a dropped copy of each adapted input for backward

# QLoRA's storage of a quantized weight: 4 bits, plus one absmax per block of 64 weights, itself quantized to 8 bits
# with an fp32 scale per 256 absmaxes (double quantization): 0.5 + 1/64 + 4/(64 x 256) bytes per weight
# (bitsandbytes' Params4bit with blocksize 64 and compress_statistics, the QLoRA paper's section 3).
QLORA_BYTES_PER_WEIGHT = 0.5 + 1.0 / 64.0 + 4.0 / (64.0 * 256.0)

# QLoRA's 4-bit base is bitsandbytes' NF4 storage and kernels, which the training job runs on CUDA only.
QLORA_ON_CPU = (
    "method qlora stores the frozen base in 4 bits with bitsandbytes, which gpuscout's job runs on CUDA GPUs only; "
    "use method lora on a CPU (the same adapters on a base in full precision)"
)


@dataclass(frozen=True)
class Adapter:
    """A LoRA (or QLoRA) adapter setting: the rank, scale, dropout and which linear layers of every decoder block
    carry one."""

    method: AdapterMethod
    rank: int = DEFAULT_RANK
    alpha: int = DEFAULT_ALPHA
    dropout: float = DEFAULT_DROPOUT
    target_modules: tuple[str, ...] = field(default=DEFAULT_TARGET_MODULES)

    def __post_init__(self) -> None:
        unknown = [m for m in self.target_modules if m not in LINEAR_MODULES]
        if unknown or not self.target_modules:
            raise ValueError(f"target_modules {', '.join(unknown) or 'none'}; allowed: {', '.join(LINEAR_MODULES)}")
        if self.rank < 1:
            raise ValueError("rank must be at least 1")

    @property
    def label(self) -> str:
        """How reports name it: ``LoRA r=16``, ``QLoRA r=64``."""
        return f"{'QLoRA' if self.method == 'qlora' else 'LoRA'} r={self.rank}"


def module_shapes(arch: Architecture) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear layer of one decoder block."""
    h, i = arch.hidden_size, arch.intermediate_size
    q = arch.num_attention_heads * arch.attention_head_dim
    kv = arch.num_key_value_heads * arch.attention_head_dim
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def adapter_params(arch: Architecture, adapter: Adapter) -> int:
    """Trainable parameters: rank x (in + out) per adapted layer, in every decoder block."""
    shapes = module_shapes(arch)
    per_block = sum(adapter.rank * (shapes[m][0] + shapes[m][1]) for m in adapter.target_modules)
    return arch.num_hidden_layers * per_block


def decoder_linear_params(arch: Architecture) -> int:
    """Weights of the decoder blocks' linear layers (what QLoRA stores in 4 bits; biases, norms, the embedding and
    the lm_head stay in the compute dtype, as transformers' bitsandbytes integration leaves the head unquantized)."""
    return arch.num_hidden_layers * sum(i * o for i, o in module_shapes(arch).values())
