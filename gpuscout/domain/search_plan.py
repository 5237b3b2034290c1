"""A settings search's plan: per target, the candidates that may be launched and those skipped with why, and the
search's limits (gpuscout.plan.search makes it from the manifest). Stored on the run (``RunRecord.search``): the local
driver resumes from it, the analysis tells each target's story from it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class SkippedCandidate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    settings: dict[str, Any]
    reason: str


class TargetSearch(BaseModel):
    """One target's search: the candidates that may be launched (in the plan's job order) and those skipped."""

    model_config = ConfigDict(extra="forbid")

    target_index: int
    instance_type: str
    dimensions: dict[str, list[Any]]  # every searched dimension (more than one value) and its values
    candidates: list[str]  # variant names of the launchable candidates
    skipped: list[SkippedCandidate]
    max_trials: int


class SearchPlan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    targets: list[TargetSearch]
    max_cost_usd: float  # the search's spend cap (search.max_cost_usd or the budget)
    max_parallel_trials: int = 1  # cloud: trials of one target running at once (search.max_parallel_trials)
    pruning: bool
    min_timed_steps: int
    reduction_factor: int
    seed: int
    objective: str

    @property
    def trial_budget(self) -> int:
        """How many trials the search launches at most: each target's max_trials, or its candidates if fewer."""
        return sum(min(t.max_trials, len(t.candidates)) for t in self.targets)
