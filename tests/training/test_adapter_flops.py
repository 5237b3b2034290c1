"""The FLOPs per token of adapter runs (gpuscout.domain.flops, "Adapters") against torch's FlopCounterMode.

Real Qwen2 models with peft's LoRA adapters (gpuscout_train.adapters.add_adapters) run forward, loss and backward on
one packed row of T tokens, a single document, so T_eff = T; the counter sees every matmul autograd runs, on all T
positions (the loss covers T - 1 predictions, the matmuls run on every position), so its total / T is compared.

Attention on a CPU: "eager" computes it with matmuls that the counter counts, and autograd skips the gradient of
each of q, k, v that needs none. "sdpa" runs the fused CPU kernel (_scaled_dot_product_flash_attention_for_cpu),
which the counter has no formula for (it would count no attention at all), so the tests map it to the four
matmuls of the convention's attention backward; the kernel, like the CUDA ones, returns the gradients of q, k and
v together whenever it runs. torch's own formula for the CUDA kernels also counts the recomputed scores in the
backward (5 matmuls), which the PaLM convention leaves out.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from gpuscout.domain import flops
from gpuscout.domain.adapters import DEFAULT_TARGET_MODULES, Adapter
from gpuscout.domain.models import PRESETS, Architecture

T = 24
RANK = 4
TINY = PRESETS["qwen2-tiny"]  # 2 layers, 4 heads, 2 kv heads, tied embeddings
ARCHS = {
    "tiny": TINY,
    "mha-untied": dataclasses.replace(TINY, num_key_value_heads=4, tie_word_embeddings=False, vocab_size=1000),
    "mqa-3-layers": dataclasses.replace(
        TINY, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=1, intermediate_size=96
    ),
}
TARGETS = {
    "all-linear": DEFAULT_TARGET_MODULES,
    "q-v": ("q_proj", "v_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
    "o": ("o_proj",),
    "down": ("down_proj",),
    "k": ("k_proj",),
}


def _sdpa_cpu_forward(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """scores = q k^T and out = P v: 2 x (2 b h s_q s_k d) (key and value may have fewer heads: GQA)."""
    b, h, s_q, d = query
    return 2 * 2 * b * h * s_q * key[2] * d


def _sdpa_cpu_backward(grad_out: Any, query: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """dP = dO v^T, dv = P^T dO, dq = dS k, dk = dS^T q: 4 x (2 b h s_q s_k d)."""
    b, h, s_q, d = query
    return 4 * 2 * b * h * s_q * args[0][2] * d


SDPA_CPU = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_forward,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward,
}


def counted_flops_per_token(
    arch: Architecture, adapter: Adapter | None, attention: str, *, checkpointing: bool = False
) -> float:
    """Matmul FLOPs of one training step on one row of T tokens, per token."""
    from gpuscout_train.adapters import add_adapters
    from gpuscout_train.packing import CausalLMWithLoss
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config: dict[str, Any] = {**arch.to_qwen2_config_kwargs(), "attn_implementation": attention}
    lm = Qwen2ForCausalLM(Qwen2Config(**config))
    if adapter is not None:
        add_adapters(lm, adapter)
    if checkpointing:  # after the adapters, as build.build_model_with_loss does
        with warnings.catch_warnings():  # transformers 5 deprecates the name build.py calls, for another
            warnings.simplefilter("ignore", FutureWarning)
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = CausalLMWithLoss(lm).train()
    ids = torch.randint(0, arch.vocab_size, (1, T))
    with FlopCounterMode(display=False, custom_mapping=SDPA_CPU) as counter:
        model(ids, torch.arange(T)[None], None, ids).backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    assert all(p.grad is not None for p in trained)  # the adapters (or every weight) did get gradients
    return counter.get_total_flops() / T


def eager_skips(arch: Architecture, adapter: Adapter) -> float:
    """FLOPs per token of the first block's attention backward that the fused kernels compute and eager autograd
    skips: of scores = q k^T and out = P v, the gradient of q, k, v each only if adapted, and dP only if q or k is;
    none of it when no q, k or v is adapted (then the convention skips the block's attention backward too)."""
    adapted = set(adapter.target_modules) & {"q_proj", "k_proj", "v_proj"}
    if not adapted:
        return 0.0
    runs = len(adapted) + bool(adapted & {"q_proj", "k_proj"})  # matmuls of the four that eager runs
    return (4 - runs) * 2.0 * arch.num_attention_heads * arch.attention_head_dim * T


# every target set on one architecture, a few on the others (each case builds and steps a model: ~0.1 s)
SDPA_CASES = [("mqa-3-layers", t) for t in TARGETS] + [
    ("tiny", "all-linear"),
    ("tiny", "q-v"),
    ("tiny", "o"),
    ("mha-untied", "all-linear"),
    ("mha-untied", "mlp"),
    ("mha-untied", "k"),
]


@pytest.mark.parametrize(("arch_name", "targets"), SDPA_CASES)
def test_adapter_flops_match_what_sdpa_computes(arch_name: str, targets: str) -> None:
    arch, adapter = ARCHS[arch_name], Adapter("lora", rank=RANK, dropout=0.0, target_modules=TARGETS[targets])
    expected = flops.model_flops_per_token(arch, float(T), adapter=adapter)
    assert counted_flops_per_token(arch, adapter, "sdpa") == pytest.approx(expected, rel=1e-12)
    assert flops.hardware_flops_per_token(arch, float(T), activation_recompute=False, adapter=adapter) == expected


@pytest.mark.parametrize("targets", list(TARGETS))
def test_adapter_flops_match_eager_autograd(targets: str) -> None:
    arch, adapter = ARCHS["tiny"], Adapter("lora", rank=RANK, dropout=0.0, target_modules=TARGETS[targets])
    expected = flops.model_flops_per_token(arch, float(T), adapter=adapter) - eager_skips(arch, adapter)
    assert counted_flops_per_token(arch, adapter, "eager") == pytest.approx(expected, rel=1e-12)


def test_adapter_flops_by_hand() -> None:
    """qwen2-tiny (h 64, I 176, 2 layers, 4 heads of 16, 2 kv heads, V 4096), rank 4 on o_proj only."""
    adapter = Adapter("lora", rank=RANK, target_modules=("o_proj",))
    n_matmul = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 176) + 64 * 4096  # 354,304
    n_adapter = 2 * 4 * (64 + 64)  # 1,024
    attention = 12 * 2 * 4 * 16 * T
    # the first block skips the input gradients of q, k, v, o (2 x 12,288) and of o's A (2 x 4 x 64), and its
    # attention backward (8 x 4 x 16 x T)
    skipped = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64) + 2 * 4 * 64 + 8 * 4 * 16 * T
    expected = 4 * n_matmul + 6 * n_adapter + attention - skipped
    assert flops.model_flops_per_token(TINY, float(T), adapter=adapter) == expected
    # the base gets no weight gradients: about 2/3 of a full fine-tune's work where attention is small
    assert 0.6 < expected / flops.model_flops_per_token(TINY, float(T)) < 0.7


@pytest.mark.parametrize(
    ("arch_name", "attention"), [("tiny", "sdpa"), ("tiny", "eager"), ("mha-untied", "sdpa"), ("mqa-3-layers", "sdpa")]
)
def test_full_fine_tune_flops_match_the_counter(arch_name: str, attention: str) -> None:
    """The PaLM convention counts the lm_head's matmul also when tied, as the counter does; nothing is skipped."""
    arch = ARCHS[arch_name]
    assert counted_flops_per_token(arch, None, attention) == pytest.approx(
        flops.model_flops_per_token(arch, float(T)), rel=1e-12
    )


@pytest.mark.parametrize("early_stop", [False, True])
@pytest.mark.parametrize("targets", [None, "q-v", "down"])
def test_recompute_adds_a_forward_and_skips_nothing(targets: str | None, early_stop: bool) -> None:
    """Under gradient checkpointing transformers makes the embedding's output require a gradient, so the first
    block skips nothing, and each decoder layer runs its forward again. The convention counts the whole forward
    again; what runs is less: the lm_head is outside the per-layer checkpoints (with the plain loss; the chunked
    loss, the default fused one, re-runs it in its own backward), and torch's early stop (its default, which
    train.py keeps) ends a layer's recompute once the last tensor backward needs is saved, before the last matmul
    (down_proj's, or its adapter's B) runs."""
    arch = ARCHS["tiny"]
    adapter = None if targets is None else Adapter("lora", rank=RANK, target_modules=TARGETS[targets])
    expected = flops.hardware_flops_per_token(arch, float(T), activation_recompute=True, adapter=adapter)
    not_rerun = 2.0 * arch.hidden_size * arch.vocab_size  # the lm_head
    if early_stop:
        last = RANK if adapter is not None and "down_proj" in adapter.target_modules else arch.intermediate_size
        not_rerun += arch.num_hidden_layers * 2.0 * last * arch.hidden_size
    with set_checkpoint_early_stop(early_stop):
        counted = counted_flops_per_token(arch, adapter, "sdpa", checkpointing=True)
    assert counted == pytest.approx(expected - not_rerun, rel=1e-12)
