"""The ``cross_entropy_kernel`` setting (packing.FUSED_LOSSES): which fused loss runs where, what an impossible
choice says, Liger's chunk size at Qwen's vocabulary, and torch's linear_cross_entropy against the full-logits loss
under bf16 autocast (the loss and gradients at the precision training compares rows at). The compiled-vs-eager check
of each path with ignored rows is CUDA-only: tests/gpu/test_cuda_paths.py."""

from __future__ import annotations

import math

import pytest
import torch
from gpuscout_train.packing import (
    IGNORE_INDEX,
    chunked_cross_entropy,
    fused_loss,
    liger_chunk_mem_const,
    plain_cross_entropy,
    torch_cross_entropy,
    torch_linear_cross_entropy_available,
)

from gpuscout.plan import memory


def test_auto_is_the_chunked_loss_on_every_device_and_under_zero3() -> None:
    for device in ("cpu", "cuda"):
        for zero3 in (False, True):
            assert fused_loss("auto", device_type=device, zero3=zero3) == "chunked"


@pytest.mark.parametrize(
    ("kernel", "device", "zero3", "says"),
    [
        ("liger", "cpu", False, "needs a CUDA GPU"),
        ("liger", "cuda", True, "ZeRO-3"),
        ("torch", "cuda", True, "ZeRO-3"),
        ("fast", "cuda", False, "not one of auto, chunked, liger, torch"),
    ],
)
def test_a_kernel_that_cannot_run_is_refused_with_the_reason(kernel: str, device: str, zero3: bool, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        fused_loss(kernel, device_type=device, zero3=zero3)


def _liger_chunk_rows(rows: int, hidden: int, vocab: int, chunk_mem_const: int) -> int:
    """Liger 0.8.5's chunk size (liger_kernel/ops/fused_linear_cross_entropy.py), written out."""
    inc_factor = math.ceil(vocab / (chunk_mem_const * hidden))
    return min(2 ** math.ceil(math.log2(math.ceil(rows / inc_factor))), rows)


@pytest.mark.parametrize(
    ("rows", "hidden"),
    [(8192, 1536), (16384, 1536), (4096, 896), (16384, 896), (2048, 3584), (49152, 1536), (40960, 3584), (81920, 896)],
)
def test_liger_chunks_are_at_most_the_chunked_losss_and_far_larger_than_its_default(rows: int, hidden: int) -> None:
    vocab = 151_936
    default = _liger_chunk_rows(rows, hidden, vocab, 1)  # 64+ chunks at Qwen's vocabulary, each a full dW rewrite
    chunk = _liger_chunk_rows(rows, hidden, vocab, liger_chunk_mem_const(rows, hidden, vocab))
    assert chunk <= 4096  # never more than the chunked loss's rows
    assert chunk >= min(rows, 1024) and chunk >= 4 * default
    # the planner's memory model computes the same chunk (gpuscout cannot import training/)
    assert memory.liger_chunk_rows(rows, hidden, vocab) == chunk


@pytest.mark.skipif(not torch_linear_cross_entropy_available(), reason="torch < 2.13 has no linear_cross_entropy")
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_torch_linear_cross_entropy_matches_the_full_logits_loss(autocast: bool) -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 1000, bias=False)
    hidden = torch.randn(2, 300, 64, requires_grad=True)
    labels = torch.randint(0, 1000, (2, 300))
    labels[0, :50] = IGNORE_INDEX  # padding and document starts are ignored rows
    labels[1, 200:] = IGNORE_INDEX
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        reference = plain_cross_entropy(head(hidden), labels)
        fused = torch_cross_entropy(hidden, head, labels)
        chunked = chunked_cross_entropy(hidden, head, labels)
    assert fused.dtype == torch.float32
    # bf16 logits: each row's loss is rounded; their fp32 mean stays within 1e-4 (a bf16 mean was 0.6 % off)
    tolerance = 1e-4 if autocast else 1e-6
    assert float(fused) == pytest.approx(float(reference), rel=tolerance)
    assert float(chunked) == pytest.approx(float(reference), rel=tolerance)
    want = torch.autograd.grad(reference, [hidden, head.weight])
    got = torch.autograd.grad(fused, [hidden, head.weight])
    for a, b in zip(want, got, strict=True):
        assert float((a - b).abs().max() / a.abs().max()) < (0.02 if autocast else 1e-5)


@pytest.mark.skipif(not torch_linear_cross_entropy_available(), reason="torch < 2.13 has no linear_cross_entropy")
def test_a_batch_with_no_target_gives_a_zero_loss_that_backpropagates() -> None:
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(1, 5, 8, requires_grad=True)
    labels = torch.full((1, 5), IGNORE_INDEX)
    loss = torch_cross_entropy(hidden, head, labels)
    loss.backward()
    assert float(loss) == 0.0 and hidden.grad is not None
