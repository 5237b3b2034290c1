"""The training scripts run as top-level modules (as in the container's /opt/ml/code); import them the same way."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuscout.paths import REPO_DIR

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The test machines are small and shared: one intra-op thread avoids OpenMP spin-wait contention."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


CORPUS = REPO_DIR / "tests" / "fixtures" / "corpus"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small prepared dataset (the test corpus, 64-token blocks, a 400-token BPE vocabulary, 20 % validation),
    prepared once per test module."""
    from gpuscout_data import prepare as dp

    out = tmp_path_factory.mktemp("data") / "train"
    dp.prepare(
        dp.PrepareConfig(
            input=str(CORPUS), output=str(out), tokenizer="bpe", vocab_size=400, sequence_length=64,
            validation_fraction=0.2, quiet=True,
        )
    )  # fmt: skip
    return out
