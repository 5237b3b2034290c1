"""The local start-up probe: measured once, cached per interpreter and library versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuscout.local import startup


def test_the_probe_measures_then_reuses_its_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSCOUT_HOME", str(tmp_path))
    monkeypatch.setattr(startup, "PROBE", "import json\n")  # the real probe imports torch: seconds
    first = startup.measure_startup_seconds()
    assert first is not None and 0 < first < 30
    cached = json.loads((tmp_path / "startup-probe.json").read_text())
    assert next(iter(cached.values()))["seconds"] == round(first, 2)
    monkeypatch.setattr(startup, "PROBE", "raise SystemExit(1)\n")
    assert startup.measure_startup_seconds() == round(first, 2)  # from the cache
    assert startup.measure_startup_seconds(use_cache=False) is None  # a failing probe gives no number
