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
    # A SageMaker training plan (reserved capacity) to run on: passed as ResourceConfig.TrainingPlanArn; required for
    # a type sold only through training plans (botocore's TrainingPlanArn pattern)
    training_plan_arn: str | None = Field(
        default=None,
        min_length=50,
        max_length=2048,
        pattern=r"^arn:aws[a-z\-]*:sagemaker:[a-z0-9\-]*:[0-9]{12}:training-plan/.+$",
    )

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
    def _combination(self, info: ValidationInfo) -> Target:
        problems: list[Problem] = []
        problems += self._purchase_problems(info)
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

    def _purchase_problems(self, info: ValidationInfo) -> list[Problem]:
        """How the catalog says the type can be bought (on demand, spot, training plan) against what is asked."""
        if self.instance_type == LOCAL:
            if self.training_plan_arn is None:
                return []
            return [Problem("training_plan_arn", "a local target runs on this machine, not on a training plan")]
        catalog = catalog_from(info)
        if self.instance_type not in catalog:
            return []  # reported by the instance_type check
        inst = catalog.get(self.instance_type)
        problems: list[Problem] = []
        if inst.training_plan_only and self.training_plan_arn is None:
            problems.append(Problem(
                "training_plan_arn",
                f"{self.instance_type} is sold for training only through SageMaker training plans, not on demand: "
                "reserve capacity (SageMaker console or CreateTrainingPlan) and set training_plan_arn to the plan's "
                "ARN, with price_per_hour_usd at the plan's price per instance-hour; or choose an on-demand type",
            ))  # fmt: skip
        if self.training_plan_arn is not None and "training_plan" not in inst.purchase_options:
            problems.append(Problem(
                "training_plan_arn",
                f"{self.instance_type} is not offered through SageMaker training plans (catalog purchase_options: "
                f"{', '.join(inst.purchase_options)})",
            ))  # fmt: skip
        if self.training_plan_arn is not None and self.price_per_hour_usd is None:
            problems.append(Problem(
                "price_per_hour_usd",
                "a job on a training plan is paid through the plan's upfront fee, not at the on-demand rate: state the "
                "plan's price per instance-hour (its fee divided by its instance-hours)",
            ))  # fmt: skip
        if self.spot and self.training_plan_arn is not None:
            problems.append(Problem("spot", "a job on a training plan uses the plan's reserved capacity, not spot"))
        elif self.spot and not inst.spot_offered:
            problems.append(Problem(
                "spot", f"{self.instance_type} is not offered as Managed Spot Training (catalog purchase_options: "
                f"{', '.join(inst.purchase_options)})",
            ))  # fmt: skip
        return problems


class Constraints(StrictModel):
    budget_usd: float = Field(gt=0.0, le=1_000_000.0)
    deadline_hours: float | None = Field(default=None, gt=0.0)
    target_loss: float | None = Field(default=None, gt=0.0)


Objective = Literal["cheapest_per_token", "fastest", "cheapest_within_deadline", "fastest_within_budget"]
