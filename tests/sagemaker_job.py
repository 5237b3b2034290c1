"""train.py's SageMaker folder contract for tests that run it as a subprocess: the hyperparameters file and the SM_*
variables under one root, as `gpuscout local` and the training container lay them out."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO_DIR = Path(__file__).resolve().parents[1]
# The training image's PYTHONPATH (training/Dockerfile: /opt/ml/code:/opt/ml/code/training) in this checkout: a test
# that runs a job the way the image does resolves gpuscout and the training packages from the same two roots
IMAGE_PYTHONPATH = os.pathsep.join([str(REPO_DIR), str(REPO_DIR / "training")])
LAUNCHER_COMMAND = ("-m", "gpuscout_train.launcher")  # the image's entry point, less its python (training/Dockerfile)


def job_environment(
    root: Path,
    dataset: Path,
    hyperparameters: dict[str, Any],
    *,
    base: Mapping[str, str] | None = None,
    **extra: str,
) -> dict[str, str]:
    """Write ``root/opt/ml/input/config/hyperparameters.json`` and return the environment that points train.py at it,
    at ``dataset`` (the train channel) and at the output, model and checkpoint folders under ``root``, over ``base``
    (this process's environment by default)."""
    config = root / "opt/ml/input/config"
    config.mkdir(parents=True, exist_ok=True)
    (config / "hyperparameters.json").write_text(json.dumps(hyperparameters))
    return {
        **(os.environ if base is None else base),
        "SM_INPUT_CONFIG_DIR": str(config),
        "SM_CHANNEL_TRAIN": str(dataset),
        "SM_OUTPUT_DATA_DIR": str(root / "opt/ml/output/data"),
        "SM_MODEL_DIR": str(root / "opt/ml/model"),
        "GPUSCOUT_CHECKPOINT_DIR": str(root / "opt/ml/checkpoints"),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        **extra,
    }
