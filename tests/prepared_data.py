"""A small prepared dataset's summary (the dataset.json fields the runner's data checks read), and a folder holding it
for tests that replace data preparation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATASET_SUMMARY: dict[str, Any] = {
    "sequence_length": 256,
    "validation_fraction": 0.05,
    "documents_read": 120,
    "dropped": {"invalid": 0},
    "tokenizer": {"kind": "bpe", "vocab_size": 4096},
    "splits": {"train": {"blocks": 100, "documents": 110}, "validation": {"blocks": 6, "documents": 10}},
}


def prepared_data(folder: Path, **over: Any) -> Path:
    """``folder`` made, with a dataset.json of DATASET_SUMMARY (``over`` replacing its top-level fields)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dataset.json").write_text(json.dumps({**DATASET_SUMMARY, **over}))
    return folder
