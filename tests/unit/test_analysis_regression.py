"""analyze_run's output for fixed inputs must not change: a guard for performance work on gpuscout.analysis/costs.

The expected files in tests/fixtures/analysis/ were generated from the code before it was optimized. Only the two
clock readings (``generated_at``, ``price_snapshot.taken_at``) are left out; every other value must match exactly,
floats to 1e-9 relative: numpy picks its exp/log kernels by CPU (AVX-512 or AVX2), and the last bits of a fitted
target-loss time differ between the two kinds of machine the suite runs on (1.2492867069020235 on an AVX2-only AMD
EPYC against 1.2492867069019609 where the files were written).
When a change *should* alter the analysis, regenerate them deliberately and review the diff:

    .venv/bin/python tests/unit/test_analysis_regression.py
"""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
from example_run import load_example_run

from gpuscout.analysis.analyze import analyze_run
from gpuscout.analysis.terms import RunTerms
from gpuscout.store.base import JobRecord, JobStatus, RunRecord
from tests.job_specs import job_spec

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
BENCHMARKS = FIXTURES / "benchmarks"
EXPECTED = FIXTURES / "analysis"


def _transitions(rng: random.Random, t0: int) -> list[dict[str, Any]]:
    out, start = [], t0
    for status in ("Starting", "LaunchingMLInstances", "DownloadingTrainingImage", "Downloading", "Training"):
        seconds = rng.randint(20, 900 if status == "Training" else 120)
        out.append({"Status": status, "StartTime": start, "EndTime": start + seconds * 1000})
        start += seconds * 1000
    out.append({"Status": "Uploading", "StartTime": start})  # open and last: dropped
    return out


def _curve(shape: str, base: list[dict[str, Any]], rng: random.Random, tps_ratio: float) -> list[dict[str, Any]]:
    """A loss curve on the fixture's token grid: the fixture's own (scaled), a steep one, a rising one, or 3 points."""
    points = []
    for p in base:
        tokens = p["tokens"]
        if shape == "steep":  # best power-law exponent beyond the grid: the log-linear fallback
            loss = 4.6 + 0.8 * (tokens / base[-1]["tokens"]) ** -5
        elif shape == "flat":
            loss = 7.0 + 0.001 * p["step"]
        else:
            factor = {"low": 0.85, "base": 1.0, "high": 1.12, "short": 1.0}[shape]
            loss = p["loss"] * factor + rng.uniform(-0.03, 0.03)
        points.append({"step": p["step"], "tokens": tokens, "elapsed_s": p["elapsed_s"] / tps_ratio, "loss": loss})
    return points[:3] if shape == "short" else points


def _synthetic_jobs() -> tuple[list[JobRecord], dict[str, Any]]:
    """~40 target x variant groups exercising every branch of the analysis (built from one fixture, seeded)."""
    rng = random.Random(20261121)
    base = json.loads((BENCHMARKS / "p4d-bs8-r0.json").read_text())
    catalog = {
        f"ml.x{i}.48xlarge": {
            "on_demand_usd_per_hour": round(rng.uniform(1.0, 120.0), 3),
            "price_region": "us-east-1",
            "price_date": "2026-11-01",
            "price_source": "synthetic regression price",
        }
        for i in range(5)
    }
    shapes = ["low", "base", "high", "steep", "flat", "short", "none"]
    jobs: list[JobRecord] = []
    for group in range(40):
        instance = f"ml.x{group % 6}.48xlarge"  # ml.x5 is not in the catalog: priced from the job spec
        count = 2 if group % 9 == 4 else 1
        reps = 1 if group % 5 == 1 else 3
        shape = shapes[group % len(shapes)]
        scale = rng.uniform(0.05, 3.0)
        for rep in range(reps):
            name = f"gs-reg-{group}-r{rep}"
            bench = copy.deepcopy(base)
            tps = base["throughput"]["tokens_per_s"] * scale * rng.uniform(0.97, 1.03)
            bench["job_name"], bench["instance_type"] = name, instance
            bench["throughput"]["tokens_per_s"] = tps
            bench["throughput"]["tokens_per_s_ci95"] = [tps * 0.99, tps * 1.01] if group % 8 else None
            bench["hardware"]["world_size"] = 8 * count
            bench["loss"]["train"] = [] if shape == "none" else _curve(shape, base["loss"]["train"], rng, scale)
            if group % 11 == 3:
                bench["efficiency"]["mfu"] = None
            status = JobStatus.COMPLETED
            if group == 7 or (group == 8 and rep == 1):
                status = JobStatus.OOM
            elif group == 12:
                status = rng.choice([JobStatus.CAPACITY, JobStatus.QUOTA])
            elif group == 13 and rep == 2:
                bench["status"], bench["failure_reason"] = "failed", "NaN loss at step 40"
            elif group == 14 and rep == 0:
                # an unreadable benchmark.json: the runner and the event recorder validate it as they read it, so the
                # job is recorded failed, with why, and no benchmark (job_process._read_benchmark)
                status = JobStatus.FAILED
            benchmark: dict[str, Any] | None = bench if status is JobStatus.COMPLETED else None
            if group == 15 and rep == 1:
                benchmark = None  # completed without a benchmark.json
            cloud = group % 3 != 0
            jobs.append(
                JobRecord(
                    run_id="regression",
                    job_name=name,
                    status=status,
                    instance_type=instance,
                    instance_count=count,
                    variant_name=f"v{group // 6}",
                    repetition=rep,
                    spot=group % 4 == 0,
                    spec=job_spec(
                        name,
                        "regression",
                        target_index=group % 6,
                        variant_name=f"v{group // 6}",
                        repetition=rep,
                        instance_type=instance,
                        instance_count=count,
                        gpus_per_instance=8,
                        spot=group % 4 == 0,
                        price_per_hour_usd=10.0,
                        spot_price_per_hour_usd=4.5 if group % 2 else None,
                        precision="bf16",
                    ),
                    benchmark=benchmark,
                    billable_seconds=rng.randint(300, 3000) if cloud else None,
                    secondary_status_transitions=_transitions(rng, 1_763_700_000_000 + group) if cloud else [],
                    failure_reason=None
                    if status is JobStatus.COMPLETED
                    else "benchmark.json is unreadable: 1 validation error for BenchmarkResult"
                    if group == 14
                    else "synthetic failure",
                )
            )
    rng.shuffle(jobs)  # the analysis must not depend on the order the store returns jobs in
    return jobs, catalog


def _case(name: str) -> tuple[RunRecord, list[JobRecord], dict[str, Any], dict[str, Any]]:
    if name == "example_run":
        run, jobs, catalog = load_example_run()
        return run, jobs, catalog, run.manifest
    jobs, catalog = _synthetic_jobs()
    manifest: dict[str, Any] = {
        "synthetic-cheapest": {
            "objective": "cheapest_per_token",
            "constraints": {"budget_usd": 1000.0, "deadline_hours": 48.0, "target_loss": 5.0},
        },
        "synthetic-fastest": {"objective": "fastest_within_budget", "constraints": {"budget_usd": 400.0}},
    }[name]
    run = RunRecord(run_id="regression", name=name, status="ANALYZING", manifest_source="test", manifest=manifest)
    return run, jobs, catalog, manifest


CASES = ("example_run", "synthetic-cheapest", "synthetic-fastest")


def _analysis_json(name: str) -> dict[str, Any]:
    run, jobs, catalog, manifest = _case(name)
    analysis = analyze_run(run, jobs, terms=RunTerms.stored(manifest), catalog=catalog)
    data: dict[str, Any] = analysis.model_dump(mode="json")
    del data["generated_at"], data["price_snapshot"]["taken_at"]  # clock readings
    return data


def _first_difference(actual: Any, expected: Any, path: str = "") -> str | None:
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key in sorted(set(expected) | set(actual)):
            if key not in actual or key not in expected:
                return f"{path}.{key}: present in only one of them"
            found = _first_difference(actual[key], expected[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(expected, list) and isinstance(actual, list):
        if len(actual) != len(expected):
            return f"{path}: {len(actual)} items, expected {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            found = _first_difference(a, e, f"{path}[{i}]")
            if found:
                return found
        return None
    if type(actual) is float and type(expected) is float and math.isclose(actual, expected, rel_tol=1e-9, abs_tol=0):
        return None
    return None if actual == expected and type(actual) is type(expected) else f"{path}: {actual!r} != {expected!r}"


@pytest.mark.parametrize("name", CASES)
def test_analysis_output_is_unchanged(name: str) -> None:
    expected = json.loads((EXPECTED / f"expected-{name}.json").read_text())
    # through JSON, as the store and report.json hold it (tuples become lists)
    actual = json.loads(json.dumps(_analysis_json(name)))
    assert _first_difference(actual, expected) is None


def test_synthetic_cases_cover_every_branch() -> None:
    data = json.loads((EXPECTED / "expected-synthetic-cheapest.json").read_text())
    methods = {j["target_loss_method"] for j in data["jobs"]}
    assert {"measured", "power-law fit", "log-linear fit", "not projected"} <= methods
    statuses = {j["status"] for j in data["jobs"]}
    assert {"completed", "OOM"} <= statuses and statuses & {"CAPACITY", "QUOTA"}
    assert any(j["excluded_reason"] for j in data["jobs"]) and any(j["rank"] for j in data["jobs"])
    assert any(j["price_source"] and "job spec" in j["price_source"] for j in data["jobs"])


if __name__ == "__main__":  # regenerate the expected files (review the diff before committing it)
    EXPECTED.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        (EXPECTED / f"expected-{case}.json").write_text(json.dumps(_analysis_json(case), indent=1) + "\n")
        print(f"wrote {EXPECTED / f'expected-{case}.json'}")
