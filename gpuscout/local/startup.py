"""The start-up time of a training process on this machine, measured, for the local plan's predictions.

Before its first step, train.py pays for importing torch and transformers (and building the model). On a small
machine that is seconds against a benchmark of seconds, so a prediction without it is wrong by a large factor. The
probe times ``import torch, transformers`` and the Qwen2 model code in a fresh interpreter, once per interpreter and
library versions, cached for a week in ``$GPUSCOUT_HOME/startup-probe.json`` (a plan must stay fast).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

PROBE = "import torch, transformers\nfrom transformers import Qwen2Config, Qwen2ForCausalLM\n"
CACHE_SECONDS = 7 * 24 * 3600
PROBE_TIMEOUT_S = 120.0


def _cache_path() -> Path:
    home = os.environ.get("GPUSCOUT_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".gpuscout") / "startup-probe.json"


def _key() -> str:
    versions = []
    for package in ("torch", "transformers"):
        try:
            versions.append(f"{package}=={metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package} missing")
    return f"{sys.executable} {' '.join(versions)}"


def measure_startup_seconds(*, use_cache: bool = True) -> float | None:
    """Seconds a fresh interpreter takes to import what train.py needs; None if the probe fails."""
    cache = _cache_path()
    key = _key()
    if use_cache:
        try:
            entry = json.loads(cache.read_text(encoding="utf-8")).get(key)
            if entry and time.time() - float(entry["measured_at"]) < CACHE_SECONDS:
                return float(entry["seconds"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    started = time.perf_counter()
    try:
        subprocess.run([sys.executable, "-c", PROBE], check=True, capture_output=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    seconds = time.perf_counter() - started
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({key: {"seconds": round(seconds, 2), "measured_at": time.time()}}) + "\n")
    except OSError:
        pass  # no cache: the next plan measures again
    return seconds
