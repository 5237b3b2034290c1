"""The settings search's pure parts (docs/search.md): the manifest section, candidate expansion and skipping,
the interval-guarded successive halving, the trial and spend budgets, and resuming a search from the store."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuscout.domain.catalog import LocalHardware, load_catalog
from gpuscout.domain.jobspec import JobSpec
from gpuscout.domain.manifest_loader import parse_manifest
from gpuscout.errors import GpuscoutError, ManifestError
from gpuscout.local import job_process
from gpuscout.local import runner as local
from gpuscout.local.job_process import JobFolders
from gpuscout.local.observer import SilentObserver
from gpuscout.local.runner import run_local
from gpuscout.local.search import StopCheck, objective_value, run_search
from gpuscout.paths import MANIFESTS_DIR
from gpuscout.plan.device_fit import FLEX_ON_CPU
from gpuscout.plan.planner import plan
from gpuscout.store.base import JobRecord, JobStatus, RunStatus
from gpuscout.store.sqlite import SqliteStore
from gpuscout.workflow.ports import JobOutcome
from tests.benchmark_results import benchmark_result

ROOT = Path(__file__).resolve().parents[2]
H100 = ROOT / "configs" / "manifests" / "h100-settings-sweep.yaml"
QUICKSTART = ROOT / "configs" / "manifests" / "quickstart.yaml"
CPU = LocalHardware(device="cpu", gpu_count=0, memory_gib=16.0, cpu_count=2, startup_s=1.0)


def _search_manifest(**search: Any) -> dict[str, Any]:
    data = yaml.safe_load(QUICKSTART.read_text())
    data["name"] = "tiny-search"
    data["variants"] = [{"name": "base", "dataloader_workers": 0}]
    data["search"] = {
        "space": {"per_device_batch_size": [1, 2, 4, 8], "gradient_checkpointing": [False, True]},
        "sequences_per_step": 8,
        **search,
    }
    return data


def _problems(data: dict[str, Any]) -> str:
    with pytest.raises(ManifestError) as err:
        parse_manifest(yaml.safe_dump(data), "m.yaml")
    return str(err.value)


def test_the_search_section_is_checked_with_field_paths() -> None:
    data = _search_manifest(by_instance_type={"ml.p5.48xlarge": {"torch_compile": [True]}}, max_cost_usd=5.0)
    data["variants"].append({"name": "other"})
    data["repetitions"] = 2
    text = _problems(data)
    assert "search.by_instance_type.ml.p5.48xlarge: not a target; allowed: local" in text
    assert "search.max_cost_usd: 5 exceeds constraints.budget_usd (1)" in text
    assert "variants: with a search section give at most one variant" in text
    assert "repetitions: a search runs each candidate once" in text
    dup = _search_manifest()
    dup["search"]["space"]["per_device_batch_size"] = [2, 2]
    assert "values must be distinct" in _problems(dup)
    none = yaml.safe_load(QUICKSTART.read_text())
    none["variants"] = []
    assert "variants: at least one variant (or a search section)" in _problems(none)
    tracking = yaml.safe_load(QUICKSTART.read_text()) | {"tracking": {}}
    assert "name mlflow, wandb or both" in _problems(tracking)


def test_candidates_span_the_space_and_skip_what_cannot_run() -> None:
    # Given 4 micro-batches x checkpointing at 8 sequences per step, and a micro-batch (3) that does not divide 8
    data = _search_manifest()
    data["search"]["space"]["per_device_batch_size"] = [1, 2, 3, 4, 8]
    manifest = parse_manifest(yaml.safe_dump(data), "m.yaml")
    the_plan = plan(manifest, load_catalog(), run_id="tiny-search-1", local_hardware=CPU)
    [target] = the_plan.search.targets
    # Then the 8 that divide are candidates with the accumulation that keeps 8 sequences per step
    assert len(the_plan.jobs) == len(target.candidates) == 8
    for job in the_plan.jobs:
        hp = job.hyperparameters
        assert int(hp["per_device_train_batch_size"]) * int(hp["gradient_accumulation_steps"]) == 8
    assert {"b1-a8-w0", "b8-a1-ckpt-w0"} <= set(target.candidates)
    assert [(s.name, s.reason) for s in target.skipped] == [
        ("b3-a1-w0", "micro-batch 3 does not divide search.sequences_per_step 8"),
        ("b3-a1-ckpt-w0", "micro-batch 3 does not divide search.sequences_per_step 8"),
    ]
    assert target.dimensions == {"per_device_batch_size": [1, 2, 3, 4, 8], "gradient_checkpointing": [False, True]}


def test_the_memory_model_keeps_the_h100_sweep_from_launching_what_cannot_fit() -> None:
    manifest = parse_manifest(H100.read_text(), str(H100))
    the_plan = plan(manifest, load_catalog(), run_id="qwen1-5b-h100-sweep-1")
    [target] = the_plan.search.targets
    memory = [s for s in target.skipped if s.reason.startswith("memory model")]
    # micro-batch 4 and up without checkpointing, and 16 even with it (the fp32 logits), need more than 90 % of
    # 80 GB under the calibrated model (docs/performance.md); none of them is a candidate
    skipped = {s.name for s in memory}
    assert {"b4-a4-w4", "b8-a2-compile-w2", "b16-a1-w4", "b16-a1-ckpt-w4"} <= skipped
    assert all(s.settings["per_device_batch_size"] >= 4 for s in memory)
    assert not skipped & set(target.candidates)
    assert {"b2-a8-w4", "b8-a2-ckpt-compile-w4"} <= set(target.candidates)
    assert len(target.candidates) + len(target.skipped) == 4 * 2 * 2 * 2
    assert len(target.candidates) <= 30  # one SageMaker tuning job's categorical values
    # and the plan's cost is what the trials can cost at most: capped by search.max_cost_usd
    assert the_plan.predicted_cost_usd == pytest.approx(110.0)


# -- the driver, on synthetic trials ------------------------------------------------------------------------------


def _plan(**search: Any) -> Any:
    manifest = parse_manifest(yaml.safe_dump(_search_manifest(**search)), "m.yaml")
    return plan(manifest, load_catalog(), run_id="tiny-search-1", local_hardware=CPU)


def _fake_trials(rates: dict[str, float], *, noise: float = 0.02, seed: int = 0) -> tuple[Any, list[str], dict]:
    """run_trial for synthetic jobs: 20 steps of 2,048 tokens at ``rates[variant]`` tokens/s (+- noise)."""
    rng = random.Random(seed)
    launched: list[str] = []
    steps_run: dict[str, int] = {}

    def run_trial(spec: JobSpec, check: StopCheck) -> JobRecord:
        launched.append(spec.variant_name)
        for step in range(1, 21):
            seconds = 2048 / (rates[spec.variant_name] * (1 + rng.uniform(-noise, noise)))
            steps_run[spec.variant_name] = step
            if why := check(step, 2048.0, seconds):
                return JobRecord.from_spec(spec, JobStatus.PRUNED, failure_reason=why, training_seconds=step)
        return JobRecord.from_spec(spec, JobStatus.COMPLETED, training_seconds=20)

    return run_trial, launched, steps_run


RATES = {
    "b1-a8-w0": 10_000.0, "b1-a8-ckpt-w0": 7_000.0, "b2-a4-w0": 20_000.0, "b2-a4-ckpt-w0": 14_000.0,
    "b4-a2-w0": 30_000.0, "b4-a2-ckpt-w0": 21_000.0, "b8-a1-w0": 40_000.0, "b8-a1-ckpt-w0": 28_000.0,
}  # fmt: skip


def test_clearly_worse_trials_are_pruned_and_the_winner_is_kept() -> None:
    the_plan = _plan(pruning={"min_timed_steps": 4, "reduction_factor": 2})
    run_trial, launched, steps = _fake_trials(RATES)
    summary = run_search(the_plan.search, the_plan.jobs, run_trial=run_trial)
    # every candidate launched once; the winner finished; the clearly slower ones stopped at the first rung
    assert sorted(launched) == sorted(RATES)
    assert summary.best == {0: "b8-a1-w0"}
    assert steps["b8-a1-w0"] == 20 and summary.pruned
    assert all(steps[name] < 20 for name in RATES if any(name in p for p in summary.pruned))
    # the first trial ran is the predicted cheapest (no checkpointing), so it has no yardstick and runs in full
    assert "ckpt" not in launched[0]
    # with pruning off, nothing is pruned and the same winner wins
    exhaustive = _plan(pruning={"enabled": False})
    run_trial, _, steps = _fake_trials(RATES)
    full = run_search(exhaustive.search, exhaustive.jobs, run_trial=run_trial)
    assert full.best == summary.best and not full.pruned and set(steps.values()) == {20}


def test_a_trial_within_the_noise_of_the_best_is_not_pruned() -> None:
    # Given two candidates 3 % apart with 20 % step noise: their intervals overlap
    rates = dict.fromkeys(RATES, 1_000.0) | {"b8-a1-w0": 40_000.0, "b4-a2-w0": 38_800.0}
    the_plan = _plan(pruning={"min_timed_steps": 4, "reduction_factor": 2})
    run_trial, _, steps = _fake_trials(rates, noise=0.2)
    summary = run_search(the_plan.search, the_plan.jobs, run_trial=run_trial)
    # Then both finish; the slow rest are pruned
    assert steps["b8-a1-w0"] == 20 and steps["b4-a2-w0"] == 20
    assert len(summary.pruned) == 6


def test_trial_and_spend_budgets_stop_the_search() -> None:
    # max_trials below the candidate count: TPE proposes, at most 3 launched
    the_plan = _plan(max_trials=3)
    run_trial, launched, _ = _fake_trials(RATES)
    summary = run_search(the_plan.search, the_plan.jobs, run_trial=run_trial)
    assert len(launched) == 3 == summary.launched and len(set(launched)) == 3
    # a spend cap below two trials' predicted cost: one trial, then the search says why it stopped
    cost = max(j.prediction.cost_usd for j in the_plan.jobs)
    capped = _plan(max_cost_usd=round(cost * 1.5, 6))
    run_trial, launched, _ = _fake_trials(RATES)
    summary = run_search(capped.search, capped.jobs, run_trial=run_trial)
    assert summary.stopped_because and "search.max_cost_usd" in summary.stopped_because
    assert len(launched) <= 2


def test_objective_values_rank_alike() -> None:
    assert objective_value(1000.0, price_per_hour_usd=3.6, objective="cheapest_per_token") == pytest.approx(1.0)
    assert objective_value(1000.0, price_per_hour_usd=3.6, objective="fastest") == pytest.approx(1000.0)


# -- resuming from the store ---------------------------------------------------------------------------------------


def test_an_interrupted_search_resumes_from_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a search interrupted (Ctrl-C) during its third trial
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "dataset.json").write_text('{"train_blocks": 4096, "train_tokens": 1048576, "vocab_size": 1024}')
    monkeypatch.setattr(local, "prepare_data", lambda *_a, **_k: data_dir)
    monkeypatch.setattr(local.prepare_data_step, "check_prepared_data", lambda *_a, **_k: set())
    manifest = tmp_path / "search.yaml"
    manifest.write_text(yaml.safe_dump(_search_manifest()))
    calls: list[str] = []

    def interrupted(spec: JobSpec, folders: JobFolders, **_: object) -> JobOutcome:
        calls.append(spec.variant_name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return JobOutcome(JobStatus.COMPLETED, None, None, 1.0)

    monkeypatch.setattr(job_process, "run_job", interrupted)
    store = SqliteStore(tmp_path / "g.db")
    seen: list[tuple[str, int, int]] = []

    class Observer(SilentObserver):
        def job_started(self, index: int, total: int, spec: JobSpec, max_steps: int | None) -> None:
            seen.append((spec.variant_name, index, total))

        def message(self, text: str, *, warning: bool = False) -> None:
            seen.append((text, 0, 0))

    first = run_local(manifest, store=store, runs_dir=tmp_path / "runs", observer=Observer())
    assert first.status is RunStatus.STOPPED and len(calls) == 3
    kept = calls[:2]
    # each trial was numbered against the trial budget (8 candidates, max_trials 8 by default), and the end says how
    # to go on
    assert [(i, n) for name, i, n in seen if name in calls] == [(1, 8), (2, 8), (3, 8)]
    hint = f"gpuscout local {manifest} --resume {first.run_id} --runs-dir {tmp_path / 'runs'}"
    assert any(hint in text for text, _, _ in seen), seen

    # When it is resumed
    calls.clear()
    monkeypatch.setattr(job_process, "run_job", lambda spec, folders, **_: calls.append(spec.variant_name)
                        or JobOutcome(JobStatus.COMPLETED, None, None, 1.0))  # fmt: skip
    seen.clear()
    again = run_local(manifest, store=store, runs_dir=tmp_path / "runs", resume=first.run_id, observer=Observer())
    assert [i for name, i, _ in seen if name in calls][:1] == [3]  # numbered after the 2 finished before

    # Then only the trials not finished ran (the interrupted one again), under the same run id
    assert again.run_id == first.run_id
    assert sorted(calls + kept) == sorted(RATES) and not set(calls) & set(kept)
    assert {j.status for j in store.list_jobs(first.run_id)} == {JobStatus.COMPLETED}

    # and a changed manifest, or a run that is not a search, is refused with why
    manifest.write_text(yaml.safe_dump(_search_manifest(seed=3)))
    with pytest.raises(GpuscoutError, match="the manifest differs"):
        run_local(manifest, store=store, runs_dir=tmp_path / "runs", resume=first.run_id)


def test_a_resumed_trial_counts_with_its_benchmarks_throughput() -> None:
    # Given the finished, fastest trial of an earlier run, recorded with its benchmark.json throughput
    the_plan = _plan(pruning={"min_timed_steps": 4, "reduction_factor": 2})
    spec = next(j for j in the_plan.jobs if j.variant_name == "b8-a1-w0")
    benchmark = benchmark_result(throughput={"tokens_per_s": 40_000.0, "tokens_per_s_ci95": [39_500.0, 40_500.0]})
    done = {spec.job_name: JobRecord.from_spec(spec, JobStatus.COMPLETED, benchmark=benchmark, training_seconds=20)}
    run_trial, launched, _ = _fake_trials(RATES)
    # When the search resumes, Then it is not run again, it is the best, and it is the yardstick for pruning
    summary = run_search(the_plan.search, the_plan.jobs, run_trial=run_trial, done=done)
    assert "b8-a1-w0" not in launched and len(launched) == 7
    assert summary.best == {0: "b8-a1-w0"} and summary.pruned


def test_parallel_trials_are_counted_in_the_budget_before_launch() -> None:
    from gpuscout.plan.jobs import Plan

    # Given a search whose spend cap is reached while trials still run: each parallel trial beyond the first can add
    # up to one (costliest) trial to the spend, so the worst case is counted before anything launches
    base = yaml.safe_load((MANIFESTS_DIR / "h100-settings-sweep.yaml").read_text())
    base["search"]["max_cost_usd"] = 10.0
    base["constraints"]["budget_usd"] = 10_000.0

    def planned(parallel: int) -> Plan:
        data = {**base, "search": {**base["search"], "max_parallel_trials": parallel}}
        catalog = load_catalog()
        return plan(parse_manifest(json.dumps(data), "m.json", catalog), catalog, run_id="r")

    one, four = planned(1), planned(4)
    assert one.search is not None and four.search is not None and four.search.max_parallel_trials == 4
    costliest = [
        sorted((j.prediction.cost_usd for j in four.jobs if j.target_index == t.target_index), reverse=True)
        for t in four.search.targets
    ]
    uncapped = sum(sum(c[: t.max_trials]) for c, t in zip(costliest, four.search.targets, strict=True))
    assert one.predicted_cost_usd == pytest.approx(min(uncapped, 10.0))
    assert four.predicted_cost_usd == pytest.approx(min(uncapped, 10.0 + sum(sum(c[:3]) for c in costliest)))
    assert four.predicted_cost_usd > one.predicted_cost_usd


def test_the_plan_table_totals_what_a_search_can_run_and_names_no_run_id() -> None:
    from rich.console import Console

    from gpuscout.cli.local_view import print_plan

    # Given a search with more candidates than trials
    the_plan = _plan(max_trials=3)
    assert the_plan.search is not None and len(the_plan.jobs) == 8
    seconds = sorted(
        (j.prediction.training_seconds + j.prediction.overhead_seconds for j in the_plan.jobs), reverse=True
    )
    # Then the time it predicts is the 3 longest candidates', not all 8
    assert the_plan.predicted_sequential_seconds == pytest.approx(sum(seconds[:3]))
    console = Console(width=200, record=True)
    print_plan(console, the_plan, for_run=False)
    text = console.export_text()
    assert "total: at most 3 of these 8 candidates run" in text and "≤ " in text
    # and `gpuscout plan`'s preview names no run id (a run draws its own)
    assert the_plan.run_id not in text and "a run draws its own run id" in text


def test_a_resumed_search_keeps_to_max_trials_counting_the_earlier_trials() -> None:
    # Given a search of at most 3 trials whose earlier process finished 2 of them
    the_plan = _plan(max_trials=3)
    earlier = [j for j in the_plan.jobs if j.variant_name in ("b8-a1-w0", "b2-a4-w0")]
    assert len(earlier) == 2
    benchmark = benchmark_result(throughput={"tokens_per_s": 30_000.0, "tokens_per_s_ci95": [29_500.0, 30_500.0]})
    done = {
        spec.job_name: JobRecord.from_spec(spec, JobStatus.COMPLETED, benchmark=benchmark, training_seconds=20)
        for spec in earlier
    }
    run_trial, launched, _ = _fake_trials(RATES)
    # When it resumes, Then one more trial runs: 3 in all, not 3 more
    summary = run_search(the_plan.search, the_plan.jobs, run_trial=run_trial, done=done)
    assert len(launched) == 1 == summary.launched
    assert launched[0] not in {"b8-a1-w0", "b2-a4-w0"}


def test_a_search_on_a_cpu_skips_flex_attention_with_the_reason() -> None:
    # Given a search over attention kernels on a CPU target (FlexAttention has no backward pass on a CPU)
    data = _search_manifest()
    data["search"]["space"] = {"attention": ["sdpa", "flex"]}
    the_plan = plan(parse_manifest(yaml.safe_dump(data), "m.yaml"), load_catalog(), run_id="s-1", local_hardware=CPU)
    [target] = the_plan.search.targets
    # Then the flex candidate is skipped, saying why and what to use, and never launched
    assert [s.reason for s in target.skipped] == [FLEX_ON_CPU]
    assert all("flex" not in name for name in target.candidates)
