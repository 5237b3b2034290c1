"""benchmarks/hopper.py end to end in --quick mode (tiny model, CPU), and the baseline's pieces of the plan."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from gpuscout.local.process_control import process_alive
from gpuscout.paths import REPO_DIR

BENCH = REPO_DIR / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"bench_{name}"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _quick(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / "hopper.py"), "--quick", "--steps", "5", "--out", str(tmp_path / "results"),
         "--data-dir", str(tmp_path / "data"), "--work-dir", str(tmp_path / "work"), *args],
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip


@pytest.mark.slow(seconds=59)
def test_quick_mode_runs_in_pieces_that_merge_into_one_table(tmp_path: Path) -> None:
    # Given two pieces run separately (as on two short GPU rentals), each with its own rows
    started = time.perf_counter()
    first = _quick(tmp_path, "--rows", "hf-trainer-as-written,optimized", "--piece", "a")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "[hopper] row 1/2: qwen2-tiny hf-trainer-as-written" in first.stdout  # progress
    second = _quick(tmp_path, "--rows", "hf-trainer-ckpt,no-fused-ce", "--piece", "b")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    elapsed = time.perf_counter() - started
    assert elapsed < 120, f"two --quick pieces took {elapsed:.0f} s"
    pieces = sorted((tmp_path / "results").glob("hopper-cpu-*-[ab].json"))
    assert [p.stem[-1] for p in pieces] == ["a", "b"]
    # When they are merged
    merged = subprocess.run(
        [sys.executable, str(BENCH / "hopper.py"), "merge", *map(str, pieces), "--out", str(tmp_path / "merged"),
         "--name", "hopper-cpu-merged"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert merged.returncode == 0, merged.stderr
    payload = json.loads((tmp_path / "merged" / "hopper-cpu-merged.json").read_text())
    md = (tmp_path / "merged" / "hopper-cpu-merged.md").read_text()
    # Then one table holds every row, with ratios against the as-written baseline (it ran on this CPU)
    rows = {r["variant"]: r for r in payload["rows"]}
    assert set(rows) == {"hf-trainer-as-written", "optimized", "hf-trainer-ckpt", "no-fused-ce"}
    assert payload["kind"] == "smoke-test" and "not a performance result" in md
    assert payload["ratio_reference"] == "hf-trainer-as-written"
    for row in rows.values():
        assert row["status"] == "completed", row
        assert row["tokens_per_s"] > 0 and row["steps"] == 5 and row["mfu"] is None
        assert row["ratio_to_baseline"] == pytest.approx(
            row["tokens_per_s"] / rows["hf-trainer-as-written"]["tokens_per_s"]
        )
    for name in ("optimized", "no-fused-ce"):  # train.py's rows carry the planner's CPU prediction beside them
        assert rows[name]["predicted_tokens_per_s"] > 0 and rows[name]["predicted_peak_gb"] > 0
        assert "matmul on this cpu" in rows[name]["details"]["planner"]["method"]
    # same initial weights, same validation targets: the losses compare; chunked CE equals full logits
    base_val = rows["hf-trainer-as-written"]["final_validation_loss"]
    assert abs(rows["optimized"]["final_validation_loss"] - base_val) < 0.5
    assert rows["optimized"]["final_validation_loss"] == pytest.approx(
        rows["no-fused-ce"]["final_validation_loss"], abs=1e-3
    )
    assert "| qwen2-tiny | optimized |" in md and "torch 2" in md
    # the HF Trainer baseline's steps are judged as train.py's are (5 steps: too few timed ones to judge)
    raw = json.loads((tmp_path / "work" / "qwen2-tiny" / "hf-trainer-as-written.json").read_text())
    assert raw["disturbance"]["timed_steps"] == raw["timed_steps"] and raw["disturbance"]["disturbed"] is False
    assert all(row["disturbed"] is None for row in rows.values())


def test_a_row_past_its_limit_is_stopped_and_reported_with_its_log(tmp_path: Path) -> None:
    """On the first H100 (2026-11-25) a row outlived its device call and left nothing: no table, no log. A row past
    --row-timeout-s is now stopped, reported "timed out" with its log's last lines, and the table is written."""
    done = _quick(tmp_path, "--rows", "optimized", "--piece", "t", "--row-timeout-s", "1")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    payload = json.loads(next((tmp_path / "results").glob("hopper-cpu-*-t.json")).read_text())
    (row,) = payload["rows"]
    assert row["status"] == "timed out" and "1 s limit" in row["failure_reason"]
    log = tmp_path / "work" / "qwen2-tiny" / "optimized" / "train.log"
    assert log.is_file() and f"log: {log}" in done.stdout
    assert "| qwen2-tiny | optimized | 1 x 7 | timed out: stopped at the row" in done.stdout


def _processes_with(marker: str) -> list[int]:
    """Pids whose environment holds ``marker`` (a test's own folder: train.py gets it in SM_OUTPUT_DATA_DIR)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes() and process_alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").is_file(), reason="reads /proc")
def test_a_row_does_not_outlive_hopper_when_hopper_is_stopped(tmp_path: Path) -> None:
    """gpu-check and `timeout` stop hopper.py with SIGTERM: its row (train.py, in a process group of its own, holding
    the GPU) must stop with it, not run on beside the next step."""
    work = tmp_path / "work"
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / "hopper.py"), "--quick", "--steps", "200", "--rows", "optimized",
         "--out", str(tmp_path / "results"), "--data-dir", str(tmp_path / "data"), "--work-dir", str(work)],
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not _processes_with(str(work)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(str(work)), "the row's train.py never started"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while _processes_with(str(work)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _processes_with(str(work))
    # and the stopped row is in the table, saying why, not lost with hopper.py
    (row,) = json.loads(next((tmp_path / "results").glob("hopper-cpu-*.json")).read_text())["rows"]
    assert row["status"] == "timed out" and "hopper.py received SIGTERM" in row["failure_reason"]


def test_a_row_cut_short_by_its_limit_is_not_reported_as_a_measurement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.py stops after its current step on SIGTERM and writes a completed result of fewer steps: at a row's
    limit that is a partial run, kept out of the table's figures, ratios and planner error."""
    hopper = _load("hopper")
    setup = hopper.parse_args(["--quick", "--steps", "30", "--work-dir", str(tmp_path)])
    variant = hopper.variants("qwen2-tiny", 4, quick=True)[0]

    def cut_short(cmd: list[str], env: dict[str, str], log: Path, timeout_s: float | None) -> str:
        out = Path(env["SM_OUTPUT_DATA_DIR"]) / "benchmark.json"
        out.parent.mkdir(parents=True)
        out.write_text(json.dumps({"status": "completed", "stop": {"steps": 7}}))
        return "stopped at the row's 60 s limit (--row-timeout-s)"

    monkeypatch.setattr(hopper, "run_logged", cut_short)
    row = hopper.run_variant(setup, "qwen2-tiny", variant, {"splits": {}, "tokenizer": {"vocab_size": 512}})
    assert row.status == "timed out" and row.tokens_per_s is None
    assert "after 7 of 30 steps: not a measurement of the row" in row.failure_reason


def test_merge_refuses_pieces_of_different_data(tmp_path: Path) -> None:
    hopper = _load("hopper")
    piece = {"dataset_sha256": "a", "steps": 5, "blocks_per_step": 1, "sequence_length": 512, "kind": "smoke-test",
             "environment": {"gpu": None}, "rows": []}  # fmt: skip
    (tmp_path / "a.json").write_text(json.dumps(piece))
    (tmp_path / "b.json").write_text(json.dumps({**piece, "dataset_sha256": "b"}))
    with pytest.raises(SystemExit):
        hopper.main(["merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path)])


def test_ratios_fall_back_to_the_checkpointed_baseline_when_the_as_written_one_runs_out_of_memory() -> None:
    hopper = _load("hopper")
    rows = [
        hopper.Row("qwen2.5-1.5b", "hf-trainer-as-written", "", "out of memory", peak_memory_gb=79.1),
        hopper.Row("qwen2.5-1.5b", "hf-trainer-ckpt", "", "completed", tokens_per_s=20_000.0),
        hopper.Row("qwen2.5-1.5b", "optimized", "", "completed", tokens_per_s=41_000.0),
    ]
    assert hopper.apply_ratios(rows) == "hf-trainer-ckpt"
    assert [r.ratio_to_baseline for r in rows] == [None, 1.0, pytest.approx(2.05)]
    assert "| out of memory: " in hopper.table(rows) and "79.1 at failure" in hopper.table(rows)


def test_a_disturbed_row_and_every_ratio_to_it_are_marked_with_the_evidence() -> None:
    hopper = _load("hopper")
    stall = {"disturbed": True, "evidence": "step 9 alone 20.0x the fastest quarter's median (310 ms), 45 % of the"}
    rows = [
        hopper.Row("qwen2.5-1.5b", "hf-trainer-ckpt", "", "completed", tokens_per_s=20_000.0,
                   disturbed=hopper.disturbed_evidence(stall)),
        hopper.Row("qwen2.5-1.5b", "optimized", "", "completed", tokens_per_s=41_000.0,
                   disturbed=hopper.disturbed_evidence({"disturbed": False, "evidence": None})),
    ]  # fmt: skip
    assert hopper.apply_ratios(rows) == "hf-trainer-ckpt"
    text = hopper.table(rows)
    baseline_line, optimized_line = (line for line in text.splitlines() if line.startswith("| qwen2.5-1.5b"))
    assert "| 20,000 (disturbed) |" in baseline_line and "| 1.00 (disturbed) |" in baseline_line
    # the optimized row ran at one speed, but its ratio divides by a disturbed baseline
    assert "| 41,000 |" in optimized_line and "| 2.05 (disturbed) |" in optimized_line
    assert f"- qwen2.5-1.5b hf-trainer-ckpt: disturbed, {stall['evidence']}" in text
    assert "qwen2.5-1.5b optimized: disturbed" not in text
    # a clean table says nothing of disturbances
    rows[0].disturbed = None
    assert "disturbed" not in hopper.table(rows)


def test_each_train_py_row_shows_the_planners_prediction_and_its_error() -> None:
    from gpuscout.domain.flops import hardware_flops_per_token
    from gpuscout.domain.hardware import load_skus
    from gpuscout.domain.models import PRESETS, QWEN_TOKENIZER_VOCAB, training_vocab

    hopper = _load("hopper")
    # the optimized 1.5B row as train.py would record it on an H100 (micro-batch 2 x 2, flex, chunked loss)
    benchmark = {
        "config": {"per_device_batch_size": 2, "gradient_accumulation_steps": 2, "deepspeed_stage": 0,
                   "torch_compile": True, "gradient_checkpointing": False, "packing": True, "attention": "flex",
                   "optimizations": ["fused_adamw", "chunked_cross_entropy", "torch_compile"],
                   "sequence_length": 4096, "precision": "bf16"},
        "hardware": {"device": "cuda", "gpu_sku": "H100-SXM5-80GB", "peak_tflops_per_gpu": 989.0, "world_size": 1,
                     "nodes": 1},
    }  # fmt: skip
    prediction = hopper.planner_prediction("qwen2.5-1.5b", benchmark, tokenizer_vocab=QWEN_TOKENIZER_VOCAB)
    arch = PRESETS["qwen2.5-1.5b"]
    arch = arch.with_vocab(training_vocab("qwen2.5-1.5b", arch.vocab_size, QWEN_TOKENIZER_VOCAB))
    flops = hardware_flops_per_token(arch, 4096.0, activation_recompute=False)
    expected = (load_skus()["H100-SXM5-80GB"].assumed_mfu or 0) * 989.4e12 / flops
    assert prediction["tokens_per_s"] == pytest.approx(expected)
    assert "H100-SXM5-80GB assumed utilization" in prediction["method"]
    assert 20 < prediction["peak_gb"] < 80  # micro-batch 2 of 4,096 tokens without checkpointing, chunked loss
    row = hopper.Row("qwen2.5-1.5b", "optimized", "all on", "completed", tokens_per_s=expected / 1.25,
                     peak_memory_gb=prediction["peak_gb"] * 1.1)  # fmt: skip
    hopper.apply_prediction(row, prediction)
    assert row.tokens_per_s_error_pct == pytest.approx(25.0)
    assert row.peak_error_pct == pytest.approx(100 * (1 / 1.1 - 1))
    assert f"{expected:,.0f} (+25.0 %)" in hopper.table([row])


def test_documents_are_the_pieces_of_the_blocks() -> None:
    baseline = _load("hf_trainer_baseline")
    ids = np.arange(16, dtype=np.int32).reshape(2, 8)
    seg = np.array([[1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 2, 2, 2, 0, 0, 0]], dtype=np.int32)
    pieces = baseline.documents(ids, seg)
    assert [p.tolist() for p in pieces] == [[0, 1, 2], [3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
    collator = baseline.PadToLength(6, pad_token_id=99)
    batch = collator([{"input_ids": [5, 6, 7]}, {"input_ids": list(range(9))}])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 99, 99, 99], [0, 1, 2, 3, 4, 5]]
    assert batch["labels"].tolist()[0] == [5, 6, 7, -100, -100, -100]  # padding (= EOS id in Qwen) is no target
    assert list(collator.counts) == [9]


def test_baseline_model_has_train_py_weights_and_default_attention() -> None:
    from gpuscout_data.dataset import DatasetSummary
    from gpuscout_train import args as train_args
    from gpuscout_train import model as train_model

    baseline = _load("hf_trainer_baseline")
    summary = DatasetSummary(
        format="gpuscout-packed-v1", script_version="1", source="x", sequence_length=32,
        tokenizer={"vocab_size": 300, "eos_token_id": 0, "pad_token_id": 0, "id": "t"}, documents=1,
        documents_read=1, dropped={}, tokens=1, padding_fraction=0.0, t_eff=1.0, sha256="", seed=0,
        validation_fraction=0.0, splits={},
    )  # fmt: skip
    hp = train_args.Hyperparameters(model_preset="qwen2-tiny", seed=5)
    ours, _, _ = train_model.build_model(hp, summary, Path("."))
    theirs, _ = baseline.build_model("qwen2-tiny", summary, seed=5)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)
    assert theirs.config._attn_implementation == "sdpa"  # the transformers default where SDPA exists


def test_variants_ablate_each_optimization_at_the_same_global_batch() -> None:
    from gpuscout_train import args as train_args

    hopper = _load("hopper")
    rows = hopper.variants("qwen2.5-1.5b", 4, quick=False)
    optimized = rows[0].hyperparameters
    assert rows[0].name == "optimized" and optimized["attention_implementation"] == "flex"
    assert optimized["per_device_train_batch_size"] == 2 and optimized["gradient_accumulation_steps"] == 2
    for row in rows:
        hp = row.hyperparameters
        assert hp["per_device_train_batch_size"] * hp["gradient_accumulation_steps"] == 4
    flipped = {row.name: {k for k, v in row.hyperparameters.items() if optimized[k] != v} for row in rows[1:]}
    assert flipped["sdpa-mask"] == {"attention_implementation"}
    assert flipped["no-fused-ce"] == {"fused_cross_entropy", "cross_entropy_kernel"}
    assert flipped["ce-liger"] == flipped["ce-torch"] == {"cross_entropy_kernel"}
    assert optimized["cross_entropy_kernel"] == "chunked"
    for row in rows:  # every row's settings are ones train.py accepts
        train_args.Hyperparameters(model_preset="qwen2.5-1.5b", **row.hyperparameters).validate()
    assert flipped["no-compile"] == {"torch_compile"}
    assert flipped["no-fused-adamw"] == {"fused_adamw"}
    assert flipped["no-pinned-memory"] == {"pin_memory"}


def test_a_measurement_run_without_a_gpu_is_refused_before_any_work(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "hopper.py"), "--models", "qwen2.5-1.5b", "--rows", "optimized",
         "--out", str(tmp_path / "results"), "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, check=False, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert proc.returncode == 2 and "no CUDA GPU" in proc.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "results").exists()
