"""The exact pins of a requirements or constraints file, for the tests that compare the project's pin files."""

from __future__ import annotations

import re
from pathlib import Path

from packaging.utils import canonicalize_name


def pins(path: Path) -> dict[str, str]:
    """Canonical name (PEP 503, ``packaging.utils.canonicalize_name``) -> version of each ``name[extras]==version``
    line of ``path``; comments and option lines (``-r ...``) skipped, and any other line fails the calling test."""
    found: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)(\[[^\]]+\])?==([^\s;]+)", line)
        assert match, f"{path.name}: {line!r} is not an exact pin (name==version)"
        found[canonicalize_name(match.group(1))] = match.group(3)
    return found
