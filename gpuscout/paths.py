"""Where gpuscout finds its configuration files and training scripts.

In a checkout (and its editable install) they are the repository's configs/ and training/; an installed wheel
(`pipx install .`, `uv tool install .`) carries copies inside the package, gpuscout/_bundled/ (pyproject.toml).
GPUSCOUT_CONFIG_DIR and GPUSCOUT_TRAINING_DIR override either (the training image sets them).
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
BUNDLED_DIR = PACKAGE_DIR / "_bundled"


def _folder(name: str) -> Path:
    """The checkout's ``name`` folder when gpuscout runs from one, else the copy the wheel carries."""
    checkout = REPO_DIR / name
    return checkout if checkout.is_dir() or not (BUNDLED_DIR / name).is_dir() else BUNDLED_DIR / name


CONFIG_DIR = Path(os.environ.get("GPUSCOUT_CONFIG_DIR", _folder("configs")))
TRAINING_DIR = Path(os.environ.get("GPUSCOUT_TRAINING_DIR", _folder("training")))
INSTANCES_DIR = CONFIG_DIR / "instances"
DEEPSPEED_DIR = CONFIG_DIR / "deepspeed"
PRICING_DIR = CONFIG_DIR / "pricing"
MANIFESTS_DIR = CONFIG_DIR / "manifests"
MEMORY_DIR = CONFIG_DIR / "memory"
