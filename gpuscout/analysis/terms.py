"""The run's terms, as the analysis and the budget guard read them from its manifest: the objective, the constraints
(and a search's spend cap), the description, and the prices a target states for itself.

A run's manifest is stored as the document it was validated as (``RunRecord.manifest``); the analysis of a run,
today or a year later, reads only these fields from it and does not validate the whole manifest again against
today's rules (a manifest a later release would refuse still has its run analysed and re-priced). A ``Manifest`` in
hand gives the same terms (``RunTerms.of``).

May import: gpuscout.domain."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpuscout.domain.manifest_targets import Objective

if TYPE_CHECKING:
    from gpuscout.domain.manifest import Manifest


class _Read(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)  # the rest of the manifest is not the analysis's


class TermsConstraints(_Read):
    budget_usd: float | None = None
    deadline_hours: float | None = None
    target_loss: float | None = None


class TargetPrice(_Read):
    """A target's own prices (targets[].price_per_hour_usd, spot_price_per_hour_usd), which override the catalog."""

    instance_type: str
    price_per_hour_usd: float | None = None
    spot_price_per_hour_usd: float | None = None


class SearchCap(_Read):
    max_cost_usd: float | None = None  # a settings search's own spend cap


class RunTerms(_Read):
    description: str | None = None
    objective: Objective = "cheapest_per_token"
    constraints: TermsConstraints = Field(default_factory=TermsConstraints)
    targets: list[TargetPrice] = Field(default_factory=list)
    search: SearchCap | None = None

    @property
    def spend_limit_usd(self) -> float | None:
        """The budget, or the search's spend cap (``search.max_cost_usd``) when that is lower; None: neither."""
        cap = self.search.max_cost_usd if self.search else None
        limits = [v for v in (self.constraints.budget_usd, cap) if v is not None]
        return min(limits) if limits else None

    @model_validator(mode="before")
    @classmethod
    def _objective_in_constraints(cls, data: object) -> object:
        """Manifests of the first releases named the objective inside ``constraints``; it still counts there."""
        if isinstance(data, Mapping) and data.get("objective") is None:
            constraints = data.get("constraints")
            if isinstance(constraints, Mapping) and constraints.get("objective") is not None:
                return {**data, "objective": constraints["objective"]}
        return data

    @classmethod
    def of(cls, manifest: Manifest) -> RunTerms:
        return cls.model_validate(manifest.model_dump(mode="json"))

    @classmethod
    def stored(cls, manifest: Mapping[str, Any] | None) -> RunTerms:
        """The terms of a stored manifest document (none stored: the defaults, no constraints)."""
        return cls.model_validate(manifest or {})
