"""Where gpuscout finds its configuration files and training scripts."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
CONFIG_DIR = Path(os.environ.get("GPUSCOUT_CONFIG_DIR", REPO_DIR / "configs"))
TRAINING_DIR = Path(os.environ.get("GPUSCOUT_TRAINING_DIR", REPO_DIR / "training"))
INSTANCES_DIR = CONFIG_DIR / "instances"
DEEPSPEED_DIR = CONFIG_DIR / "deepspeed"
PRICING_DIR = CONFIG_DIR / "pricing"
MANIFESTS_DIR = CONFIG_DIR / "manifests"
MEMORY_DIR = CONFIG_DIR / "memory"
