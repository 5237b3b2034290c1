"""The training scripts run as top-level modules (as in the container's /opt/ml/code); import them the same way."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from gpuscout.paths import TRAINING_DIR

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if str(TRAINING_DIR) not in sys.path:
    sys.path.insert(0, str(TRAINING_DIR))


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The test machines are small and shared: one intra-op thread avoids OpenMP spin-wait contention."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
