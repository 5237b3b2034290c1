"""Time analyze_run on 10,000 synthetic job results (target: under 2 s). Not a test; run it by hand:

    .venv/bin/python benchmarks/analysis_10k.py [--jobs 10000] [--target-loss 5.0]

The jobs are copies of tests/fixtures/benchmarks/p4d-bs8-r0.json spread over 25 instance types x variants x 3
repetitions, with throughput scaled per job; every group's loss curve is checked against the target loss (a third
reach it, the rest need a power-law fit). Building the inputs is not timed; analyze_run is.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from gpuscout.analysis.analyze import analyze_run
from gpuscout.analysis.terms import RunTerms
from gpuscout.domain.jobspec import JobSpec, Prediction
from gpuscout.store.base import JobRecord, JobStatus, RunRecord

# the synthetic jobs were never planned: no predicted rate
UNPREDICTED = Prediction(
    tokens_per_s=None, mfu_assumed=None, training_seconds=0.0, overhead_seconds=0.0, cost_usd=0.0, method="none"
)

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "benchmarks" / "p4d-bs8-r0.json"
REPETITIONS = 3
INSTANCE_TYPES = 25


def make_jobs(count: int, rng: random.Random) -> tuple[list[JobRecord], dict[str, dict[str, object]]]:
    base = json.loads(FIXTURE.read_text())
    catalog = {
        f"ml.x{i}.48xlarge": {
            "on_demand_usd_per_hour": round(rng.uniform(1.0, 120.0), 3),
            "price_region": "us-east-1",
            "price_date": "2026-11-01",
            "price_source": "synthetic benchmark price",
        }
        for i in range(INSTANCE_TYPES)
    }
    jobs = []
    for n in range(count):
        group, rep = divmod(n, REPETITIONS)
        instance = f"ml.x{group % INSTANCE_TYPES}.48xlarge"
        variant = f"v{group // INSTANCE_TYPES}"
        name = f"gs-bench-{group}-r{rep}"
        bench = dict(base)  # analysis never mutates its input: share the unchanged parts (loss curve, ...)
        bench["throughput"] = dict(base["throughput"])
        scale = rng.uniform(0.05, 3.0) if rep == 0 else 1.0
        bench["job_name"] = name
        bench["instance_type"] = instance
        tps = bench["throughput"]["tokens_per_s"] * scale * rng.uniform(0.98, 1.02)
        bench["throughput"]["tokens_per_s"] = tps
        bench["throughput"]["tokens_per_s_ci95"] = [tps * 0.99, tps * 1.01]
        status = JobStatus.COMPLETED if rng.random() > 0.03 else rng.choice([JobStatus.OOM, JobStatus.CAPACITY])
        jobs.append(
            JobRecord(
                run_id="bench",
                job_name=name,
                status=status,
                instance_type=instance,
                variant_name=variant,
                repetition=rep,
                spot=group % 7 == 0,
                spec=JobSpec(
                    job_name=name,
                    run_id="bench",
                    target_index=group % INSTANCE_TYPES,
                    variant_name=variant,
                    repetition=rep,
                    instance_type=instance,
                    instance_count=1,
                    gpus_per_instance=8,
                    spot=group % 7 == 0,
                    price_per_hour_usd=10.0,
                    precision="bf16",
                    max_runtime_seconds=3600,
                    hyperparameters={},
                    prediction=UNPREDICTED,
                ),
                benchmark=bench if status is JobStatus.COMPLETED else None,
                billable_seconds=rng.randint(300, 3000),
                failure_reason=None if status is JobStatus.COMPLETED else "synthetic failure",
            )
        )
    return jobs, catalog


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--target-loss", type=float, default=5.0)
    args = parser.parse_args()
    rng = random.Random(0)
    jobs, catalog = make_jobs(args.jobs, rng)
    manifest = {
        "objective": "cheapest_per_token",
        "constraints": {"budget_usd": 1000.0, "deadline_hours": 48.0, "target_loss": args.target_loss},
    }
    run = RunRecord(run_id="bench", name="bench", status="ANALYZING", manifest_source="benchmark", manifest=manifest)
    start, cpu_start = time.perf_counter(), time.process_time()
    analysis = analyze_run(run, jobs, terms=RunTerms.stored(manifest), catalog=catalog)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    ranked = sum(1 for j in analysis.jobs if j.rank is not None)
    print(
        f"analyze_run: {len(jobs):,} jobs -> {len(analysis.jobs):,} target x variant groups "
        f"({ranked:,} ranked, {len(analysis.excluded):,} excluded) in {elapsed:.3f} s wall, "
        f"{cpu:.3f} s CPU ({'OK' if elapsed < 2.0 else 'OVER'} the 2 s target)"
    )


if __name__ == "__main__":
    main()
