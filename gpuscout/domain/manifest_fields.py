"""What every manifest section model shares: strict pydantic models (``extra="forbid"``, frozen), the slug and
precision types, the control-character and S3 URI patterns, the error a model validator raises to report several
problems at once, and the catalog a validation runs against (its context, else configs/instances).

May import: gpuscout.domain.catalog, gpuscout.errors, pydantic."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo

from gpuscout.domain.catalog import Catalog, load_catalog
from gpuscout.errors import Problem

SLUG_RE = r"^[a-z0-9](?:[a-z0-9-]{0,38}[a-z0-9])?$"
S3_URI_RE = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\x00-\x1f]*)?$")
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")

Slug = Annotated[str, Field(pattern=SLUG_RE, description="1-40 lowercase letters, digits and inner hyphens")]
Precision = Literal["bf16", "fp16", "fp32"]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


class ManifestProblemsError(ValueError):
    """Raised inside a model validator to report several problems at once, with paths relative to that model;
    :func:`parse_manifest` expands them."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


def catalog_from(info: ValidationInfo) -> Catalog:
    ctx = info.context if isinstance(info.context, dict) else {}
    catalog = ctx.get("catalog")
    return catalog if isinstance(catalog, Catalog) else load_catalog()
