"""benchmarks/memory_probe_gpu.py on a machine without CUDA: its grid, the planner's prediction per row, and a
clear refusal (the measurement itself needs a GPU: `make gpu-memory-probe`)."""

from __future__ import annotations

from pathlib import Path

import memory_probe_gpu as probe
import pytest


def test_the_grid_covers_both_models_and_every_code_path() -> None:
    grid = probe.grid(["qwen2.5-0.5b", "qwen2.5-1.5b"])
    assert {p.model for p in grid} == {"qwen2.5-0.5b", "qwen2.5-1.5b"}
    assert {p.attention for p in grid} == {"flex", "sdpa", "sdpa-unpacked"}
    assert {p.loss for p in grid} == {"chunked", "liger", "torch", "plain"}
    assert {p.checkpointing for p in grid} == {True, False}
    assert len(set(grid)) == len(grid)


def test_each_row_carries_the_planners_prediction_and_its_uncertainty() -> None:
    small = probe.predicted(probe.Probe("qwen2.5-1.5b", 1, 4096, "flex", "chunked", True))
    large = probe.predicted(probe.Probe("qwen2.5-1.5b", 2, 4096, "sdpa", "plain", False))
    # checkpointing + fused loss at batch 1 needs far less than full logits at batch 2
    assert 0 < small["predicted_gb"] < large["predicted_gb"]
    assert 0 < small["predicted_uncertainty_gb"] < small["predicted_gb"] / 4
    liger = probe.predicted(probe.Probe("qwen2.5-1.5b", 1, 4096, "flex", "liger", True))
    # Liger keeps one bf16 chunk of logits and the fp32 weight gradient: less than the chunked loss's fp32 chunk
    assert liger["predicted_gb"] < small["predicted_gb"]
    torch_row = probe.predicted(probe.Probe("qwen2.5-1.5b", 1, 4096, "flex", "torch", True))
    assert torch_row["predicted_gb"] == pytest.approx(small["predicted_gb"])  # measured as the chunked loss
    assert torch_row["predicted_uncertainty_gb"] > small["predicted_uncertainty_gb"]  # its kernel was not probed


def test_a_row_whose_loss_the_box_lacks_is_skipped_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from gpuscout_train import packing

    monkeypatch.setattr(packing, "liger_available", lambda: False)
    row = probe.measure(probe.Probe("qwen2.5-0.5b", 1, 4096, "flex", "liger", False))
    assert row["status"] == "skipped" and "liger-kernel" in row["reason"]


def test_without_cuda_it_refuses_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the probe would measure")
    assert probe.main(["--out", str(tmp_path / "m.json")]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err and not (tmp_path / "m.json").exists()
