"""Exclusions, ranking by the manifest's objective, the Pareto front and the recommendation.

Objectives and their metric:

- ``cheapest_per_token`` / ``cheapest_within_deadline``: lowest $ per 1M tokens at the price the target pays
  (spot targets at the spot price);
- ``fastest`` / ``fastest_within_budget``: highest tokens/s (all GPUs together).

Constraints: ``deadline_hours`` excludes, under every objective, a target whose full workload (one epoch of the
dataset, or training to ``target_loss`` when set, plus overheads) takes longer. ``budget_usd`` caps the benchmark
spend at planning time; here it excludes a target whose workload costs more only under ``fastest_within_budget``.

Ties are broken deterministically: by the other metric (cheaper first for speed objectives, faster first for cost
objectives), then instance type, instance count, variant name, spot last, and job name, all ascending.

Jobs that train by different methods (full, LoRA, QLoRA) do different work per token: such a run is ranked by the
cost (cost objectives) or time (speed objectives) to ``constraints.target_loss``, its pick is provisional at best
(that comparison has no interval), and without a target loss there is no pick.

The winner is "clear" only when its 95 % confidence interval on the objective's metric does not overlap the
runner-up's; otherwise the summary says "No pick (no clear winner)" and names both. Every summary answers first
("Pick ..." or "No pick (...)"), then says what to do next; the diagnostics are the recommendation's notes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from gpuscout.domain.run_analysis import Constraints, Exclusion, JobAnalysis, Recommendation

COST_OBJECTIVES = frozenset({"cheapest_per_token", "cheapest_within_deadline"})


def _cost(job: JobAnalysis) -> float:
    value = job.effective_usd_per_million_units
    return value if value is not None else float("inf")


def _speed(job: JobAnalysis) -> float:
    return job.rate or 0.0


def sort_key(job: JobAnalysis, objective: str) -> tuple[Any, ...]:
    """Deterministic order for ``objective``: best first (see module docstring for the tie-breakers)."""
    names = (job.instance_type, job.instance_count, job.variant_name, job.spot, job.job_name)
    if objective in COST_OBJECTIVES:
        return (_cost(job), -_speed(job), *names)
    return (-_speed(job), _cost(job), *names)


def exclusion_reason(job: JobAnalysis, objective: str, constraints: Constraints) -> str | None:
    if job.status != "completed" or job.rate is None:
        return job.failure or f"no result (status {job.status})"
    if job.effective_usd_per_million_units is None:
        return "no price for the instance type"
    needs_workload = constraints.deadline_hours is not None or (
        objective == "fastest_within_budget" and constraints.budget_usd is not None
    )
    if needs_workload and job.workload_hours is None:
        detail = job.target_loss_detail or "no dataset size"
        return f"cannot check the constraints: time to loss {constraints.target_loss} unknown ({detail})"
    if (
        constraints.deadline_hours is not None
        and job.workload_hours is not None
        and job.workload_hours > constraints.deadline_hours
    ):
        hours = f"{job.workload_hours:,.1f} h > {constraints.deadline_hours:g} h"
        return f"misses the deadline: {hours} ({job.workload_basis})"
    if (
        objective == "fastest_within_budget"
        and constraints.budget_usd is not None
        and job.workload_usd is not None
        and job.workload_usd > constraints.budget_usd
    ):
        return f"over budget: ${job.workload_usd:,.2f} > ${constraints.budget_usd:,.2f} ({job.workload_basis})"
    return None


def pareto_front(jobs: Sequence[JobAnalysis]) -> set[str]:
    """Job names not dominated on (higher tokens/s, lower $ per 1M tokens). O(n log n): sort, then one sweep."""
    points = [j for j in jobs if j.rate is not None and j.effective_usd_per_million_units is not None]
    points.sort(key=lambda j: (-_speed(j), _cost(j)))
    front: set[str] = set()
    best_cost = float("inf")
    last_on_front: tuple[float, float] | None = None
    for job in points:
        point = (_speed(job), _cost(job))
        if point[1] < best_cost:  # faster-or-equal points came first, so only a lower cost survives
            front.add(job.job_name)
            best_cost, last_on_front = point[1], point
        elif point == last_on_front:  # an exact duplicate of a front point is not dominated either
            front.add(job.job_name)
    return front


def _interval(job: JobAnalysis, objective: str) -> tuple[float, float] | None:
    return job.effective_usd_per_million_units_ci95 if objective in COST_OBJECTIVES else job.rate_ci95


def _metric_text(job: JobAnalysis, objective: str) -> str:
    interval = _interval(job, objective)
    if objective in COST_OBJECTIVES:
        text = f"${_cost(job):,.4g} per 1M {job.unit}{' (spot)' if job.spot else ''}"
        if interval:
            text += f" (95 % CI ${interval[0]:,.4g}-{interval[1]:,.4g})"
        return text
    text = f"{_speed(job):,.0f} {job.unit}/s"
    if interval:
        text += f" (95 % CI {interval[0]:,.0f}-{interval[1]:,.0f})"
    return text


def _margin(best: JobAnalysis, runner_up: JobAnalysis, objective: str) -> float:
    if objective in COST_OBJECTIVES:
        return _cost(runner_up) / _cost(best) - 1.0  # the runner-up costs this much more per token
    return _speed(best) / _speed(runner_up) - 1.0  # the winner is this much faster


def seconds_text(seconds: float) -> str:
    """A duration in the unit that shows it (s, min or h): "0.0 h" for a 40-second job said nothing."""
    if seconds < 90:
        return f"{seconds:,.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:,.1f} min"
    return f"{seconds / 3600:,.1f} h"


def duration_text(hours: float) -> str:
    return seconds_text(hours * 3600.0)


def usd_text(value: float) -> str:
    """Dollars with the digits that matter: cents from $1, four significant digits below ("$0.00" said nothing),
    never in scientific notation ("$2.171e-05" is not how anyone writes money)."""
    if abs(value) >= 1 or value == 0:
        return f"${value:,.2f}"
    text = f"{value:.4g}"
    if "e" in text:
        digits = 3 - math.floor(math.log10(abs(value)))
        text = f"{value:.{digits}f}"
    return f"${text}"


class Judgement(NamedTuple):
    """The verdict between the leader and the runner-up: why, in one clause, what to do next (None when nothing
    would change it), and the diagnostics behind it (the recommendation's notes)."""

    verdict: str
    reason: str
    next_step: str | None = None
    notes: tuple[str, ...] = ()


def recommend(ranked: Sequence[JobAnalysis], objective: str, *, search: bool = False) -> Recommendation:
    """Recommendation from eligible jobs in rank order; ``search``: a settings search's (its advice differs).

    The summary answers first: "Pick <job> (<confidence>)" or "No pick (<why>)", the figures, then "Next:" the one
    thing that would firm it up; the diagnostics behind the verdict are its ``notes``. A margin over the runner-up is
    quoted only when both measurements are trusted (neither disturbed nor contended) and their intervals separate."""
    if not ranked:
        return Recommendation(
            job_name=None, summary="No pick: every target x variant was excluded (see the exclusions)."
        )
    best = ranked[0]
    facts = _metric_text(best, objective)
    other = (
        f"{_speed(best):,.0f} {best.unit}/s"
        if objective in COST_OBJECTIVES
        else f"${_cost(best):,.4g} per 1M {best.unit}"
    )
    if best.workload_hours is not None and best.workload_usd is not None:
        other += f"; {best.workload_basis}: {duration_text(best.workload_hours)}, {usd_text(best.workload_usd)}"
    base = dict(
        job_name=best.job_name,
        instance_type=best.instance_type,
        instance_count=best.instance_count,
        variant_name=best.variant_name,
    )
    lead = "lowest" if objective in COST_OBJECTIVES else "fastest"
    measured = f"measured {lead} on the mean: {best.label}: {facts}, {other}"
    if len(ranked) == 1 and best.disturbed:
        return Recommendation(
            **base,
            summary=f"No pick (cannot tell): {best.label}, the only target x variant left, was disturbed. "
            f"Next: {_disturbed_advice([best])}.",
            notes=[_disturbed_text([best]), _capitalized(measured)],
            clear_winner=False,
            verdict="cannot_tell",
        )
    if len(ranked) == 1:  # measured, but compared with nothing: never a firm (green) winner
        return Recommendation(
            **base,
            summary=f"Pick {best.label} (only candidate): {facts}, {other}. Nothing was compared with it: this "
            "says what it does, not that it is the best choice.",
            clear_winner=False,
            verdict="only_candidate",
        )
    runner = ranked[1]
    margin = _margin(best, runner, objective)
    comparison = (
        f"the runner-up {runner.label} costs {margin:.1%} more ({_metric_text(runner, objective)})"
        if objective in COST_OBJECTIVES
        else f"{margin:.1%} faster than the runner-up {runner.label} ({_metric_text(runner, objective)})"
    )
    judged = judge(best, runner, objective, search=search)
    below = [j for j in ranked[2:] if j.disturbed and _could_lead(j, best, objective)]
    if below and judged.verdict in ("clear", "provisional"):  # a disturbed measurement may hide a faster setting
        hidden = f"a disturbed measurement ranks lower and may be faster than measured ({_disturbed_text(below)})"
        rerun = f"{_disturbed_advice(below)} and compare"
        judged = Judgement(
            "provisional",
            "; ".join(filter(None, [judged.reason if judged.verdict == "provisional" else "", hidden])),
            f"{judged.next_step}; also {rerun}" if judged.next_step else f"to make it firm, {rerun}",
            (*judged.notes, hidden),
        )
    trusted = not any(j.disturbed or j.contention_note for j in (best, runner))
    next_step = f" Next: {judged.next_step}." if judged.next_step else ""
    summary = {
        "clear": f"Pick {best.label} (clear winner): {facts}, {other}; {comparison}.",
        "provisional": f"Pick {best.label} (provisional): {facts}, {other}"
        + (f"; {comparison}" if trusted else "")
        + f".{next_step}",
        "no_clear_winner": f"No pick (no clear winner): {best.label} and {runner.label} are within noise of each "
        f"other; {measured}.{next_step}",
        "cannot_tell": f"No pick (cannot tell): {judged.reason}.{next_step}",
        "same_settings": f"No pick (same settings): {judged.reason}.{next_step}",
    }[judged.verdict]
    notes = list(judged.notes)
    if judged.verdict == "cannot_tell":
        notes.append(_capitalized(measured))
    return Recommendation(
        **base,
        summary=summary,
        notes=notes,
        margin_fraction=margin if judged.verdict in ("clear", "provisional") and trusted else None,
        runner_up_job_name=runner.job_name,
        clear_winner=judged.verdict == "clear",
        verdict=judged.verdict,
    )


METHOD_ORDER = ("full", "lora", "qlora")


def method_comparison(ranked: Sequence[JobAnalysis]) -> str | None:
    """With more than one training method among the ranked jobs, each method's cheapest way to the target loss:
    tokens/s and $/1M tokens do not compare a LoRA run with a full fine-tune (a token of adapter training does less
    to the loss), the time and cost to the same loss do. None with one method."""
    methods = sorted({j.method for j in ranked}, key=METHOD_ORDER.index)
    if len(methods) < 2:
        return None
    target = next((j.target_loss for j in ranked if j.target_loss is not None), None)
    if target is None:
        return (
            f"Methods differ ({', '.join(methods)}): tokens/s and $/1M tokens do not compare them at equal quality; "
            "set constraints.target_loss to compare the time and cost each takes to the same loss."
        )
    parts = []
    for method in methods:
        reached = [j for j in ranked if j.method == method and j.target_loss_usd is not None]
        if not reached:
            parts.append(f"{method}: no run projects the loss ({next(j.label for j in ranked if j.method == method)})")
            continue
        best = min(reached, key=lambda j: (j.target_loss_usd or 0.0, j.job_name))
        hours = best.target_loss_hours
        when = f" in {duration_text(hours)}" if hours is not None else ""
        how = "" if best.target_loss_method == "measured" else f" ({best.target_loss_method or 'projected'})"
        parts.append(f"{best.adapter or method} on {best.label} reaches it for {usd_text(best.target_loss_usd or 0.0)}"
                     f"{when}{how}")  # fmt: skip
    return f"At equal quality (loss {target:g}, training only): " + "; ".join(parts) + "."


def _to_target(job: JobAnalysis, objective: str) -> float:
    """What reaching the target loss takes: dollars under a cost objective, hours under a speed one (inf: unknown)."""
    value = job.target_loss_usd if objective in COST_OBJECTIVES else job.target_loss_hours
    return value if value is not None else float("inf")


def across_methods(ranked: Sequence[JobAnalysis], objective: str, comparison: str) -> Recommendation:
    """The recommendation of a run whose jobs train by different methods, ranked (``decide``) by the time or cost to
    the target loss: never a clear winner (that comparison has no interval), and no pick without a target loss."""
    best = ranked[0]
    base = dict(job_name=best.job_name, instance_type=best.instance_type, instance_count=best.instance_count,
                variant_name=best.variant_name)  # fmt: skip
    if best.target_loss is None or math.isinf(_to_target(best, objective)):
        return Recommendation(
            **base, summary=f"No pick (methods differ): {comparison}", notes=[comparison], verdict="cannot_tell"
        )
    reach = "cheapest" if objective in COST_OBJECTIVES else "fastest"
    return Recommendation(
        **base,
        summary=f"Pick {best.label} (provisional: the {reach} to the target loss; methods compare there, with no "
        f"confidence interval): {comparison} Next: repeat the run to see the spread, and compare the validation "
        "losses (training.eval_interval).",
        notes=[comparison],
        runner_up_job_name=ranked[1].job_name if len(ranked) > 1 else None,
        verdict="provisional",
    )


def _could_lead(job: JobAnalysis, best: JobAnalysis, objective: str) -> bool:
    """A disturbed job lower down could have led had all its steps run at its own reference speed."""
    factor = job.undisturbed_factor
    if factor is None:
        return True  # nothing to bound it with
    if objective in COST_OBJECTIVES:
        return _cost(job) / factor <= _cost(best)
    return _speed(job) * factor >= _speed(best)


def _disturbed_text(jobs: Sequence[JobAnalysis]) -> str:
    return "; ".join(f"{j.label}: {j.disturbance_note}" for j in jobs)


def _capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]


def _disturbed_advice(jobs: Sequence[JobAnalysis]) -> str:
    """What would give the disturbed jobs a measurement to compare, as an instruction: run it again on a quiet
    machine, unless torch.compile's compiles explain the flag. That cause is in the job (a shape or a guard that
    changes between steps), so the same settings run again repeat it on any machine."""
    recompiled = [j for j in jobs if j.recompiled]
    others = [j for j in jobs if not j.recompiled]
    parts = []
    if recompiled:
        names = " and ".join(j.label for j in recompiled)
        its, it = ("its", "it") if len(recompiled) == 1 else ("their", "them")
        parts.append(
            f"for {names} (torch.compile compiled graphs in {its} slow steps, which the same settings do again on "
            "any machine), keep the input shapes fixed from step to step (every batch padded or packed to one "
            "length) or raise training.warmup_steps past the last compile (and max_steps with it), then run "
            f"{it} again"
        )
    if others:
        it = "it" if len(others) == 1 else "them"
        parts.append(f"run {' and '.join(j.label for j in others) if recompiled else it} again on a quiet machine")
    return "; ".join(parts)


def _separate_advice(best: JobAnalysis, runner: JobAnalysis, *, search: bool) -> str:
    """What would separate two overlapping measurements, as the summary's "Next:" clause: a quiet machine when either
    was contended (repetitions on a busy machine only widen the intervals), else more repetitions, which a search's
    candidates get as plain variants."""
    if best.contention_note or runner.contention_note:
        return (
            "they were measured while other processes competed for the machine: a quiet machine, not more "
            "repetitions, would separate them"
        )
    if search:
        return (
            f"re-running {best.variant_name} and {runner.variant_name} as plain variants with repetitions: 2 would "
            "separate them (a search runs each candidate once)"
        )
    return "more repetitions would separate them"


def judge(best: JobAnalysis, runner: JobAnalysis, objective: str, *, search: bool = False) -> Judgement:
    """The verdict between the leader and the runner-up, why, and what to do next (docs/costs.md, "The verdict").

    - same_settings: the two run the same settings under different names, so any difference is noise;
    - cannot_tell: either was disturbed (domain/disturbance.py: its steps did not run at one speed), or has no
      usable interval (missing, zero-width, reaching zero, fewer than 2 timed steps);
    - no_clear_winner: the 95 % intervals overlap;
    - provisional: they do not overlap, but an interval is within-run only (one repetition: step-to-step noise, not
      run-to-run noise), a steady-state stop never reached its tolerance, or a measurement was taken while other
      processes competed for the machine;
    - clear: between-repetition intervals (>= 2 repetitions each) that do not overlap, measured as asked.
    """
    if best.settings_key is not None and best.settings_key == runner.settings_key:
        return Judgement(
            "same_settings",
            f"{best.label} and {runner.label} run the same settings under different names, so the difference "
            "between them is measurement noise",
            "keep one of them (repetitions repeat a measurement)",
        )
    disturbed = [j for j in (best, runner) if j.disturbed]
    if disturbed:
        names = " and ".join(j.label for j in disturbed)
        return Judgement(
            "cannot_tell",
            f"{names} {'was' if len(disturbed) == 1 else 'were'} disturbed (the steps did not run at one speed)",
            _disturbed_advice(disturbed),
            (_disturbed_text(disturbed),),
        )
    mine, theirs = _interval(best, objective), _interval(runner, objective)
    unusable = [j for j, ci in ((best, mine), (runner, theirs)) if ci is None or ci[1] - ci[0] <= 0 or ci[0] <= 0]
    if unusable:
        return Judgement(
            "cannot_tell",
            "no usable 95 % interval for "
            + " and ".join(f"{j.label} ({j.ci_method or 'no interval'})" for j in unusable),
            "raise training.max_steps (more timed steps), or set repetitions: 2 or more",
        )
    assert mine is not None and theirs is not None
    if mine[0] <= theirs[1] and theirs[0] <= mine[1]:
        return Judgement(
            "no_clear_winner",
            f"the 95 % confidence intervals of {best.label} and {runner.label} overlap",
            _separate_advice(best, runner, search=search),
        )
    within = [j for j in (best, runner) if j.ci_kind != "between_repetitions"]
    unsettled = [j for j in (best, runner) if j.tolerance_reached is False]
    crowded = [j for j in (best, runner) if j.contention_note]
    if within or unsettled or crowded:
        reasons = []
        if crowded:
            reasons.append("; ".join(f"{j.label}: {j.contention_note}" for j in crowded))
        if within:
            reasons.append(
                "the intervals of " + " and ".join(j.label for j in within) + " come from the steps of a single "
                "run, which miss run-to-run noise (on a shared machine the same settings vary by far more between "
                "runs than within one)"
            )
        if unsettled:
            reasons.append(" and ".join(f"{j.label}: {j.stop_text}" for j in unsettled))
        if crowded:
            firm = "run it again on a quiet machine (more repetitions on a busy one only widen the intervals)"
        elif within and search:
            firm = (
                f"re-run {best.variant_name} and {runner.variant_name} as plain variants with repetitions: 2 (a "
                "search runs each candidate once)"
            )
        elif within:
            firm = "set repetitions: 2 or more (they run interleaved)"
        else:
            firm = "let the steady-state rule settle"
        notes = tuple(_capitalized(r) for r in reasons)
        return Judgement("provisional", "; ".join(reasons), f"to make it firm, {firm} and compare again", notes)
    return Judgement("clear", "between-repetition intervals do not overlap")


def decide(
    jobs: Sequence[JobAnalysis], objective: str, constraints: Constraints, *, search: bool = False
) -> tuple[list[JobAnalysis], Recommendation, list[Exclusion]]:
    """Exclude, rank, mark the Pareto front and recommend. Returns ranked jobs first, then excluded ones."""
    eligible: list[JobAnalysis] = []
    excluded: list[JobAnalysis] = []
    for job in jobs:
        reason = exclusion_reason(job, objective, constraints)
        if reason is None:
            eligible.append(job)
        else:
            excluded.append(job.model_copy(update={"excluded_reason": reason, "rank": None}))
    mixed = len({j.method for j in eligible}) > 1  # methods compare at the target loss, not per token
    eligible.sort(key=lambda j: ((_to_target(j, objective),) if mixed else ()) + sort_key(j, objective))
    excluded.sort(key=lambda j: (j.instance_type, j.instance_count, j.variant_name, j.spot, j.job_name))
    front = pareto_front(eligible + excluded)
    ranked = [
        job.model_copy(update={"rank": i, "excluded_reason": None, "on_pareto_front": job.job_name in front})
        for i, job in enumerate(eligible, start=1)
    ]
    excluded = [job.model_copy(update={"on_pareto_front": job.job_name in front}) for job in excluded]
    exclusions = [
        Exclusion(
            job_name=j.job_name,
            instance_type=j.instance_type,
            variant_name=j.variant_name,
            reason=j.excluded_reason or "",
        )
        for j in excluded
    ]
    comparison = method_comparison(ranked)
    if comparison is not None:
        return ranked + excluded, across_methods(ranked, objective, comparison), exclusions
    return ranked + excluded, recommend(ranked, objective, search=search), exclusions


def with_incomplete(recommendation: Recommendation, incomplete: str | None) -> Recommendation:
    """The recommendation of a run that did not finish everything it planned: never a firm winner, and it says first
    what did not run (``incomplete``, analyze.incomplete_note)."""
    if incomplete is None:
        return recommendation
    summary = recommendation.summary.replace("(clear winner)", "(provisional: the run is incomplete)", 1)
    return recommendation.model_copy(
        update={"clear_winner": False, "summary": summary, "notes": [incomplete, *recommendation.notes]}
    )
