"""What an analysis is: one target x variant's aggregated metrics and costs (``JobAnalysis``), the exclusions, the
recommendation and the whole run's answer (``RunAnalysis``), with what they are made of: the machines measured on
(``Machine``), a job's time per phase (``TimeBreakdown``) and every price used (``PriceSnapshot``). Plain pydantic
models, the schema of report.json and of the stored RESULT row; the analysis (gpuscout.analysis) computes them."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gpuscout.domain.prices import REFRESH_COMMAND, PriceKind, stale_days


class TimeBreakdown(BaseModel):
    """Seconds per phase of one job (per instance; multiply by instance count for instance-seconds)."""

    model_config = ConfigDict(extra="forbid")

    provisioning: float = 0.0
    image_pull: float = 0.0
    data_download: float = 0.0
    startup: float = 0.0  # model build, data load, compile before step 1 (inside SageMaker's "Training")
    training: float = 0.0
    upload: float = 0.0
    source: str

    @property
    def overhead_seconds(self) -> float:
        return self.provisioning + self.image_pull + self.data_download + self.startup + self.upload


class Machine(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    instance_type: str
    device: str  # cuda | cpu
    model: str | None  # the GPU's name as the driver reports it, or the CPU's model name
    gpus: int  # all instances together; 0 on CPU
    cpu_count: int | None
    python: str | None
    torch: str | None
    transformers: str | None
    deepspeed: str | None
    cuda: str | None  # the CUDA runtime torch was built with
    driver: str | None  # the NVIDIA driver

    @property
    def software(self) -> str:
        parts = [f"{name} {version}" for name, version in (("python", self.python), ("torch", self.torch),
                 ("transformers", self.transformers), ("deepspeed", self.deepspeed)) if version]  # fmt: skip
        return ", ".join(parts) or "-"


def kind_of(on_demand_source: str) -> PriceKind:
    """The kind a price's source implies (prices stored before kinds were recorded)."""
    if on_demand_source == "aws-price-list":
        return "live"
    if on_demand_source in ("manifest override", "job spec"):
        return "manifest"
    return "snapshot"


class InstancePrice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    instance_type: str
    on_demand_usd_per_hour: float = Field(ge=0)
    spot_usd_per_hour: float = Field(ge=0)
    on_demand_source: str  # "catalog: <source>", "aws-price-list", "manifest override", "job spec"
    spot_source: str  # "assumed 60 % discount (<source>)" or "manifest override"
    date: str  # the day the catalog's rate was read, the Price List's effectiveDate, or "" for an override
    region: str
    kind: PriceKind | None = None  # None in results stored before kinds: read from on_demand_source

    @property
    def price_kind(self) -> PriceKind:
        return self.kind or kind_of(self.on_demand_source)

    def kind_text(self, at: datetime) -> str:
        """The price's kind; a snapshot price read more than 90 days before ``at`` is marked STALE with the command
        that refreshes it."""
        kind = self.price_kind
        if (age := stale_days(kind, self.date, at.date())) is not None:
            return f"snapshot, STALE ({age} days; {REFRESH_COMMAND})"
        return kind


class PriceSnapshot(BaseModel):
    """Every price a result used, frozen: stored with the result so the run can be re-priced or audited."""

    model_config = ConfigDict(extra="forbid")

    prices: dict[str, InstancePrice]
    spot_assumption: str
    taken_at: datetime
    notes: list[str] = Field(default_factory=list)  # e.g. why the Price List refresh fell back to the table


Objective = Literal["cheapest_per_token", "fastest", "cheapest_within_deadline", "fastest_within_budget"]
OBJECTIVES: tuple[str, ...] = ("cheapest_per_token", "fastest", "cheapest_within_deadline", "fastest_within_budget")


def _count(n: int) -> str:
    """12,345 -> 12.3k; 1,234,567 -> 1.23M; 7,615,616,512 -> 7.62B."""
    for size, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= size:
            return f"{n / size:.3g}{suffix}"
    return str(n)


class JobAnalysis(BaseModel):
    """One target x variant: its repetitions aggregated. Dollar fields are None until priced."""

    model_config = ConfigDict(extra="forbid")

    job_name: str  # the first repetition's job name
    job_names: list[str]
    target_index: int | None = None
    instance_type: str
    instance_count: int = 1
    gpus: int = 0  # all instances together
    gpu_sku: str | None = None
    variant_name: str
    spot: bool = False
    repetitions: int  # completed repetitions behind the numbers
    repetitions_planned: int
    status: str  # "completed" or the status that stopped every repetition (FAILED, OOM, CAPACITY, ...)
    failure: str | None = None  # why no repetition completed
    unit: Literal["tokens", "samples"] = "tokens"  # what is ranked: tokens, or samples (a job section's unit)
    # throughput and efficiency
    samples_per_s: float | None = None  # samples jobs: the ranked rate
    samples_per_s_ci95: tuple[float, float] | None = None
    usd_per_million_samples: float | None = None
    usd_per_million_samples_ci95: tuple[float, float] | None = None
    usd_per_million_samples_spot: float | None = None
    usd_per_million_samples_spot_ci95: tuple[float, float] | None = None
    tokens_per_s: float | None = None
    tokens_per_s_ci95: tuple[float, float] | None = None
    ci_method: str | None = None
    # between_repetitions | within_run | unreliable (then tokens_per_s_ci95 is None; ci_method says why)
    ci_kind: str | None = None
    timed_steps: int | None = None  # the fewest timed steps of any repetition
    stop_rule: str | None = None  # fixed | steady_state
    stop_reason: str | None = None
    ci_tolerance: float | None = None  # steady_state: the requested half-width, a fraction of the mean
    ci_half_width_fraction: float | None = None  # steady_state: the widest half-width any repetition ended with
    tolerance_reached: bool | None = None  # steady_state only; None for the fixed rule
    settings_key: str | None = None  # equal keys = the same settings under different names
    contention_note: str | None = None  # local runs: measured while other processes competed (never a clear win)
    # the figures include a disturbed measurement (domain/disturbance.py): never a firm or provisional winner
    disturbed: bool = False
    disturbance_note: str | None = None  # what the detector found, also when a clean re-measurement replaced it
    # disturbed, and torch.compile's compiles in the slow steps explain it: the job's own cause, which a re-run repeats
    recompiled: bool = False
    # disturbed: how much faster it would have been with every timed step at its reference step's speed (an upper
    # bound the verdict uses to tell whether a disturbed job lower down could have led); None = cannot tell
    undisturbed_factor: float | None = None
    kernel_note: str | None = None  # the kernel took a large share of the step time (a steady cost, not a disturbance)
    host_allocator: str | None = None  # train.py's host memory allocator (benchmark.json software.host_allocator)
    # what trained (benchmark.json config): full, lora or qlora; the adapters ("LoRA r=16"); trainable and all
    # parameters (None for a job section's job, which reports no model)
    method: Literal["full", "lora", "qlora"] = "full"
    adapter: str | None = None
    params_trainable: int | None = None
    params_total: int | None = None
    tokens_per_s_per_gpu: float | None = None
    mfu: float | None = None
    hfu: float | None = None
    step_time_p50_s: float | None = None
    step_time_p90_s: float | None = None
    peak_memory_gb: float | None = None  # torch's peak allocated (the most of any repetition)
    peak_reserved_gb: float | None = None  # the caching allocator's peak reserved, beside it (CUDA only)
    host_rss_peak_gb: float | None = None  # the job process's peak resident memory (the most of any repetition)
    validation_note: str | None = None  # the final validation failed: no validation loss, the measurement stands
    final_train_loss: float | None = None
    # prices used
    usd_per_hour: float | None = None  # on-demand, per instance
    spot_usd_per_hour: float | None = None
    price_source: str | None = None
    # cost per token
    usd_per_million_tokens: float | None = None  # on-demand
    usd_per_million_tokens_ci95: tuple[float, float] | None = None
    usd_per_million_tokens_spot: float | None = None
    usd_per_million_tokens_spot_ci95: tuple[float, float] | None = None
    # the user's full dataset
    dataset_tokens: int | None = None
    epoch_seconds: float | None = None
    epoch_hours: float | None = None
    epoch_usd: float | None = None
    epoch_usd_spot: float | None = None
    # the target loss
    target_loss: float | None = None
    target_loss_method: str | None = None
    target_loss_detail: str | None = None
    target_loss_tokens: float | None = None
    target_loss_seconds: float | None = None
    target_loss_hours: float | None = None
    target_loss_usd: float | None = None
    # the full job the user would run: training (epoch or to the target loss) plus overheads
    workload_basis: str | None = None
    workload_hours: float | None = None
    workload_usd: float | None = None
    # what the planner predicted (its rate in ``unit``/s, and how: FLOPs model, the user's estimate, a calibration)
    predicted_rate: float | None = None
    prediction_method: str | None = None
    # what the benchmark itself cost
    billed_seconds: float | None = None  # per instance, all repetitions (failed ones included)
    billed_source: str | None = None
    billed_usd: float | None = None
    time_breakdown: TimeBreakdown | None = None  # mean over repetitions, per instance
    overhead_seconds: float | None = None
    overhead_usd: float | None = None
    loss_curve: list[tuple[float, float, float]] = Field(default_factory=list)  # (tokens, elapsed s, train loss)
    # (step, seconds) of the timed steps of the repetition the per-step chart shows (a disturbed one if any)
    step_times: list[tuple[int, float]] = Field(default_factory=list)
    # the same repetition's every step (warm-up included): (step, its own rate in ``unit``/s, timed), (step, loss)
    step_rates: list[tuple[int, float, bool]] = Field(default_factory=list)
    step_losses: list[tuple[int, float]] = Field(default_factory=list)
    # decision
    excluded_reason: str | None = None
    rank: int | None = None
    on_pareto_front: bool = False

    @property
    def stop_text(self) -> str:
        """The stop rule's outcome in a few words, e.g. "steady state not reached (±4.9 % > ±2.0 %), 16 timed"."""
        timed = f", {self.timed_steps} timed" if self.timed_steps is not None else ""
        if self.stop_rule != "steady_state":
            return f"fixed steps{timed}"
        if self.tolerance_reached:
            return f"steady state reached (±{100 * (self.ci_half_width_fraction or 0):.1f} %){timed}"
        achieved = (
            f"±{100 * self.ci_half_width_fraction:.1f} %" if self.ci_half_width_fraction is not None else "no interval"
        )
        return f"steady state not reached ({achieved} > ±{100 * (self.ci_tolerance or 0):.1f} %){timed}"

    @property
    def measurement_note(self) -> str:
        """What makes the row's number weaker than it looks: an unreliable interval, competition, disturbance."""
        flags = []
        if self.ci_kind == "unreliable":
            flags.append(self.ci_method or "unreliable interval")
        notes = (self.contention_note, self.disturbance_note, self.kernel_note, self.validation_note)
        flags += [note for note in notes if note]
        return "; ".join(flags)

    @property
    def trains_text(self) -> str:
        """``LoRA r=16: 37.4k of 1.2M parameters (3.1 %)``, ``full: 1.2M parameters``; empty without a count."""
        if not self.params_total:
            return ""
        total = _count(self.params_total)
        if self.method == "full" or not self.params_trainable:
            return f"full: {total} parameters"
        share = self.params_trainable / self.params_total
        return f"{self.adapter or self.method}: {_count(self.params_trainable)} of {total} parameters ({share:.1%})"

    @property
    def label(self) -> str:
        count = f" x{self.instance_count}" if self.instance_count > 1 else ""
        spot = " (spot)" if self.spot else ""
        return f"{self.instance_type}{count} / {self.variant_name}{spot}"

    @property
    def effective_usd_per_hour(self) -> float | None:
        return self.spot_usd_per_hour if self.spot else self.usd_per_hour

    @property
    def effective_usd_per_million_tokens(self) -> float | None:
        return self.usd_per_million_tokens_spot if self.spot else self.usd_per_million_tokens

    @property
    def effective_usd_per_million_tokens_ci95(self) -> tuple[float, float] | None:
        return self.usd_per_million_tokens_spot_ci95 if self.spot else self.usd_per_million_tokens_ci95

    # the ranked unit: tokens, or samples for a job section's samples job
    @property
    def rate(self) -> float | None:
        return self.samples_per_s if self.unit == "samples" else self.tokens_per_s

    @property
    def rate_ci95(self) -> tuple[float, float] | None:
        return self.samples_per_s_ci95 if self.unit == "samples" else self.tokens_per_s_ci95

    @property
    def effective_usd_per_million_units(self) -> float | None:
        if self.unit == "samples":
            return self.usd_per_million_samples_spot if self.spot else self.usd_per_million_samples
        return self.effective_usd_per_million_tokens

    @property
    def effective_usd_per_million_units_ci95(self) -> tuple[float, float] | None:
        if self.unit == "samples":
            return self.usd_per_million_samples_spot_ci95 if self.spot else self.usd_per_million_samples_ci95
        return self.effective_usd_per_million_tokens_ci95


class Recommendation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_name: str | None
    instance_type: str | None = None
    instance_count: int | None = None
    variant_name: str | None = None
    summary: str  # the answer first ("Pick ..." / "No pick (...)"), its figures, then "Next: ..."
    notes: list[str] = Field(default_factory=list)  # the diagnostics behind the verdict, shown after the summary
    margin_fraction: float | None = None  # how much better than the runner-up (only between trusted measurements)
    runner_up_job_name: str | None = None
    clear_winner: bool = False
    # clear | provisional | no_clear_winner | cannot_tell | same_settings | only_candidate | none
    verdict: str = "none"


class Exclusion(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_name: str
    instance_type: str
    variant_name: str
    reason: str


class Constraints(BaseModel):
    model_config = ConfigDict(extra="forbid")

    budget_usd: float | None = None
    deadline_hours: float | None = None
    target_loss: float | None = None


class SearchTrial(BaseModel):
    model_config = ConfigDict(extra="forbid")

    variant: str
    status: str  # a JobStatus value
    reason: str | None = None


class SearchTargetOutcome(BaseModel):
    """One target's settings search: what it could try, skipped before launch, launched, pruned (and why)."""

    model_config = ConfigDict(extra="forbid")

    instance_type: str
    dimensions: dict[str, list[Any]]
    candidates: int  # launchable (fit, and divide the sequences per step)
    skipped: list[SearchTrial]  # never launched: the memory model or the fixed sequences per step ruled them out
    trials: list[SearchTrial]  # launched, in the order they finished
    not_launched: list[str]  # launchable but not run (trial budget or spend cap)
    best: str | None  # the target's best completed trial by the analysis' ranking


class SearchOutcome(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pruning: bool
    min_timed_steps: int
    reduction_factor: int
    max_cost_usd: float
    targets: list[SearchTargetOutcome]


class RunAnalysis(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_id: str
    run_name: str | None = None
    description: str | None = None  # the manifest's: what the run compares, in the user's words
    objective: Objective
    constraints: Constraints
    dataset_tokens: int | None = None
    unit: Literal["tokens", "samples"] = "tokens"
    jobs: list[JobAnalysis]
    recommendation: Recommendation
    excluded: list[Exclusion]
    price_snapshot: PriceSnapshot
    total_billed_usd: float
    assumptions: list[str]
    search: SearchOutcome | None = None  # a settings search's candidates, trials and prunes (docs/search.md)
    # the run stopped, or jobs it planned did not finish: what did not run (never a firm winner then)
    incomplete: str | None = None
    machines: list[Machine] = Field(default_factory=list)  # what the numbers were measured on (analysis/machines.py)
    generated_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
