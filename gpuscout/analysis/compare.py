"""``gpuscout compare``: the analysed jobs of several runs in one ranking, by dollars per million work units.

Runs answer questions one run cannot: a sequence length against another (manifest-wide, so one run each), today's
settings against last week's. The comparison is only as fair as its inputs, so it says where it is not:

- A job whose measurement the analysis did not trust (not completed, disturbed, measured under contention, or with
  no usable interval) is listed with the reason and never ranked: no margin is quoted against it.
- Between ranked jobs a difference is quoted only where their 95 % intervals of $ per 1M units do not overlap;
  otherwise the row says the intervals overlap (within noise), as the single-run verdict does.
- Runs measured on different machines (another GPU or CPU model, core count or torch) or priced at different rates
  for one instance type are named above the table: a difference may be the machine's or the price's, not the
  settings'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuscout.domain.run_analysis import JobAnalysis, Machine
from gpuscout.errors import GpuscoutError
from gpuscout.store.base import ResultRecord, RunRecord


class CompareError(GpuscoutError):
    """The runs cannot be compared (not analysed, nothing measured, different units)."""


@dataclass(frozen=True)
class ComparedJob:
    run_id: str
    run_name: str
    sequence_length: int | None
    job: JobAnalysis
    rank: int | None  # None: not ranked (untrusted, see ``why_not_ranked``)
    why_not_ranked: str | None
    versus_best: str | None  # "+12.3 %", "within noise (95 % intervals overlap)", None for the best

    @property
    def usd_per_million(self) -> float | None:
        return self.job.effective_usd_per_million_units

    def as_row(self) -> dict[str, Any]:
        job = self.job
        ci = job.rate_ci95 or (None, None)
        return {
            "rank": self.rank,
            "run_id": self.run_id,
            "run_name": self.run_name,
            "sequence_length": self.sequence_length,
            "variant": job.variant_name,
            "instance_type": job.instance_type,
            "instance_count": job.instance_count,
            "spot": job.spot,
            "unit": job.unit,
            "rate": job.rate,
            "rate_ci95_low": ci[0],
            "rate_ci95_high": ci[1],
            "usd_per_million": self.usd_per_million,
            "versus_best": self.versus_best,
            "not_ranked": self.why_not_ranked,
        }


@dataclass(frozen=True)
class Comparison:
    unit: str
    jobs: list[ComparedJob]  # ranked first (best first), then the unranked in run order
    notes: list[str]  # what makes the comparison less than like-for-like


def _untrusted(job: JobAnalysis) -> str | None:
    """Why a job's figure cannot be ranked against others, or None."""
    if job.status != "completed":
        return f"{job.status}" + (f": {job.failure}" if job.failure else "")
    if job.disturbed:
        return "disturbed measurement (its steps did not run at one speed)"
    if job.contention_note:
        return "measured while other processes competed for the machine"
    if job.ci_kind in (None, "unreliable") or job.rate_ci95 is None:
        return job.ci_method or "no usable 95 % interval"
    if job.effective_usd_per_million_units is None:
        return "not priced"
    return None


def _jobs_of(run: RunRecord, result: ResultRecord | None) -> list[JobAnalysis]:
    if result is None:
        raise CompareError(
            f"run {run.run_id} has no analysis (status {run.status.value}); a run is analysed when it ends "
            f"(`gpuscout analyze {run.run_id}` closes a local run that stopped early)"
        )
    return list(result.analysis.jobs)


def _machines(result: ResultRecord | None) -> list[Machine]:
    return list(result.analysis.machines) if result else []


def _machine_notes(runs: Sequence[tuple[RunRecord, ResultRecord | None]]) -> list[str]:
    """One note per instance type whose runs were measured on different hardware or software."""
    by_type: dict[str, dict[tuple[Any, ...], list[str]]] = {}
    for run, result in runs:
        for m in _machines(result):
            kind = (m.device, m.model, m.gpus, m.cpu_count, m.torch)
            by_type.setdefault(m.instance_type, {}).setdefault(kind, []).append(run.run_id)
    notes = []
    for instance_type, kinds in by_type.items():
        if len(kinds) > 1:
            described = "; ".join(
                f"{', '.join(dict.fromkeys(ids))}: {model or device}"
                + (f" x{gpus}" if gpus else f", {cpus} cores" if cpus else "")
                + (f", torch {torch}" if torch else "")
                for (device, model, gpus, cpus, torch), ids in kinds.items()
            )
            notes.append(
                f"{instance_type} was not the same machine in every run ({described}): a difference between these "
                "runs may be the machine's, not the settings'"
            )
    return notes


def _price_notes(jobs: Sequence[ComparedJob]) -> list[str]:
    prices: dict[str, dict[float, list[str]]] = {}
    for c in jobs:
        if c.job.effective_usd_per_hour is not None:
            key = f"{c.job.instance_type}{' (spot)' if c.job.spot else ''}"
            prices.setdefault(key, {}).setdefault(round(c.job.effective_usd_per_hour, 6), []).append(c.run_id)
    return [
        f"{instance} was priced differently by these runs' analyses ("
        + "; ".join(f"${rate:,.4g}/h: {', '.join(dict.fromkeys(ids))}" for rate, ids in rates.items())
        + "): compare tokens/s, or re-price each run with `gpuscout results RUN --reprice`"
        for instance, rates in prices.items()
        if len(rates) > 1
    ]


def _versus(best: JobAnalysis, other: JobAnalysis) -> str:
    best_ci, other_ci = best.effective_usd_per_million_units_ci95, other.effective_usd_per_million_units_ci95
    if best_ci is None or other_ci is None or other_ci[0] <= best_ci[1]:
        return "within noise (95 % intervals overlap)"
    best_usd, other_usd = best.effective_usd_per_million_units, other.effective_usd_per_million_units
    assert best_usd is not None and other_usd is not None  # ranked jobs are priced
    return f"+{(other_usd / best_usd - 1) * 100:.1f} %"


def compare_runs(runs: Sequence[tuple[RunRecord, ResultRecord | None]]) -> Comparison:
    """Rank every analysed job of ``runs`` by $ per 1M units (lowest first); CompareError when it cannot."""
    if len(runs) < 2:
        raise CompareError("compare needs at least two runs")
    candidates: list[tuple[RunRecord, JobAnalysis]] = [
        (run, job) for run, result in runs for job in _jobs_of(run, result)
    ]
    units = {job.unit for _, job in candidates}
    if len(units) > 1:
        raise CompareError(f"these runs count different work units ({', '.join(sorted(units))}): nothing to rank")
    ranked: list[tuple[RunRecord, JobAnalysis]] = []
    unranked: list[ComparedJob] = []
    for run, job in candidates:
        reason = _untrusted(job)
        if reason is None:
            ranked.append((run, job))
        else:
            unranked.append(_compared(run, job, rank=None, why=reason, versus=None))
    ranked.sort(key=lambda pair: pair[1].effective_usd_per_million_units or 0.0)
    compared = [
        _compared(run, job, rank=i + 1, why=None, versus=_versus(ranked[0][1], job) if i else None)
        for i, (run, job) in enumerate(ranked)
    ]
    jobs = compared + unranked
    notes = _machine_notes(runs) + _price_notes(jobs)
    if not compared:
        notes.insert(0, "no job of these runs was measured well enough to rank (each row says why)")
    return Comparison(unit=units.pop() if units else "tokens", jobs=jobs, notes=notes)


def _compared(
    run: RunRecord, job: JobAnalysis, *, rank: int | None, why: str | None, versus: str | None
) -> ComparedJob:
    length = (run.manifest or {}).get("sequence_length")
    return ComparedJob(
        run_id=run.run_id,
        run_name=run.name,
        sequence_length=int(length) if isinstance(length, int) else None,
        job=job,
        rank=rank,
        why_not_ranked=why,
        versus_best=versus,
    )
