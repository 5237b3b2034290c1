"""The prepared dataset's format, written by the data preparation job and read by training: dataset.json (its
summary) and shards of packed blocks, each a pair of .npy files holding ``input_ids`` and ``segment_ids`` (int32,
[blocks, sequence_length]; segment ids number the document pieces of a block 1, 2, ... and are 0 on padding).
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpuscout.errors import DataPreparationError

FORMAT = "gpuscout-packed-v1"
BLOCKS_PER_SHARD = 4096


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


def write_split(
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


def summarize(documents: int, ids: np.ndarray, seg: np.ndarray) -> SplitSummary:
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
