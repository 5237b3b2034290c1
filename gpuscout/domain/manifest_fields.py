"""What every manifest section model shares: strict pydantic models (``extra="forbid"``, frozen), the slug and
precision types, the control-character and S3 URI patterns, the error a model validator raises to report several
problems at once, and the catalog a validation runs against (its context, else configs/instances).

May import: gpuscout.domain.catalog, gpuscout.errors, pydantic."""

from __future__ import annotations

import re
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from gpuscout.domain.catalog import Catalog, load_catalog
from gpuscout.errors import Problem

SLUG_RE = r"^[a-z0-9](?:[a-z0-9-]{0,38}[a-z0-9])?$"
S3_URI_RE = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\x00-\x1f]*)?$")
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")

Slug = Annotated[str, Field(pattern=SLUG_RE, description="1-40 lowercase letters, digits and inner hyphens")]
Precision = Literal["bf16", "fp16", "fp32"]


def _whole_number_field(annotation: Any) -> bool:
    """An int field (``int``, ``int | None``, ``Annotated[int, ...]``) that takes no text."""
    if get_origin(annotation) is Annotated:
        return _whole_number_field(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        members = get_args(annotation)
        return str not in members and any(_whole_number_field(m) for m in members)
    return annotation is int


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_not_text(cls, value: object, info: ValidationInfo) -> object:
        """A whole number written as text (``max_steps: "12"``) is refused rather than read as 12: quotes in YAML
        mean text, and a manifest that says something else than it means is a mistake worth naming. (Decimal
        fields stay lenient: YAML reads ``1e-3`` as text, and writing it so is common.)"""
        if isinstance(value, str) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and _whole_number_field(field.annotation):
                raise ValueError(f"a whole number, not the text {value!r} (remove the quotes)")
        return value


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
