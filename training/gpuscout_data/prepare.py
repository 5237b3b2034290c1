"""Raw text -> cleaned, tokenized, packed shards + tokenizer/ + dataset.json.

Runs as a SageMaker Processing job (raw data in /opt/ml/processing/input/raw, results to
/opt/ml/processing/output), as a command (``python -m gpuscout_data --input ... --output ...``) or in process
(``prepare(PrepareConfig(...))``). Identical input and arguments give byte-identical output.

Pipeline: read documents (jsonl / json / txt / parquet from a folder, a file, an S3 prefix, or a bundled corpus:
sources.py) -> NFC-normalize, drop empty / too short / exact duplicates -> deterministic train/validation split
by a hash of the text -> tokenize (tokenizer.py; several processes), append EOS per document -> concatenate and
cut into blocks of ``sequence_length`` tokens, keeping a segment id per token (1, 2, ... per document piece in a
block, 0 = padding) so training can mask attention across documents -> shards of .npy files (dataset.py: the
format training reads).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys
import tempfile
import time
import unicodedata
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuscout.domain.dataset_checks import invalid_lines
from gpuscout.errors import DISK_FULL, DataPreparationError, disk_full_file, is_disk_full

from .dataset import (
    BLOCKS_PER_SHARD,
    FORMAT,
    DatasetSummary,
    SplitSummary,
    pack,
    summarize,
    write_split,
)
from .sources import FORMATS, read_documents
from .tokenizer import build_tokenizer, tokenize

SCRIPT_VERSION = "1.0.0"
SAGEMAKER_INPUT = Path("/opt/ml/processing/input/raw")
SAGEMAKER_OUTPUT = Path("/opt/ml/processing/output")


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

    tokenizer, tokenizer_id = build_tokenizer(
        config.tokenizer, vocab_size=config.vocab_size, path=config.tokenizer_path, train_documents=train_docs
    )
    tokenizer_dir = out / "tokenizer"
    tokenizer.save_pretrained(str(tokenizer_dir))
    started = time.perf_counter()
    progress = functools.partial(log, config)
    train_tokens = tokenize(tokenizer, tokenizer_dir, train_docs, "train", workers=config.workers, log=progress)
    val_tokens = (
        tokenize(tokenizer, tokenizer_dir, val_docs, "validation", workers=config.workers, log=progress)
        if val_docs
        else []
    )
    tokenize_seconds = time.perf_counter() - started

    digest = hashlib.sha256()
    splits: dict[str, SplitSummary] = {}
    for name, docs, encoded in (("train", train_docs, train_tokens), ("validation", val_docs, val_tokens)):
        ids, seg = pack(encoded, config.sequence_length, tokenizer.pad_token_id)
        summary = summarize(len(docs), ids, seg)
        summary.shards = write_split(out, name, ids, seg, blocks_per_shard=config.blocks_per_shard, digest=digest)
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
