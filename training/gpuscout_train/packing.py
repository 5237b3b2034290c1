"""Packed batches without cross-document attention, and a cross-entropy that never builds full-vocab logits.

A packed block holds several document pieces, numbered by ``segment_ids`` (1, 2, ... ; 0 = padding, written by
gpuscout_data/prepare.py). With ``packing=True`` every token attends only to earlier tokens of its own piece (a
block-diagonal causal mask), positions restart at 0 for every piece, and the first token of a piece is not a
prediction target of the previous piece's last token. With ``packing=False`` the data is first unpacked
(``unpack_blocks``): every document piece gets a row of its own, padded to the sequence length, the way a plain
HF Trainer set-up feeds documents; make_inputs then masks the padding only. The model must run with
``use_cache=False``.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gpuscout_data.dataset import piece_spans
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
CHUNK_ROWS = 4096  # target rows a fused loss projects at a time (memory model: gpuscout/plan/memory.py)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: Any  # 4D bool/float tensor, 2D padding mask, flex BlockMask, or None
    labels: torch.Tensor
    segment_ids: torch.Tensor

    # The counts are computed on access only: on a GPU each one is a device-to-host copy that stalls the host,
    # and the training loop counts tokens on the CPU copy of the batch instead (train_data.token_counts).
    @property
    def tokens(self) -> int:
        """Non-padding tokens in the batch."""
        return int((self.segment_ids > 0).sum())

    @property
    def target_tokens(self) -> int:
        """Tokens that are prediction targets (labels after the shift != IGNORE_INDEX)."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())


def unpack_blocks(ids: np.ndarray, seg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One row per document piece of the packed blocks, in block order, left-aligned and padded to the block
    length (segment id 1 for the piece, 0 for padding; padding ids are 0 and never targets)."""
    rows, starts, ends = piece_spans(seg)
    out_ids = np.zeros((len(rows), seg.shape[1]), dtype=ids.dtype)
    out_seg = np.zeros((len(rows), seg.shape[1]), dtype=seg.dtype)
    for k, (r, start, end) in enumerate(zip(rows, starts, ends, strict=True)):
        out_ids[k, : end - start] = ids[r, start:end]
        out_seg[k, : end - start] = 1
    return out_ids, out_seg


def position_ids_from_segments(segment_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 at every document piece (and count on through padding)."""
    b, length = segment_ids.shape
    index = torch.arange(length, device=segment_ids.device).expand(b, length)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index))
    start_index = torch.cummax(start_index, dim=1).values
    return index - start_index


def document_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, L, L] bool, True where query i may attend key j: same piece and j <= i (padding sees padding)."""
    length = segment_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same & causal)[:, None, :, :]


@functools.cache
def compiled_create_block_mask() -> Any:
    """``torch.compile(create_block_mask)``, made once per process. torch deprecates create_block_mask's ``_compile``
    flag ("will be removed in the future": a DeprecationWarning on every call in torch 2.11 and 2.13, which Python
    shows under pytest, as on the first H100's CUDA tests) in favour of compiling the function; the flag itself
    wrapped it in a new ``torch.compile`` on every call."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def _flex_block_mask(segment_ids: torch.Tensor) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    seg = segment_ids

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (seg[b, q] == seg[b, kv]) & (kv <= q)

    b, length = seg.shape
    # On CUDA the mask is built by a compiled kernel block by block; eager creation materializes the full
    # [B, L, L] mask (and its int64 intermediates, about 1 GB at B=8, L=4096) for every micro-batch.
    build = compiled_create_block_mask() if seg.is_cuda else create_block_mask
    return build(mask_mod, B=b, H=None, Q_LEN=length, KV_LEN=length, device=str(seg.device))


def install_flex_autocast_cast() -> None:
    """Make transformers' flex attention run q, k and v in the autocast dtype, whatever torch does.

    Under bf16 autocast with fp32 master weights, transformers hands flex attention q/k in fp32 and v in bf16 (the
    projections meet autocast differently); torch 2.8's flex_attention raises "Expected query, key, and value to
    have the same dtype", torch 2.13 accepts it. This wraps the registered "flex_attention" function once
    (AttentionInterface.register) so the image and the tests see the same inputs on any torch version.
    """
    from transformers.modeling_utils import AttentionInterface

    current = AttentionInterface._global_mapping["flex_attention"]
    if getattr(current, "gpuscout_casts_to_autocast_dtype", False):
        return

    def flex_in_autocast_dtype(
        module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
        *args: Any, **kwargs: Any,
    ) -> Any:  # fmt: skip
        device = query.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        return current(module, query, key, value, attention_mask, *args, **kwargs)

    flex_in_autocast_dtype.gpuscout_casts_to_autocast_dtype = True  # type: ignore[attr-defined]
    AttentionInterface.register("flex_attention", flex_in_autocast_dtype)


def make_inputs(
    input_ids: torch.Tensor, segment_ids: torch.Tensor, *, packing: bool, attention: str, dtype: torch.dtype
) -> ModelInputs:
    """Model inputs for one micro-batch of blocks (tensors already on the training device)."""
    input_ids = input_ids.long()
    real = segment_ids > 0
    labels = torch.where(real, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    if packing:
        position_ids = position_ids_from_segments(segment_ids)
        labels = torch.where(position_ids == 0, torch.full_like(labels, IGNORE_INDEX), labels)
        mask: Any
        if attention == "flex":
            mask = _flex_block_mask(segment_ids)
        else:
            mask = document_causal_mask(segment_ids)
            if attention == "eager":  # eager attention adds the mask to the scores
                zero = torch.zeros((), dtype=dtype, device=mask.device)
                mask = torch.where(mask, zero, torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=mask.device))
    else:
        b, length = input_ids.shape
        position_ids = torch.arange(length, device=input_ids.device).expand(b, length)
        mask = real.long()
    return ModelInputs(input_ids, position_ids, mask, labels, segment_ids)


def eager_validation(attention: str) -> Any:
    """The context train.py validates in: a torch.compile'd model runs eagerly there, except with flex attention.

    Compiling the validation's forward costs new full-model graphs (eval mode and no grad; train.py pads a short
    last batch so there is no second shape): on an H100 (2026-11-25) two of them took about 30 s for Qwen2.5-1.5B,
    more than the few eager forwards they speed up. Flex attention is the exception: eager flex_attention is an
    unfused reference that materializes fp32 scores (about 7-8 GB alive per layer call at Qwen2.5-1.5B, 4,096
    tokens, micro-batch 2, by a count of torch's math_attention; not measured), and "force_eager" would switch off
    transformers' own compiled flex kernel too, so with flex the compiled model validates compiled (one graph)."""
    if attention == "flex":
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


def _chunk_loss_sum(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(
    hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, *, chunk_tokens: int = CHUNK_ROWS
) -> torch.Tensor:
    """Mean next-token cross-entropy of ``head(hidden)`` against ``labels`` (shifted inside, like HF).

    The prediction rows are projected ``chunk_tokens`` at a time, and each chunk's logits are recomputed in the
    backward pass instead of being stored, so peak memory holds one [chunk, vocab] block instead of the batch's
    [B, L, vocab] logits. Numerically the same loss as a cross-entropy over the full logits.
    ``head`` is called as a module so DeepSpeed ZeRO-3 gathers its weight.

    Every row is projected, ignored ones too (they add 0 to the sum and get no gradient), so the chunks' shapes
    depend on the batch's shape alone and torch.compile traces one graph for every micro-batch. Dropping the
    ignored rows first (a boolean index) made the row count data-dependent: a graph break, and a recompile for
    each new number of targets, i.e. per packed micro-batch (seen on an H100, 2026-11-25). The price is the head's
    work on ignored rows: one per document piece and the padding, under 0.1 % of a packed batch's rows; without
    packing it is every padding position (the layers below compute those positions too).
    """
    h = hidden[:, :-1, :].reshape(-1, hidden.shape[-1])
    t = labels[:, 1:].reshape(-1)
    count = (t != IGNORE_INDEX).sum()
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, t.shape[0], chunk_tokens):
        part = checkpoint(
            _chunk_loss_sum,
            h[start : start + chunk_tokens],
            head,
            t[start : start + chunk_tokens],
            use_reentrant=False,
        )
        total = total + part
    return total / count.clamp(min=1)  # no targets: 0, and no gradient anywhere


def plain_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Reference loss: the full logits, shifted, mean over targets (what transformers computes)."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1, :].reshape(-1, logits.shape[-1]).float(),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
    )


# The fused losses (never the full [B, L, vocab] logits). "chunked": the project's own (chunked_cross_entropy),
# "liger": Liger kernel's fused linear cross-entropy (CUDA + triton), "torch": torch's own
# torch.nn.functional.linear_cross_entropy with chunking options (torch >= 2.13). All three project CHUNK_ROWS
# target rows at a time, so the planner's memory model (gpuscout/plan/memory.py, "chunked") holds for each.
FUSED_LOSSES = ("chunked", "liger", "torch")
LOSSES = ("plain", *FUSED_LOSSES)


def liger_chunk_mem_const(rows: int, hidden: int, vocab: int, *, chunk_rows: int = CHUNK_ROWS) -> int:
    """Liger's ``chunk_mem_const`` that makes its chunks about ``chunk_rows`` rows.

    Liger 0.8.5 splits the rows into next_pow2(rows / ceil(vocab / (c * hidden))) row chunks, c = 1 by default:
    at Qwen's 151,936-word vocabulary and 1,536 hidden that is 64 chunks of 128 rows for 8,192 rows, and every chunk
    rewrites the whole [vocab, hidden] weight-gradient buffer (~1 GB in fp32), ~120 GB of memory traffic per
    micro-batch. With this constant the chunks are at most about ``chunk_rows`` (Liger rounds to a power of two:
    4,095 rows at Qwen2.5-0.5B's shapes run as 2 chunks of 2,048), except where the vocabulary is smaller than the
    wanted chunks x hidden: the constant is then 1 and the chunks may be larger (a small model, a small loss).
    gpuscout/plan/memory.py's liger_chunk_rows applies the same arithmetic."""
    wanted_chunks = max(1, -(-rows // chunk_rows))
    return max(1, vocab // (wanted_chunks * hidden))  # rounded down: no fewer (larger) chunks than wanted


def torch_linear_cross_entropy_available() -> bool:
    return hasattr(torch.nn.functional, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")


def _targets(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states that predict a target and their targets, ignored rows dropped (shifted like HF)."""
    h = hidden[:, :-1, :].reshape(-1, hidden.shape[-1])
    t = labels[:, 1:].reshape(-1)
    keep = t != IGNORE_INDEX
    return h[keep], t[keep]


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer would run in here: autocast's when it is on for the tensor's device."""
    kind = tensor.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return tensor.dtype


@torch.compiler.disable  # a Triton autograd.Function with an early return: kept out of the compiled graph
def liger_cross_entropy(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss through Liger's fused linear cross-entropy, ignored rows dropped before the kernel,
    ~CHUNK_ROWS-row chunks, weight gradient accumulated in fp32. Runs eagerly even inside a compiled model:
    under torch.compile its ignore_index handling can return a wrong or NaN loss (Liger-Kernel PR #1338)."""
    import inspect

    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    h, t = _targets(hidden, labels)
    if t.numel() == 0:
        return hidden.sum() * 0.0
    weight: torch.Tensor = head.weight  # type: ignore[assignment]  # a Linear's weight
    dtype = _compute_dtype(h)
    h = h.to(dtype)
    options: dict[str, Any] = {"ignore_index": IGNORE_INDEX, "reduction": "mean", "accum_dtype": torch.float32}
    forward = inspect.signature(LigerFusedLinearCrossEntropyFunction.forward)
    if "chunk_mem_const" in forward.parameters:
        options["chunk_mem_const"] = liger_chunk_mem_const(h.shape[0], h.shape[1], weight.shape[0])
    bound = forward.bind(None, h, weight, t, **options)
    bound.apply_defaults()
    result = LigerFusedLinearCrossEntropyFunction.apply(*list(bound.arguments.values())[1:])
    return result[0] if isinstance(result, tuple) else result


@torch.compiler.disable  # torch's chunked op falls back to eager under compile anyway; said here, not found out
def torch_cross_entropy(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss through torch.nn.functional.linear_cross_entropy (chunked, CHUNK_ROWS rows per chunk,
    torch's own accumulation policy for the device and dtype), ignored rows dropped first. ``reduction="none"`` so
    the mean is taken in fp32 (the op's own mean comes back in bf16, ~0.5 % coarse); the price: its backward
    recomputes each chunk's logits (one more head matmul than Liger's, like the chunked loss's recompute)."""
    h, t = _targets(hidden, labels)
    if t.numel() == 0:
        return hidden.sum() * 0.0
    dtype = _compute_dtype(h)
    options = torch.nn.LinearCrossEntropyOptions(chunking_method=None, batch_chunk_size=CHUNK_ROWS)
    weight: torch.Tensor = head.weight.to(dtype)  # type: ignore[assignment]  # a Linear's weight
    # Per-row losses averaged in fp32: the op returns its reduction in the input dtype, and a bf16 mean is off by
    # up to ~0.5 % (7.28 for 7.234 in a CPU check), coarser than the differences between rows we compare.
    rows = torch.nn.functional.linear_cross_entropy(h.to(dtype), weight, t, reduction="none", options=options)
    return rows.float().mean()


class CausalLMWithLoss(torch.nn.Module):
    """A *ForCausalLM model whose forward returns the mean next-token loss of a packed micro-batch.

    ``loss``: "plain" (full logits, as transformers computes them), or one of FUSED_LOSSES: "chunked"
    (chunked_cross_entropy), "liger" (Liger kernel; CUDA only) or "torch" (torch's linear_cross_entropy). "liger" and
    "torch" take the head's weight directly, so they cannot run under DeepSpeed ZeRO-3 (its weights are partitioned);
    "chunked" calls the head as a module and can. DDP / DeepSpeed wrap this module.
    """

    def __init__(self, lm: torch.nn.Module, *, loss: str = "plain") -> None:
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"unknown loss {loss!r}; one of {', '.join(LOSSES)}")
        missing = _missing_library(loss)
        if missing:
            raise ValueError(f"loss {loss!r}: {missing}")
        self.lm = lm
        self.loss_kind = loss

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: Any, labels: torch.Tensor
    ) -> torch.Tensor:
        lm: Any = self.lm
        hidden = lm.model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
        head = lm.get_output_embeddings()
        if self.loss_kind == "plain":
            return plain_cross_entropy(head(hidden), labels)
        if self.loss_kind == "liger":
            return liger_cross_entropy(hidden, head, labels)
        if self.loss_kind == "torch":
            return torch_cross_entropy(hidden, head, labels)
        return chunked_cross_entropy(hidden, head, labels)


def fused_loss(kernel: str, *, device_type: str, zero3: bool) -> str:
    """The fused loss a ``cross_entropy_kernel`` setting runs here; ValueError naming why when it cannot.

    "auto" is the chunked loss everywhere: it runs on every device and under ZeRO-3, and no GPU measurement has yet
    shown another to be faster (benchmarks/hopper.py rows ce-liger and ce-torch time them). An explicit choice that
    cannot run is refused, never swapped for another silently."""
    if kernel == "auto":
        return "chunked"
    if kernel not in FUSED_LOSSES:
        raise ValueError(f"cross_entropy_kernel {kernel!r} is not one of auto, {', '.join(FUSED_LOSSES)}")
    if kernel in ("liger", "torch") and zero3:
        raise ValueError(f"cross_entropy_kernel {kernel} reads the head's weight directly, which DeepSpeed ZeRO-3 "
                         "partitions; use chunked (or auto) with deepspeed_stage 3")  # fmt: skip
    if kernel == "liger" and device_type != "cuda":
        raise ValueError("cross_entropy_kernel liger needs a CUDA GPU (Liger's kernels are Triton's)")
    missing = _missing_library(kernel)
    if missing:
        raise ValueError(f"cross_entropy_kernel {kernel}: {missing}")
    return kernel


def _missing_library(loss: str) -> str | None:
    """Why ``loss`` cannot run here for want of a library (CausalLMWithLoss and fused_loss both ask); None if it can."""
    if loss == "liger" and not liger_available():
        return "liger-kernel (with triton) is not installed (pip install liger-kernel==0.8.5)"
    if loss == "torch" and not torch_linear_cross_entropy_available():
        return f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy (torch 2.13 or later)"
    return None


def liger_available() -> bool:
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return False
    return True
