"""The local settings search (docs/search.md): Optuna proposes a target's candidates (the planner's, which already
leave out what the memory model says will not fit), each trial is an ordinary job run by ``gpuscout local``, and a
trial is stopped early (PRUNED) once it is clearly worse than the best so far.

Pruning is successive halving on the steady-state statistics: at rung k (``min_timed_steps`` x
``reduction_factor``^k timed steps, warm-up excluded) Optuna's SuccessiveHalvingPruner keeps the best
1/``reduction_factor`` of the trials that reached the rung; a trial it would stop is stopped only when its 95 %
interval is also clearly worse than the best finished trial's (the trial's most favourable value is worse than the
best's least favourable), so a noisy start never loses the winner. Every trial is a row in the store: the search
resumes from the store (``run_search(done=...)``) and its trials are ranked by the ordinary analysis.

Imported only for a manifest with a search section (Optuna is not imported otherwise)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import optuna

from gpuscout.domain.intervals import ratio_ci95
from gpuscout.domain.jobspec import JobSpec
from gpuscout.domain.manifest_training import default_warmup_steps
from gpuscout.domain.search_plan import SearchPlan, TargetSearch
from gpuscout.store.base import JobRecord, JobStatus

CANDIDATE_PARAM = "candidate"
# Proposals per launched trial before a sampler that keeps proposing tried or skipped settings is given up on.
MAX_PROPOSALS_PER_TRIAL = 20


def warmup_steps(spec: JobSpec) -> int:
    hp = spec.hyperparameters
    if hp.get("warmup_steps"):
        return int(hp["warmup_steps"])
    return default_warmup_steps(int(hp.get("max_steps", "0") or 0))


def objective_value(tokens_per_s: float, *, price_per_hour_usd: float, objective: str) -> float:
    """The value a trial minimises: USD per 1M tokens for the cost objectives, seconds per 1M tokens for the
    fastest ones (one target's trials share its price, so both rank its candidates alike)."""
    if tokens_per_s <= 0:
        return math.inf
    if objective.startswith("cheapest"):
        return price_per_hour_usd / 3600.0 / tokens_per_s * 1e6
    return 1e6 / tokens_per_s


def objective_unit(objective: str) -> str:
    return "$/1M tokens" if objective.startswith("cheapest") else "s/1M tokens"


@dataclass
class TrialStats:
    """A running trial's timed (post-warm-up) steps, from its metric lines."""

    warmup: int
    tokens: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    seen_step: int = 0

    def add(self, step: int, tokens: float, seconds: float) -> bool:
        """Record a step once; True when it is a new timed step."""
        if step <= self.seen_step:
            return False
        self.seen_step = step
        if step <= self.warmup or seconds <= 0:
            return False
        self.tokens.append(tokens)
        self.seconds.append(seconds)
        return True

    @property
    def timed_steps(self) -> int:
        return len(self.tokens)

    def throughput(self) -> tuple[float, float, float]:
        """tokens/s over the timed steps and its 95 % interval (low, high)."""
        mean, low, high = ratio_ci95(self.tokens, self.seconds)
        return mean, low, high


class IntervalHalvingPruner(optuna.pruners.BasePruner):
    """Successive halving whose verdict must also be clear: see the module docstring."""

    def __init__(self, *, min_timed_steps: int, reduction_factor: int) -> None:
        self._halving = optuna.pruners.SuccessiveHalvingPruner(
            min_resource=min_timed_steps, reduction_factor=reduction_factor, min_early_stopping_rate=0
        )

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        if not self._halving.prune(study, trial):
            return False
        finished = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))]
        if not finished:
            return False
        best = min(finished, key=lambda t: float(t.value if t.value is not None else math.inf))
        best_worst_case = float(best.user_attrs.get("value_high", best.value or math.inf))
        return float(trial.user_attrs.get("value_low", math.inf)) > best_worst_case


# run_trial(spec, should_stop) runs one job and returns its final row (status PRUNED, with the reason, when
# should_stop(step, tokens, seconds) returned one); should_stop gets every metric line's step.
StopCheck = Callable[[int, float, float], str | None]
RunTrial = Callable[[JobSpec, StopCheck], JobRecord]


@dataclass
class SearchSummary:
    launched: int = 0
    spent_usd: float = 0.0
    stopped_because: str | None = None
    pruned: list[str] = field(default_factory=list)
    best: dict[int, str] = field(default_factory=dict)  # target index -> the best finished candidate by the search


def _value_from_record(
    record: JobRecord, spec: JobSpec, objective: str, stats: TrialStats | None
) -> tuple[float, float, float] | None:
    """(value, low, high) of a finished trial: its timed steps when seen, else its benchmark's throughput."""
    price = spec.price_per_hour_usd * spec.instance_count
    if stats is not None and stats.timed_steps >= 2:
        mean, low, high = stats.throughput()
    else:
        throughput = record.benchmark.throughput if record.benchmark else None
        mean = (throughput.tokens_per_s if throughput else None) or 0.0
        ci = (throughput.tokens_per_s_ci95 if throughput else None) or (mean, mean)
        low, high = ci[0] or mean, ci[1] or mean
    if mean <= 0:
        return None
    value = objective_value(mean, price_per_hour_usd=price, objective=objective)
    worst = objective_value(max(low, 1e-9), price_per_hour_usd=price, objective=objective)
    best_case = objective_value(max(high, 1e-9), price_per_hour_usd=price, objective=objective)
    return value, best_case, worst


def launch_order(target: TargetSearch, specs: Mapping[str, JobSpec], *, seed: int) -> list[str]:
    """The candidates, the planner's cheapest prediction first (a likely winner finishes early, so pruning has a
    yardstick soon), ties in a seeded random order."""
    rng = random.Random(seed)
    shuffled = list(target.candidates)
    rng.shuffle(shuffled)
    return sorted(shuffled, key=lambda name: specs[name].prediction.cost_usd)


def _study(target: TargetSearch, plan: SearchPlan, specs: Mapping[str, JobSpec]) -> optuna.Study:
    """Every candidate once, in :func:`launch_order`, when the trial budget covers them all; otherwise TPE
    proposes after the predicted best."""
    pruner: optuna.pruners.BasePruner = (
        IntervalHalvingPruner(min_timed_steps=plan.min_timed_steps, reduction_factor=plan.reduction_factor)
        if plan.pruning
        else optuna.pruners.NopPruner()
    )
    order = launch_order(target, specs, seed=plan.seed)
    every = target.max_trials >= len(target.candidates)
    sampler = optuna.samplers.RandomSampler(seed=plan.seed) if every else optuna.samplers.TPESampler(seed=plan.seed)
    study = optuna.create_study(direction="minimize", sampler=sampler, pruner=pruner)
    for name in order if every else order[:1]:
        study.enqueue_trial({CANDIDATE_PARAM: name})
    return study


def _trial_cost(seconds: float, spec: JobSpec) -> float:
    return seconds / 3600.0 * spec.price_per_hour_usd * spec.instance_count


def run_search(
    plan: SearchPlan,
    jobs: Sequence[JobSpec],
    *,
    run_trial: RunTrial,
    done: Mapping[str, JobRecord] | None = None,
    on_message: Callable[[str], None] = lambda _text: None,
) -> SearchSummary:
    """Run each target's study; ``done``: rows of trials already finished (a resumed search re-uses them and
    launches only the rest). Returns what was launched and spent."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    summary = SearchSummary()
    done = dict(done or {})
    for prior in done.values():
        summary.spent_usd += _prior_cost(prior)
    for target in plan.targets:
        specs = {j.variant_name: j for j in jobs if j.target_index == target.target_index}
        _search_target(target, plan, specs, run_trial=run_trial, done=done, summary=summary, on_message=on_message)
        if summary.stopped_because:
            break
    return summary


def _prior_cost(record: JobRecord) -> float:
    """A finished trial's spend, as :func:`_trial_cost` counted it: its wall time x price x instances."""
    price = record.spec.price_per_hour_usd * record.spec.instance_count
    return float(record.training_seconds or 0) / 3600.0 * price


def _search_target(
    target: TargetSearch,
    plan: SearchPlan,
    specs: Mapping[str, JobSpec],
    *,
    run_trial: RunTrial,
    done: dict[str, JobRecord],
    summary: SearchSummary,
    on_message: Callable[[str], None],
) -> None:
    study = _study(target, plan, specs)
    distribution = optuna.distributions.CategoricalDistribution(list(target.candidates))
    # trials finished before (a resumed search) are asked first and count against max_trials like any launched one
    for name in target.candidates:
        if name in specs and specs[name].job_name in done:
            study.enqueue_trial({CANDIDATE_PARAM: name})
    launched = 0
    proposals = 0
    unit = objective_unit(plan.objective)
    tried: set[str] = set()
    counted: set[str] = set()
    while (
        launched < target.max_trials
        and len(tried) < len(target.candidates)
        and proposals < MAX_PROPOSALS_PER_TRIAL * target.max_trials
    ):
        proposals += 1
        trial = study.ask({CANDIDATE_PARAM: distribution})
        name = str(trial.params[CANDIDATE_PARAM])
        spec = specs[name]
        tried.add(name)
        if spec.job_name in done:  # tried before (a resumed search, or the sampler proposing it again)
            _tell_prior(study, trial, done[spec.job_name], spec, plan.objective)
            launched += name not in counted  # a trial of the earlier process, once
            counted.add(name)
            continue
        predicted = spec.prediction.cost_usd
        if summary.spent_usd + predicted > plan.max_cost_usd:
            summary.stopped_because = (
                f"search.max_cost_usd: ${summary.spent_usd:.4f} spent, the next trial ({name}) is predicted to cost "
                f"${predicted:.4f}, over the ${plan.max_cost_usd:g} cap"
            )
            on_message(f"search: {summary.stopped_because}")
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            return
        launched += 1
        summary.launched += 1
        stats = TrialStats(warmup=warmup_steps(spec))
        record = run_trial(spec, _stop_check(study, trial, spec, plan, stats))
        done[spec.job_name] = record
        summary.spent_usd += _trial_cost(record.training_seconds or 0, spec)
        _tell_outcome(study, trial, record, spec, objective=plan.objective, stats=stats)
        if record.status is JobStatus.PRUNED:
            summary.pruned.append(spec.job_name)
    complete = [t for t in study.trials if t.state is optuna.trial.TrialState.COMPLETE]
    if complete:
        best = study.best_trial
        summary.best[target.target_index] = str(best.params[CANDIDATE_PARAM])
        on_message(
            f"search on {target.instance_type}: {launched} trial(s) launched, best so far "
            f"{best.params[CANDIDATE_PARAM]} ({best.value:.4g} {unit})"
        )


def _stop_check(
    study: optuna.Study, trial: optuna.Trial, spec: JobSpec, plan: SearchPlan, stats: TrialStats
) -> StopCheck:
    """A running trial's timed steps go to Optuna as rung values; the reason to stop it when the pruner says so."""
    price = spec.price_per_hour_usd * spec.instance_count
    unit = objective_unit(plan.objective)

    def value(tokens_per_s: float) -> float:
        return objective_value(max(tokens_per_s, 1e-9), price_per_hour_usd=price, objective=plan.objective)

    def check(step: int, tokens: float, seconds: float) -> str | None:
        if not stats.add(step, tokens, seconds) or stats.timed_steps < 2:
            return None
        mean, low, high = stats.throughput()
        at_best = value(high)  # the most favourable value the interval allows
        trial.set_user_attr("value_low", at_best)
        trial.set_user_attr("value_high", value(low))
        trial.report(value(mean), stats.timed_steps)
        if not trial.should_prune():
            return None
        best = study.best_trial
        best_high = float(best.user_attrs.get("value_high", best.value or math.inf))
        return (
            f"pruned after {stats.timed_steps} timed steps: {mean:,.0f} tokens/s (95 % interval {low:,.0f}-"
            f"{high:,.0f}), at best {at_best:.4g} {unit}, is clearly worse than {best.params[CANDIDATE_PARAM]} "
            f"({best.value:.4g} {unit}, at worst {best_high:.4g})"
        )

    return check


def _tell_outcome(
    study: optuna.Study, trial: optuna.Trial, record: JobRecord, spec: JobSpec, *, objective: str, stats: TrialStats
) -> None:
    if record.status is JobStatus.PRUNED:
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        return
    values = _value_from_record(record, spec, objective, stats) if record.status is JobStatus.COMPLETED else None
    if values is None:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        return
    value, low, high = values
    trial.set_user_attr("value_low", low)
    trial.set_user_attr("value_high", high)
    study.tell(trial, value)


def _tell_prior(study: optuna.Study, trial: optuna.Trial, record: JobRecord, spec: JobSpec, objective: str) -> None:
    """A trial finished before (its row in the store): its result, without running it again."""
    _tell_outcome(study, trial, record, spec, objective=objective, stats=TrialStats(warmup=0))
