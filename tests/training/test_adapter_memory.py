"""The planner's memory model for LoRA and QLoRA (gpuscout/plan/memory.py) against the real peft model on CPU:
a whole training step's peak bytes (forward, loss, backward, clipping, AdamW over the adapters, gradients zeroed with
``set_to_none``: train.py's order), parameters and optimizer states included; the bytes autograd saves for backward
(benchmarks/memory_probe.py) over precision, checkpointing, rank and dropout; and what the model says of a 7B.

The probe's ``ShapesOnly`` stand-in skips the matrix products' arithmetic (the same bytes; the first test holds it to
the real kernels for a whole step), so the file runs in seconds on two cores."""

from __future__ import annotations

import dataclasses

import pytest

from gpuscout.domain.adapters import QLORA_BYTES_PER_WEIGHT, Adapter, adapter_params, decoder_linear_params
from gpuscout.domain.flops import total_params
from gpuscout.domain.models import PRESETS
from gpuscout.errors import PlanError
from gpuscout.plan import memory
from gpuscout.plan.memory import StepSettings, estimate, load_calibration

memory_probe = pytest.importorskip("memory_probe")
pytest.importorskip("peft")

LAYERS = 2
GB = 1e9


def arch(preset: str, *, vocab: int):
    return dataclasses.replace(PRESETS[preset], num_hidden_layers=LAYERS, vocab_size=vocab)


def step_peak(shape, setting, *, batch: int, seq: int, vocab: int, real_arithmetic: bool = False) -> int:
    """Peak bytes alive over a later training step (AdamW's moments made by a first one), every parameter, moment
    and storage the step creates counted: a CPU stand-in for torch.cuda.max_memory_allocated."""
    import torch
    from gpuscout_train.adapters import trainable_parameters
    from gpuscout_train.packing import make_inputs

    with memory_probe.kernels(real=real_arithmetic):
        model = memory_probe.build_model(shape, layers=LAYERS, vocab=vocab, setting=setting)
        optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-4, foreach=False)  # build.py's on a CPU
        ids, seg = memory_probe.packed_batch(batch, seq, vocab)
        bf16 = setting.precision == "bf16"

        def step() -> None:
            dtype = torch.bfloat16 if bf16 else torch.float32
            inputs = make_inputs(ids, seg, packing=True, attention=setting.attention, dtype=dtype)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = model(inputs.input_ids, inputs.position_ids, inputs.attention_mask, inputs.labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()
        moments = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        tracker = memory_probe.LiveBytes([*model.parameters(), *moments])
        with tracker:
            step()
    return tracker.peak


def test_the_stand_in_holds_a_whole_adapter_steps_peak():
    setting = memory_probe.Setting("sdpa", True, "plain", "bf16", Adapter("lora", rank=8, dropout=0.05))
    shape = memory_probe.LayerShape("narrow", hidden=64, intermediate=160, heads=4, kv_heads=2)
    args = dict(batch=2, seq=64, vocab=512)
    assert step_peak(shape, setting, **args) == step_peak(shape, setting, **args, real_arithmetic=True)


STEP_CASES = [
    pytest.param("qwen2-tiny", 4096, 4, 256, False, id="qwen2-tiny"),
    pytest.param("qwen2-tiny", 4096, 4, 256, True, id="qwen2-tiny-ckpt"),
    pytest.param("qwen2.5-0.5b", 2048, 2, 256, False, id="0.5b-2-layers"),
    pytest.param("qwen2.5-0.5b", 2048, 2, 256, True, id="0.5b-2-layers-ckpt"),
]


@pytest.mark.parametrize(("preset", "vocab", "batch", "seq", "ckpt"), STEP_CASES)
def test_a_cpu_lora_steps_peak_is_within_15_percent_of_the_estimate(preset, vocab, batch, seq, ckpt):
    """device="cpu": fp32 frozen base, fp32 adapters, no autocast, the CPU's dropout; the estimate's whole allocated
    peak (frozen weights + adapter states + the step's transients) against the measured one, parameters included."""
    adapter = Adapter("lora", rank=16)
    setting = memory_probe.Setting("sdpa", ckpt, "plain", "fp32", adapter)
    measured = step_peak(memory_probe.preset_shape(preset), setting, batch=batch, seq=seq, vocab=vocab)
    a = arch(preset, vocab=vocab)
    e = estimate(a, seq=seq, batch=batch, settings=StepSettings(gradient_checkpointing=ckpt, adapter=adapter),
                 world=1, device="cpu")  # fmt: skip
    assert e.frozen_weights == 4 * total_params(a) and e.states == 16 * adapter_params(a, adapter)
    print(f"{preset} ckpt={ckpt}: predicted {e.allocated / 1e6:.1f} MB (frozen {e.frozen_weights / 1e6:.1f}), "
          f"measured {measured / 1e6:.1f} MB: {e.allocated / measured - 1:+.1%}")  # fmt: skip
    assert e.allocated == pytest.approx(measured, rel=0.15)


@pytest.mark.parametrize("ckpt", [False, True], ids=["full", "ckpt"])
def test_a_bf16_lora_steps_peak_is_within_15_percent_of_the_cuda_estimate(ckpt):
    """CUDA's storage on CPU kernels: the frozen base in bf16, fp32 adapters under bf16 autocast (their copies),
    against the CUDA estimate less the context."""
    adapter = Adapter("lora", rank=16)
    setting = memory_probe.Setting("sdpa", ckpt, "plain", "bf16", adapter)
    vocab, batch, seq = 2048, 2, 256
    measured = step_peak(memory_probe.preset_shape("qwen2.5-0.5b"), setting, batch=batch, seq=seq, vocab=vocab)
    a = arch("qwen2.5-0.5b", vocab=vocab)
    e = estimate(a, seq=seq, batch=batch, settings=StepSettings(gradient_checkpointing=ckpt, adapter=adapter), world=1)
    assert e.frozen_weights == 2 * total_params(a) and e.weight_copies == 2 * adapter_params(a, adapter)
    print(f"bf16 ckpt={ckpt}: predicted {e.allocated / 1e6:.1f} MB, measured {measured / 1e6:.1f} MB: "
          f"{e.allocated / measured - 1:+.1%}")  # fmt: skip
    assert e.allocated == pytest.approx(measured, rel=0.15)


BATCH, SEQ, VOCAB = 2, 96, 1024
SAVED_CASES = [
    (precision, ckpt, rank, dropout, kernel)
    for precision in ("bf16", "fp32")
    for ckpt in (False, True)
    for rank in (8, 64)
    for dropout, kernel in ((0.0, "cpu"), (0.05, "cpu"), (0.05, "cuda"))  # the CPU's dropout kernel, or CUDA's
    if not (kernel == "cuda" and rank == 64)
]


def case_id(case) -> str:
    precision, ckpt, rank, dropout, kernel = case
    return f"{precision}-{'ckpt' if ckpt else 'full'}-r{rank}-" + (f"dropout-{kernel}" if dropout else "no-dropout")


@pytest.mark.parametrize(("precision", "ckpt", "rank", "dropout", "kernel"), SAVED_CASES, ids=map(case_id, SAVED_CASES))
def test_the_saved_bytes_are_within_15_percent_of_the_measured(precision, ckpt, rank, dropout, kernel):
    """qwen2.5-0.5b's layer shape (not among the shapes the rank and dropout terms were fitted on), two layers: the
    bytes saved for backward, logits included; dropout under the CPU's kernel (device="cpu") and CUDA's fused one."""
    adapter = Adapter("lora", rank=rank, dropout=dropout)
    setting = memory_probe.Setting("sdpa", ckpt, "plain", precision, adapter)
    with memory_probe.cuda_dropout() if kernel == "cuda" else memory_probe.contextlib.nullcontext():
        measured = memory_probe.saved_bytes(
            memory_probe.preset_shape("qwen2.5-0.5b"), setting, layers=LAYERS, batch=BATCH, seq=SEQ, vocab=VOCAB
        )
    a = arch("qwen2.5-0.5b", vocab=VOCAB)
    s = StepSettings(precision=precision, gradient_checkpointing=ckpt, adapter=adapter)
    predicted = memory.saved_activation_bytes(a, seq=SEQ, batch=BATCH, settings=s, device=kernel)
    predicted += memory.saved_logit_bytes(a, seq=SEQ, batch=BATCH, settings=s)
    print(f"{setting.key} r{rank} dropout {dropout} ({kernel}): predicted {predicted / 1e6:.3f} MB, measured "
          f"{measured.activations / 1e6:.3f} MB: {predicted / measured.activations - 1:+.2%}")  # fmt: skip
    assert predicted == pytest.approx(measured.activations, rel=0.15)
    # autocast copies only the adapters' fp32 weights (2 B each); the bf16 base and head need none. Saved for backward
    # are all but the first layer's q, k and v A matrices (their input needs no gradient); autocast's cache holds
    # those through the forward pass all the same, which the estimate's weight_copies counts.
    first_layer_a = rank * 3 * a.hidden_size
    expected_copies = 2 * (adapter_params(a, adapter) - first_layer_a) if precision == "bf16" and not ckpt else 0
    assert measured.weight_copies == expected_copies


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_fewer_target_modules_save_less_than_the_seven_module_figure(precision):
    """The calibration is measured with adapters on all seven linear layers; a subset (q and v, the LoRA paper's) is
    planned with that figure, an upper bound: only the adapters' own saved inputs go away."""
    adapter = Adapter("lora", rank=16, target_modules=("q_proj", "v_proj"))
    setting = memory_probe.Setting("sdpa", False, "plain", precision, adapter)
    shape = memory_probe.preset_shape("qwen2.5-0.5b")
    measured = memory_probe.saved_bytes(shape, setting, layers=LAYERS, batch=BATCH, seq=SEQ, vocab=VOCAB)
    a = arch("qwen2.5-0.5b", vocab=VOCAB)
    s = StepSettings(precision=precision, adapter=adapter)
    predicted = memory.saved_activation_bytes(a, seq=SEQ, batch=BATCH, settings=s, device="cpu")
    predicted += memory.saved_logit_bytes(a, seq=SEQ, batch=BATCH, settings=s)
    print(f"q,v only ({precision}): predicted {predicted / 1e6:.3f} MB, measured {measured.activations / 1e6:.3f} "
          f"MB: {predicted / measured.activations - 1:+.1%}")  # fmt: skip
    assert measured.activations <= predicted <= 1.5 * measured.activations


def test_the_lora_calibration_is_what_the_probe_measures_now():
    setting = memory_probe.Setting("sdpa", False, "plain", "bf16", Adapter("lora", rank=memory_probe.ADAPTER_RANKS[0]))
    shape = memory_probe.preset_shape("qwen2.5-0.5b")
    row = memory_probe.probe_shape(shape, setting, batch=2, seqs=(32, 64), vocabs=(512, 1024))
    stored = load_calibration().setting("bf16/sdpa/full/plain/lora")
    recorded = stored["measurements"]["qwen2.5-0.5b"]
    assert row["layer_bytes_per_token"] == pytest.approx(recorded["layer_bytes_per_token"], rel=0.01)
    features = {**memory.shape_features(PRESETS["qwen2.5-0.5b"]), "rank": memory_probe.ADAPTER_RANKS[0]}
    assert memory._linear(stored["layer_bytes_per_token"], features) == pytest.approx(row["layer_bytes_per_token"],
                                                                                     rel=0.02)  # fmt: skip
    # the fitted rank term is what the rank costs: B saves A's output, rank-wide, per adapted layer (7 x 2 B in bf16)
    terms = memory_probe.adapter_terms(memory_probe.LayerShape("s", 256, 512, 4, 2), setting, batch=2, seq=32,
                                       vocab=512)  # fmt: skip
    assert terms["rank"] == stored["layer_bytes_per_token"]["rank"] == 7 * 2
    # and the checkpointed setting's backward transient, on the first shape it was fitted on
    ckpt = dataclasses.replace(setting, checkpointing=True)
    small = memory_probe.LayerShape(memory_probe.ADAPTER_TERM_SHAPES[0], 256, 512, 4, 2)
    raw = stored["measurements"][small.name]["raw_saved_bytes"]
    layer = {s: raw[f"layers2_seq{s}_vocab512"] - raw[f"layers1_seq{s}_vocab512"] for s in (32, 64)}
    backward = memory_probe.backward_bytes_per_token(small, ckpt, layer_bytes=layer, batch=2, seqs=(32, 64), vocab=512)
    stored_ckpt = load_calibration().setting(ckpt.key)
    assert backward == stored_ckpt["measurements"][small.name]["backward_bytes_per_token"]
    assert memory._linear(stored_ckpt["layer_backward_bytes_per_token"], small.features()) == pytest.approx(backward)


SEVEN_B = PRESETS["qwen2.5-7b"]
L40S_USABLE = 0.9 * 48e9


@pytest.mark.parametrize(("seq", "ckpt"), [(2048, False), (4096, True)])
def test_a_7b_lora_fits_one_l40s_and_a_full_fine_tune_does_not(seq, ckpt):
    lora = estimate(SEVEN_B, seq=seq, batch=1, world=1,
                    settings=StepSettings(gradient_checkpointing=ckpt, adapter=Adapter("lora", rank=16)))  # fmt: skip
    full = estimate(SEVEN_B, seq=seq, batch=1, world=1, settings=StepSettings(gradient_checkpointing=ckpt))
    print(f"7B seq {seq} ckpt={ckpt}: LoRA r=16 {lora.total_gb:.1f} GB (+-{lora.uncertainty / GB:.1f}), "
          f"full {full.total_gb:.1f} GB")  # fmt: skip
    assert lora.total < L40S_USABLE
    assert full.total > 48e9
    assert lora.frozen_weights == 2 * total_params(SEVEN_B)  # the bf16 base, no fp32 master copy


def test_a_7b_qlora_fits_24_gb():
    adapter = Adapter("qlora", rank=16)
    e = estimate(
        SEVEN_B, seq=2048, batch=1, world=1, settings=StepSettings(gradient_checkpointing=True, adapter=adapter)
    )
    print(f"7B QLoRA r=16 seq 2048 ckpt: {e.total_gb:.1f} GB (+-{e.uncertainty / GB:.1f})")
    assert e.total < 24e9
    quantized = decoder_linear_params(SEVEN_B)
    assert e.frozen_weights == QLORA_BYTES_PER_WEIGHT * quantized + 2 * (total_params(SEVEN_B) - quantized)
    assert 0.51 < QLORA_BYTES_PER_WEIGHT < 0.52  # 4 bits and the double-quantized block scales


def test_what_adapters_cannot_be_planned_with():
    a = PRESETS["qwen2.5-1.5b"]
    with pytest.raises(PlanError, match="ZeRO"):
        estimate(a, seq=512, batch=1, world=2, settings=StepSettings(deepspeed_stage=2, adapter=Adapter("lora")))
    with pytest.raises(PlanError, match="CUDA"):
        estimate(a, seq=512, batch=1, world=1, settings=StepSettings(adapter=Adapter("qlora")), device="cpu")
    # and full fine-tuning keeps its own calibration keys and parts
    assert StepSettings().calibration_key == "bf16/sdpa/full/plain"
    assert StepSettings(adapter=Adapter("qlora")).calibration_key == "bf16/sdpa/full/plain/lora"
    assert estimate(a, seq=512, batch=1, world=1, settings=StepSettings()).frozen_weights == 0
