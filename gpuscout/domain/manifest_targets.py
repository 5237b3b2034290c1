"""The manifest sections that say where a benchmark runs and what answer it wants: the targets (instance type,
count, spot, price override; checked against the catalog), the constraints and the objective.

May import: gpuscout.domain's catalog and manifest_fields, pydantic."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from gpuscout.domain.catalog import LOCAL
from gpuscout.domain.manifest_fields import ManifestProblemsError, StrictModel, catalog_from
from gpuscout.errors import Problem


class Target(StrictModel):
    instance_type: str = Field(min_length=1, max_length=64)
    instance_count: int = Field(default=1, ge=1, le=64)
    spot: bool = False
    price_per_hour_usd: float | None = Field(default=None, gt=0.0)  # overrides the catalog's on-demand price
    spot_price_per_hour_usd: float | None = Field(default=None, gt=0.0)
    max_wait_hours: float | None = Field(default=None, gt=0.0, le=120.0)  # managed spot: wait + run limit

    @field_validator("instance_type")
    @classmethod
    def _in_catalog(cls, v: str, info: ValidationInfo) -> str:
        catalog = catalog_from(info)
        if v not in catalog.training_types:
            if v in catalog:
                raise ValueError(
                    f"{v} is a {catalog.get(v).role} instance, not a training target; "
                    f"allowed: {', '.join(catalog.training_types)}"
                )
            raise ValueError(f"unknown instance type {v!r}; allowed: {', '.join(catalog.training_types)}")
        return v

    @model_validator(mode="after")
    def _combination(self) -> Target:
        problems: list[Problem] = []
        if self.instance_type == LOCAL:
            if self.price_per_hour_usd is None:
                problems.append(
                    Problem("price_per_hour_usd", "a local target must state what this machine costs per hour")
                )
            if self.spot:
                problems.append(Problem("spot", "spot is a SageMaker option; a local target cannot be spot"))
            if self.instance_count != 1:
                problems.append(Problem("instance_count", "a local target has instance_count 1"))
        if not self.spot:
            for field in ("spot_price_per_hour_usd", "max_wait_hours"):
                if getattr(self, field) is not None:
                    problems.append(Problem(field, "only used with spot: true"))
        if problems:
            raise ManifestProblemsError(problems)
        return self


class Constraints(StrictModel):
    budget_usd: float = Field(gt=0.0, le=1_000_000.0)
    deadline_hours: float | None = Field(default=None, gt=0.0)
    target_loss: float | None = Field(default=None, gt=0.0)


Objective = Literal["cheapest_per_token", "fastest", "cheapest_within_deadline", "fastest_within_budget"]
