"""Reading one configuration file of configs/ (a GPU, an instance type, the price snapshot) into its model: every
problem comes back as a CatalogError that names the file and each field's path. And writing a file whole or not at
all (the price snapshot, a run's report): readers see the old file or the new one, never half of it.

May import: gpuscout.errors, pydantic and the standard library."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from gpuscout.errors import CatalogError

Model = TypeVar("Model", bound=BaseModel)


def read_config_file(path: Path, model: type[Model], what: str, *, context: dict[str, Any] | None = None) -> Model:
    """``path`` validated as ``model``; ``what`` names the file's kind in the error ("GPU file", "instance file")."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CatalogError(f"{path}: cannot read {what}: {err}") from err
    try:
        return model.model_validate(raw, context=context)
    except ValidationError as err:
        details = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(file)'}: {e['msg']}" for e in err.errors(include_url=False)
        )
        raise CatalogError(f"{path}: invalid {what}: {details}") from err


def write_whole(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file beside it, renamed over it; on any OSError (a full disk) the
    temporary file is removed, the old file is left as it was, and the error is raised."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
