"""Measure, on CPU, the memory a training step of train.py holds for backward, and write the planner's calibration.

The planner (gpuscout/plan/memory.py) predicts activation and logit memory from coefficients measured here rather
than assumed. This probe builds ``Qwen2ForCausalLM`` decoder layers with real layer shapes (the presets' hidden,
intermediate, head and key/value-head sizes, plus synthetic shapes that vary one dimension at a time), wraps the
model exactly as train.py does (``CausalLMWithLoss``, ``make_inputs`` with packing and the dense 4D document mask,
fp32 master weights, gradient checkpointing with ``use_reentrant=False``) and runs one forward pass under
``torch.autocast("cpu", dtype=torch.bfloat16)`` (or in fp32) and its backward pass.

What is measured:

* **saved bytes**: every tensor autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``),
  counted once per untyped storage (``data_ptr``), parameter storages excluded. Saved tensors derived from a
  parameter through a chain of single-input ops (autocast's bf16 weight copies and their transposes) are counted
  apart as *weight copies*: they scale with parameters, not tokens.
* **loss peak**: the largest number of bytes alive at once while the loss alone (hidden states -> lm_head -> loss)
  runs forward and backward, tracked op by op with a ``TorchDispatchMode`` that adds every new output storage and
  subtracts it when the storage is freed (a CPU stand-in for ``torch.cuda.max_memory_allocated``).

Bytes are exactly linear in tokens per layer plus a term in sequence^2 per layer (the attention mask), so a few
layers and short sequences determine them: per decoder layer = saved(2 layers) - saved(1 layer), solved at two
sequence lengths for the per-token and per-(batch x seq^2) terms; per vocabulary entry = the difference between
two vocabulary sizes. The per-token-per-layer bytes of all shapes are fitted (least squares) as a linear function
of hidden, intermediate, key/value width (kv_heads x head_dim) and heads, which is the formula the planner uses.

Bytes depend on shapes, dtypes and the order tensors are created and freed, never on values, so the probe does not
compute the matrix products (``ShapesOnly``): every op of the model code runs as in training, but a matmul or CPU SDPA
kernel's output is allocated zero-filled with the shape and strides its meta kernel gives, and random weight
initialisation fills zeros. That is what makes it fast on every CPU: on an AVX2-only CPU oneDNN runs bf16 matmuls on
its reference path (~1 GFLOP/s), where a 1.5B-wide layer's backward takes minutes. ``--real-arithmetic`` runs the real
kernels instead; tests/training/test_memory_calibration.py checks that both count the same bytes.

Attention: "sdpa" and "eager" are probed. Flex attention's compiled block mask exists on CUDA only; the planner
models flex as sdpa without the dense mask. Loss: "plain" and "chunked" are probed; Liger's fused linear
cross-entropy is CUDA-only and, like the chunked loss, never stores full logits: the planner uses the chunked
coefficients for it.

LoRA (``adapter_settings``, keys ending ``/lora``): every setting again with adapters on all seven linear layers,
added by train.py's own ``add_adapters`` before checkpointing is enabled (build.py's order), the frozen base stored
in bf16 when probing bf16 (as on CUDA). Per layer it adds a ``rank`` term (ADAPTER_RANKS: the same layers at a
second rank), the dropout's bytes under CUDA's fused kernel (``cuda_dropout``: a bool mask) and the CPU's, and with
checkpointing the backward pass's transient per token (``backward_bytes_per_token``, from a micro-batch's peak):
each on ADAPTER_TERM_SHAPES, which vary hidden and intermediate apart. QLoRA's 4-bit layers need bitsandbytes on
CUDA; the planner uses LoRA's keys for it.

    .venv/bin/python benchmarks/memory_probe.py --output configs/memory/calibration.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import platform
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpuscout_train.packing import CausalLMWithLoss, chunked_cross_entropy, make_inputs, plain_cross_entropy
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from gpuscout.domain.adapters import Adapter
from gpuscout.domain.models import PRESETS

LAYER_FEATURES = ("hidden", "intermediate", "kv_width", "heads", "one")
MASK_FEATURES = ("heads", "one")
MODEL_FEATURES = ("hidden", "head_dim", "one")
DROPOUT_FEATURES = ("hidden", "intermediate")  # the adapted layers' inputs are hidden (or query) and intermediate wide
BACKWARD_FEATURES = ("hidden", "intermediate", "one")
# LoRA: every setting is probed at the first rank without dropout over all shapes; the rank and dropout terms per
# layer are the differences at the second rank and with dropout, on shapes that vary hidden and intermediate apart.
ADAPTER_RANKS = (8, 64)
ADAPTER_DROPOUT = 0.05
ADAPTER_TERM_SHAPES = ("synthetic-h256-i512-n4-kv2", "synthetic-h256-i1024-n4-kv2", "synthetic-h512-i512-n8-kv2")
# Shapes that vary one dimension at a time around a small base, so the fit can tell the dimensions apart
# (in the presets the query width always equals hidden).
SYNTHETIC_SHAPES = (
    (256, 512, 4, 2),
    (256, 1024, 4, 2),
    (512, 512, 8, 2),
    (256, 512, 4, 4),
    (256, 512, 8, 2),
    (384, 768, 6, 3),
)


_aten = torch.ops.aten
# Kernels whose arithmetic is the probe's whole cost; their outputs' shapes come from their meta kernels.
_PRODUCTS = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
})  # fmt: skip
_RANDOM_FILLS = frozenset({_aten.normal_.default, _aten.uniform_.default})


class ShapesOnly(TorchDispatchMode):
    """Runs every op as usual except the matrix products and CPU SDPA kernels, whose outputs are new zero-filled
    tensors with the shape, strides and dtype their meta kernels give, and random initialisation, which fills zeros.

    Autograd, autocast and checkpointing sit above this mode, so what is saved for backward, which storages exist and
    when they are freed are exactly what the real kernels give (a test compares both); only values differ."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _RANDOM_FILLS:
            return args[0].zero_()
        if func not in _PRODUCTS:
            return func(*args, **kwargs)

        def meta(x: Any) -> Any:
            return x.to("meta") if isinstance(x, torch.Tensor) else x

        def allocate(x: Any) -> Any:
            return torch.zeros_like(x, device="cpu") if isinstance(x, torch.Tensor) else x  # keeps the strides

        return tree_map(allocate, func(*tree_map(meta, args), **tree_map(meta, kwargs)))


def kernels(*, real: bool) -> contextlib.AbstractContextManager[Any]:
    """The real kernels (``real=True``), or ``ShapesOnly``: the same bytes, no arithmetic."""
    return contextlib.nullcontext() if real else ShapesOnly()


@contextlib.contextmanager
def cuda_dropout() -> Iterator[None]:
    """``F.dropout`` in training as CUDA runs it: torch's fused ``native_dropout``, which saves a bool mask (1 byte
    per element) for backward, where the CPU's composite dropout saves a mask in the input's dtype (4 bytes in fp32).
    p = 0 (the attention's) is left to the original, which returns its input."""
    original = torch.nn.functional.dropout

    def fused(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if not training or p == 0.0 or inplace:
            return original(input, p, training, inplace)
        return torch.native_dropout(input, p, True)[0]

    torch.nn.functional.dropout = fused
    try:
        yield
    finally:
        torch.nn.functional.dropout = original


@dataclass(frozen=True)
class LayerShape:
    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def features(self) -> dict[str, float]:
        return {
            "hidden": self.hidden,
            "intermediate": self.intermediate,
            "kv_width": self.kv_heads * self.head_dim,
            "heads": self.heads,
            "head_dim": self.head_dim,
            "one": 1,
        }


def preset_shape(name: str) -> LayerShape:
    a = PRESETS[name]
    return LayerShape(name, a.hidden_size, a.intermediate_size, a.num_attention_heads, a.num_key_value_heads)


@dataclass(frozen=True)
class Setting:
    attention: str = "sdpa"  # sdpa | eager
    checkpointing: bool = False
    loss: str = "plain"  # plain | chunked
    precision: str = "bf16"  # bf16 (autocast over fp32 weights; a frozen adapter base stored in bf16) | fp32
    adapter: Adapter | None = None  # LoRA adapters on a frozen base (add_adapters), or full fine-tuning

    @property
    def key(self) -> str:
        """The calibration's key: one per setting, whatever the adapter's rank and dropout (fitted within it)."""
        key = f"{self.precision}/{self.attention}/{'ckpt' if self.checkpointing else 'full'}/{self.loss}"
        return key + ("/lora" if self.adapter is not None else "")

    def with_adapter(self, adapter: Adapter | None) -> Setting:
        return dataclasses.replace(self, adapter=adapter)


@dataclass
class Saved:
    activations: int  # bytes of saved storages that are neither parameters nor derived from one
    weight_copies: int  # bytes of saved storages derived from a parameter (autocast's bf16 casts)


def _from_parameter(t: torch.Tensor, depth: int = 4) -> bool:
    """True if ``t`` is a parameter seen through single-input ops of the same size (a cast, a transpose, a view);
    an embedding lookup also has one input that needs a gradient, but a different size."""
    node = t.grad_fn
    for _ in range(depth):
        if node is None:
            return False
        nexts = [n for n, _ in node.next_functions if n is not None]
        if len(nexts) != 1:
            return False
        node = nexts[0]
        if type(node).__name__ == "AccumulateGrad":
            parameter: torch.Tensor = getattr(node, "variable")  # noqa: B009 (not in the Node stubs)
            return parameter.numel() == t.numel()
    return False


def build_model(shape: LayerShape, *, layers: int, vocab: int, setting: Setting) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=vocab,
                         tie_word_embeddings=True, use_cache=False, max_position_embeddings=4096)  # fmt: skip
    config._attn_implementation = setting.attention
    lm = Qwen2ForCausalLM(config).train()  # fp32 master weights, as train.py keeps them
    if setting.adapter is not None:  # build.py's order: adapters first (a CUDA bf16 run's base frozen in bf16)
        from gpuscout_train.adapters import add_adapters

        frozen = torch.bfloat16 if setting.precision == "bf16" else None
        add_adapters(lm, setting.adapter, frozen_dtype=frozen)
    if setting.checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return CausalLMWithLoss(lm, loss=setting.loss)


def packed_batch(batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and segment ids: two document pieces per row (the mask is dense either way)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    seg = torch.ones(batch, seq, dtype=torch.long)
    seg[:, seq // 2 :] = 2
    return ids, seg


def _autocast(precision: str) -> Any:
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def saved_bytes(
    shape: LayerShape, setting: Setting, *, layers: int, batch: int, seq: int, vocab: int, real_arithmetic: bool = False
) -> Saved:
    """Bytes autograd saves for backward in one training forward pass (module docstring)."""
    with kernels(real=real_arithmetic):
        return _saved_bytes(shape, setting, layers=layers, batch=batch, seq=seq, vocab=vocab)


def _saved_bytes(shape: LayerShape, setting: Setting, *, layers: int, batch: int, seq: int, vocab: int) -> Saved:
    model = build_model(shape, layers=layers, vocab=vocab, setting=setting)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids, seg = packed_batch(batch, seq, vocab)
    dtype = torch.bfloat16 if setting.precision == "bf16" else torch.float32
    inputs = make_inputs(ids, seg, packing=True, attention=setting.attention, dtype=dtype)
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = (storage.nbytes(), _from_parameter(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _autocast(setting.precision):
        loss = model(inputs.input_ids, inputs.position_ids, inputs.attention_mask, inputs.labels)
    loss.backward()  # runs the checkpointed recomputation too (its saved tensors are not held at once)
    return Saved(
        activations=sum(n for n, weight in seen.values() if not weight),
        weight_copies=sum(n for n, weight in seen.values() if weight),
    )


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages created under this mode and still alive; ``peak`` is the most at once.

    Tensors that exist before (``adopt``) are followed too, so that one replaced under the mode (autograd
    accumulating into an existing ``.grad`` out of place) does not count twice; ``peak`` is above what they held.
    """

    def __init__(self, adopt: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        self.live = 0
        self._refs: dict[int, Any] = {}
        for t in adopt:
            self._track(t)
        self.peak = self.live
        self.baseline = self.live

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        size = storage.nbytes()
        if key in self._refs or size == 0:
            return

        def freed(_: Any, key: int = key, size: int = size) -> None:
            self.live -= size
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(storage, freed)
        self.live += size
        self.peak = max(getattr(self, "peak", 0), self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def micro_batch_peak(
    shape: LayerShape, setting: Setting, *, layers: int, batch: int, seq: int, vocab: int, real_arithmetic: bool = False
) -> int:
    """Peak bytes of the storages a step's first micro-batch creates (train.py's order: the forward pass under
    autocast, its backward outside it), the parameters made before it not counted."""
    with kernels(real=real_arithmetic):
        model = build_model(shape, layers=layers, vocab=vocab, setting=setting)
        ids, seg = packed_batch(batch, seq, vocab)
        dtype = torch.bfloat16 if setting.precision == "bf16" else torch.float32
        tracker = LiveBytes()
        with tracker:
            inputs = make_inputs(ids, seg, packing=True, attention=setting.attention, dtype=dtype)
            with _autocast(setting.precision):
                loss = model(inputs.input_ids, inputs.position_ids, inputs.attention_mask, inputs.labels)
            loss.backward()
    return tracker.peak


def backward_bytes_per_token(
    shape: LayerShape,
    setting: Setting,
    *,
    layer_bytes: dict[int, int],
    batch: int,
    seqs: Sequence[int],
    vocab: int,
    real_arithmetic: bool = False,
) -> float:
    """The backward pass's transient of a recomputed layer, per token, with checkpointing (``setting``): a one-layer
    model's micro-batch peak (at the recomputation, where a small vocabulary puts it) less what is held there: the
    checkpointed model's saved bytes, the layer's recomputed activations (``layer_bytes``: its saved bytes without
    checkpointing, by sequence length) and make_inputs' dense mask; the difference of two sequence lengths, so that
    what does not grow with tokens (the layer's adapter gradients) drops out. What is left: the activations'
    gradients, with adapters the largest part of a layer's backward (peft casts an adapter's input to fp32, so its
    gradient is fp32 too)."""
    assert setting.checkpointing
    mask_entry = 1 if setting.attention != "eager" else (2 if setting.precision == "bf16" else 4)
    held = {}
    for seq in seqs:
        peak = micro_batch_peak(shape, setting, layers=1, batch=batch, seq=seq, vocab=vocab,
                                real_arithmetic=real_arithmetic)  # fmt: skip
        saved = saved_bytes(shape, setting, layers=1, batch=batch, seq=seq, vocab=vocab,
                            real_arithmetic=real_arithmetic).activations  # fmt: skip
        held[seq] = peak - saved - layer_bytes[seq] - mask_entry * batch * seq * seq
    (s1, h1), (s2, h2) = sorted(held.items())
    return (h2 - h1) / (batch * (s2 - s1))


def loss_peak_bytes(
    *, loss: str, precision: str, batch: int, seq: int, hidden: int, vocab: int, real_arithmetic: bool = False
) -> int:
    """Peak bytes alive while the loss alone runs forward and backward from fp32 hidden states (the residual stream
    train.py's final norm hands the head under autocast), head weight and its gradient included."""
    with kernels(real=real_arithmetic):
        return _loss_peak_bytes(loss=loss, precision=precision, batch=batch, seq=seq, hidden=hidden, vocab=vocab)


def _loss_peak_bytes(*, loss: str, precision: str, batch: int, seq: int, hidden: int, vocab: int) -> int:
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    hidden_states = torch.randn(batch, seq, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, seq))
    tracker = LiveBytes()
    with tracker:
        with _autocast(precision):
            if loss == "plain":
                value = plain_cross_entropy(head(hidden_states), labels)
            else:
                value = chunked_cross_entropy(hidden_states, head, labels)
        value.backward()
    return tracker.peak


def _solve_layer_terms(per_layer: dict[int, int], batch: int) -> tuple[float, float]:
    """Per-token and per-(batch x seq^2) bytes of one decoder layer from its bytes at two sequence lengths."""
    (s1, b1), (s2, b2) = sorted(per_layer.items())
    a = np.array([[batch * s1, batch * s1 * s1], [batch * s2, batch * s2 * s2]], dtype=float)
    per_token, per_seq2 = np.linalg.solve(a, np.array([b1, b2], dtype=float))
    return float(per_token), float(per_seq2)


def probe_shape(
    shape: LayerShape,
    setting: Setting,
    *,
    batch: int,
    seqs: Sequence[int],
    vocabs: Sequence[int],
    real_arithmetic: bool = False,
) -> dict:
    """Raw measurements and derived per-layer, per-model and per-vocabulary terms for one shape and setting."""
    v1, v2 = sorted(vocabs)
    raw: dict[str, int] = {}
    per_layer: dict[int, int] = {}
    one_layer: dict[int, Saved] = {}
    weight_copies = 0
    for seq in seqs:
        one = saved_bytes(shape, setting, layers=1, batch=batch, seq=seq, vocab=v1, real_arithmetic=real_arithmetic)
        two = saved_bytes(shape, setting, layers=2, batch=batch, seq=seq, vocab=v1, real_arithmetic=real_arithmetic)
        raw[f"layers1_seq{seq}_vocab{v1}"] = one.activations
        raw[f"layers2_seq{seq}_vocab{v1}"] = two.activations
        per_layer[seq] = two.activations - one.activations
        one_layer[seq] = one
        weight_copies = two.weight_copies - one.weight_copies
    per_token, per_seq2 = _solve_layer_terms(per_layer, batch)
    s1 = min(seqs)
    wide = saved_bytes(shape, setting, layers=1, batch=batch, seq=s1, vocab=v2, real_arithmetic=real_arithmetic)
    raw[f"layers1_seq{s1}_vocab{v2}"] = wide.activations
    rows = batch * (s1 - 1)  # the plain loss's rows: every position but the last predicts the next token
    per_vocab = (wide.activations - one_layer[s1].activations) / (rows * (v2 - v1))
    model_per_token = {
        seq: (one_layer[seq].activations - per_layer[seq] - per_vocab * batch * (seq - 1) * v1) / (batch * seq)
        for seq in seqs
    }
    return {
        "shape": dataclasses.asdict(shape),
        "raw_saved_bytes": raw,
        "layer_weight_copy_bytes": weight_copies,
        "layer_bytes_per_token": per_token,
        "layer_bytes_per_batch_seq2": per_seq2,
        "model_bytes_per_token": {str(k): v for k, v in model_per_token.items()},
        "bytes_per_token_per_vocab": per_vocab,
    }


def adapter_terms(
    shape: LayerShape, setting: Setting, *, batch: int, seq: int, vocab: int, real_arithmetic: bool = False
) -> dict[str, float]:
    """One decoder layer's LoRA bytes per token beyond ``setting``'s (its adapter at ADAPTER_RANKS[0] without
    dropout): per unit of rank (measured at ADAPTER_RANKS[1]), and with dropout (ADAPTER_DROPOUT) under CUDA's fused
    kernel and under the CPU's."""
    assert setting.adapter is not None and not setting.checkpointing

    def per_layer(adapter: Adapter, *, fused_dropout: bool = False) -> float:
        varied = setting.with_adapter(adapter)
        with cuda_dropout() if fused_dropout else contextlib.nullcontext():
            one, two = (saved_bytes(shape, varied, layers=n, batch=batch, seq=seq, vocab=vocab,
                                    real_arithmetic=real_arithmetic) for n in (1, 2))  # fmt: skip
        return (two.activations - one.activations) / (batch * seq)

    r1, r2 = ADAPTER_RANKS
    base = per_layer(setting.adapter)
    dropped = dataclasses.replace(setting.adapter, dropout=ADAPTER_DROPOUT)
    return {
        "rank": (per_layer(dataclasses.replace(setting.adapter, rank=r2)) - base) / (r2 - r1),
        "dropout": per_layer(dropped, fused_dropout=True) - base,
        "dropout_cpu": per_layer(dropped) - base,
    }


def fit(rows: Sequence[dict], target: str, features: Sequence[str], *, less: float = 0.0) -> dict[str, float]:
    """Least-squares coefficients of ``target`` (a key of each row, less ``less``) on the shape features."""
    return fit_values([LayerShape(**r["shape"]) for r in rows], [_value(r, target) - less for r in rows], features)


def fit_values(shapes: Sequence[LayerShape], values: Sequence[float], features: Sequence[str]) -> dict[str, float]:
    x = np.array([[s.features()[f] for f in features] for s in shapes], dtype=float)
    coef, *_ = np.linalg.lstsq(x, np.array(values, dtype=float), rcond=None)
    return {f: round(float(c), 4) for f, c in zip(features, coef, strict=True)}


def _value(row: dict, target: str) -> float:
    value = row[target]
    if isinstance(value, dict):  # model_bytes_per_token per sequence length: the longest is the least rounded
        return float(value[max(value, key=int)])
    return float(value)


def settings(*, adapter: Adapter | None = None) -> Iterator[Setting]:
    """bf16 autocast (GPU training; fp16 saves the same bytes) and fp32 (CPU training, where train.py runs without
    autocast), sdpa and eager, each with and without checkpointing, with the plain and the chunked loss; full
    fine-tuning, or ``adapter`` on a frozen base."""
    for precision in ("bf16", "fp32"):
        for attention in ("sdpa", "eager"):
            for checkpointing in (False, True):
                for loss in ("plain", "chunked"):
                    yield Setting(attention, checkpointing, loss, precision, adapter)


def calibrate(
    shapes: Sequence[LayerShape],
    *,
    batch: int,
    seqs: Sequence[int],
    vocabs: Sequence[int],
    setting_list: Sequence[Setting],
    loss_vocab: int,
    loss_seqs: Sequence[int],
    real_arithmetic: bool = False,
) -> dict[str, Any]:
    """Every setting's coefficients (fitted over ``shapes``) and raw measurements, plus the loss peaks."""
    out: dict[str, Any] = {}
    for setting in setting_list:
        rows = [
            probe_shape(s, setting, batch=batch, seqs=seqs, vocabs=vocabs, real_arithmetic=real_arithmetic)
            for s in shapes
        ]
        print(f"{setting.key}: " + ", ".join(f"{r['shape']['name']} {r['layer_bytes_per_token']:.0f}" for r in rows),
              flush=True)  # fmt: skip
        out[setting.key] = {
            "layer_bytes_per_token": fit(rows, "layer_bytes_per_token", LAYER_FEATURES),
            "layer_bytes_per_batch_seq2": fit(rows, "layer_bytes_per_batch_seq2", MASK_FEATURES),
            "model_bytes_per_token": fit(rows, "model_bytes_per_token", MODEL_FEATURES),
            "bytes_per_token_per_vocab": round(float(np.mean([r["bytes_per_token_per_vocab"] for r in rows])), 4),
            "measurements": {r["shape"]["name"]: r for r in rows},
        }
        if setting.adapter is not None and not setting.checkpointing:
            terms = _adapter_fit(rows, setting, batch=batch, seq=min(seqs), vocab=min(vocabs),
                                 real_arithmetic=real_arithmetic)  # fmt: skip
            out[setting.key].update(terms)
        elif setting.adapter is not None:  # its no-checkpointing twin is probed first (settings())
            twin = out[dataclasses.replace(setting, checkpointing=False).key]["measurements"]
            out[setting.key]["layer_backward_bytes_per_token"] = _backward_fit(
                rows, twin, setting, batch=batch, seqs=seqs, vocab=min(vocabs), real_arithmetic=real_arithmetic
            )
    peaks: dict[str, Any] = {}
    for precision in ("bf16", "fp32"):
        for loss in ("plain", "chunked"):
            measured = {
                str(seq): loss_peak_bytes(loss=loss, precision=precision, batch=batch, seq=seq, hidden=64,
                                          vocab=loss_vocab, real_arithmetic=real_arithmetic)
                for seq in loss_seqs
            }  # fmt: skip
            (s1, p1), (s2, p2) = sorted((int(k), v) for k, v in measured.items())
            peaks[f"{precision}/{loss}"] = {
                "peak_bytes": measured,
                "bytes_per_token_per_vocab": round((p2 - p1) / (batch * (s2 - s1) * loss_vocab), 4),
            }
    return {
        "settings": {k: v for k, v in out.items() if not k.endswith("/lora")},
        "adapter_settings": {k: v for k, v in out.items() if k.endswith("/lora")},
        "loss_peak": {"hidden": 64, "vocab": loss_vocab, "batch": batch, **peaks},
    }


def _adapter_fit(
    rows: Sequence[dict], setting: Setting, *, batch: int, seq: int, vocab: int, real_arithmetic: bool
) -> dict[str, Any]:
    """An adapter setting's rank and dropout terms (adapter_terms on ADAPTER_TERM_SHAPES, or every shape probed when
    they are not among them): the per-layer fit of ``rows`` less the first rank's share, plus bytes per unit of rank,
    and the dropout's bytes fitted on hidden and intermediate (under CUDA's kernel, and the CPU's)."""
    probed = [r for r in rows if r["shape"]["name"] in ADAPTER_TERM_SHAPES] or list(rows)
    shapes = [LayerShape(**r["shape"]) for r in probed]
    terms = [adapter_terms(s, setting, batch=batch, seq=seq, vocab=vocab, real_arithmetic=real_arithmetic)
             for s in shapes]  # fmt: skip
    for row, term in zip(probed, terms, strict=True):
        row["adapter_terms_per_token"] = term
    per_rank = round(float(np.mean([t["rank"] for t in terms])), 4)
    layer = fit(rows, "layer_bytes_per_token", LAYER_FEATURES, less=per_rank * ADAPTER_RANKS[0])
    return {
        "layer_bytes_per_token": {**layer, "rank": per_rank},
        "layer_dropout_bytes_per_token": fit_values(shapes, [t["dropout"] for t in terms], DROPOUT_FEATURES),
        "layer_dropout_bytes_per_token_cpu": fit_values(shapes, [t["dropout_cpu"] for t in terms], DROPOUT_FEATURES),
    }


def _backward_fit(
    rows: Sequence[dict],
    twin: dict[str, dict],
    setting: Setting,
    *,
    batch: int,
    seqs: Sequence[int],
    vocab: int,
    real_arithmetic: bool,
) -> dict[str, float]:
    """A checkpointed adapter setting's backward transient per token (backward_bytes_per_token on
    ADAPTER_TERM_SHAPES), fitted on hidden, intermediate and a constant; ``twin``: the measurements without
    checkpointing, whose per-layer saved bytes are the recomputed layer's."""
    probed = [r for r in rows if r["shape"]["name"] in ADAPTER_TERM_SHAPES] or list(rows)
    shapes = [LayerShape(**r["shape"]) for r in probed]
    values = []
    for row, shape in zip(probed, shapes, strict=True):
        raw = twin[shape.name]["raw_saved_bytes"]
        layer = {s: raw[f"layers2_seq{s}_vocab{vocab}"] - raw[f"layers1_seq{s}_vocab{vocab}"] for s in seqs}
        row["backward_bytes_per_token"] = backward_bytes_per_token(
            shape, setting, layer_bytes=layer, batch=batch, seqs=seqs, vocab=vocab, real_arithmetic=real_arithmetic
        )
        values.append(row["backward_bytes_per_token"])
    return fit_values(shapes, values, BACKWARD_FEATURES)


@dataclass
class ProbeArguments:
    output: str = "configs/memory/calibration.json"
    presets: str = "qwen2.5-0.5b,qwen2.5-1.5b"
    synthetic: bool = True
    batch: int = 2
    seq_lengths: str = "32,64"
    vocab_sizes: str = "512,1024"
    loss_vocab: int = 8192
    loss_seq_lengths: str = "64,128"
    threads: int = 2
    real_arithmetic: bool = False  # run the real matmul/SDPA kernels (ShapesOnly counts the same bytes without them)


def parse_args(argv: Sequence[str] | None) -> ProbeArguments:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    for f in dataclasses.fields(ProbeArguments):
        kinds: dict[str, Callable[[str], Any]] = {"bool": _flag, "int": int, "str": str}
        kind = kinds[str(f.type)]
        parser.add_argument(f"--{f.name}", type=kind, default=f.default)
    return ProbeArguments(**vars(parser.parse_args(argv)))


def _flag(text: str) -> bool:
    return text.lower() in ("1", "true", "yes")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    import transformers

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = [preset_shape(p) for p in args.presets.split(",") if p]
    if args.synthetic:
        shapes += [LayerShape(f"synthetic-h{h}-i{i}-n{n}-kv{kv}", h, i, n, kv) for h, i, n, kv in SYNTHETIC_SHAPES]
    result = calibrate(
        shapes,
        batch=args.batch,
        seqs=_ints(args.seq_lengths),
        vocabs=_ints(args.vocab_sizes),
        setting_list=list(settings()) + list(settings(adapter=Adapter("lora", rank=ADAPTER_RANKS[0]))),
        loss_vocab=args.loss_vocab,
        loss_seqs=_ints(args.loss_seq_lengths),
        real_arithmetic=args.real_arithmetic,
    )
    doc = {
        "about": (
            "Activation and logit bytes of train.py's training step, measured on CPU by benchmarks/memory_probe.py "
            "(saved_tensors_hooks, storages deduplicated, parameters and their autocast copies excluded); "
            "gpuscout/plan/memory.py reads it. Keys: precision/attention/checkpointing/loss; adapter_settings' end "
            "in /lora: LoRA adapters (add_adapters) on a frozen base, stored in bf16 under bf16 autocast."
        ),
        "command": "python benchmarks/memory_probe.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
        },
        "probe": {
            "batch": args.batch,
            "seq_lengths": _ints(args.seq_lengths),
            "vocab_sizes": _ints(args.vocab_sizes),
            "layers": [1, 2],
            "kernels": "real" if args.real_arithmetic else "shapes only (matmul and SDPA outputs not computed)",
            "shapes": [s.name for s in shapes],
            "adapter": {
                "ranks": list(ADAPTER_RANKS),
                "dropout": ADAPTER_DROPOUT,
                "term_shapes": list(ADAPTER_TERM_SHAPES),
            },
        },
        **result,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
