"""Degenerate prepared data, found before anything is measured (dataset.json from training/gpuscout_data/prepare.py).

A benchmark on degenerate data measures nothing useful: a training split smaller than one global batch repeats the
same blocks every step, an empty validation split gives no validation loss, a trained BPE vocabulary far below the
request changes the model's embedding and output sizes (and so its speed), and a source whose lines were mostly
invalid is not the data the user meant. ``dataset_problems`` returns what to refuse and what to flag loudly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

VOCAB_FAR_BELOW = 0.5  # a trained vocabulary under half the requested size is flagged
INVALID_FRACTION = 0.10  # more than 10 % of the records read were invalid (not text, broken JSON)
DOMINANT_DOCUMENT = 0.5  # one document holds more than half of the kept text


@dataclass(frozen=True)
class DatasetProblem:
    severity: Literal["refuse", "warn"]
    message: str


def global_batch_blocks(hyperparameters: Mapping[str, Any], world_size: int) -> int:
    batch = int(hyperparameters.get("per_device_train_batch_size") or 1)
    accumulation = int(hyperparameters.get("gradient_accumulation_steps") or 1)
    return batch * accumulation * max(1, world_size)


def invalid_lines(dropped: Mapping[str, int], firsts: Mapping[str, str], *, text_field: str | None = None) -> list[str]:
    """What was wrong with the records dropped as invalid, one line per kind, naming the first place of each
    (data_preparation's ``dropped`` counts and ``first_invalid``); ``text_field`` names the field when known."""
    lines = []
    if dropped.get("not_json"):
        lines.append(f"{int(dropped['not_json']):,} lines are not valid JSON, first at {firsts.get('not_json', '?')}")
    if dropped.get("no_text_field"):
        field = f"string field {text_field!r}" if text_field else "text field"
        lines.append(
            f"{int(dropped['no_text_field']):,} records have no {field} (dataset.text_field), "
            f"first at {firsts.get('no_text_field', '?')}"
        )
    return lines


def dataset_problems(
    summary: Mapping[str, Any], *, requested_vocab_size: int | None = None, global_batch: int | None = None
) -> list[DatasetProblem]:
    """Problems of a prepared dataset (dataset.json as a dict); ``global_batch`` in blocks of one job, if known."""
    problems: list[DatasetProblem] = []
    splits = summary.get("splits") or {}
    train_blocks = int((splits.get("train") or {}).get("blocks") or 0)
    validation = splits.get("validation") or {}
    if global_batch is not None and train_blocks < global_batch:
        problems.append(
            DatasetProblem(
                "refuse",
                f"the training split has {train_blocks} blocks of {summary.get('sequence_length')} tokens, fewer than "
                f"one global batch ({global_batch} blocks): every step would repeat the same data; lower "
                "per_device_batch_size x gradient_accumulation_steps, or use more data (dataset.max_documents, a "
                "larger dataset.source)",
            )
        )
    if float(summary.get("validation_fraction") or 0) > 0 and int(validation.get("blocks") or 0) == 0:
        problems.append(
            DatasetProblem(
                "warn",
                f"the validation split is empty ({validation.get('documents', 0)} documents): no validation loss "
                "will be measured; raise dataset.validation_fraction or use more data",
            )
        )
    tokenizer = summary.get("tokenizer") or {}
    vocab = tokenizer.get("vocab_size")
    if (
        tokenizer.get("kind") == "bpe"
        and requested_vocab_size
        and vocab
        and vocab < VOCAB_FAR_BELOW * requested_vocab_size
    ):
        problems.append(
            DatasetProblem(
                "warn",
                f"the trained BPE vocabulary has {vocab:,} tokens, far below the requested {requested_vocab_size:,} "
                "(too little text to learn more merges): the model's embedding and output layers, and so its speed, "
                "differ from what was asked; use more data or a smaller tokenizer.vocab_size",
            )
        )
    read = int(summary.get("documents_read") or 0)
    dropped = summary.get("dropped") or {}
    invalid = int(dropped.get("invalid") or 0)
    if read and invalid / read > INVALID_FRACTION:
        kinds = invalid_lines(dropped, summary.get("first_invalid") or {})
        detail = "; ".join(kinds) if kinds else "check dataset.text_field and the file format"
        problems.append(
            DatasetProblem(
                "warn", f"{invalid:,} of {read:,} records were invalid and dropped ({invalid / read:.0%}): {detail}"
            )
        )
    train_tokens = int((splits.get("train") or {}).get("tokens") or 0)
    validation_tokens = int(validation.get("tokens") or 0)
    if validation_tokens > train_tokens:
        problems.append(
            DatasetProblem(
                "warn",
                f"the validation split holds more tokens ({validation_tokens:,}) than the training split "
                f"({train_tokens:,}): the benchmark trains on the smaller part of the text; lower "
                "dataset.validation_fraction or use more documents",
            )
        )
    largest = float(summary.get("largest_document_fraction") or 0)
    if largest > DOMINANT_DOCUMENT:
        cut = int(summary.get("documents_cut") or 0)
        how = (
            f"it was cut into pieces of at most {int(summary.get('max_piece_characters') or 0):,} characters "
            "before the train/validation split"
            if cut
            else "the split puts it on one side whole"
        )
        problems.append(
            DatasetProblem(
                "warn",
                f"one document holds {largest:.0%} of the text: {how}; the benchmark's data is mostly that one "
                "document",
            )
        )
    return problems


SAMPLED_RECORDS = 20  # the first records of a JSON Lines source that validate reads
SAMPLED_BYTES = 1 << 20  # and at most this much of the file


def source_content_problems(files: list[Path], *, fmt: str, text_field: str, suffixes: tuple[str, ...]) -> list[str]:
    """What a quick look at a local source's files (those data preparation would read: ``files``) finds wrong
    before anything runs: none at all, a suffix data preparation cannot read, an empty first file, or JSON Lines
    whose first records have no string ``text_field``. Reads at most SAMPLED_BYTES of one file."""
    if not files:
        what = f"{'/'.join(suffixes)} files" if fmt == "auto" else "files"
        return [f"no {what} in it (set dataset.format to read files of another suffix)"]
    first = files[0]
    if fmt == "auto" and first.suffix not in suffixes:
        return [
            f"{first.name}: cannot tell its format from the suffix {first.suffix or '(none)'!r} (known: "
            f"{', '.join(suffixes)}); set dataset.format (jsonl, txt or parquet)"
        ]
    if first.stat().st_size == 0:
        return [f"{first.name} is empty"]
    kind = fmt if fmt != "auto" else {".jsonl": "jsonl", ".json": "jsonl"}.get(first.suffix, "other")
    if kind != "jsonl":
        return []
    with first.open("rb") as handle:
        head = handle.read(SAMPLED_BYTES).decode("utf-8-sig", errors="replace")
    if first.suffix == ".json" and head.lstrip().startswith("["):
        return []  # one JSON array: read whole by data preparation, which counts its bad records
    lines = [line for line in head.splitlines() if line.strip()][:SAMPLED_RECORDS]
    if len(head) == SAMPLED_BYTES and lines:
        lines = lines[:-1]  # the last line may be cut off by the sample
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            records.append(None)
    if not records or any(isinstance(r, dict) and isinstance(r.get(text_field), str) for r in records):
        return []
    if all(r is None for r in records):
        return [f"{first.name}: its first {len(records)} line(s) are not JSON (is it JSON Lines?)"]
    fields = sorted({key for r in records if isinstance(r, dict) for key in r})
    found = f"; its records have: {', '.join(fields[:8])}" if fields else ""
    return [
        f"{first.name}: none of its first {len(records)} record(s) has a string field {text_field!r}{found}; "
        "set dataset.text_field"
    ]
