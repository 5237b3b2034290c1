"""benchmarks/profile_train.py on the CPU: train.py in-process under the torch profiler, one profiler step per
optimizer step (tiny model, the prepared test corpus)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import profile_train
import pytest

from gpuscout.paths import REPO_DIR
from tests.sagemaker_job import job_environment

SCRIPT = REPO_DIR / "benchmarks" / "profile_train.py"

# optimized-row switches that run on a CPU (hopper.py --quick's: no compile, SDPA); two micro-batches per step
TRAIN_ARGS = [
    "--model_preset=qwen2-tiny", "--per_device_train_batch_size=2", "--gradient_accumulation_steps=2",
    "--eval_interval=0", "--validation_batches=1", "--packing=true", "--fused_cross_entropy=true",
    "--cross_entropy_kernel=chunked", "--fused_adamw=true", "--seed=3",
]  # fmt: skip


def _profile(root: Path, dataset: Path, wait: int, active: int, max_steps: int) -> subprocess.CompletedProcess[str]:
    env = job_environment(root, dataset, {}, CUDA_VISIBLE_DEVICES="")  # the hyperparameters come after --
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--wait", str(wait), "--active", str(active), "--rows", "60",
         "--out", str(root / "profile"), "--", *TRAIN_ARGS, f"--max_steps={max_steps}"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_profiles_the_active_optimizer_steps_into_a_table_and_json(dataset: Path, tmp_path: Path) -> None:
    proc = _profile(tmp_path, dataset, wait=1, active=2, max_steps=5)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # train.py ran to the end as usual
    result = json.loads((tmp_path / "opt/ml/output/data/benchmark.json").read_text())
    assert result["status"] == "completed" and len(result["steps"]) == 5
    (txt,) = (tmp_path / "profile").glob("profile-*.txt")
    (js,) = (tmp_path / "profile").glob("profile-*.json")
    text = txt.read_text()
    assert text.startswith("# CPU only") and "wait 1, warmup 1, active 2 optimizer steps" in text
    assert "Self CPU time total" in text and "Self CPU time total" in proc.stdout
    summary = json.loads(js.read_text())
    assert summary["active"] == 2 and summary["total_self_cpu_time_us"] > 0
    entries = summary["entries"]
    assert 0 < len(entries) <= 60 and any(e["self_cpu_time_us"] > 0 for e in entries)
    assert entries == sorted(entries, key=lambda e: -e["self_cpu_time_us"])
    # two recorded profiler steps, each one optimizer step with its two micro-batches of data, forward and backward
    counts = {e["name"]: e["count"] for e in entries}
    assert counts["ProfilerStep*"] == 2 and counts["Optimizer.step#AdamW.step"] == 2
    assert counts["NllLossBackward0"] == 4


def test_a_run_too_short_for_the_window_fails_saying_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # a stand-in for train.py that makes two optimizer steps (the hook and the window are what is under test)
    script = tmp_path / "stand_in" / "two_steps.py"
    script.parent.mkdir()
    script.write_text(
        "import torch\n"
        "w = torch.nn.Parameter(torch.ones(3))\n"
        "opt = torch.optim.SGD([w], lr=0.1)\n"
        "for _ in range(2):\n"
        "    (w * w).sum().backward()\n"
        "    opt.step()\n"
    )
    monkeypatch.syspath_prepend(str(script.parent))  # importable as a module, as gpuscout_train.train is
    monkeypatch.setattr(profile_train, "TRAIN_MODULE", "two_steps")
    code = profile_train.main(["--wait", "1", "--active", "3", "--out", str(tmp_path / "profile")])
    err = capsys.readouterr().err
    assert code != 0
    assert "profiler window was never completed" in err
    assert "train.py made 2 optimizer step(s), the window needs 5" in err
    assert not (tmp_path / "profile").exists()
