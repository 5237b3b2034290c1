"""Stand-ins for the training jobs: a test replaces what the runner starts (``python -m gpuscout_train.train``,
``python -m gpuscout_data``) with a short script of its own, in a package of the same name first on the child's
PYTHONPATH. The runner's commands stay the real ones; only what they resolve to changes."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest


def stand_in_packages(root: Path, *, train: str | None = None, prepare: str | None = None) -> Path:
    """``root`` holding a gpuscout_train whose train module is ``train`` and/or a gpuscout_data whose ``__main__`` is
    ``prepare`` (each dedented); returns ``root``, for the front of a PYTHONPATH."""
    for package, module, body in (("gpuscout_train", "train.py", train), ("gpuscout_data", "__main__.py", prepare)):
        if body is None:
            continue
        folder = root / package
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").write_text("")
        (folder / module).write_text(textwrap.dedent(body))
    return root


def pythonpath_with(root: Path) -> str:
    """This process's PYTHONPATH with ``root`` in front."""
    return os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)


def use_stand_ins(
    monkeypatch: pytest.MonkeyPatch, root: Path, *, train: str | None = None, prepare: str | None = None
) -> None:
    """The jobs this test's runner starts resolve to the stand-ins (the runner hands children this environment)."""
    stand_in_packages(root, train=train, prepare=prepare)
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(root))
