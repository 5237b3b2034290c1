"""train.py with LoRA adapters (method lora), subprocesses on the tiny model: the adapters train and the base stays
frozen, a checkpoint holds the adapters alone and a job killed after it resumes to the same losses, the saved model is
peft's adapter, and benchmark.json says what trained."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gpuscout.domain.adapters import Adapter, adapter_params
from gpuscout.domain.benchmark import BenchmarkResult
from gpuscout.domain.models import PRESETS
from gpuscout.paths import TRAIN_MODULE
from tests.sagemaker_job import job_environment

HPS = {
    "run_id": "r-test",
    "job_name": "gs-test-lora",
    "instance_type": "local",
    "model_preset": "qwen2-tiny",
    "per_device_train_batch_size": "4",
    "max_steps": "12",
    "learning_rate": "0.01",
    "seed": "7",
    "checkpoint_interval": "6",
    "validation_batches": "1",
    "method": "lora",
    "lora_rank": "4",
    "lora_alpha": "8",
    "lora_target_modules": "q_proj,v_proj,down_proj",
}


def _run(root: Path, dataset: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", TRAIN_MODULE], env=job_environment(root, dataset, HPS, **env),
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip


def _result(root: Path) -> BenchmarkResult:
    return BenchmarkResult.model_validate_json((root / "opt/ml/output/data/benchmark.json").read_text())


@pytest.mark.slow(seconds=15)
def test_a_lora_job_trains_its_adapters_checkpoints_them_alone_and_resumes(dataset: Path, tmp_path: Path) -> None:
    whole = _run(tmp_path / "whole", dataset, GPUSCOUT_SAVE_MODEL="1")
    assert whole.returncode == 0, whole.stderr[-3000:]
    result = _result(tmp_path / "whole")
    assert result.config is not None and result.loss is not None and result.efficiency is not None
    assert result.config.method == "lora" and "lora_r4" in result.config.optimizations
    assert result.config.lora is not None and result.config.lora.target_modules == ["q_proj", "v_proj", "down_proj"]
    assert result.config.params_total > result.config.params_trainable
    adapter = Adapter("lora", rank=4, target_modules=("q_proj", "v_proj", "down_proj"))
    assert result.config.params_trainable == adapter_params(PRESETS["qwen2-tiny"], adapter)  # vocabulary aside
    losses = [p.loss for p in result.loss.train]
    assert losses[-1] < losses[0]  # the adapters learn
    # peft's adapter files, not a whole model
    saved = {p.name for p in (tmp_path / "whole/opt/ml/model").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= saved and "model.safetensors" not in saved
    # the checkpoint's model state is the adapters' tensors alone
    step6, _ = sorted((tmp_path / "whole/opt/ml/checkpoints").glob("step-*"), key=lambda p: p.name)
    state: dict[str, Any] = torch.load(step6 / "state.pt", map_location="cpu", weights_only=True)
    assert state["model"] and all("lora_" in key for key in state["model"])
    assert sum(t.numel() for t in state["model"].values()) == result.config.params_trainable

    killed = _run(tmp_path / "spot", dataset, GPUSCOUT_EXIT_AFTER_STEP="6")
    assert killed.returncode == 3, killed.stderr[-3000:]
    resumed = _run(tmp_path / "spot", dataset)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = _result(tmp_path / "spot")
    assert again.stop is not None and again.stop.resumed_from_step == 6 and again.loss is not None
    assert [p.loss for p in again.loss.train] == pytest.approx(losses, abs=1e-5)
