"""The planner's memory model against the bytes the real model code saves for backward (benchmarks/memory_probe.py),
re-measured here on CPU with the presets' layer shapes (two layers, short sequences: bytes are per token per layer),
and configs/memory/calibration.json against what the probe produces today.

The probe runs the model code with the matrix products not computed (``memory_probe.ShapesOnly``: the same bytes, no
arithmetic), so these tests take seconds on every CPU, AVX2-only ones included, where a 1.5B-wide bf16 backward takes
minutes; the first test holds the stand-in to the real kernels on narrow shapes."""

from __future__ import annotations

import dataclasses

import pytest

from gpuscout.domain.adapters import Adapter
from gpuscout.domain.flops import matmul_params
from gpuscout.domain.models import PRESETS
from gpuscout.plan import memory
from gpuscout.plan.memory import StepSettings, load_calibration

memory_probe = pytest.importorskip("memory_probe")

BATCH, SEQ, VOCAB, LAYERS = 2, 96, 1024, 2
NARROW = memory_probe.LayerShape("narrow", hidden=64, intermediate=160, heads=4, kv_heads=2)


def small(preset: str):
    return dataclasses.replace(PRESETS[preset], num_hidden_layers=LAYERS, vocab_size=VOCAB)


def predicted_saved(preset: str, setting) -> float:
    s = StepSettings(
        precision=setting.precision,
        attention=setting.attention,
        gradient_checkpointing=setting.checkpointing,
        fused_cross_entropy=setting.loss == "chunked",
    )
    a = small(preset)
    return memory.saved_activation_bytes(a, seq=SEQ, batch=BATCH, settings=s) + memory.saved_logit_bytes(
        a, seq=SEQ, batch=BATCH, settings=s
    )


CASES = [
    pytest.param(preset, memory_probe.Setting(attention, ckpt, loss, "bf16"), id=f"{preset}-{attention}-{tag}-{loss}")
    for preset in ("qwen2.5-0.5b", "qwen2.5-1.5b")
    for attention in ("sdpa",)
    for ckpt, tag in ((False, "full"), (True, "ckpt"))
    for loss in ("plain", "chunked")
] + [
    pytest.param("qwen2.5-0.5b", memory_probe.Setting("eager", False, "plain", "bf16"), id="qwen2.5-0.5b-eager"),
    pytest.param("qwen2.5-0.5b", memory_probe.Setting("sdpa", False, "plain", "fp32"), id="qwen2.5-0.5b-fp32"),
]


@pytest.mark.parametrize(
    "setting",
    [memory_probe.Setting(attention, ckpt, loss, precision)
     for attention, ckpt, loss, precision in (("sdpa", False, "plain", "bf16"), ("sdpa", True, "chunked", "bf16"),
                                              ("eager", False, "chunked", "bf16"), ("sdpa", False, "plain", "fp32"),
                                              ("eager", True, "plain", "fp32"))]
    + [memory_probe.Setting("sdpa", False, "plain", "bf16", Adapter("lora", rank=8, dropout=0.05)),
       memory_probe.Setting("eager", True, "chunked", "fp32", Adapter("lora", rank=8))],
    ids=lambda s: s.key,
)  # fmt: skip
def test_the_stand_in_counts_what_the_real_kernels_save_and_hold(setting):
    """Saved bytes, weight copies, the loss peak and a whole micro-batch's peak are the same with and without the
    arithmetic (narrow layers, so the real bf16 kernels are cheap on any CPU), LoRA adapters (peft) included."""
    args = dict(layers=LAYERS, batch=BATCH, seq=48, vocab=512)
    stand_in = memory_probe.saved_bytes(NARROW, setting, **args)
    assert stand_in == memory_probe.saved_bytes(NARROW, setting, **args, real_arithmetic=True)
    assert stand_in.activations > 0
    loss_args = dict(loss=setting.loss, precision=setting.precision, batch=2, seq=64, hidden=32, vocab=1024)
    assert memory_probe.loss_peak_bytes(**loss_args) == memory_probe.loss_peak_bytes(**loss_args, real_arithmetic=True)
    peaks = {real: micro_batch_peak(NARROW, setting, batch=2, seq=64, vocab=512, real_arithmetic=real)
             for real in (False, True)}  # fmt: skip
    assert peaks[False] == peaks[True]


def micro_batch_peak(
    shape, setting, *, batch: int, seq: int, vocab: int, real_arithmetic: bool = False, first: bool = False
) -> int:
    """Peak bytes alive over the forward + backward of a micro-batch, every storage it creates tracked until freed:
    the first of a step (no gradients yet; they are counted as they appear) or a later one (gradients already there,
    as under gradient accumulation; not counted)."""
    import torch
    from gpuscout_train.packing import make_inputs

    with memory_probe.kernels(real=real_arithmetic):
        model = memory_probe.build_model(shape, layers=LAYERS, vocab=vocab, setting=setting)
        ids, seg = memory_probe.packed_batch(batch, seq, vocab)
        bf16 = setting.precision == "bf16"

        def micro_batch() -> None:
            dtype = torch.bfloat16 if bf16 else torch.float32
            inputs = make_inputs(ids, seg, packing=True, attention=setting.attention, dtype=dtype)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # train.py's order: forward inside,
                loss = model(inputs.input_ids, inputs.position_ids, inputs.attention_mask, inputs.labels)
            loss.backward()  # backward outside (autocast's weight-copy cache is gone by then)

        if not first:
            micro_batch()
        tracker = memory_probe.LiveBytes([p.grad for p in model.parameters() if p.grad is not None])
        with tracker:
            micro_batch()
    return tracker.peak - tracker.baseline


@pytest.mark.parametrize(("preset", "setting"), CASES)
def test_the_estimate_is_within_15_percent_of_the_measured_saved_bytes(preset, setting):
    shape = memory_probe.preset_shape(preset)
    measured = memory_probe.saved_bytes(shape, setting, layers=LAYERS, batch=BATCH, seq=SEQ, vocab=VOCAB)
    predicted = predicted_saved(preset, setting)
    assert predicted == pytest.approx(measured.activations, rel=0.15), (
        f"predicted {predicted / 1e6:.2f} MB, measured {measured.activations / 1e6:.2f} MB"
    )
    if setting.precision == "bf16" and not setting.checkpointing:  # autocast's copies: 2 B per matmul weight
        a = PRESETS[preset]
        layer_params = (matmul_params(a) - a.hidden_size * a.vocab_size) / a.num_hidden_layers
        # the plain loss saves the lm_head's copy too; the chunked one recomputes it in backward
        expected = LAYERS * 2 * layer_params + (2 * a.hidden_size * VOCAB if setting.loss == "plain" else 0)
        assert measured.weight_copies == pytest.approx(expected, rel=0.01)


def test_the_calibration_file_is_what_the_probe_measures_now():
    setting = memory_probe.Setting("sdpa", False, "plain", "bf16")
    shape = memory_probe.preset_shape("qwen2.5-1.5b")
    row = memory_probe.probe_shape(shape, setting, batch=2, seqs=(32, 64), vocabs=(512, 1024))
    stored = load_calibration().setting(setting.key)
    recorded = stored["measurements"]["qwen2.5-1.5b"]
    assert row["layer_bytes_per_token"] == pytest.approx(recorded["layer_bytes_per_token"], rel=0.01)
    assert row["bytes_per_token_per_vocab"] == pytest.approx(stored["bytes_per_token_per_vocab"], rel=0.02)
    # and the fitted formula reproduces the measurement of this preset's shape
    fitted = memory._linear(stored["layer_bytes_per_token"], memory.shape_features(PRESETS["qwen2.5-1.5b"]))
    assert fitted == pytest.approx(row["layer_bytes_per_token"], rel=0.02)
    assert memory._linear(stored["layer_bytes_per_batch_seq2"], memory.shape_features(PRESETS["qwen2.5-1.5b"])) == (
        pytest.approx(row["layer_bytes_per_batch_seq2"], abs=0.5)
    )


@pytest.mark.parametrize("loss", ["plain", "chunked"])
def test_the_loss_peak_is_what_the_calibration_says(loss):
    calibration = load_calibration().loss_peak
    peaks = [memory_probe.loss_peak_bytes(loss=loss, precision="bf16", batch=2, seq=s, hidden=64, vocab=4096)
             for s in (64, 128)]  # fmt: skip
    per = (peaks[1] - peaks[0]) / (2 * 64 * 4096)
    assert per == pytest.approx(calibration[f"bf16/{loss}"]["bytes_per_token_per_vocab"], rel=0.05)
    # the full logits upcast to fp32 cost far more than the 6 bytes the old model assumed
    assert per > 10


@pytest.mark.parametrize("first", [True, False], ids=["first-micro-batch", "later-micro-batch"])
@pytest.mark.parametrize(
    ("preset", "ckpt", "loss"),
    [("qwen2.5-0.5b", False, "plain"), ("qwen2.5-0.5b", True, "plain"), ("qwen2.5-1.5b", False, "chunked"),
     ("qwen2.5-1.5b", True, "chunked")],
)  # fmt: skip
def test_a_micro_batchs_peak_is_within_the_stated_uncertainty_and_15_percent(preset, ckpt, loss, first):
    """The whole forward + backward of a micro-batch, every storage it creates tracked until freed, against the
    estimate less what existed before it (weights and moments; the gradients too for a later micro-batch) and the
    CUDA context. The first micro-batch of a step starts without gradients (accumulation 1 on one GPU): its peak is
    at the loss or, with checkpointing, at the first layer's recomputation, most gradients made by then."""
    batch, seq, vocab = 4, 256, 8192
    setting = memory_probe.Setting("sdpa", ckpt, loss, "bf16")
    measured = micro_batch_peak(
        memory_probe.preset_shape(preset), setting, batch=batch, seq=seq, vocab=vocab, first=first
    )
    a = dataclasses.replace(PRESETS[preset], num_hidden_layers=LAYERS, vocab_size=vocab)
    settings = StepSettings(gradient_checkpointing=ckpt, fused_cross_entropy=loss == "chunked",
                            gradient_accumulation_steps=1 if first else 2)  # fmt: skip
    e = memory.estimate(a, seq=seq, batch=batch, settings=settings, world=1)
    assert (e.absent_at_loss > 0) == first
    predicted = e.allocated - (e.states - e.absent_at_loss)
    print(f"{preset} ckpt={ckpt} {loss} first={first}: predicted {predicted / 1e6:.1f} "
          f"+- {e.allocated_uncertainty / 1e6:.1f} MB, measured {measured / 1e6:.1f} MB")  # fmt: skip
    assert abs(predicted - measured) <= e.allocated_uncertainty, (
        f"predicted {predicted / 1e6:.1f} +- {e.allocated_uncertainty / 1e6:.1f} MB, measured {measured / 1e6:.1f} MB"
    )
    assert predicted == pytest.approx(measured, rel=0.15)
