"""`gpuscout compare` ranks several runs' jobs together, honestly (gpuscout.analysis.compare), and `gpuscout delete`
removes local runs, their rows and their folders, never a run in progress."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from gpuscout.analysis.analyze import analyze_run
from gpuscout.analysis.terms import RunTerms
from gpuscout.cli import app as cli
from gpuscout.domain.catalog import load_catalog
from gpuscout.domain.manifest_loader import load_manifest
from gpuscout.paths import MANIFESTS_DIR
from gpuscout.store.base import JobRecord, JobStatus, ResultRecord, RunRecord, RunStatus
from gpuscout.store.sqlite import SqliteStore
from tests.job_specs import job_spec
from tests.unit.test_cli import _benchmark

QUICKSTART = MANIFESTS_DIR / "quickstart.yaml"
runner = CliRunner()


def _run(
    store: SqliteStore,
    run_id: str,
    *,
    sequence_length: int,
    rates: dict[str, float],
    folder: Path | None = None,
    cpu_count: int = 2,
    status: RunStatus = RunStatus.SUCCEEDED,
    disturbed: str | None = None,
) -> None:
    """A local run of the quickstart at ``sequence_length`` whose variants measured ``rates`` tokens/s, analysed by
    the real analysis code; ``disturbed``: that variant's steps did not run at one speed."""
    catalog = load_catalog()
    text = QUICKSTART.read_text().replace("sequence_length: 256", f"sequence_length: {sequence_length}")
    source = (folder or store.path.parent) / f"{run_id}.yaml"
    source.write_text(text)
    manifest = load_manifest(source, catalog=catalog)
    run = RunRecord(
        run_id=run_id, name="quickstart", status=status, manifest_source=str(source),
        manifest=manifest.model_dump(mode="json"), run_dir=str(folder) if folder else None,
        host=os.uname().nodename, pid=os.getpid(),
    )  # fmt: skip
    store.put_run(run)
    jobs = []
    for variant, rate in rates.items():
        bench: dict[str, Any] = _benchmark(f"gs-{run_id[-6:]}-{variant}", rate, 4)
        bench["hardware"]["cpu_count"] = cpu_count
        if variant == disturbed:
            bench["disturbance"] = {"disturbed": True, "evidence": "3 of 27 steps ran 4x slower", "timed_steps": 27,
                                   "slow_steps": 3}  # fmt: skip
        job = JobRecord(
            run_id=run_id, job_name=bench["job_name"], status=JobStatus.COMPLETED, instance_type="local",
            variant_name=variant,
            spec=job_spec(bench["job_name"], run_id, variant_name=variant, price_per_hour_usd=0.096),
            benchmark=bench,
        )  # fmt: skip
        store.put_job(job)
        jobs.append(job)
    analysis = analyze_run(run, jobs, terms=RunTerms.of(manifest), catalog=catalog)
    store.put_result(ResultRecord(run_id=run_id, analysis=analysis.model_dump(mode="json")))


def _invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(cli.app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_compare_ranks_two_runs_and_quotes_only_separated_differences(tmp_path: Path) -> None:
    # Given two runs of the same settings at two sequence lengths (manifest-wide, so a run each)
    db = tmp_path / "g.db"
    store = SqliteStore(db)
    _run(store, "quickstart-a-256", sequence_length=256, rates={"b4-a1": 9_000.0, "b1-a4": 8_900.0})
    _run(store, "quickstart-b-128", sequence_length=128, rates={"b4-a1": 12_000.0, "b1-a4": 6_000.0},
         disturbed="b1-a4")  # fmt: skip
    # When they are compared
    code, out, err = _invoke("compare", "quickstart-a-256", "quickstart-b-128", "--db", str(db), "-f", "json")
    assert code == 0, err
    compared = json.loads(out)
    ranked = [j for j in compared["jobs"] if j["rank"] is not None]
    # Then the three trusted jobs are ranked by $ per 1M tokens across the runs, best first, with their run's length
    assert [(j["run_id"], j["variant"], j["sequence_length"]) for j in ranked] == [
        ("quickstart-b-128", "b4-a1", 128), ("quickstart-a-256", "b4-a1", 256), ("quickstart-a-256", "b1-a4", 256),
    ]  # fmt: skip
    assert ranked[0]["versus_best"] is None
    assert ranked[1]["versus_best"].startswith("+") and ranked[1]["versus_best"].endswith(" %")  # 12k vs 9k: apart
    assert ranked[2]["versus_best"].startswith("+")
    # the disturbed measurement is listed with why, never ranked and never quoted against
    (unranked,) = [j for j in compared["jobs"] if j["rank"] is None]
    assert unranked["variant"] == "b1-a4" and "disturbed" in unranked["not_ranked"] and unranked["versus_best"] is None
    # and the table says the same
    code, out, _ = _invoke("compare", "quickstart-a-256", "quickstart-b-128", "--db", str(db))
    assert code == 0 and "2 runs compared" in out and "disturbed measurement" in " ".join(out.split())


def test_overlapping_intervals_are_within_noise_and_other_machines_are_named(tmp_path: Path) -> None:
    db = tmp_path / "g.db"
    store = SqliteStore(db)
    _run(store, "quickstart-a", sequence_length=256, rates={"b4-a1": 9_000.0})
    _run(store, "quickstart-b", sequence_length=256, rates={"b4-a1": 9_100.0}, cpu_count=8)  # another machine
    code, out, err = _invoke("compare", "quickstart-a", "quickstart-b", "--db", str(db), "-f", "json")
    assert code == 0, err
    compared = json.loads(out)
    assert compared["jobs"][1]["versus_best"] == "within noise (95 % intervals overlap)"  # +-3 % each: they overlap
    (note,) = compared["notes"]
    assert note.startswith("local was not the same machine in every run") and "8 cores" in note


def test_compare_refuses_a_run_without_analysis_and_a_single_run(tmp_path: Path) -> None:
    db = tmp_path / "g.db"
    store = SqliteStore(db)
    _run(store, "quickstart-a", sequence_length=256, rates={"b4-a1": 9_000.0})
    store.put_run(RunRecord(run_id="quickstart-q", name="quickstart", status=RunStatus.FAILED, manifest_source="x"))
    code, _, err = _invoke("compare", "quickstart-a", "quickstart-q", "--db", str(db))
    assert code != 0 and "run quickstart-q has no analysis (status FAILED)" in " ".join(err.split())
    code, _, err = _invoke("compare", "quickstart-a", "--db", str(db))
    assert code != 0 and "at least two runs" in err


def test_delete_removes_rows_and_the_run_folder_but_not_a_live_run(tmp_path: Path) -> None:
    db = tmp_path / "g.db"
    store = SqliteStore(db)
    folder = tmp_path / "runs" / "quickstart-old"
    (folder / "jobs").mkdir(parents=True)
    (folder / "report.md").write_text("# old\n")
    _run(store, "quickstart-old", sequence_length=256, rates={"b4-a1": 9_000.0}, folder=folder)
    _run(store, "quickstart-live", sequence_length=256, rates={"b4-a1": 9_000.0}, status=RunStatus.RUNNING)
    # A run in progress (its process, this test's, is alive) is refused, and nothing is deleted
    code, _, err = _invoke("delete", "quickstart-old", "quickstart-live", "--db", str(db), "--yes")
    assert code != 0 and "quickstart-live still running" in err
    assert folder.is_dir() and store.get_run("quickstart-old")
    # Without --yes and no terminal to ask on: refused, nothing deleted
    code, _, err = _invoke("delete", "quickstart-old", "--db", str(db))
    assert code != 0 and "pass --yes" in err and folder.is_dir()
    # With --yes: the run's rows (run, jobs, result) and its folder go; the other run stays
    code, out, err = _invoke("delete", "quickstart-old", "--db", str(db), "--yes")
    assert code == 0, err
    assert "deleted 1 run(s)" in out and not folder.exists() and (tmp_path / "runs").is_dir()
    assert [r.run_id for r in store.list_runs()] == ["quickstart-live"]
    assert store.list_jobs("quickstart-old") == [] and store.get_result("quickstart-old") is None
    code, _, err = _invoke("delete", "quickstart-old", "--db", str(db), "--yes")
    assert code != 0 and "quickstart-old" in err  # unknown now: one readable error
