"""Peak memory of one training step per GPU, from coefficients measured on the real model code.

The activation and loss bytes come from configs/memory/calibration.json, which benchmarks/memory_probe.py writes: it
runs train.py's model wrapping (CausalLMWithLoss, make_inputs with packing and the dense 4D document mask, fp32
master weights under bf16 autocast, non-reentrant checkpointing) on CPU and counts the bytes autograd saves for
backward. docs/performance.md ("Memory model") says how, on what, and what still needs a GPU to confirm.

Peak = states + CUDA context (+ NCCL) + the largest of three moments' transients, where (T = batch x sequence
tokens):

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
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    settings: dict[str, dict[str, Any]]
    loss_peak: dict[str, Any]
    versions: dict[str, str]

    def setting(self, key: str) -> dict[str, Any]:
        try:
            return self.settings[key]
        except KeyError:
            raise PlanError(f"{CALIBRATION_PATH}: no memory calibration for {key}") from None


@functools.cache
def load_calibration(path: Path = CALIBRATION_PATH) -> Calibration:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise PlanError(f"cannot read the memory calibration {path}: {err}") from err
    return Calibration(settings=doc["settings"], loss_peak=doc["loss_peak"], versions=doc["versions"])


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

    @property
    def calibration_key(self) -> str:
        precision = "fp32" if self.precision == "fp32" else "bf16"  # fp16 saves the same bytes as bf16
        attention = "eager" if self.attention == "eager" else "sdpa"
        layers = "ckpt" if self.gradient_checkpointing else "full"
        return f"{precision}/{attention}/{layers}/{'chunked' if self.fused_cross_entropy else 'plain'}"

    def with_checkpointing(self, value: bool) -> StepSettings:
        return StepSettings(**{**self.__dict__, "gradient_checkpointing": value})


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU by part; ``total`` is the step's peak, the largest of three moments (module docstring): the
    loss (every weight copy, every saved activation and the loss transient at once, less the gradients not yet
    created), with checkpointing a layer's recomputation in the backward pass (the saved inputs, one layer's full
    activations and its weight copies, less the gradients still to come), and the optimizer step (the states)."""

    states: float
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

    @property
    def at_loss(self) -> float:
        return self.weight_copies + self.loss - self.absent_at_loss

    @property
    def at_recompute(self) -> float:
        if not self.recompute:  # no checkpointing: no such moment
            return -(self.activations + self.mask)
        return self.recompute - self.absent_at_recompute

    @property
    def transient(self) -> float:
        """What the peak moment adds to the states, the saved activations, mask, context and NCCL."""
        return max(self.at_loss, self.at_recompute, -(self.activations + self.mask))

    @property
    def total(self) -> float:
        return self.states + self.activations + self.mask + self.transient + self.cuda_context + self.nccl

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


def layer_activation_bytes(arch: Architecture, *, seq: int, batch: int, settings: StepSettings) -> float:
    """Bytes one decoder layer saves for backward without checkpointing (the recomputed layer's, with it)."""
    c = load_calibration().setting(settings.with_checkpointing(False).calibration_key)
    per_token = _linear(c["layer_bytes_per_token"], shape_features(arch))
    per_seq2 = _linear(c["layer_bytes_per_batch_seq2"], shape_features(arch))
    if settings.attention != "eager" and not _dense_mask_applies(settings):
        per_seq2 = 0.0  # sdpa without a dense mask (flex, or unpacked rows with a padding mask) keeps no L^2 term
    return per_token * batch * seq + per_seq2 * batch * seq * seq


def saved_activation_bytes(arch: Architecture, *, seq: int, batch: int, settings: StepSettings) -> float:
    """What the forward pass leaves saved for backward: every layer's activations (or checkpointed inputs) and the
    model-level ones, logits excluded (the loss term covers them)."""
    c = load_calibration().setting(settings.calibration_key)
    features = shape_features(arch)
    tokens = batch * seq
    model_level = _linear(c["model_bytes_per_token"], features) * tokens
    if settings.gradient_checkpointing:
        return arch.num_hidden_layers * _linear(c["layer_bytes_per_token"], features) * tokens + model_level
    return arch.num_hidden_layers * layer_activation_bytes(arch, seq=seq, batch=batch, settings=settings) + model_level


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


def _uncertainty(settings: StepSettings, e: MemoryEstimate) -> float:
    """Bytes either way (module docstring): each part's share, summed."""
    kernel = settings.cross_entropy_kernel if settings.fused_cross_entropy else "plain"
    loss_share = 0.25 if kernel in ("liger", "torch") else 0.10
    activation_share = 0.05 + (0.20 if settings.torch_compile else 0.0)
    parts = (
        activation_share * (e.activations + e.mask),
        # the recomputation moment: which gradients exist by then is approximated (13 % off on CPU at 2 layers)
        (activation_share + 0.15) * e.recompute,
        loss_share * e.loss,
        CUDA_CONTEXT_UNCERTAINTY_GB * 1e9 if e.cuda_context else 0.0,
        NCCL_UNCERTAINTY_GB * 1e9 if e.nccl else 0.0,
        # ZeRO-3's gathered layers: DeepSpeed's own figure approximates them by the largest one
        e.states * 0.05 if settings.deepspeed_stage == 3 else 0.0,
    )
    return sum(parts)


def estimate(
    arch: Architecture, *, seq: int, batch: int, settings: StepSettings, world: int, device: str = "cuda"
) -> MemoryEstimate:
    """Peak memory per GPU (or of the host, ``device="cpu"``) for one training step (module docstring)."""
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
        mask=mask_bytes(seq=seq, batch=batch, settings=settings),
        loss=loss_bytes(arch, seq=seq, batch=batch, settings=settings),
        recompute=recompute,
        cuda_context=CUDA_CONTEXT_GB * 1e9 if device == "cuda" else 0.0,
        absent_at_loss=absent,
        absent_at_recompute=absent_later,
        nccl=NCCL_GB * 1e9 if device == "cuda" and world > 1 else 0.0,
    )
    return dataclasses.replace(e, uncertainty=_uncertainty(settings, e))
