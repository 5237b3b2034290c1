"""What the analysis does with a disturbed measurement (gpuscout/domain/disturbance.py decides which are): leave a
disturbed repetition out when an undisturbed one of the same variant exists, say so in the variant's note, and bound
how much faster a disturbed one could have been (the verdict's question whether it could have led).

May import: gpuscout.domain and gpuscout.store."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from gpuscout.domain.benchmark import Disturbance, StepAccount
from gpuscout.domain.disturbance import kernel_note as domain_kernel_note
from gpuscout.store.base import JobRecord


class Measured(Protocol):
    """One repetition's measurement, as the analysis reads it from benchmark.json."""

    @property
    def disturbance(self) -> Disturbance | None: ...  # None: no steps recorded

    @property
    def steps(self) -> list[StepAccount]: ...  # benchmark.json's steps


def disturbed(rep: Measured) -> bool:
    return bool(rep.disturbance and rep.disturbance.disturbed)


def undisturbed_factor(reps: Sequence[Measured]) -> float | None:
    """How much faster the disturbed repetitions would have been had every timed step run at the reference step's
    speed (their timed time / (reference step x timed steps), the largest); None when a disturbed repetition has no
    steps to tell."""
    factors = []
    for rep in reps:
        if not disturbed(rep):
            continue
        reference = (rep.disturbance.reference_step_s if rep.disturbance else None) or 0.0
        timed = [s.seconds for s in rep.steps if s.timed]
        if reference <= 0 or not timed:
            return None
        factors.append(max(1.0, math.fsum(timed) / (reference * len(timed))))
    return max(factors) if factors else None


def kernel_note(reps: Sequence[Measured]) -> str | None:
    """The domain's kernel note for the repetition whose kernel share was the largest, if any earns one."""
    notes = [
        ((r.disturbance.system_share if r.disturbance else None) or 0.0, domain_kernel_note(r.disturbance))
        for r in reps
    ]
    notes = [(share, note) for share, note in notes if note]
    return max(notes)[1] if notes else None


def disturbance_note(all_reps: Sequence[tuple[JobRecord, Measured]], used: Sequence[Measured]) -> str | None:
    """What the disturbance detector found in a group's repetitions, and whether the figures still include it."""
    flagged = [(job, rep) for job, rep in all_reps if disturbed(rep)]
    if not flagged:
        return None
    first_flagged = flagged[0][1].disturbance
    evidence = (first_flagged.evidence if first_flagged else None) or "steps ran at different speeds"
    if not any(disturbed(rep) for rep in used):
        names = ", ".join(job.job_name for job, _ in flagged)
        return f"left out of the figures: {names} was disturbed ({evidence})"
    first = "disturbed measurement: " + evidence
    return first if len(all_reps) == 1 else f"{len(flagged)} of {len(all_reps)} repetitions: {first}"
