"""The verdict: never a confident answer from noise (docs/costs.md, "The verdict").

Built through analyze_run from real benchmark.json fixtures, with the numbers of the cases seen on a busy 2-core
machine: identical variants with wild repetitions, one timed step, one repetition each, a steady-state stop that
never settled.
"""

from __future__ import annotations

import copy
import io
import json
import re
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuscout.analysis.analyze import analyze_run
from gpuscout.analysis.report import render_markdown
from gpuscout.analysis.terms import RunTerms
from gpuscout.cli.local_view import _tps_text
from gpuscout.domain.contention import Contention
from gpuscout.local.results import result_rows
from gpuscout.store.base import JobRecord, JobStatus, RunRecord
from tests.job_specs import job_spec

BASE = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks" / "p4d-bs8-r0.json").read_text())
CATALOG = {"local": {"on_demand_usd_per_hour": 0.096, "price_source": "test", "price_date": "2026-11-01"}}
RUN = RunRecord(run_id="verdict", name="verdict", status="ANALYZING", manifest_source="test", manifest={})


def _said(rec: Any) -> str:
    """The whole recommendation as shown: the answer, then its notes (the diagnostics behind the verdict)."""
    return " ".join([rec.summary, *rec.notes])


def _bench(tps: float, ci: tuple[float, float] | None, *, timed_steps: int = 16, stop: dict[str, Any] | None = None):
    bench = copy.deepcopy(BASE)
    bench["throughput"]["tokens_per_s"] = tps
    bench["throughput"]["tokens_per_s_ci95"] = list(ci) if ci else None
    bench["timing"]["timed_steps"] = timed_steps
    bench["stop"] = stop or {"rule": "fixed", "reason": "max_steps reached", "steps": timed_steps + 4}
    return bench


def _job(variant: str, rep: int, bench: dict[str, Any], *, workers: int = 0, tolerance: str = "0.02") -> JobRecord:
    name = f"gs-v-{variant}-r{rep}"
    return JobRecord(
        run_id="verdict",
        job_name=name,
        status=JobStatus.COMPLETED,
        instance_type="local",
        instance_count=1,
        variant_name=variant,
        repetition=rep,
        spec=job_spec(
            name,
            "verdict",
            variant_name=variant,
            repetition=rep,
            price_per_hour_usd=0.096,
            precision="fp32",
            hyperparameters={
                "job_name": name,
                "per_device_train_batch_size": "4",
                "dataloader_num_workers": str(workers),
                "ci_tolerance": tolerance,
            },
        ),
        benchmark={**bench, "job_name": name},
    )


def _table_text(rows: list[dict[str, Any]]) -> str:
    from rich.console import Console

    from gpuscout.cli.local_view import print_ranked

    console = Console(file=io.StringIO(), width=300)
    print_ranked(console, rows)
    return console.file.getvalue()  # type: ignore[attr-defined]


def _verdict(jobs: list[JobRecord], objective: str = "cheapest_per_token"):
    return analyze_run(RUN, jobs, terms=RunTerms.stored({"objective": objective}), catalog=CATALOG)


@settings(max_examples=60, deadline=None)
@given(
    tps=st.lists(st.floats(100.0, 1e6), min_size=2, max_size=6),
    half=st.lists(st.floats(0.0, 2e5), min_size=6, max_size=6),
    reps=st.integers(1, 3),
    objective=st.sampled_from(["cheapest_per_token", "fastest"]),
)
def test_identical_variants_are_never_a_clear_winner_whatever_the_noise(
    tps: list[float], half: list[float], reps: int, objective: str
) -> None:
    # Given two variants with the same settings under different names and any measured numbers at all
    jobs = []
    for i, value in enumerate(tps[: 2 * reps] if len(tps) >= 2 * reps else tps * reps):
        variant, rep = ("a", "b")[i % 2], i // 2
        jobs.append(_job(variant, rep, _bench(value, (value - half[i % 6], value + half[i % 6]))))
    # When the run is analysed
    rec = _verdict(jobs, objective).recommendation
    # Then no winner is called
    assert not rec.clear_winner
    assert rec.verdict == "same_settings"
    assert rec.summary.startswith("No pick (same settings):")


def test_wild_repetitions_give_an_unreliable_interval_and_cannot_tell() -> None:
    # Seen: 13,367 ± 134,370 and 12,298 ± 94,775 tokens/s from 2 repetitions each, called "clear" (8.7 % more).
    # Here the settings differ (dataloader workers) so only the statistics decide.
    jobs = [
        _job("a", 0, _bench(23_946, (23_000, 24_900))),
        _job("a", 1, _bench(2_788, (2_700, 2_900))),
        _job("b", 0, _bench(19_760, (19_000, 20_500)), workers=1),
        _job("b", 1, _bench(4_836, (4_700, 5_000)), workers=1),
    ]
    analysis = _verdict(jobs)
    assert analysis.recommendation.verdict == "cannot_tell" and not analysis.recommendation.clear_winner
    assert analysis.recommendation.summary.startswith("No pick (cannot tell):")
    for job in analysis.jobs:
        assert job.ci_kind == "unreliable" and job.tokens_per_s_ci95 is None
        assert job.usd_per_million_tokens_ci95 is None
        assert "reaches zero or below" in (job.ci_method or "")
    # printed as unreliable, never as a negative bound
    rows = result_rows(analysis, [])
    assert [_tps_text(r) for r in rows] == ["13,367 (CI unreliable)", "12,298 (CI unreliable)"]
    markdown = render_markdown(analysis, [])
    assert "(CI unreliable)" in markdown
    assert not re.search(r"[ (±$]-\d", markdown), "no negative number is printed"


def test_one_timed_step_cannot_tell() -> None:
    # Seen: max_steps 4 leaves one timed step: "22,377 ± 0" and a 13 % "clear" winner between identical settings.
    jobs = [
        _job("a", 0, _bench(22_377, (22_377, 22_377), timed_steps=1)),
        _job("b", 0, _bench(19_800, (19_800, 19_800), timed_steps=1), workers=1),
    ]
    analysis = _verdict(jobs)
    assert analysis.recommendation.verdict == "cannot_tell"
    assert "1 timed step" in analysis.jobs[0].ci_method


def test_zero_width_interval_cannot_tell() -> None:
    jobs = [
        _job("a", 0, _bench(22_377, (22_377, 22_377))),
        _job("b", 0, _bench(11_000, (10_000, 12_000)), workers=1),
    ]
    assert _verdict(jobs).recommendation.verdict == "cannot_tell"


def test_one_repetition_is_provisional_and_says_what_makes_it_firm() -> None:
    # Within-run intervals of ±3-5 % while run-to-run varies ±25 %: a 29 % lead from one run each is not firm.
    jobs = [
        _job("a", 0, _bench(24_237, (23_364, 25_110))),
        _job("b", 0, _bench(18_700, (17_900, 19_500)), workers=1),
    ]
    rec = _verdict(jobs).recommendation
    assert rec.verdict == "provisional" and not rec.clear_winner
    assert rec.summary.startswith("Pick local / ") and " (provisional): " in _said(rec)
    assert "Next: to make it firm, set repetitions: 2 or more" in rec.summary


def test_clearly_different_variants_with_repetitions_are_a_clear_winner() -> None:
    fast = [24_000, 24_400, 23_800]
    slow = [12_100, 11_900, 12_300]
    jobs = [_job("fast", r, _bench(v, (v * 0.97, v * 1.03))) for r, v in enumerate(fast)]
    jobs += [_job("slow", r, _bench(v, (v * 0.97, v * 1.03)), workers=2) for r, v in enumerate(slow)]
    analysis = _verdict(jobs)
    rec = analysis.recommendation
    assert rec.verdict == "clear" and rec.clear_winner
    assert rec.summary.startswith("Pick local / fast (clear winner): ")
    assert {j.ci_kind for j in analysis.jobs} == {"between_repetitions"}


def test_overlapping_repetitions_are_no_clear_winner() -> None:
    jobs = [_job("a", r, _bench(v, (v * 0.97, v * 1.03))) for r, v in enumerate([20_000, 26_000, 17_000])]
    jobs += [_job("b", r, _bench(v, (v * 0.97, v * 1.03)), workers=1) for r, v in enumerate([19_000, 21_000, 18_500])]
    assert _verdict(jobs).recommendation.verdict == "no_clear_winner"


def test_a_steady_state_stop_that_never_settled_is_flagged_and_not_firm() -> None:
    unsettled = {"rule": "steady_state", "reason": "max_steps reached before the throughput CI settled", "steps": 60}
    fast = [24_000, 24_400, 23_800]
    jobs = [
        _job("fast", r, _bench(v, (v * 0.951, v * 1.049), stop=unsettled), tolerance="0.02") for r, v in enumerate(fast)
    ]
    jobs += [
        _job("slow", r, _bench(v, (v * 0.99, v * 1.01)), workers=2) for r, v in enumerate([12_000, 12_100, 11_900])
    ]
    analysis = _verdict(jobs)
    fast_row = next(j for j in analysis.jobs if j.variant_name == "fast")
    assert fast_row.tolerance_reached is False
    assert fast_row.stop_text == "steady state not reached (±4.9 % > ±2.0 %), 16 timed"
    assert analysis.recommendation.verdict == "provisional"
    # flagged where a user looks: the results rows (table/json/csv) and the report
    row = next(r for r in result_rows(analysis, []) if r["variant"] == "fast")
    assert row["tolerance_reached"] is False and row["stop_reason"] == unsettled["reason"]
    assert row["timed_steps"] == 16 and row["stop"] == "steady state not reached (±4.9 % > ±2.0 %), 16 timed"
    assert "⚠" in _table_text(result_rows(analysis, []))
    assert "⚠ steady state not reached (±4.9 % > ±2.0 %)" in render_markdown(analysis, [])


def test_a_measurement_under_competition_is_never_a_clear_winner() -> None:
    busy = Contention(
        competing=True, note="measured under competition: other processes used 1.3 of 2 CPU cores on average"
    )
    fast = [24_000, 24_400, 23_800]
    jobs = [
        _job("fast", r, _bench(v, (v * 0.97, v * 1.03))).model_copy(update={"contention": busy if r == 1 else None})
        for r, v in enumerate(fast)
    ]
    jobs += [
        _job("slow", r, _bench(v, (v * 0.97, v * 1.03)), workers=2) for r, v in enumerate([12_100, 11_900, 12_300])
    ]
    analysis = _verdict(jobs)
    rec = analysis.recommendation
    assert rec.verdict == "provisional" and not rec.clear_winner
    assert "1 of 3 repetitions measured under competition" in _said(rec) and "quiet machine" in _said(rec)
    # the answer comes first, and no margin is quoted against the contended measurement
    assert rec.summary.startswith("Pick local / fast (provisional): ") and "Next: " in rec.summary
    assert rec.margin_fraction is None and "faster than the runner-up" not in rec.summary
    row = next(r for r in result_rows(analysis, []) if r["variant"] == "fast")
    assert "measured under competition" in row["note"]


def test_a_local_cpu_run_has_no_spot_price_and_no_per_gpu_figure() -> None:
    bench = _bench(20_000, (19_500, 20_500))
    bench["hardware"] = {**bench["hardware"], "device": "cpu", "world_size": 1, "gpu_sku": None}
    analysis = _verdict([_job("a", 0, bench)])
    [job] = analysis.jobs
    assert job.usd_per_million_tokens is not None
    assert job.usd_per_million_tokens_spot is None and job.epoch_usd_spot is None and job.spot_usd_per_hour is None
    assert job.tokens_per_s_per_gpu is None
    assert any("no spot price" in a for a in analysis.assumptions)
    assert "spot targets are billed at the spot price" not in " ".join(analysis.assumptions)


def _disturbed(bench: dict[str, Any]) -> dict[str, Any]:
    # the b4-a1 slow phase of the quickstart (docs/metrics.md, "Disturbed measurements"): 25-33 ms, then 48-70 ms
    millis = [30, 30, 30, 27, 28, 32, 33, 64, 48, 63, 65, 66, 57, 62, 61, 67, 67, 64, 66, 60, 53, 70]
    steps = [{"step": i + 1, "seconds": ms / 1000, "timed": i >= 3} for i, ms in enumerate(millis)]
    return {**bench, "steps": steps}


def test_a_disturbed_leader_cannot_win_and_a_disturbed_follower_keeps_the_leader_provisional() -> None:
    fast = [24_000, 24_400, 23_800]
    slow = [12_100, 11_900, 12_300]
    clean = [_job("fast", r, _bench(v, (v * 0.97, v * 1.03))) for r, v in enumerate(fast)]
    clean += [_job("slow", r, _bench(v, (v * 0.97, v * 1.03)), workers=2) for r, v in enumerate(slow)]
    # Given a clear win measured cleanly, when the leader's every repetition was disturbed: cannot tell
    leader = [_job("fast", r, _disturbed(_bench(v, (v * 0.97, v * 1.03)))) for r, v in enumerate(fast)]
    analysis = _verdict(leader + clean[3:])
    rec = analysis.recommendation
    assert rec.verdict == "cannot_tell" and not rec.clear_winner
    assert "local / fast: 3 of 3 repetitions: disturbed measurement: 12 of 19 timed steps" in _said(rec)
    fast_row = next(r for r in result_rows(analysis, []) if r["variant"] == "fast")
    assert fast_row["disturbed"] and "disturbed measurement" in fast_row["note"]
    assert "⚠ 3 of 3 repetitions: disturbed measurement" in render_markdown(analysis, [])
    # When a third, disturbed variant ranks last but could have led at its undisturbed speed (its slow phase cost it
    # ~1.75x): the clean leader is no more than provisional; one that could not have led leaves the win clear
    closer = [
        _job("slow", r, _bench(v, (v * 0.97, v * 1.03)), workers=2) for r, v in enumerate([20_100, 19_900, 20_300])
    ]
    for tps, verdict in ((14_000, "provisional"), (6_000, "clear")):
        third = [_job("third", r, _disturbed(_bench(tps, (tps * 0.97, tps * 1.03))), workers=4) for r in range(3)]
        rec = _verdict(clean[:3] + closer + third).recommendation
        assert rec.verdict == verdict, (tps, rec.summary)
        assert ("local / third: 3 of 3 repetitions: disturbed" in _said(rec)) == (verdict == "provisional")
    # And a disturbed repetition beside clean ones is left out of the figures, and the note says which
    mixed = [*clean[:2], _job("fast", 2, _disturbed(_bench(9_000, (8_700, 9_300)))), *clean[3:]]
    job = next(j for j in _verdict(mixed).jobs if j.variant_name == "fast")
    assert job.repetitions == 2 and not job.disturbed and job.tokens_per_s == 24_200
    assert job.disturbance_note and job.disturbance_note.startswith(
        "left out of the figures: gs-v-fast-r2 was disturbed (12 of"
    )


def test_a_lone_disturbed_candidate_is_not_a_firm_answer() -> None:
    analysis = _verdict([_job("only", 0, _disturbed(_bench(20_000, (19_000, 21_000))))])
    assert analysis.recommendation.verdict == "cannot_tell" and not analysis.recommendation.clear_winner


def test_a_kernel_busy_with_page_faults_earns_a_note_but_does_not_change_the_verdict() -> None:
    fast = [24_000, 24_400, 23_800]
    slow = [12_100, 11_900, 12_300]

    def faulting(bench: dict[str, Any]) -> dict[str, Any]:  # every step alike: half its time in the kernel
        steps = [
            {"step": i + 1, "seconds": 0.03, "timed": i >= 3, "system_s": 0.015, "minor_faults": 1650}
            for i in range(20)
        ]
        return {**bench, "steps": steps}

    jobs = [_job("fast", r, _bench(v, (v * 0.97, v * 1.03))) for r, v in enumerate(fast)]
    jobs += [_job("slow", r, faulting(_bench(v, (v * 0.97, v * 1.03))), workers=2) for r, v in enumerate(slow)]
    analysis = _verdict(jobs)
    assert analysis.recommendation.verdict == "clear"
    slow_job = next(j for j in analysis.jobs if j.variant_name == "slow")
    assert not slow_job.disturbed and slow_job.kernel_note == (
        "the kernel took 50 % of the step time at 55k minor page faults/s (a host allocator that returns memory "
        "every step does this; see host_allocator)"
    )
    assert slow_job.kernel_note in slow_job.measurement_note
    assert next(j for j in analysis.jobs if j.variant_name == "fast").kernel_note is None


def _recompiled(bench: dict[str, Any]) -> dict[str, Any]:
    """Steady 30 ms steps, but step 12 took 2 s compiling a new torch.compile graph (a shape that changed)."""
    steps = [
        {"step": i + 1, "seconds": 2.0 if i == 11 else 0.03, "timed": i >= 3, "compiled_graphs": int(i in (0, 11))}
        for i in range(22)
    ]
    return {**bench, "steps": steps}


def test_a_recompile_is_answered_with_what_to_change_and_other_disturbances_with_a_quiet_machine() -> None:
    fast = [24_000, 24_400, 23_800]
    slow = [12_100, 11_900, 12_300]
    # Given a leader whose stall compiled a graph, and a runner-up with a slow phase that compiled nothing
    jobs = [_job("fast", r, _recompiled(_bench(v, (v * 0.97, v * 1.03)))) for r, v in enumerate(fast)]
    jobs += [_job("slow", r, _disturbed(_bench(v, (v * 0.97, v * 1.03))), workers=2) for r, v in enumerate(slow)]
    analysis = _verdict(jobs)
    # Then neither can win, and each gets the advice that fits its cause
    rec = analysis.recommendation
    assert rec.verdict == "cannot_tell"
    assert {j.variant_name: j.recompiled for j in analysis.jobs} == {"fast": True, "slow": False}
    assert "torch.compile compiled 1 graph in that step" in _said(rec)
    assert (
        "Next: for local / fast (torch.compile compiled graphs in its slow steps, which the same settings do again on "
        "any machine), keep the input shapes fixed from step to step" in _said(rec)
    )
    assert "then run it again; run local / slow again on a quiet machine" in _said(rec)
    # A lone candidate that recompiled is told the same
    only = _verdict([_job("only", 0, _recompiled(_bench(20_000, (19_000, 21_000))))]).recommendation
    assert only.verdict == "cannot_tell" and "Next: for local / only (torch.compile compiled graphs" in only.summary
    assert "quiet machine" not in only.summary
    # and so is a recompiled variant ranked lower that could have led: the leader stays provisional until it is fixed
    clean = [_job("fast", r, _bench(v, (v * 0.97, v * 1.03))) for r, v in enumerate(fast)]
    clean += [
        _job("slow", r, _bench(v, (v * 0.97, v * 1.03)), workers=2) for r, v in enumerate([20_100, 19_900, 20_300])
    ]
    third = [_job("third", r, _recompiled(_bench(9_000, (8_700, 9_300))), workers=4) for r in range(3)]
    rec = _verdict(clean + third).recommendation
    assert rec.verdict == "provisional", rec.summary
    assert "Next: to make it firm, for local / third (torch.compile compiled graphs in its slow steps" in _said(rec)
