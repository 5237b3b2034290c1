"""The GPU-only code paths, run the way training runs them: bf16 autocast over fp32 master weights, packed real
tokens, flex attention with a compiled block mask, Liger's fused linear cross-entropy, torch.compile on CUDA, NVML
sampling, and the planner's memory model against torch.cuda.max_memory_allocated.

Every test is marked ``cuda`` and skipped without a CUDA GPU (tests/gpu/conftest.py). `make gpu-check` runs them
and writes benchmarks/results/gpu-check-<gpu>-<date>.json. Written and CPU-collected without a GPU at hand
(docs/performance.md says which checks have run where).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.cuda

REPO = Path(__file__).resolve().parents[2]
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def real_blocks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, int]:
    """Packed blocks of real Hebrew text (bundled:hebrew-bible, 1,024-token BPE, 1,024-token blocks)."""
    from gpuscout_data import dataset as ds
    from gpuscout_data import prepare as dp

    out = tmp_path_factory.mktemp("data")
    dp.prepare(dp.PrepareConfig(input="bundled:hebrew-bible", output=str(out), tokenizer="bpe", vocab_size=1024,
                                sequence_length=1024, max_documents=200, workers=1, quiet=True))  # fmt: skip
    ids, seg = ds.load_split(str(out), "train")
    summary = ds.load_summary(out)
    return torch.as_tensor(ids[:2]).cuda(), torch.as_tensor(seg[:2]).long().cuda(), int(summary.tokenizer["vocab_size"])


def _model(attention: str, vocab: int, *, layers: int = 4, hidden: int = 512) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096, use_cache=False,
                         tie_word_embeddings=False)  # fmt: skip
    config._attn_implementation = attention
    return Qwen2ForCausalLM(config).cuda().train()  # fp32 master weights, as train.py keeps them


def _loss_and_grads(model: Any, loss: str, ids: Any, seg: Any, attention: str) -> tuple[float, dict[str, Any]]:
    from gpuscout_train.packing import CausalLMWithLoss, make_inputs

    wrapper = CausalLMWithLoss(model, loss=loss)
    inputs = make_inputs(ids, seg, packing=True, attention=attention, dtype=BF16)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=BF16):
        value = wrapper(inputs.input_ids, inputs.position_ids, inputs.attention_mask, inputs.labels)
    value.backward()
    return float(value), {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(a: dict[str, Any], b: dict[str, Any], rtol: float) -> float:
    """Largest relative difference (by norm) between two gradient sets, asserted below ``rtol``."""
    worst = 0.0
    for name, ga in a.items():
        gb = b[name]
        worst = max(worst, float((ga - gb).norm() / (gb.norm() + 1e-12)))
    assert worst < rtol, f"gradients differ by {worst:.3g} (relative norm), tolerance {rtol}"
    return worst


def test_flex_matches_sdpa_with_the_4d_mask_under_bf16_autocast(real_blocks: Any, record: Any) -> None:
    ids, seg, vocab = real_blocks
    loss_sdpa, grads_sdpa = _loss_and_grads(_model("sdpa", vocab), "chunked", ids, seg, "sdpa")
    loss_flex, grads_flex = _loss_and_grads(_model("flex_attention", vocab), "chunked", ids, seg, "flex")
    worst = _close(grads_flex, grads_sdpa, rtol=0.05)
    record(loss_sdpa=loss_sdpa, loss_flex=loss_flex, worst_grad_rel_diff=worst)
    assert loss_flex == pytest.approx(loss_sdpa, rel=1e-2)


def test_the_block_mask_is_built_by_one_compiled_function_without_the_deprecated_flag(real_blocks: Any) -> None:
    # the first H100's CUDA tests (torch 2.11) showed the DeprecationWarning that create_block_mask's _compile flag
    # "will be removed in the future"; packing now compiles create_block_mask once per process instead
    import warnings

    from gpuscout_train.packing import _flex_block_mask, compiled_create_block_mask
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask

    _, seg, _ = real_blocks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        masks = [_flex_block_mask(seg)]
        graphs = counters["stats"]["unique_graphs"]
        masks.append(_flex_block_mask(seg.flip(0)))  # the next micro-batch: a new closure, the same shapes
    assert not [w for w in caught if "_compile flag" in str(w.message)]
    assert counters["stats"]["unique_graphs"] == graphs  # built by the graphs compiled for the first: no recompile
    assert compiled_create_block_mask() is compiled_create_block_mask()
    for mask, segments in zip(masks, (seg, seg.flip(0)), strict=True):  # the same mask as eager creation builds

        def mask_mod(b: Any, h: Any, q: Any, kv: Any, segments: Any = segments) -> Any:
            return (segments[b, q] == segments[b, kv]) & (kv <= q)

        length = segments.shape[1]
        eager = create_block_mask(mask_mod, B=segments.shape[0], H=None, Q_LEN=length, KV_LEN=length, device="cuda")
        assert torch.equal(mask.to_dense(), eager.to_dense())


def test_liger_matches_the_chunked_loss_and_gradients(real_blocks: Any, record: Any) -> None:
    from gpuscout_train.packing import liger_available

    if not liger_available():
        pytest.fail("liger-kernel is not installed: the fused cross-entropy path cannot be checked")
    ids, seg, vocab = real_blocks
    loss_chunked, grads_chunked = _loss_and_grads(_model("sdpa", vocab), "chunked", ids, seg, "sdpa")
    loss_liger, grads_liger = _loss_and_grads(_model("sdpa", vocab), "liger", ids, seg, "sdpa")
    worst = _close(grads_liger, grads_chunked, rtol=0.05)
    record(loss_chunked=loss_chunked, loss_liger=loss_liger, worst_grad_rel_diff=worst)
    assert loss_liger == pytest.approx(loss_chunked, rel=1e-2)


def test_torch_compile_on_and_off_give_the_same_loss(real_blocks: Any, record: Any) -> None:
    ids, seg, vocab = real_blocks
    eager, _ = _loss_and_grads(_model("sdpa", vocab), "chunked", ids, seg, "sdpa")
    compiled_model = _model("sdpa", vocab)
    compiled_model.model = torch.compile(compiled_model.model)
    started = time.perf_counter()
    compiled, _ = _loss_and_grads(compiled_model, "chunked", ids, seg, "sdpa")
    record(loss_eager=eager, loss_compiled=compiled, compile_and_step_s=round(time.perf_counter() - started, 1))
    assert compiled == pytest.approx(eager, rel=1e-2)


@pytest.mark.parametrize("loss", ["chunked", "torch", "liger"])
def test_each_fused_loss_compiled_equals_eager_and_the_full_logits_with_ignored_rows(
    real_blocks: Any, record: Any, loss: str
) -> None:
    """train.py compiles the whole CausalLMWithLoss; a fused loss inside the compiled region must give the eager
    loss and gradients when labels hold -100 (Liger-Kernel PR #1338: wrong or NaN under compile). Every
    cross_entropy_kernel choice, the full-logits loss as the reference."""
    from gpuscout_train.packing import CausalLMWithLoss, fused_loss, make_inputs, torch_linear_cross_entropy_available

    if loss == "torch" and not torch_linear_cross_entropy_available():
        pytest.skip(f"torch {torch.__version__} has no linear_cross_entropy (2.13+): cross_entropy_kernel torch is out")
    try:
        fused_loss(loss, device_type="cuda", zero3=False)
    except ValueError as err:
        pytest.fail(f"cross_entropy_kernel {loss} cannot run on this machine: {err}")
    ids, seg, vocab = real_blocks
    inputs = make_inputs(ids, seg, packing=True, attention="sdpa", dtype=BF16)
    labels = inputs.labels.clone()
    labels[0, : labels.shape[1] // 3] = -100  # a long ignored span beside padding and document starts
    model = _model("sdpa", vocab)

    def run(wrapper: Any) -> tuple[float, dict[str, Any]]:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=BF16):
            value = wrapper(inputs.input_ids, inputs.position_ids, inputs.attention_mask, labels)
        value.backward()
        return float(value), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}

    reference, grads_reference = run(CausalLMWithLoss(model, loss="plain"))
    eager, grads_eager = run(CausalLMWithLoss(model, loss=loss))
    compiled_wrapper = CausalLMWithLoss(model, loss=loss)
    compiled_wrapper.compile()  # as train.py does
    compiled, grads_compiled = run(compiled_wrapper)
    worst_eager = _close(grads_eager, grads_reference, rtol=0.05)
    worst_compiled = _close(grads_compiled, grads_eager, rtol=0.05)
    record(loss_plain=reference, loss_eager=eager, loss_compiled=compiled, worst_grad_rel_diff_eager=worst_eager,
           worst_grad_rel_diff_compiled=worst_compiled)  # fmt: skip
    assert math.isfinite(eager) and math.isfinite(compiled), "loss is NaN or infinite"
    assert eager == pytest.approx(reference, rel=1e-2)
    assert compiled == pytest.approx(eager, rel=1e-2)


def test_nvml_fills_utilization_and_power() -> None:
    from gpuscout_train.metrics import GpuSampler

    sampler = GpuSampler([torch.cuda.current_device()], interval_s=0.1)
    assert sampler.available, "NVML is not available (pip install nvidia-ml-py)"
    assert sampler.driver_version()
    sampler.start()
    sampler.timing(True)  # stop() averages the samples taken while timing is on (train.py's timed steps)
    a = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    end = time.perf_counter() + 2.0
    while time.perf_counter() < end:
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
    util, power = sampler.stop()
    assert util is not None and util > 0 and power is not None and power > 0


MEMORY_CASES = [
    # (preset, micro-batch, sequence, gradient checkpointing, loss: plain or a fused kernel)
    pytest.param("qwen2.5-0.5b", 1, 4096, False, "chunked", id="0.5b-b1-chunked"),
    pytest.param("qwen2.5-0.5b", 2, 4096, True, "chunked", id="0.5b-b2-ckpt-chunked"),
    pytest.param("qwen2.5-0.5b", 1, 4096, False, "liger", id="0.5b-b1-liger"),
    pytest.param("qwen2.5-0.5b", 1, 2048, False, "plain", id="0.5b-b1-2k-full-logits"),
]


def _planned_and_reset(arch: Any, variant: Any, *, batch: int, seq: int) -> tuple[float, float, Any]:
    """The planner's peak for one GPU in bf16 as torch.cuda.max_memory_allocated sees it (neither the CUDA context
    nor NCCL) in GB, its stated uncertainty as a fraction, and the model's sdpa config; the GPU's cache emptied, its
    peak statistics reset and the seed set, for the step about to be measured."""
    from transformers import Qwen2Config

    from gpuscout.plan.planner import memory_estimate

    estimate = memory_estimate(arch, seq=seq, batch=batch, precision="bf16", stage=0, world=1, variant=variant)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    config = Qwen2Config(**arch.to_qwen2_config_kwargs(), use_cache=False)
    config._attn_implementation = "sdpa"
    return estimate.allocated / 1e9, estimate.allocated_uncertainty / estimate.allocated, config


def _two_steps_peak(wrapper: Any, optimizer: Any, *, vocab: int, batch: int, seq: int) -> tuple[float, float]:
    """Two optimizer steps as train.py runs them on one GPU (forward under autocast, backward outside it, gradients
    set to None; the second step has the optimizer state allocated): torch's peak allocated and reserved, in GB."""
    ids = torch.randint(0, vocab, (batch, seq), device="cuda")
    positions = torch.arange(seq, device="cuda").expand(batch, seq)
    for _ in range(2):
        with torch.autocast("cuda", dtype=BF16):
            value = wrapper(ids, positions, None, ids)
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return torch.cuda.max_memory_allocated() / 1e9, torch.cuda.max_memory_reserved() / 1e9


@pytest.mark.parametrize(("preset", "batch", "seq", "ckpt", "loss"), MEMORY_CASES)
def test_the_planners_peak_memory_is_within_its_stated_uncertainty(
    preset: str, batch: int, seq: int, ckpt: bool, loss: str, record: Any
) -> None:
    """Two optimizer steps as train.py runs them on one GPU (forward under autocast, backward outside it, fused
    AdamW, gradients set to None): torch's peak allocated against the planner's estimate less the CUDA context,
    within the uncertainty the estimate states for this case (gpuscout.plan.memory)."""
    from gpuscout_train.packing import CausalLMWithLoss, liger_available
    from transformers import Qwen2ForCausalLM

    from gpuscout.domain.manifest_training import Variant
    from gpuscout.domain.models import PRESETS, QWEN_TOKENIZER_VOCAB, training_vocab

    if loss == "liger" and not liger_available():
        pytest.fail("liger-kernel is not installed")
    arch = PRESETS[preset]
    arch = arch.with_vocab(training_vocab(preset, arch.vocab_size, QWEN_TOKENIZER_VOCAB))
    fused = loss != "plain"
    # packing off: the step below feeds no attention mask (causal sdpa), so the dense-mask terms do not apply
    variant = Variant(name="m", per_device_batch_size=batch, gradient_checkpointing=ckpt, fused_cross_entropy=fused,
                      cross_entropy_kernel=loss if fused else "auto", packing=False,
                      gradient_accumulation_steps=1)  # fmt: skip
    predicted, tolerance, config = _planned_and_reset(arch, variant, batch=batch, seq=seq)
    model = Qwen2ForCausalLM(config).cuda().train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    wrapper = CausalLMWithLoss(model, loss=loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    measured, reserved = _two_steps_peak(wrapper, optimizer, vocab=arch.vocab_size, batch=batch, seq=seq)
    record(predicted_gb=round(predicted, 2), tolerance=round(tolerance, 3), measured_gb=round(measured, 2),
           reserved_gb=round(reserved, 2), ratio=round(predicted / measured, 3))  # fmt: skip
    del model, wrapper, optimizer
    torch.cuda.empty_cache()
    assert predicted == pytest.approx(measured, rel=tolerance), (
        f"predicted {predicted:.1f} GB +- {tolerance:.0%}, measured {measured:.1f} GB"
    )


LORA_MEMORY_CASES = [
    # (micro-batch, sequence, gradient checkpointing): a 0.5B base in bf16 with rank-16 adapters on every linear
    pytest.param(1, 4096, False, id="0.5b-lora-b1"),
    pytest.param(2, 4096, True, id="0.5b-lora-b2-ckpt"),
]


@pytest.mark.parametrize(("batch", "seq", "ckpt"), LORA_MEMORY_CASES)
def test_the_planners_lora_peak_memory_is_within_its_stated_uncertainty(
    batch: int, seq: int, ckpt: bool, record: Any
) -> None:
    """Two optimizer steps of a LoRA run as train.py builds it on CUDA (gpuscout_train.build: the base read in bf16,
    adapters in fp32 by peft, AdamW over the adapters, the chunked loss): torch's peak allocated against the
    planner's adapter estimate (gpuscout.plan.memory), within 15 % or the uncertainty it states, whichever is wider
    (the adapter model's CUDA kernels were not probed on CPU)."""
    from gpuscout_train.adapters import add_adapters, trainable_parameters
    from gpuscout_train.packing import CausalLMWithLoss
    from transformers import Qwen2ForCausalLM

    from gpuscout.domain.manifest_training import Variant
    from gpuscout.domain.models import PRESETS, QWEN_TOKENIZER_VOCAB, training_vocab

    arch = PRESETS["qwen2.5-0.5b"]
    arch = arch.with_vocab(training_vocab(arch.name, arch.vocab_size, QWEN_TOKENIZER_VOCAB))
    variant = Variant(name="m", method="lora", per_device_batch_size=batch, gradient_checkpointing=ckpt,
                      fused_cross_entropy=True, packing=False, gradient_accumulation_steps=1)  # fmt: skip
    adapter = variant.adapter()
    assert adapter is not None
    predicted, tolerance, config = _planned_and_reset(arch, variant, batch=batch, seq=seq)
    model = Qwen2ForCausalLM._from_config(config, dtype=BF16).cuda().train()
    add_adapters(model, adapter, frozen_dtype=BF16)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    wrapper = CausalLMWithLoss(model, loss="chunked")
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-4, fused=True)
    measured, reserved = _two_steps_peak(wrapper, optimizer, vocab=arch.vocab_size, batch=batch, seq=seq)
    record(predicted_gb=round(predicted, 2), tolerance=round(tolerance, 3), measured_gb=round(measured, 2),
           reserved_gb=round(reserved, 2), ratio=round(predicted / measured, 3))  # fmt: skip
    del model, wrapper, optimizer
    torch.cuda.empty_cache()
    assert predicted == pytest.approx(measured, rel=max(tolerance, 0.15)), (
        f"predicted {predicted:.1f} GB +- {tolerance:.0%}, measured {measured:.1f} GB"
    )
