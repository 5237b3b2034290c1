"""Packing masks, the chunked cross-entropy and the optimizer toggles, on a tiny random Qwen2 (CPU)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from gpuscout_train.packing import (
    IGNORE_INDEX,
    CausalLMWithLoss,
    chunked_cross_entropy,
    eager_validation,
    make_inputs,
    plain_cross_entropy,
    position_ids_from_segments,
    unpack_blocks,
)
from transformers import Qwen2Config, Qwen2ForCausalLM

from gpuscout.domain.models import PRESETS


def _model(attention: str = "sdpa", vocab: int = 97) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    kwargs = dict(PRESETS["qwen2-tiny"].with_vocab(vocab).to_qwen2_config_kwargs())
    config = Qwen2Config(**kwargs, use_cache=False)  # type: ignore[arg-type]
    config._attn_implementation = attention
    return Qwen2ForCausalLM(config).eval()


def test_positions_restart_per_document() -> None:
    seg = torch.tensor([[1, 1, 1, 2, 2, 3, 0, 0]])
    assert position_ids_from_segments(seg).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_block_equals_documents_run_separately(attention: str) -> None:
    model = _model(attention)
    docs = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 12, 5)]
    ids = torch.cat([*docs, torch.zeros(4, dtype=torch.long)])[None, :]
    seg = torch.cat([torch.full((len(d),), i + 1) for i, d in enumerate(docs)] + [torch.zeros(4)]).long()[None, :]
    inputs = make_inputs(ids, seg, packing=True, attention=attention, dtype=torch.float32)
    with torch.no_grad():
        packed = model(
            input_ids=inputs.input_ids, position_ids=inputs.position_ids, attention_mask=inputs.attention_mask
        ).logits[0]
        start = 0
        for doc in docs:
            alone = model(input_ids=doc[None, :]).logits[0]
            torch.testing.assert_close(packed[start : start + len(doc)], alone, atol=1e-5, rtol=1e-5)
            start += len(doc)
        # without the document mask the second document would see the first: the logits differ
        leaky = model(input_ids=ids).logits[0]
        assert not torch.allclose(leaky[7:19], packed[7:19], atol=1e-3)
    # the first token of every document is no prediction target of the previous document
    assert inputs.labels[0, [0, 7, 19, 24, 25, 26, 27]].tolist() == [IGNORE_INDEX] * 7


def test_chunked_cross_entropy_equals_plain_loss_and_gradients() -> None:
    torch.manual_seed(1)
    head = torch.nn.Linear(16, 301, bias=False)
    hidden = torch.randn(3, 20, 16, requires_grad=True)
    labels = torch.randint(0, 301, (3, 20))
    labels[0, 5:9] = IGNORE_INDEX
    plain = plain_cross_entropy(head(hidden), labels)
    g_plain = torch.autograd.grad(plain, [hidden, head.weight])
    chunked = chunked_cross_entropy(hidden, head, labels, chunk_tokens=7)
    g_chunked = torch.autograd.grad(chunked, [hidden, head.weight])
    torch.testing.assert_close(chunked, plain, atol=1e-6, rtol=1e-6)
    for a, b in zip(g_chunked, g_plain, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_chunked_cross_entropy_with_no_target_is_zero_and_backpropagates_zeros() -> None:
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    loss = chunked_cross_entropy(hidden, head, torch.full((2, 5), IGNORE_INDEX), chunk_tokens=3)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert hidden.grad is not None and not hidden.grad.any() and head.weight.grad is not None
    assert not head.weight.grad.any()


def _packed_batch(
    generator: torch.Generator, pieces: int, *, rows: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment ids of ``pieces`` documents cut at random places (the same cuts in every row) and random token ids."""
    seg = torch.ones(rows, length, dtype=torch.long)
    for number, cut in enumerate(sorted(torch.randperm(length - 1, generator=generator)[: pieces - 1].tolist()), 2):
        seg[:, cut + 1 :] = number
    return seg, torch.randint(0, 97, (rows, length), generator=generator)


def _compiled_fresh(attention: str) -> CausalLMWithLoss:
    """The tiny model in training mode with the chunked loss, compiled with aot_eager (dynamo, then AOT autograd's
    forward and backward, as Inductor traces, without generating kernels), after dynamo's caches and counters are
    reset so the test counts only its own graphs."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = CausalLMWithLoss(_model(attention).train(), loss="chunked")
    model.compile(backend="aot_eager")
    return model


def test_one_compiled_graph_serves_micro_batches_with_different_target_counts() -> None:
    """train.py compiles CausalLMWithLoss; packed micro-batches differ in their number of targets (one ignored row
    per document piece). The loss must not make that number part of the graph: on an H100 (2026-11-25) the chunked
    loss's boolean row selection broke the graph and recompiled it per micro-batch. aot_eager traces as Inductor
    would (dynamo, then AOT autograd's forward and backward) without generating kernels."""
    from torch._dynamo.utils import counters

    model = _compiled_fresh("sdpa")
    generator = torch.Generator().manual_seed(4)
    counts = set()
    for pieces in (2, 3, 5, 4):  # a different number of documents, so of targets, in each micro-batch
        seg, ids = _packed_batch(generator, pieces, rows=2, length=64)
        inputs = make_inputs(ids, seg, packing=True, attention="sdpa", dtype=torch.float32)
        counts.add(int((inputs.labels[:, 1:] != IGNORE_INDEX).sum()))
        model(inputs.input_ids, inputs.position_ids, inputs.attention_mask, inputs.labels).backward()
    assert len(counts) == 4
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    # validation (eval, no grad, a last batch of one block) compiles nothing more under eager_validation
    model.eval()
    with torch.no_grad(), eager_validation("sdpa"):
        value = model(inputs.input_ids[:1], inputs.position_ids[:1], inputs.attention_mask[:1], inputs.labels[:1])
    assert torch.isfinite(value)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    # with flex the model validates compiled: eager flex_attention is an unfused reference (fp32 scores in memory)
    assert isinstance(eager_validation("flex"), contextlib.nullcontext)
    torch._dynamo.reset()


def test_flex_attentions_block_mask_built_per_micro_batch_does_not_recompile_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The optimized rows run flex attention under torch.compile, with a BlockMask (and its mask_mod closure over the
    micro-batch's segment ids) built afresh for every micro-batch. Were the mask or its closure guarded by identity,
    each micro-batch would compile the model again, as the chunked loss's row selection did on the H100. Training
    mode, forward and backward: torch refuses flex attention's backward on a CPU only in a front-end device check,
    which is lifted here (aot_eager runs flex's reference implementation, whose backward works on a CPU). Blocks of
    512 tokens are four of flex's 128-token mask blocks, so the block layout differs between micro-batches."""
    import torch.nn.attention.flex_attention as flex
    from torch._dynamo.utils import counters

    monkeypatch.setattr(flex, "_validate_device", lambda query, key, value: None)
    model = _compiled_fresh("flex_attention")
    generator = torch.Generator().manual_seed(5)
    layouts = set()
    for pieces in (2, 3, 5, 4):
        seg, ids = _packed_batch(generator, pieces, rows=1, length=512)
        inputs = make_inputs(ids, seg, packing=True, attention="flex", dtype=torch.float32)
        layouts.add(tuple(seg[0].tolist()))
        model.zero_grad()
        model(inputs.input_ids, inputs.position_ids, inputs.attention_mask, inputs.labels).backward()
        assert all(p.grad is not None for p in model.parameters())
        assert any(bool(p.grad.abs().sum() > 0) for p in model.parameters() if p.grad is not None)
    assert len(layouts) == 4
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()


def test_rows_that_fill_up_a_validation_batch_do_not_change_its_loss() -> None:
    """train.py fills a short last validation batch with copies of its rows, their labels ignored."""
    model = _model()
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(5))
    seg = torch.tensor([[1] * 10 + [2] * 14])
    for loss in ("plain", "chunked"):
        wrapper = CausalLMWithLoss(model, loss=loss)
        one = make_inputs(ids, seg, packing=True, attention="sdpa", dtype=torch.float32)
        two = make_inputs(ids.repeat(2, 1), seg.repeat(2, 1), packing=True, attention="sdpa", dtype=torch.float32)
        two.labels[1:] = IGNORE_INDEX
        with torch.no_grad():
            alone = wrapper(one.input_ids, one.position_ids, one.attention_mask, one.labels)
            padded = wrapper(two.input_ids, two.position_ids, two.attention_mask, two.labels)
        torch.testing.assert_close(padded, alone, rtol=1e-6, atol=1e-6)


def test_model_losses_agree_with_transformers() -> None:
    model = _model()
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    seg = torch.ones_like(ids)
    inputs = make_inputs(ids, seg, packing=False, attention="sdpa", dtype=torch.float32)
    with torch.no_grad():
        reference = model(input_ids=ids, labels=ids).loss
        plain = CausalLMWithLoss(model, loss="plain")(
            inputs.input_ids, inputs.position_ids, inputs.attention_mask, inputs.labels
        )
        chunked = CausalLMWithLoss(model, loss="chunked")(
            inputs.input_ids, inputs.position_ids, inputs.attention_mask, inputs.labels
        )
    torch.testing.assert_close(plain, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked, reference, atol=1e-5, rtol=1e-5)


def test_fused_adamw_toggle_gives_equal_numerics_on_cpu() -> None:
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(4))
    inputs = make_inputs(ids, torch.ones_like(ids), packing=True, attention="sdpa", dtype=torch.float32)
    results = []
    for foreach in (False, True):  # train.py: fused_adamw=false -> for-loop AdamW, true -> foreach on CPU
        model = CausalLMWithLoss(_model().train())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=foreach)
        for _ in range(3):
            loss = model(inputs.input_ids, inputs.position_ids, inputs.attention_mask, inputs.labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_unpacking_gives_each_document_piece_a_padded_row() -> None:
    ids = np.array([[5, 6, 7, 8, 9, 0, 0], [1, 2, 3, 4, 5, 6, 7]], dtype=np.uint32)
    seg = np.array([[1, 1, 2, 2, 2, 0, 0], [3, 3, 3, 3, 3, 4, 4]], dtype=np.uint16)
    rows, segs = unpack_blocks(ids, seg)
    assert rows.tolist() == [
        [5, 6, 0, 0, 0, 0, 0],
        [7, 8, 9, 0, 0, 0, 0],
        [1, 2, 3, 4, 5, 0, 0],
        [6, 7, 0, 0, 0, 0, 0],
    ]
    assert segs.tolist() == [[1 if v else 0 for v in row] for row in rows.tolist()]
    assert rows.dtype == ids.dtype and segs.dtype == seg.dtype


def test_no_packing_trains_on_the_same_targets_as_masked_packing() -> None:
    # Given packed blocks, the unpacked rows (packing=False) hold the same non-padding tokens and prediction
    # targets, so the mean loss equals the document-masked packed loss: only the padding differs.
    model = _model()
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 97, (2, 16), generator=gen)
    seg = torch.tensor([[1] * 5 + [2] * 8 + [0] * 3, [3] * 9 + [4] * 7])
    packed = make_inputs(ids, seg, packing=True, attention="sdpa", dtype=torch.float32)
    rows, segs = unpack_blocks(ids.numpy(), seg.numpy())
    unpacked = make_inputs(
        torch.from_numpy(rows), torch.from_numpy(segs), packing=False, attention="sdpa", dtype=torch.float32
    )
    assert unpacked.tokens == packed.tokens == 29
    assert unpacked.target_tokens == packed.target_tokens == 29 - 4
    loss = CausalLMWithLoss(model, loss="plain")
    with torch.no_grad():
        a = loss(packed.input_ids, packed.position_ids, packed.attention_mask, packed.labels)
        b = loss(unpacked.input_ids, unpacked.position_ids, unpacked.attention_mask, unpacked.labels)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_flex_attention_gets_q_k_v_in_the_autocast_dtype() -> None:
    # Seen on torch 2.8 (the old training image): under bf16 autocast with fp32 master weights transformers hands
    # flex attention q/k in fp32 and v in bf16, and flex_attention raises. train.py wraps the registered function.
    from gpuscout_train.packing import install_flex_autocast_cast
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    original = AttentionInterface._global_mapping["flex_attention"]
    seen: list[tuple[torch.dtype, ...]] = []

    def spy(module, query, key, value, attention_mask, **kwargs):  # type: ignore[no-untyped-def]
        seen.append((query.dtype, key.dtype, value.dtype))
        return query, None

    try:
        AttentionInterface.register("flex_attention", spy)
        install_flex_autocast_cast()
        install_flex_autocast_cast()  # idempotent: wraps once
        q = k = torch.zeros(1, 2, 4, 8)
        v = torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ALL_ATTENTION_FUNCTIONS["flex_attention"](None, q, k, v, None, scaling=1.0)
        ALL_ATTENTION_FUNCTIONS["flex_attention"](None, q, k, v, None)  # no autocast: left as they are
    finally:
        AttentionInterface.register("flex_attention", original)
    assert seen == [(torch.bfloat16,) * 3, (torch.float32, torch.float32, torch.bfloat16)]
