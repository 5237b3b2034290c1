"""FLOPs per token, the numerator of MFU (docs/metrics.md "FLOPs convention").

Convention (PaLM, Chowdhery et al. 2022, appendix B), per trained token:

    model FLOPs/token    = 6 * N_matmul + 12 * L * H * d_head * T_eff
    hardware FLOPs/token = model FLOPs/token + (2 * N_matmul + 4 * L * H * d_head * T_eff) with full
                           activation recompute (gradient checkpointing re-runs the forward pass)

N_matmul counts the weights of every matrix multiply: q, k, v, o projections, the three MLP matrices of every
layer, and the lm_head (counted even when tied to the input embedding, because the matmul is done); the input
embedding lookup, norms and biases are excluded. T_eff is the attention context length averaged over tokens:
sum(l_i^2) / sum(l_i) over the document pieces l_i, since each token attends only within its document, whether
pieces are packed with a document mask or each padded in a row of its own; for one sequence of length T it is T.
Causal masking is *not* halved, as in PaLM, so figures compare with published MFU numbers.

Adapters (LoRA, QLoRA; docs/metrics.md "Adapters"). The base is frozen and only the adapters' A and B train, so the
count is the matmuls autograd runs, per token:

    model FLOPs/token    = 4 * N_matmul + 6 * N_adapter + 12 * L * H * d_head * T_eff - S_0
    hardware FLOPs/token = 4 * N_matmul + 6 * N_adapter + 12 * L * H * d_head * T_eff
                           + (2 * N_matmul + 2 * N_adapter + 4 * L * H * d_head * T_eff) with activation recompute
                           (without it, as the model FLOPs)

- forward 2 * N_matmul + 2 * N_adapter + 4 * L * H * d_head * T_eff (N_adapter = adapters.adapter_params);
- backward of the base: no weight gradients (frozen); the input gradient of every matmul (2 * its weights), and the
  attention backward (8 * H * d_head * T_eff a layer), wherever the input needs a gradient;
- backward of an adapter on a layer ``in -> out`` of rank r: the weight gradients of A and B (2 * r * (in + out)),
  the input gradient of B (2 * r * out), and that of A (2 * r * in) where the layer's input needs a gradient.

Every input needs a gradient downstream of the first adapter, so all of them do from the second block on and at the
lm_head. In the first block the input (the norm of the frozen embedding) needs none, and a linear layer's input
needs one only if a layer at an earlier stage of the block carries an adapter: stage 0 q, k, v (the block's input),
1 o (attention over q, k, v), 2 gate, up (the residual stream after o), 3 down (gate and up). S_0 is what the first
block skips: for the layers at or before the first adapted stage, 2 * weights, plus 2 * r * in for those adapted,
plus the block's attention backward 8 * H * d_head * T_eff when none of q, k, v is adapted. The fused attention
kernels (sdpa's flash, memory-efficient and cuDNN, flex) compute the gradients of q, k and v together, so the first
block's attention backward counts whole once any of them is adapted (eager attention would skip the matmuls of the
ones not adapted). Gradient checkpointing makes the embedding's output require a gradient (transformers'
enable_input_require_grads, which it calls for a causal LM), so with recompute nothing is skipped: S_0 counts only
without it (the recompute counts the whole forward, as for a full run, though the per-layer checkpoints re-run
neither the lm_head nor a layer's last matmul, which torch's early stop skips). QLoRA counts the same matmuls: its
4-bit weights are dequantized to the compute dtype for each one.

MFU of an adapter run is the fraction of peak spent on this work, which is less than a full fine-tune's per token
(the base gets no weight gradients: its matmul part is about 2/3 of a full run's, the attention part the same; 0.77
of the full count for Qwen2.5-0.5B, 0.71 for 7B, at T_eff 4096 with the default adapters). It is not the same work
as a full run's, so the MFU of an adapter run and that of a full run do not compare as speeds of the same job:
compare tokens/s for the same model, or time to a quality.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuscout.domain.adapters import LINEAR_MODULES, Adapter, adapter_params, module_shapes
from gpuscout.domain.models import Architecture

# A decoder block's linear layers by stage: each stage's input depends on the outputs of every earlier stage (q, k, v
# read the block's input; o the attention over them; gate and up the residual stream after o; down gate and up).
STAGES = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2, "down_proj": 3}


def matmul_params(arch: Architecture) -> int:
    """Weights that take part in a matrix multiply per token (see module docstring)."""
    h = arch.hidden_size
    d = arch.attention_head_dim
    q = h * arch.num_attention_heads * d
    kv = 2 * h * arch.num_key_value_heads * d
    o = arch.num_attention_heads * d * h
    mlp = 3 * h * arch.intermediate_size
    per_layer = q + kv + o + mlp
    return arch.num_hidden_layers * per_layer + h * arch.vocab_size


def total_params(arch: Architecture) -> int:
    """All trainable parameters of a Qwen2 model with this architecture (biases on q/k/v, RMSNorm weights)."""
    h = arch.hidden_size
    d = arch.attention_head_dim
    kv_dim = arch.num_key_value_heads * d
    q_dim = arch.num_attention_heads * d
    attn = h * q_dim + q_dim + 2 * (h * kv_dim + kv_dim) + q_dim * h
    mlp = 3 * h * arch.intermediate_size
    norms = 2 * h
    embed = arch.vocab_size * h
    lm_head = 0 if arch.tie_word_embeddings else arch.vocab_size * h
    return arch.num_hidden_layers * (attn + mlp + norms) + h + embed + lm_head


def attention_flops_per_token(arch: Architecture, t_eff: float) -> float:
    return 12.0 * arch.num_hidden_layers * arch.num_attention_heads * arch.attention_head_dim * t_eff


def first_block_frozen_inputs(adapter: Adapter) -> tuple[str, ...]:
    """The first decoder block's linear layers whose input needs no gradient in an adapter run without recompute:
    those at or before the first stage that carries an adapter (module docstring, "Adapters")."""
    first = min(STAGES[m] for m in adapter.target_modules)
    return tuple(m for m in LINEAR_MODULES if STAGES[m] <= first)


def first_block_skipped_flops(arch: Architecture, t_eff: float, adapter: Adapter) -> float:
    """S_0: the backward FLOPs per token the first block skips in an adapter run, its input (the norm of the frozen
    embedding) needing no gradient: the input gradients of the layers before the first adapter (of the base matmul,
    and of A where adapted) and, when none of q, k, v is adapted, the block's attention backward."""
    shapes = module_shapes(arch)
    frozen = first_block_frozen_inputs(adapter)
    skipped = sum(2 * shapes[m][0] * shapes[m][1] for m in frozen)
    skipped += sum(2 * adapter.rank * shapes[m][0] for m in frozen if m in adapter.target_modules)
    attention = 0.0
    if "o_proj" in frozen:  # o's input (the attention output) needs no gradient: no attention backward either
        attention = 8.0 * arch.num_attention_heads * arch.attention_head_dim * t_eff
    return float(skipped) + attention


def _adapter_flops(arch: Architecture, t_eff: float, adapter: Adapter) -> float:
    """Forward + backward per token of an adapter run where every input needs a gradient (before S_0)."""
    return 4.0 * matmul_params(arch) + 6.0 * adapter_params(arch, adapter) + attention_flops_per_token(arch, t_eff)


def model_flops_per_token(arch: Architecture, t_eff: float, *, adapter: Adapter | None = None) -> float:
    """FLOPs of forward + backward for one token (MFU numerator); of an adapter run when ``adapter`` is given (the
    base frozen, only the adapters trained: module docstring, "Adapters")."""
    if adapter is not None:
        return _adapter_flops(arch, t_eff, adapter) - first_block_skipped_flops(arch, t_eff, adapter)
    return 6.0 * matmul_params(arch) + attention_flops_per_token(arch, t_eff)


def hardware_flops_per_token(
    arch: Architecture, t_eff: float, *, activation_recompute: bool, adapter: Adapter | None = None
) -> float:
    """FLOPs actually executed per token (HFU numerator): adds one extra forward pass under recompute. For an
    adapter run the forward includes the adapters, and under recompute the first block skips nothing (the embedding's
    output then requires a gradient)."""
    if adapter is not None:
        if not activation_recompute:
            return model_flops_per_token(arch, t_eff, adapter=adapter)
        forward = 2.0 * matmul_params(arch) + 2.0 * adapter_params(arch, adapter)
        return _adapter_flops(arch, t_eff, adapter) + forward + attention_flops_per_token(arch, t_eff) / 3.0
    flops = model_flops_per_token(arch, t_eff)
    if activation_recompute:
        flops += 2.0 * matmul_params(arch) + attention_flops_per_token(arch, t_eff) / 3.0
    return flops


def effective_context(document_lengths: Iterable[int]) -> float:
    """T_eff = sum(l^2) / sum(l): mean number of keys a token attends to under document masking."""
    total = 0
    squares = 0
    for length in document_lengths:
        if length < 0:
            raise ValueError("document lengths must be non-negative")
        total += length
        squares += length * length
    if total == 0:
        raise ValueError("no tokens")
    return squares / total


def mfu(tokens_per_s: float, flops_per_token: float, num_gpus: int, peak_tflops_per_gpu: float) -> float:
    """Model FLOPs utilization as a fraction (0.45 = 45 %)."""
    if num_gpus <= 0 or peak_tflops_per_gpu <= 0:
        raise ValueError("num_gpus and peak must be positive")
    return tokens_per_s * flops_per_token / (num_gpus * peak_tflops_per_gpu * 1e12)
