"""A complete benchmark.json for tests that care about a few of its fields: the fixture of a real p4d job
(tests/fixtures/benchmarks/p4d-bs8-r0.json) with the test's fields merged in. A job's benchmark is a
``BenchmarkResult`` wherever gpuscout holds it, so a test's partial dict would not be one."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

BASE = json.loads((Path(__file__).resolve().parent / "fixtures" / "benchmarks" / "p4d-bs8-r0.json").read_text())


def _merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def benchmark_result(**fields: Any) -> dict[str, Any]:
    """The fixture's benchmark.json with ``fields`` merged in (a nested dict merges into the fixture's, key by key;
    anything else replaces it)."""
    return _merged(BASE, fields)
