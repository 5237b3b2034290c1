"""The optimizations change speed, not numerics (docs/performance.md).

Optimized path (train.py with packing, fused_cross_entropy, fused_adamw): documents packed into one block with a
block-diagonal causal mask, chunked cross-entropy, foreach AdamW on CPU (fused on CUDA). Baseline path: the plain
transformers model run on each document separately with ``labels`` (its own loss), plain for-loop AdamW. Same
initial weights, same data: the loss, every gradient and the weights after a few optimizer steps agree.

flex attention runs on CPU too, but compiling it there takes about 100 s on a 2-core machine, so the CPU test uses
SDPA with the 4D document mask; the flex and Liger variants run where CUDA is present. Each fused loss the
``cross_entropy_kernel`` setting offers (chunked, torch's linear_cross_entropy, Liger) is held to the same bar.
"""

from __future__ import annotations

import pytest
import torch
from gpuscout_train.packing import CausalLMWithLoss, liger_available, make_inputs, torch_linear_cross_entropy_available
from transformers import Qwen2Config, Qwen2ForCausalLM

from gpuscout.domain.models import PRESETS

VOCAB = 211
LENGTHS = (9, 23, 14, 5)  # four documents in one block of 56 tokens (5 of padding)
BLOCK = 56
LR = 1e-2
STEPS = 3


def _model(attention: str, device: str) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    kwargs = dict(PRESETS["qwen2-tiny"].with_vocab(VOCAB).to_qwen2_config_kwargs())
    config = Qwen2Config(**kwargs, use_cache=False)  # type: ignore[arg-type]
    config._attn_implementation = attention
    model = Qwen2ForCausalLM(config)
    model.to(device)  # type: ignore[arg-type]  # transformers' typed wrapper of Module.to
    return model.train()


def _documents() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def _packed(docs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    pad = BLOCK - sum(LENGTHS)
    ids = torch.cat([*docs, torch.zeros(pad, dtype=torch.long)])[None, :]
    seg = torch.cat([torch.full((len(d),), i + 1) for i, d in enumerate(docs)] + [torch.zeros(pad)]).long()[None, :]
    return ids, seg


def _baseline_loss(model: Qwen2ForCausalLM, docs: list[torch.Tensor], device: str) -> torch.Tensor:
    """Each document alone through the HF model with labels; token-weighted mean over all targets."""
    total = torch.zeros((), device=device)
    for doc in docs:
        d = doc.to(device)[None, :]
        total = total + model(input_ids=d, labels=d).loss * (len(doc) - 1)
    return total / sum(n - 1 for n in LENGTHS)


def _optimized_loss(wrapper: CausalLMWithLoss, docs: list[torch.Tensor], attention: str, device: str) -> torch.Tensor:
    ids, seg = _packed(docs)
    inputs = make_inputs(ids.to(device), seg.to(device), packing=True, attention=attention, dtype=torch.float32)
    assert inputs.target_tokens == sum(n - 1 for n in LENGTHS)  # the same targets as the documents alone
    return wrapper(inputs.input_ids, inputs.position_ids, inputs.attention_mask, inputs.labels)


CASES = [pytest.param("sdpa", "chunked", "cpu", id="cpu-sdpa-mask-chunked-ce-foreach-adamw")]
if torch_linear_cross_entropy_available():
    CASES.append(pytest.param("sdpa", "torch", "cpu", id="cpu-sdpa-mask-torch-ce-foreach-adamw"))
if torch.cuda.is_available():
    CASES.append(pytest.param("flex", "chunked", "cuda", id="cuda-flex-chunked-ce-fused-adamw"))
    if torch_linear_cross_entropy_available():
        CASES.append(pytest.param("flex", "torch", "cuda", id="cuda-flex-torch-ce-fused-adamw"))
    if liger_available():
        CASES.append(pytest.param("flex", "liger", "cuda", id="cuda-flex-liger-ce-fused-adamw"))


@pytest.mark.parametrize(("attention", "loss", "device"), CASES)
def test_optimized_path_matches_baseline_loss_gradients_and_updates(attention: str, loss: str, device: str) -> None:
    docs = _documents()
    baseline = _model("sdpa", device)
    impl = {"sdpa": "sdpa", "flex": "flex_attention"}[attention]
    optimized = CausalLMWithLoss(_model(impl, device), loss=loss)
    for a, b in zip(baseline.parameters(), optimized.lm.parameters(), strict=True):
        assert torch.equal(a, b)  # same initial weights

    fused = {"fused": True} if device == "cuda" else {"foreach": True}
    opt_base = torch.optim.AdamW(baseline.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    opt_fast = torch.optim.AdamW(optimized.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1, **fused)
    atol, rtol = (1e-5, 1e-4) if device == "cpu" else (1e-4, 1e-3)
    for step in range(STEPS):
        loss_base = _baseline_loss(baseline, docs, device)
        loss_fast = _optimized_loss(optimized, docs, attention, device)
        torch.testing.assert_close(loss_fast, loss_base, atol=atol, rtol=rtol, msg=f"loss differs at step {step}")
        loss_base.backward()
        loss_fast.backward()
        names = [n for n, _ in baseline.named_parameters()]
        for name, a, b in zip(names, baseline.parameters(), optimized.lm.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None, name
            torch.testing.assert_close(
                b.grad, a.grad, atol=atol, rtol=rtol, msg=f"gradient of {name} differs at step {step}"
            )
        opt_base.step()
        opt_fast.step()
        opt_base.zero_grad(set_to_none=True)
        opt_fast.zero_grad(set_to_none=True)
    for (name, a), b in zip(baseline.named_parameters(), optimized.lm.parameters(), strict=True):
        if name.endswith("k_proj.bias"):
            # q . b_k is the same for every key of a query, so softmax cancels it: the gradient is 0 up to rounding
            # (~1e-9), and AdamW's m / sqrt(v) turns rounding noise of either path into +-lr steps. Its gradient
            # was compared above (absolutely); its value is no test of the optimizations.
            continue
        # AdamW moves an element by up to lr per step whatever its gradient's size, so an element whose gradient is
        # near rounding level can move differently; the weights must agree to 1 % of the largest possible update.
        torch.testing.assert_close(
            b, a, atol=0.01 * LR * STEPS, rtol=0, msg=f"{name} differs after {STEPS} AdamW steps"
        )


def test_without_the_document_mask_the_loss_differs() -> None:
    """Control: the comparison above is sensitive; packing without the mask lets documents see each other."""
    docs = _documents()
    baseline = _model("sdpa", "cpu")
    leaky = CausalLMWithLoss(_model("sdpa", "cpu"), loss="chunked")
    ids, seg = _packed(docs)
    inputs = make_inputs(ids, seg, packing=True, attention="sdpa", dtype=torch.float32)
    causal_only = torch.ones(BLOCK, BLOCK, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        wrong = leaky(inputs.input_ids, inputs.position_ids, causal_only, inputs.labels)
        right = _baseline_loss(baseline, docs, "cpu")
    assert abs(float(wrong) - float(right)) > 1e-4
