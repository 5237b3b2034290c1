"""Where gpuscout finds its configuration files, and the entry points of its training jobs.

In a checkout (and its editable install) the configuration is the repository's configs/; an installed wheel
(`pipx install .`, `uv tool install .`) carries a copy inside the package, gpuscout/_bundled/ (pyproject.toml).
GPUSCOUT_CONFIG_DIR overrides either (the training image sets it).

The jobs are packages of their own, in training/: gpuscout_train (the training job), gpuscout_data (data
preparation) and gpuscout_report (the SDK a user's script calls). They are part of the gpuscout distribution, so an
install (editable or wheel) imports them like gpuscout itself; the training image, which is not an install, puts
the same two source roots on PYTHONPATH (/opt/ml/code and /opt/ml/code/training, training/Dockerfile). Every
process that runs one starts it as a module (``python -m``), never by a file's path.
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
INSTANCES_DIR = CONFIG_DIR / "instances"
DEEPSPEED_DIR = CONFIG_DIR / "deepspeed"
PRICING_DIR = CONFIG_DIR / "pricing"
MANIFESTS_DIR = CONFIG_DIR / "manifests"
MEMORY_DIR = CONFIG_DIR / "memory"

# Where gpuscout is not installed (the training image, a GPU machine's copy of the checkout), these two folders on
# PYTHONPATH import gpuscout and the training packages: training/Dockerfile's /opt/ml/code:/opt/ml/code/training
SOURCE_ROOTS = (REPO_DIR, REPO_DIR / "training")


def source_pythonpath(existing: str | None = None) -> str:
    """PYTHONPATH for a child process run from this checkout's sources: ``existing`` (what the caller put first stays
    first), then SOURCE_ROOTS."""
    return os.pathsep.join([*([existing] if existing else []), *(str(root) for root in SOURCE_ROOTS)])


TRAIN_MODULE = "gpuscout_train.train"  # one training process (the image's launcher starts it under torchrun)
DATA_PREPARATION_MODULE = "gpuscout_data"  # the data preparation job (its __main__)
REPORT_MODULE = "gpuscout_report"  # ``--from-log``: benchmark.json from a user's script's metric lines
