"""Peak memory of one training step per GPU, from coefficients measured on the real model code.

The activation and loss bytes come from configs/memory/calibration.json, which benchmarks/memory_probe.py writes: it
runs train.py's model wrapping (CausalLMWithLoss, make_inputs with packing and the dense 4D document mask, fp32
master weights under bf16 autocast, non-reentrant checkpointing) on CPU and counts the bytes autograd saves for
backward. docs/performance.md ("Memory model") says how, on what, and what still needs a GPU to confirm.

Peak = states (+ an adapter run's frozen weights) + CUDA context (+ NCCL) + the largest of three moments' transients
(four with adapters, below), where (T = batch x sequence tokens):

* the loss (end of the forward pass and the loss's backward): weight copies + activations + mask + loss, less the
  fp32 gradients when they do not exist yet (one GPU, no DeepSpeed, accumulation 1: train.py zeroes gradients with
  ``set_to_none``, and there are no DDP bucket views);
* with checkpointing, the first layer's recomputation at the end of the backward pass (activations + mask +
  recompute), every gradient there but that layer's (and an untied input embedding's) when they start absent;
* the end of the backward pass and the optimizer step (fused AdamW on CUDA): the states alone.

The parts:

* states: 16 bytes/parameter (fp32 weights 4 + fp32 gradients 4 + AdamW 8; DDP's gradients are views of its
  buckets); under ZeRO-2/3 DeepSpeed's own estimators (state_bytes): 2 B/param whole + 18 B/param sharded, or the
  18 sharded + the largest layer gathered;
* weight copies: under autocast (bf16/fp16 without DeepSpeed) every matmul weight gets a 16-bit copy, cached for the
  forward pass and saved for backward: 2 bytes per matmul parameter;
* activations: per layer ``layer_bytes_per_token(h, i, kv_width, heads) x T + layer_bytes_per_batch_seq2 x batch x
  seq^2`` (the attention mask sdpa converts per layer, or eager's attention probabilities), plus the model-level
  ``model_bytes_per_token x T`` (embeddings, final norm, lm_head input). With checkpointing every layer keeps only
  its checkpointed input, and one layer's full activations (and weight copies) are recomputed at a time in the
  backward pass, after the loss: the peak is the larger of that moment and the loss's;
* mask: the dense [batch, 1, seq, seq] mask make_inputs builds for packing (bool for sdpa, the compute dtype for
  eager); flex attention's block mask is small, so flex is modelled as sdpa without either mask term;
* loss: the measured peak of the loss alone, per token and vocabulary entry: the full logits (bf16, a contiguous
  copy, the fp32 upcast, log-softmax and their gradients) for the plain loss, one 4,096-token chunk of them for the
  chunked loss and torch's; Liger's from its code (loss_bytes): one chunk of logits in the compute dtype, the fp32
  weight gradient and the input's gradient;
* CUDA context: 1.5 GB (not seen by torch.cuda.max_memory_allocated);
* NCCL, with more than one GPU: 1 GB per GPU of communicator buffers outside torch's allocator (NVIDIA/nccl#864
  reports ~1.6 GB for one communicator with its all-reduce, CUDA context included; NVLS on NVSwitch machines takes
  more, which is why NeMo's launcher sets NCCL_NVLS_ENABLE=0 to save memory).

The head's gradient is not a term: the loss's peak comes before it (tests/training/test_memory_calibration.py measures
whole micro-batches, first and later, with train.py's order: forward under autocast, backward outside it).

Every estimate states its own uncertainty (``MemoryEstimate.uncertainty``, bytes either way), the sum of each part's:
states and weight copies are counted exactly (DeepSpeed's ZeRO-3 largest layer is approximated); activations and the
loss were calibrated on CPU kernels with the real model code, and CUDA's attention and loss kernels keep their own
buffers (5 % of activations, 10 % of the loss, 25 % for Liger's and torch's fused kernels, not probed on CPU; 20 %
of the recomputed layer, whose moment's gradients are approximated);
torch.compile re-plans what is saved (20 % of activations when compiled: not measured yet); the CUDA context
+-0.75 GB; NCCL +-1 GB. Allocator fragmentation is not counted: the planner compares against
90 % of the GPU memory, train.py runs with ``expandable_segments`` and reports reserved beside allocated.

Adapters (``StepSettings.adapter``, LoRA or QLoRA; gpuscout_train/adapters.py builds them with peft): only the adapters
train, so the states are 16 bytes per adapter parameter (gpuscout.domain.adapters.adapter_params) and the frozen base is
its own part, ``frozen_weights`` (counted exactly), at its storage precision: on CUDA 2 bytes per weight in bf16/fp16
(no fp32 master copy), 4 in fp32; QLoRA's decoder linears at QLORA_BYTES_PER_WEIGHT (4-bit NF4 with double-quantized
scales) and the rest in the compute dtype; on a CPU 4 bytes. Autocast copies only the adapters' fp32 weights (2 B each);
the gradients absent at the loss are the adapters'. The activations come from the calibration's ``adapter_settings``
(keys ending ``/lora``), measured on the real peft model with its base frozen in bf16 under bf16 autocast: a frozen
linear saves its weight, not its input, while each adapter saves its own 16-bit copy of its input (peft casts the input
to the adapters' fp32, autocast casts it back) and B saves A's rank-wide output, so a layer's bytes per token take a
measured ``rank`` term (two ranks probed); dropout adds its masks (and fp32 dropped copies), measured apart for CUDA's
fused kernel (bool mask) and the CPU's (a mask in the input's dtype). Without checkpointing the first layer's input
needs no gradient (its norm saves nothing): the measured model-level term carries that; with checkpointing transformers
makes the embedding output require a gradient, so every layer is alike. A layer's backward transient (the activations'
gradients, fp32 where peft cast the input: ``layer_backward_bytes``, measured per token) joins the recomputation moment,
and without checkpointing makes a fourth moment, the last layer's backward with every activation still saved
(``at_backward``; the loss's peak is larger at real vocabularies). The calibration covers adapters on all seven linear
layers; fewer target modules are planned with that figure, an upper bound (only the adapters' own saved tensors go
away). QLoRA's bitsandbytes layers do not run on a CPU, so LoRA's bytes stand in, an upper bound too (under autocast
peft does not cast a 4-bit layer's input, so the adapters share it), +-10 % of activations, and one dequantized weight
in the compute dtype is a backward transient (in the recomputation, else in the uncertainty). ZeRO is refused with
adapters (PlanError): nothing worth sharding trains.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuscout.domain.adapters import (
    QLORA_BYTES_PER_WEIGHT,
    QLORA_ON_CPU,
    Adapter,
    adapter_params,
    decoder_linear_params,
)
from gpuscout.domain.flops import matmul_params, total_params
from gpuscout.domain.models import Architecture
from gpuscout.errors import PlanError
from gpuscout.paths import MEMORY_DIR

CALIBRATION_PATH = MEMORY_DIR / "calibration.json"
STATE_BYTES_PER_PARAM = 16.0
WEIGHT_COPY_BYTES_PER_PARAM = 2.0
CUDA_CONTEXT_GB = 1.5
CUDA_CONTEXT_UNCERTAINTY_GB = 0.75
NCCL_GB = 1.0  # per GPU, with more than one (module docstring)
NCCL_UNCERTAINTY_GB = 1.0
CHUNK_TOKENS = 4096  # training/gpuscout_train/packing.py chunked_cross_entropy's chunk_tokens


@dataclass(frozen=True)
class Calibration:
    settings: dict[str, dict[str, Any]]  # full fine-tuning
    loss_peak: dict[str, Any]
    versions: dict[str, str]
    adapter_settings: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # LoRA: keys end "/lora"

    def setting(self, key: str) -> dict[str, Any]:
        try:
            return self.adapter_settings[key] if key.endswith("/lora") else self.settings[key]
        except KeyError:
            raise PlanError(f"{CALIBRATION_PATH}: no memory calibration for {key}") from None


@functools.cache
def load_calibration(path: Path = CALIBRATION_PATH) -> Calibration:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise PlanError(f"cannot read the memory calibration {path}: {err}") from err
    return Calibration(settings=doc["settings"], loss_peak=doc["loss_peak"], versions=doc["versions"],
                       adapter_settings=doc.get("adapter_settings", {}))  # fmt: skip


def shape_features(arch: Architecture) -> dict[str, float]:
    head_dim = arch.attention_head_dim
    return {
        "hidden": arch.hidden_size,
        "intermediate": arch.intermediate_size,
        "kv_width": arch.num_key_value_heads * head_dim,
        "heads": arch.num_attention_heads,
        "head_dim": head_dim,
        "one": 1.0,
    }


def _linear(coefficients: dict[str, float], features: dict[str, float]) -> float:
    return sum(c * features[name] for name, c in coefficients.items())


@dataclass(frozen=True)
class StepSettings:
    """The training settings that change activation memory (train.py's hyperparameters of the same names)."""

    precision: str = "bf16"  # bf16 | fp16 | fp32
    attention: str = "sdpa"  # sdpa | eager | flex
    gradient_checkpointing: bool = False
    fused_cross_entropy: bool = False
    packing: bool = True
    deepspeed_stage: int = 0
    cross_entropy_kernel: str = "chunked"  # chunked | liger | torch (the fused loss's kernel; "auto" is chunked)
    torch_compile: bool = False
    gradient_accumulation_steps: int = 1
    adapter: Adapter | None = None  # LoRA or QLoRA adapters on a frozen base; None: full fine-tuning

    @property
    def calibration_key(self) -> str:
        precision = "fp32" if self.precision == "fp32" else "bf16"  # fp16 saves the same bytes as bf16
        attention = "eager" if self.attention == "eager" else "sdpa"
        layers = "ckpt" if self.gradient_checkpointing else "full"
        key = f"{precision}/{attention}/{layers}/{'chunked' if self.fused_cross_entropy else 'plain'}"
        return key + ("/lora" if self.adapter is not None else "")  # QLoRA: LoRA's (module docstring)

    def with_checkpointing(self, value: bool) -> StepSettings:
        return StepSettings(**{**self.__dict__, "gradient_checkpointing": value})


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU by part; ``total`` is the step's peak, the largest of three moments (module docstring): the
    loss (every weight copy, every saved activation and the loss transient at once, less the gradients not yet
    created), with checkpointing a layer's recomputation in the backward pass (the saved inputs, one layer's full
    activations and its weight copies, less the gradients still to come), and the optimizer step (the states).
    With adapters the states are the adapters' alone and the frozen base is ``frozen_weights``."""

    states: float  # the trained parameters' fp32 weights, gradients and AdamW moments (or ZeRO's shares)
    weight_copies: float
    activations: float  # saved for backward at the end of the forward pass
    mask: float
    loss: float
    recompute: float  # one layer's activations and weight copies while it is recomputed (checkpointing), else 0
    cuda_context: float
    absent_at_loss: float = 0.0  # states not yet allocated when the loss runs (the fp32 gradients, accumulation 1)
    absent_at_recompute: float = 0.0  # gradients still to come when the first layer is recomputed
    nccl: float = 0.0  # communicator buffers outside torch's allocator (world > 1)
    uncertainty: float = 0.0  # bytes either way (module docstring)
    frozen_weights: float = 0.0  # an adapter run's frozen base at its storage precision (0: full fine-tuning)
    # an adapter run's last layer's backward without checkpointing: its activations' gradients, every saved
    # activation still held (the loss freed); 0 for full fine-tuning and with checkpointing
    backward: float = 0.0

    @property
    def at_loss(self) -> float:
        return self.weight_copies + self.loss - self.absent_at_loss

    @property
    def at_recompute(self) -> float:
        if not self.recompute:  # no checkpointing: no such moment
            return -(self.activations + self.mask)
        return self.recompute - self.absent_at_recompute

    @property
    def at_backward(self) -> float:
        if not self.backward:  # full fine-tuning, or checkpointing (the recomputation holds it)
            return -(self.activations + self.mask)
        return self.weight_copies + self.backward - self.absent_at_loss

    @property
    def transient(self) -> float:
        """What the peak moment adds to the states, frozen weights, saved activations, mask, context and NCCL."""
        return max(self.at_loss, self.at_recompute, self.at_backward, -(self.activations + self.mask))

    @property
    def total(self) -> float:
        return (
            self.states
            + self.frozen_weights
            + self.activations
            + self.mask
            + self.transient
            + self.cuda_context
            + self.nccl
        )

    @property
    def total_gb(self) -> float:
        return self.total / 1e9

    @property
    def allocated(self) -> float:
        """The peak torch.cuda.max_memory_allocated sees: without the CUDA context and NCCL's buffers."""
        return self.total - self.cuda_context - self.nccl

    @property
    def allocated_uncertainty(self) -> float:
        """``uncertainty`` less the context's and NCCL's parts (not in what torch allocates)."""
        outside = (CUDA_CONTEXT_UNCERTAINTY_GB * 1e9 if self.cuda_context else 0.0) + (
            NCCL_UNCERTAINTY_GB * 1e9 if self.nccl else 0.0
        )
        return max(self.uncertainty - outside, 0.0)


def largest_layer_params(arch: Architecture) -> int:
    """Parameters of the largest single module (DeepSpeed's ``largest_layer_params``): the embedding (or an untied
    head, the same shape) for a Qwen-sized vocabulary, else an MLP projection."""
    return max(arch.vocab_size * arch.hidden_size, arch.hidden_size * arch.intermediate_size)


def state_bytes(arch: Architecture, *, stage: int, world: int, half: bool = True) -> float:
    """Model states per GPU. Without DeepSpeed: fp32 weights, fp32 gradients and two AdamW moments, 16 bytes per
    parameter (DDP's gradients are views of its buckets, no extra copy). With ZeRO and a 16-bit precision,
    DeepSpeed's own estimators without offload (deepspeed 0.19.8, estimate_zero2/3_model_states_mem_needs): 16-bit
    weights kept whole plus 18 bytes per parameter sharded (16-bit and fp32 gradients, fp32 master weights, two
    moments) under ZeRO-2; the 18 sharded plus the largest layer gathered in fp32 terms (4 bytes per parameter)
    under ZeRO-3. In fp32 (``half=False``; the estimators assume 16-bit training and do not cover it): under ZeRO-2
    fp32 weights whole plus 16 bytes per parameter sharded (stage_1_and_2.py clones the master partition whatever
    its dtype: 4, gradients 4, moments 8); under ZeRO-3 16 sharded (stage3.py reuses the fp32 partition)."""
    params = total_params(arch)
    if stage == 3:
        return 4.0 * largest_layer_params(arch) + (18.0 if half else 16.0) * params / world
    if stage == 2:
        return (2.0 * params + 18.0 * params / world) if half else (4.0 * params + 16.0 * params / world)
    return params * STATE_BYTES_PER_PARAM


def _dense_mask_applies(s: StepSettings) -> bool:
    return s.packing and s.attention != "flex"


def _features(arch: Architecture, settings: StepSettings) -> dict[str, float]:
    """The shape features, and an adapter's rank (the per-layer fit's "rank" term)."""
    features = shape_features(arch)
    if settings.adapter is not None:
        features["rank"] = float(settings.adapter.rank)
    return features


def layer_activation_bytes(
    arch: Architecture, *, seq: int, batch: int, settings: StepSettings, device: str = "cuda"
) -> float:
    """Bytes one decoder layer saves for backward without checkpointing (the recomputed layer's, with it). An
    adapter's dropout adds its masks and dropped inputs: CUDA's fused dropout keeps a bool mask, the CPU's a mask in
    the input's dtype (``device``)."""
    c = load_calibration().setting(settings.with_checkpointing(False).calibration_key)
    features = _features(arch, settings)
    per_token = _linear(c["layer_bytes_per_token"], features)
    if settings.adapter is not None and settings.adapter.dropout > 0:
        per_token += _linear(c["layer_dropout_bytes_per_token" + ("" if device == "cuda" else "_cpu")], features)
    per_seq2 = _linear(c["layer_bytes_per_batch_seq2"], features)
    if settings.attention != "eager" and not _dense_mask_applies(settings):
        per_seq2 = 0.0  # sdpa without a dense mask (flex, or unpacked rows with a padding mask) keeps no L^2 term
    return per_token * batch * seq + per_seq2 * batch * seq * seq


def saved_activation_bytes(
    arch: Architecture, *, seq: int, batch: int, settings: StepSettings, device: str = "cuda"
) -> float:
    """What the forward pass leaves saved for backward: every layer's activations (or checkpointed inputs) and the
    model-level ones, logits excluded (the loss term covers them). With adapters and no checkpointing the first
    layer's input needs no gradient, so its norm saves nothing: the model-level term (measured) is the smaller."""
    c = load_calibration().setting(settings.calibration_key)
    features = _features(arch, settings)
    tokens = batch * seq
    model_level = _linear(c["model_bytes_per_token"], features) * tokens
    if settings.gradient_checkpointing:
        return arch.num_hidden_layers * _linear(c["layer_bytes_per_token"], features) * tokens + model_level
    layer = layer_activation_bytes(arch, seq=seq, batch=batch, settings=settings, device=device)
    return arch.num_hidden_layers * layer + model_level


def saved_logit_bytes(arch: Architecture, *, seq: int, batch: int, settings: StepSettings) -> float:
    """Bytes of logits the loss saves for backward (the plain loss's fp32 log-softmax; none when fused)."""
    c = load_calibration().setting(settings.calibration_key)
    return float(c["bytes_per_token_per_vocab"]) * batch * (seq - 1) * arch.vocab_size


def liger_chunk_rows(rows: int, hidden: int, vocab: int, *, chunk_rows: int = CHUNK_TOKENS) -> int:
    """Rows per chunk of Liger 0.8.5's fused linear cross-entropy as train.py calls it: gpuscout_train/packing.py's
    liger_chunk_mem_const (tests/training/test_loss_paths.py holds the two equal), then Liger's own split,
    next_pow2(rows / ceil(vocab / (c x hidden))), at most ``rows``."""
    wanted = max(1, -(-rows // chunk_rows))
    const = max(1, vocab // (wanted * hidden))
    factor = -(-vocab // (const * hidden))
    per_chunk = -(-rows // factor)
    return min(1 << (per_chunk - 1).bit_length(), rows)


def loss_bytes(arch: Architecture, *, seq: int, batch: int, settings: StepSettings) -> float:
    """Peak bytes of the loss: all prediction rows' logits at once (plain) or one chunk of them (the chunked loss,
    and torch's, measured as the chunked one). Liger computes its gradients in the forward pass: one chunk of logits
    in the compute dtype, rewritten in place as their gradient, the fp32 weight-gradient accumulator and the input's
    gradient (liger_kernel 0.8.5 ops/fused_linear_cross_entropy.py)."""
    precision = "fp32" if settings.precision == "fp32" else "bf16"
    rows = batch * (seq - 1)
    if settings.fused_cross_entropy and settings.cross_entropy_kernel == "liger":
        entry = 4.0 if precision == "fp32" else 2.0
        chunk = liger_chunk_rows(rows, arch.hidden_size, arch.vocab_size)
        return (
            entry * chunk * arch.vocab_size + 4.0 * arch.vocab_size * arch.hidden_size + entry * rows * arch.hidden_size
        )
    kind = "chunked" if settings.fused_cross_entropy else "plain"
    per = float(load_calibration().loss_peak[f"{precision}/{kind}"]["bytes_per_token_per_vocab"])
    if settings.fused_cross_entropy:
        rows = min(rows, CHUNK_TOKENS)
    return per * rows * arch.vocab_size


def mask_bytes(*, seq: int, batch: int, settings: StepSettings) -> float:
    if not _dense_mask_applies(settings):
        return 0.0
    entry = 1.0 if settings.attention != "eager" else (4.0 if settings.precision == "fp32" else 2.0)
    return entry * batch * seq * seq


def gradients_absent_at_loss(settings: StepSettings, *, world: int) -> bool:
    """Whether the fp32 gradients do not exist yet when the loss runs: one GPU without DeepSpeed (no DDP bucket
    views), gradients zeroed with ``set_to_none`` (train.py), and one micro-batch per optimizer step."""
    return world == 1 and settings.deepspeed_stage == 0 and settings.gradient_accumulation_steps <= 1


def frozen_weight_bytes(arch: Architecture, adapter: Adapter, *, precision: str, device: str) -> float:
    """An adapter run's frozen base at its storage precision (gpuscout_train/build.py frozen_dtype): on CUDA in the
    compute dtype (2 bytes per weight in bf16, 4 in fp32; LoRA under fp16 keeps an fp32 base, which autocast copies),
    QLoRA's decoder linears in 4-bit NF4 with double-quantized
    scales (QLORA_BYTES_PER_WEIGHT) and the rest (embedding, norms, biases, lm_head) in the compute dtype; on a CPU
    in fp32, where train.py computes."""
    params = total_params(arch)
    compute = 2.0 if device == "cuda" and precision != "fp32" else 4.0
    if adapter.method == "qlora":
        quantized = decoder_linear_params(arch)
        return QLORA_BYTES_PER_WEIGHT * quantized + compute * (params - quantized)
    if precision == "fp16":  # LoRA under fp16 keeps its base in fp32 (an fp16 residual stream overflows in Qwen2)
        return 4.0 * params
    return compute * params


def layer_backward_bytes(arch: Architecture, *, seq: int, batch: int, settings: StepSettings) -> float:
    """An adapter run's transient in one layer's backward pass: the activations' gradients (peft casts an adapter's
    input to fp32, so its gradient is fp32 too), measured per token with checkpointing (memory_probe's
    backward_bytes_per_token) and the same for a layer's backward without it."""
    c = load_calibration().setting(settings.with_checkpointing(True).calibration_key)
    return _linear(c["layer_backward_bytes_per_token"], _features(arch, settings)) * batch * seq


def _dequantized_bytes(arch: Architecture, settings: StepSettings) -> float:
    """QLoRA's transient: bitsandbytes dequantizes one 4-bit weight at a time into the compute dtype (the largest,
    an MLP projection); 0 for LoRA and full fine-tuning."""
    if settings.adapter is None or settings.adapter.method != "qlora":
        return 0.0
    return (4.0 if settings.precision == "fp32" else 2.0) * arch.hidden_size * arch.intermediate_size


def _step_parts(
    arch: Architecture, *, seq: int, batch: int, settings: StepSettings, world: int, device: str
) -> dict[str, float]:
    """The parts a full fine-tune and an adapter run count alike: the dense mask, the loss, the CUDA context and
    NCCL's buffers."""
    return {
        "mask": mask_bytes(seq=seq, batch=batch, settings=settings),
        "loss": loss_bytes(arch, seq=seq, batch=batch, settings=settings),
        "cuda_context": CUDA_CONTEXT_GB * 1e9 if device == "cuda" else 0.0,
        "nccl": NCCL_GB * 1e9 if device == "cuda" and world > 1 else 0.0,
    }


def _adapter_estimate(
    arch: Architecture, *, seq: int, batch: int, settings: StepSettings, world: int, device: str
) -> MemoryEstimate:
    """estimate() for LoRA and QLoRA (module docstring): the states of the adapters alone, the frozen base at its
    storage precision, autocast copies of the adapters' fp32 weights only, their gradients absent at the loss."""
    adapter = settings.adapter
    assert adapter is not None
    if settings.deepspeed_stage:
        raise PlanError(f"{adapter.label}: ZeRO stage {settings.deepspeed_stage} is not supported with adapters "
                        "(only the adapters train: nothing worth sharding); use deepspeed_stage 0")  # fmt: skip
    if adapter.method == "qlora" and device != "cuda":
        raise PlanError(QLORA_ON_CPU)
    if device != "cuda":  # train.py autocasts on CUDA only: on the CPU the model computes (and is stored) in fp32
        settings = dataclasses.replace(settings, precision="fp32")
    autocast = settings.precision != "fp32" and device == "cuda"
    trained = adapter_params(arch, adapter)
    layers = max(arch.num_hidden_layers, 1)
    copies = WEIGHT_COPY_BYTES_PER_PARAM * trained if autocast else 0.0  # the bf16 base needs none
    if autocast and settings.precision == "fp16" and adapter.method == "lora":  # its fp32 base is copied too
        copies += WEIGHT_COPY_BYTES_PER_PARAM * matmul_params(arch)
    recompute = 0.0
    if settings.gradient_checkpointing:
        # the layer's activations, its backward's activation gradients (measured per token), its adapters' weight
        # copies, their new gradients and the accumulated sum, and under QLoRA a dequantized weight
        recompute = layer_activation_bytes(arch, seq=seq, batch=batch, settings=settings, device=device)
        recompute += layer_backward_bytes(arch, seq=seq, batch=batch, settings=settings)
        recompute += copies / layers + 8.0 * trained / layers + _dequantized_bytes(arch, settings)
    # without checkpointing, the last layer's backward (measured with it: the same layer's backward)
    backward = 0.0 if settings.gradient_checkpointing else layer_backward_bytes(arch, seq=seq, batch=batch,
                                                                                settings=settings)  # fmt: skip
    absent = absent_later = 0.0
    if gradients_absent_at_loss(settings, world=world):
        absent = 4.0 * trained  # the adapters' gradients; the frozen base has none
        absent_later = absent / layers  # the first layer's, still to come when it is recomputed
    e = MemoryEstimate(
        states=STATE_BYTES_PER_PARAM * trained,
        weight_copies=copies,
        activations=saved_activation_bytes(arch, seq=seq, batch=batch, settings=settings, device=device),
        recompute=recompute,
        absent_at_loss=absent,
        absent_at_recompute=absent_later,
        **_step_parts(arch, seq=seq, batch=batch, settings=settings, world=world, device=device),
        frozen_weights=frozen_weight_bytes(arch, adapter, precision=settings.precision, device=device),
        backward=backward,
    )
    # QLoRA's dequantized weight: in the recomputation with checkpointing, else a backward transient left uncounted
    dequantized = 0.0 if settings.gradient_checkpointing else _dequantized_bytes(arch, settings)
    uncertainty = _uncertainty(settings, e, dequantized=dequantized)
    return dataclasses.replace(e, uncertainty=uncertainty)


def _uncertainty(settings: StepSettings, e: MemoryEstimate, *, dequantized: float = 0.0) -> float:
    """Bytes either way (module docstring): each part's share, summed; ``dequantized``: QLoRA's dequantized weight,
    a backward transient not otherwise counted."""
    kernel = settings.cross_entropy_kernel if settings.fused_cross_entropy else "plain"
    loss_share = 0.25 if kernel in ("liger", "torch") else 0.10
    activation_share = 0.05 + (0.20 if settings.torch_compile else 0.0)
    parts = (
        activation_share * (e.activations + e.mask),
        # the recomputation moment: which gradients exist by then is approximated (13 % off on CPU at 2 layers)
        (activation_share + 0.15) * e.recompute,
        activation_share * e.backward,
        loss_share * e.loss,
        CUDA_CONTEXT_UNCERTAINTY_GB * 1e9 if e.cuda_context else 0.0,
        NCCL_UNCERTAINTY_GB * 1e9 if e.nccl else 0.0,
        # ZeRO-3's gathered layers: DeepSpeed's own figure approximates them by the largest one
        e.states * 0.05 if settings.deepspeed_stage == 3 else 0.0,
    )
    if settings.adapter is not None and settings.adapter.method == "qlora":
        # bitsandbytes' layers are not probed (LoRA's bytes stand in) and dequantize a weight at a time in backward
        return sum(parts) + 0.10 * e.activations + dequantized
    return sum(parts)


def estimate(
    arch: Architecture, *, seq: int, batch: int, settings: StepSettings, world: int, device: str = "cuda"
) -> MemoryEstimate:
    """Peak memory per GPU (or of the host, ``device="cpu"``) for one training step (module docstring)."""
    if settings.adapter is not None:
        return _adapter_estimate(arch, seq=seq, batch=batch, settings=settings, world=world, device=device)
    autocast = settings.precision != "fp32" and settings.deepspeed_stage == 0 and device == "cuda"
    half = settings.precision != "fp32" and device == "cuda"
    if device != "cuda":  # train.py autocasts on CUDA only: on the CPU the model computes in fp32
        settings = StepSettings(**{**settings.__dict__, "precision": "fp32"})
    copies = WEIGHT_COPY_BYTES_PER_PARAM * matmul_params(arch) if autocast else 0.0
    recompute = 0.0
    if settings.gradient_checkpointing:
        layer_copies = (copies - WEIGHT_COPY_BYTES_PER_PARAM * arch.hidden_size * arch.vocab_size) / max(
            arch.num_hidden_layers, 1
        )
        # + the layer's backward: a new fp32 gradient of its largest weight and the accumulated sum (8 B x h x i)
        backward = 8.0 * arch.hidden_size * arch.intermediate_size
        recompute = layer_activation_bytes(arch, seq=seq, batch=batch, settings=settings) + max(layer_copies, 0.0)
        recompute += backward
    head = arch.vocab_size * arch.hidden_size
    stage = settings.deepspeed_stage
    absent = absent_later = 0.0
    if gradients_absent_at_loss(settings, world=world):
        absent = 4.0 * total_params(arch)
        layer_params = (matmul_params(arch) - head) / max(arch.num_hidden_layers, 1)
        absent_later = 4.0 * (layer_params + (0 if arch.tie_word_embeddings else head))
    e = MemoryEstimate(
        states=state_bytes(arch, stage=stage, world=world, half=half),
        weight_copies=copies,
        activations=saved_activation_bytes(arch, seq=seq, batch=batch, settings=settings),
        recompute=recompute,
        absent_at_loss=absent,
        absent_at_recompute=absent_later,
        **_step_parts(arch, seq=seq, batch=batch, settings=settings, world=world, device=device),
    )
    return dataclasses.replace(e, uncertainty=_uncertainty(settings, e))
