"""Verdicts that tell the truth off the happy path: a run that did not finish everything, a variant compared with
nothing, and measurements taken on a busy machine."""

from __future__ import annotations

from pathlib import Path

from example_run import load_example_run
from test_recommend import _job

from gpuscout.analysis import report
from gpuscout.analysis.analyze import analyze_run, reprice
from gpuscout.analysis.pricing import PriceBook
from gpuscout.analysis.recommend import decide
from gpuscout.analysis.terms import RunTerms
from gpuscout.domain.contention import Contention
from gpuscout.domain.run_analysis import Constraints
from gpuscout.store.base import JobStatus, RunStatus


def _stopped_run():
    """The example run as Ctrl-C leaves it: the run STOPPED, one repetition stopped, one never started."""
    run, jobs, catalog = load_example_run()
    run = run.model_copy(update={"status": RunStatus.STOPPED})
    jobs[9] = jobs[9].model_copy(update={"status": JobStatus.STOPPED, "benchmark": None})
    jobs[10] = jobs[10].model_copy(update={"status": JobStatus.PLANNED, "benchmark": None})
    return run, jobs, catalog


def test_a_stopped_run_says_what_did_not_run_and_is_never_a_firm_winner(tmp_path: Path) -> None:
    run, jobs, catalog = _stopped_run()
    analysis = analyze_run(run, jobs, terms=RunTerms.stored(run.manifest), catalog=catalog)
    assert analysis.incomplete is not None
    assert analysis.incomplete.startswith("Incomplete run: it was stopped; 4 of 14 jobs did not finish")
    assert "ml.p5.48xlarge / bs16 rep 2 (STOPPED)" in analysis.incomplete
    assert "ml.p5.48xlarge / bs16 rep 3 (PLANNED)" in analysis.incomplete
    assert analysis.recommendation.clear_winner is False
    # the answer comes first, never a firm pick; what did not run is the first note under it
    summary = analysis.recommendation.summary
    assert summary.startswith("Pick ") and "(provisional" in summary and "(clear winner)" not in summary
    assert analysis.recommendation.notes[0] == analysis.incomplete
    # re-pricing keeps the caveat (it recomputes the verdict)
    repriced = reprice(analysis, PriceBook.from_catalog(catalog))
    assert repriced.recommendation.clear_winner is False and repriced.incomplete == analysis.incomplete
    files = report.write_report(analysis, tmp_path)
    markdown = Path(files["md"]).read_text()
    head = markdown[: markdown.index("## Ranked results")]
    assert head.count("Incomplete run: it was stopped") == 1  # the banner under the recommendation, once
    page = Path(files["html"]).read_text()
    assert "class='rec unclear'" in page and "Incomplete run: it was stopped" in page


def test_a_run_where_everything_finished_has_no_caveat() -> None:
    run, jobs, catalog = load_example_run()
    done = [j.model_copy(update={"status": JobStatus.COMPLETED}) for j in jobs if j.benchmark is not None]
    analysis = analyze_run(run, done, terms=RunTerms.stored(run.manifest), catalog=catalog)
    assert analysis.incomplete is None
    assert not analysis.recommendation.summary.startswith(("Incomplete", "Not everything"))


def test_failed_jobs_are_named_without_calling_the_run_stopped() -> None:
    run, jobs, catalog = load_example_run()  # one OOM and one CAPACITY job
    analysis = analyze_run(run, jobs, terms=RunTerms.stored(run.manifest), catalog=catalog)
    assert analysis.incomplete == (
        "Not everything ran; 2 of 14 jobs did not finish: ml.g5.2xlarge / bs16 (OOM), ml.p5e.48xlarge / bs16 "
        "(CAPACITY). The verdict covers only what finished."
    )


def test_the_only_candidate_is_never_a_clear_winner() -> None:
    _, rec, _ = decide([_job("a", "ml.a", 10_000, (9_000, 11_000))], "fastest", Constraints())
    assert rec.verdict == "only_candidate" and not rec.clear_winner


def _crowded(job, note: str = "measured under competition (2.1 other cores busy)"):
    return job.model_copy(update={"contention_note": note})


def test_contended_measurements_are_never_told_to_add_repetitions() -> None:
    overlapping = [_crowded(_job("a", "ml.a", 10_000, (9_000, 11_000))), _job("b", "ml.b", 9_800, (9_000, 10_500))]
    _, rec, _ = decide(overlapping, "fastest", Constraints())
    assert rec.verdict == "no_clear_winner"
    assert "a quiet machine, not more repetitions" in rec.summary and "More repetitions would" not in rec.summary
    apart = [_crowded(_job("a", "ml.a", 20_000, (19_000, 21_000), reps=1)), _job("b", "ml.b", 9_800, (9_000, 10_500))]
    _, rec, _ = decide(apart, "fastest", Constraints())
    assert rec.verdict == "provisional" and not rec.clear_winner
    assert "run it again on a quiet machine" in rec.summary and "repetitions: 2" not in rec.summary


def test_a_searchs_advice_is_something_a_search_manifest_can_do() -> None:
    """validate refuses repetitions for a search: its advice is to re-run the top two as plain variants."""
    jobs = [_job("a", "ml.a", 20_000, (19_000, 21_000), reps=1, variant="b4"),
            _job("b", "ml.a", 9_800, (9_000, 10_500), reps=1, variant="b2")]  # fmt: skip
    _, rec, _ = decide(jobs, "fastest", Constraints(), search=True)
    assert rec.verdict == "provisional"
    assert "re-run b4 and b2 as plain variants with repetitions: 2" in rec.summary
    assert "set repetitions: 2 or more" not in rec.summary
    overlapping = [_job("a", "ml.a", 10_000, (9_000, 11_000), variant="b4"),
                   _job("b", "ml.a", 9_800, (9_000, 10_500), variant="b2")]  # fmt: skip
    _, rec, _ = decide(overlapping, "fastest", Constraints(), search=True)
    assert "Next: re-running b4 and b2 as plain variants with repetitions: 2" in rec.summary


def test_the_report_answers_first_and_carries_the_contention_banner_right_after(tmp_path: Path) -> None:
    run, jobs, catalog = load_example_run()
    busy = Contention(competing=True, note="measured under competition (1.8 other cores busy)")
    jobs = [j.model_copy(update={"contention": busy}) if j.variant_name == "bs8" else j for j in jobs]
    analysis = analyze_run(run, jobs, terms=RunTerms.stored(run.manifest), catalog=catalog)
    files = report.write_report(analysis, tmp_path)
    for path in (files["md"], files["html"]):
        text = Path(path).read_text()
        banner = text.index("Measured under competition: 1 of")
        answer = text.index("Recommendation")
        assert answer < banner < text.index("Ranked results") and "more repetitions on a busy one do not fix it" in text
        assert text.count("measured under competition (1.8 other cores busy)") >= 1  # the row's own note


def test_small_workloads_are_not_shown_as_zero_hours_and_zero_dollars() -> None:
    from gpuscout.analysis.recommend import duration_text, usd_text

    assert duration_text(40 / 3600) == "40 s" and duration_text(0.5) == "30.0 min" and duration_text(3.0) == "3.0 h"
    assert usd_text(0.0004123) == "$0.0004123" and usd_text(12.345) == "$12.35"
    job = _job("a", "ml.a", 10_000, (9_000, 11_000)).model_copy(
        update={"workload_basis": "one epoch", "workload_hours": 0.01, "workload_usd": 0.0004}
    )
    _, rec, _ = decide([job], "fastest", Constraints())
    assert "one epoch: 36 s, $0.0004" in rec.summary and "0.0 h" not in rec.summary
