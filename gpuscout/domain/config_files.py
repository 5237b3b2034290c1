"""Reading one configuration file of configs/ (a GPU, an instance type, the price snapshot) into its model: every
problem comes back as a CatalogError that names the file and each field's path.

May import: gpuscout.errors, pydantic and the standard library."""

from __future__ import annotations

import json
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
