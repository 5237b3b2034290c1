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
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuscout.domain.models import Architecture


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


def model_flops_per_token(arch: Architecture, t_eff: float) -> float:
    """FLOPs of forward + backward for one token (MFU numerator)."""
    return 6.0 * matmul_params(arch) + attention_flops_per_token(arch, t_eff)


def hardware_flops_per_token(arch: Architecture, t_eff: float, *, activation_recompute: bool) -> float:
    """FLOPs actually executed per token (HFU numerator): adds one extra forward pass under recompute."""
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
