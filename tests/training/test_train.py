"""train.py end to end under the SageMaker folder contract (subprocesses, tiny model, CPU)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from gpuscout_data import dataset as ds
from gpuscout_train import args as train_args
from gpuscout_train import data as train_data
from gpuscout_train import model as train_model

from gpuscout.domain.benchmark import BenchmarkResult
from gpuscout.domain.metric_lines import METRIC_DEFINITIONS
from gpuscout.domain.tracking import TRACKING_ENV, JobTracking, WandbDestination
from gpuscout.errors import TrainingError
from gpuscout.paths import TRAIN_MODULE
from tests import wandb_offline_reader as wb
from tests.sagemaker_job import job_environment

HPS = {
    "run_id": "r-test",
    "job_name": "gs-test-tiny",
    "instance_type": "local",
    "model_preset": "qwen2-tiny",
    "per_device_train_batch_size": "4",
    "gradient_accumulation_steps": "1",
    "max_steps": "20",
    "learning_rate": "0.003",
    "seed": "7",
    "precision": "auto",
    "packing": "true",
    "eval_interval": "10",
    "checkpoint_interval": "5",
    "validation_batches": "2",
    "sagemaker_program": "train.py",  # SageMaker adds these; train.py ignores them
}


def _run(root: Path, dataset: Path, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """One job in the SageMaker folder layout under ``root`` (as gpuscout local mirrors it)."""
    env = job_environment(root, dataset, HPS, **(extra_env or {}))
    return subprocess.run(
        [sys.executable, "-m", TRAIN_MODULE],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _result(root: Path) -> BenchmarkResult:
    return BenchmarkResult.model_validate_json((root / "opt/ml/output/data/benchmark.json").read_text())


@pytest.mark.slow(seconds=22)
def test_tiny_model_trains_and_resumes_after_a_hard_exit(dataset: Path, tmp_path: Path) -> None:
    full = _run(tmp_path / "full", dataset)
    assert full.returncode == 0, full.stderr[-3000:]
    result = _result(tmp_path / "full")
    raw = json.loads((tmp_path / "full/opt/ml/output/data/benchmark.json").read_text())
    jsonschema.validate(raw, BenchmarkResult.model_json_schema())
    assert result.status == "completed"
    assert result.loss is not None and result.timing is not None and result.throughput is not None
    losses = [p.loss for p in result.loss.train]
    assert [p.step for p in result.loss.train] == list(range(1, 21))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5  # it learns
    assert [p.step for p in result.loss.validation] == [10, 20]
    assert result.timing.warmup_steps == 3 and result.timing.timed_steps == 17
    assert result.throughput.tokens_per_s > 0
    # every step's time and the process's own resource use; the detector's verdict on them; one clock
    assert [s.step for s in result.steps] == list(range(1, 21)) and sum(s.timed for s in result.steps) == 17
    assert all(s.user_s is not None and s.minor_faults is not None and s.involuntary_switches is not None
               for s in result.steps)  # fmt: skip
    assert sum(s.user_s or 0 for s in result.steps) > 0 and result.steps[0].sm_clock_mhz is None  # no GPU
    assert result.disturbance is not None and result.disturbance.timed_steps == 17
    assert result.timing.import_time_s is not None and 0 < result.timing.import_time_s < result.timing.startup_time_s
    assert result.timing.startup_time_s < result.timing.wall_time_s
    assert "malloc kept for training" in (result.software.host_allocator or "")
    # the host's NVIDIA driver and CUDA versions are recorded; this CPU host has none, and CPU torch no CUDA runtime
    assert (result.software.nvidia_driver, result.software.cuda_driver) == (None, None)
    import torch

    assert result.software.cuda_runtime == torch.version.cuda
    low, high = result.throughput.tokens_per_s_ci95
    assert low <= high
    assert result.efficiency is not None and result.efficiency.mfu is None
    assert result.efficiency.note == "n/a on CPU: no dense tensor-core peak"
    assert result.efficiency.t_eff == pytest.approx(ds.load_summary(dataset).t_eff)
    assert result.config.global_batch_size == 4 and result.hardware.device == "cpu"
    assert result.dataset.sha256 == ds.load_summary(dataset).sha256
    # every step's metric line is parsed by the SageMaker MetricDefinitions regexes
    lines = [ln for ln in full.stdout.splitlines() if ln.startswith("gpuscout_metric") and " loss=" in ln]
    assert len(lines) == 20
    loss_re = next(d["Regex"] for d in METRIC_DEFINITIONS if d["Name"] == "train:loss")
    parsed = [float(re.search(loss_re, ln).group(1)) for ln in lines]  # type: ignore[union-attr]
    assert parsed == pytest.approx(losses, rel=1e-6)
    summary_re = next(d["Regex"] for d in METRIC_DEFINITIONS if d["Name"] == "summary:tokens_per_s")
    assert any(re.search(summary_re, ln) for ln in full.stdout.splitlines())
    # the learning rate logged for a step is the one its update used: warmup 3 -> 1/3, 2/3, then the full rate
    rates = [float(re.search(r" lr=([0-9.e+-]+)", ln).group(1)) for ln in lines[:4]]  # type: ignore[union-attr]
    assert rates == pytest.approx([0.001, 0.002, 0.003, 0.003])
    # HFU counts what runs: SDPA attends over the whole block and padded positions are computed
    assert result.efficiency.hardware_flops_per_token > result.efficiency.flops_per_token

    # The same job, killed hard right after step 10 (its checkpoint is written), then started again.
    killed = _run(tmp_path / "spot", dataset, {"GPUSCOUT_EXIT_AFTER_STEP": "10"})
    assert killed.returncode == 3, killed.stderr[-3000:]
    assert not (tmp_path / "spot/opt/ml/output/data/benchmark.json").exists()
    resumed = _run(tmp_path / "spot", dataset)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    again = _result(tmp_path / "spot")
    assert again.stop is not None and again.stop.resumed_from_step == 10 and again.stop.steps == 20
    assert again.loss is not None
    assert [p.step for p in again.loss.train] == list(range(1, 21))
    assert [p.loss for p in again.loss.train] == pytest.approx(losses, abs=1e-5)
    assert again.loss.final_validation_loss == pytest.approx(result.loss.final_validation_loss, abs=1e-5)


def test_hyperparameters_from_sagemaker_and_cli(tmp_path: Path) -> None:
    (tmp_path / "hyperparameters.json").write_text(json.dumps({**HPS, "attention_implementation": '"eager"'}))
    env = {"SM_INPUT_CONFIG_DIR": str(tmp_path), "SM_HPS": json.dumps({"max_steps": "30"})}
    hp = train_args.parse_hyperparameters(["--warmup_steps", "", "--fused-adamw=true"], env)
    assert hp.max_steps == 30 and hp.warmup_steps is None and hp.fused_adamw is True
    assert hp.attention_implementation == "eager" and hp.packing is True and hp.learning_rate == 0.003
    with pytest.raises(TrainingError, match=r"unknown hyperparameter.*learnig_rate"):
        train_args.parse_hyperparameters(["--learnig_rate", "1"], env)
    with pytest.raises(TrainingError, match="not true or false"):
        train_args.parse_hyperparameters(["--packing", "maybe"], env)
    with pytest.raises(TrainingError, match="exactly one of model_preset"):
        train_args.parse_hyperparameters(["--model_name_or_path", "Qwen/Qwen2.5-0.5B"], env)


def test_hub_model_offline_fails_clearly(dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hp = train_args.Hyperparameters(model_name_or_path="Qwen/Qwen2.5-0.5B")
    with pytest.raises(TrainingError, match="HF_HUB_OFFLINE=1"):
        train_model.build_model(hp, ds.load_summary(dataset), tmp_path)


def test_an_s3_model_loads_from_its_input_channel_without_network(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # Given an S3 model that SageMaker already downloaded as the "model" channel (network isolation: no S3 calls)
    channel = tmp_path / "opt/ml/input/data/model"
    config = Qwen2Config(vocab_size=600, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(channel)
    monkeypatch.delenv("SM_CHANNEL_MODEL", raising=False)  # the image's entry point is not SageMaker's toolkit
    monkeypatch.setattr(train_model, "MODEL_CHANNEL_DIR", str(channel))
    monkeypatch.setattr(
        train_model, "_download_s3_model", lambda *_a: pytest.fail("downloaded although the channel has it")
    )
    hp = train_args.Hyperparameters(model_name_or_path="s3://gpuscout-data-1/raw/models/tiny/")
    # When train.py builds the model, Then it loads the channel's copy
    model, arch, name = train_model.build_model(hp, ds.load_summary(dataset), tmp_path / "work")
    assert arch.hidden_size == 32 and name == "s3://gpuscout-data-1/raw/models/tiny/"
    assert model.config.num_hidden_layers == 1


def test_canary_layers_cut_the_model_to_a_few_layers(dataset: Path, tmp_path: Path) -> None:
    hp = train_args.Hyperparameters(model_preset="qwen2.5-0.5b", canary_layers=2)
    model, arch, _ = train_model.build_model(hp, ds.load_summary(dataset), tmp_path)
    assert model.config.num_hidden_layers == 2 and arch.num_hidden_layers == 2
    assert model.config.hidden_size == 896  # the preset's layer shape, unchanged
    with pytest.raises(TrainingError, match="canary_layers"):
        train_args.parse_hyperparameters(["--model_preset", "qwen2-tiny", "--canary_layers", "-1"], {})


def test_deepspeed_configs_fill_every_auto() -> None:
    hp = train_args.Hyperparameters(
        model_preset="qwen2-tiny", per_device_train_batch_size=2, gradient_accumulation_steps=4
    )
    for stage in (2, 3):
        hp.deepspeed_stage = stage
        config = train_model.deepspeed_config(hp, "bf16", world_size=16, hidden_size=896)
        assert "auto" not in json.dumps(config)
        assert "optimizer" not in config  # torch AdamW from train.py, so no DeepSpeed op build
        assert config["train_batch_size"] == 2 * 4 * 16
        assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
        assert config["zero_optimization"]["stage"] == stage


DEEPSPEED_INIT = """
import os, sys
if {fixed}:
    from gpuscout_train import distributed as train_distributed
    from gpuscout_train import model as train_model
    train_distributed.init_distributed()
    train_model.deepspeed_collectives_through_torch()  # as train.py does before DeepSpeed starts on a CPU
import deepspeed
print("mlflow loaded with deepspeed:", "mlflow" in sys.modules, flush=True)
deepspeed.init_distributed(dist_backend="gloo")
import torch.distributed as dist
print("world", dist.get_world_size(), "rank", dist.get_rank())
import mlflow  # as a job tracked with MLflow imports it after DeepSpeed started
print("mlflow afterwards:", mlflow.__name__)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fixed", [False, True], ids=["without-launcher-env", "after-init_distributed"])
def test_deepspeed_initializes_in_one_process_under_the_sagemaker_environment(tmp_path: Path, fixed: bool) -> None:
    # Given one process with SageMaker's SM_TRAINING_ENV (as gpuscout local and a one-GPU instance have) and no
    # launcher variables, When DeepSpeed initializes its distributed backend:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT", "LOCAL_WORLD_SIZE")}  # fmt: skip
    env["SM_TRAINING_ENV"] = json.dumps({"hosts": ["algo-1"], "current_host": "algo-1"})
    code = DEEPSPEED_INIT.format(fixed=fixed)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=110, check=False
    )
    if fixed:
        # Then train.py's single-process environment lets it start a one-rank group
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "world 1 rank 0" in proc.stdout
        assert "deepspeed_shm_comm" not in proc.stdout  # no shared-memory op compiled or loaded on a CPU
        # and DeepSpeed came without MLflow (train_model.import_deepspeed), which the job can still import itself
        assert "mlflow loaded with deepspeed: False" in proc.stdout
        assert "mlflow afterwards: mlflow" in proc.stdout
    else:
        # (without it, DeepSpeed's SageMaker discovery fails before step 1: the bug this guards against)
        assert proc.returncode != 0 and "OMPI_COMM_WORLD_RANK" in proc.stderr
        # and a plain `import deepspeed` imports MLflow (its autotuner's optional logger) when it is installed
        assert "mlflow loaded with deepspeed: True" in proc.stdout


def test_every_rank_runs_the_same_number_of_validation_forwards() -> None:
    # 5 blocks, batch 2, 2 ranks: rank 0 has blocks 0-1 and 4, rank 1 only 2-3; both run two forwards
    assert train_data.validation_starts(5, 2, 2, 0, 10) == [0, 4]
    assert train_data.validation_starts(5, 2, 2, 1, 10) == [2, None]
    # the h100-settings-sweep case: [1,1,1,1,1,0,0,0] real batches on 8 ranks -> one forward each
    counts = [len(train_data.validation_starts(5, 1, 8, r, 4)) for r in range(8)]
    assert counts == [1] * 8
    assert train_data.validation_starts(0, 2, 2, 0, 10) == []
    assert train_data.validation_starts(100, 2, 2, 1, 3) == [2, 6, 10]  # capped at validation_batches


def test_every_validation_forward_has_the_full_batch_and_says_which_rows_count() -> None:
    ids = np.arange(5 * 4, dtype=np.int32).reshape(5, 4)
    seg = np.ones((5, 4), dtype=np.int32)
    # rank 0 of 2, batch 2: blocks 0-1, then the short last batch (block 4) filled up with a copy of itself
    got = list(train_data.validation_batches(ids, seg, 2, world=2, rank=0, max_batches=10))
    assert [(real, counted, tuple(i.shape)) for real, i, _, counted in got] == [(True, 2, (2, 4)), (True, 1, (2, 4))]
    assert got[1][1].tolist() == [ids[4].tolist(), ids[4].tolist()]
    # rank 1: blocks 2-3, then a forward of its own-less round on the split's first blocks, counting nothing
    got = list(train_data.validation_batches(ids, seg, 2, world=2, rank=1, max_batches=10))
    assert [(real, counted) for real, _, _, counted in got] == [(True, 2), (False, 2)]
    assert got[1][1].tolist() == ids[:2].tolist()


@pytest.mark.slow(seconds=15)
@pytest.mark.timeout(240)
def test_two_ddp_ranks_validate_an_uneven_split_without_hanging(dataset: Path, tmp_path: Path) -> None:
    # Given 2 gloo ranks (torchrun) and one validation micro-batch: rank 0 has it, rank 1 has none
    blocks = ds.load_summary(dataset).splits["validation"].blocks
    root = tmp_path / "ddp"
    config = root / "opt/ml/input/config"
    config.mkdir(parents=True)
    hps = {**HPS, "per_device_train_batch_size": str(blocks), "max_steps": "4", "eval_interval": "2",
           "checkpoint_interval": "0", "validation_batches": "4", "job_name": "gs-test-ddp"}  # fmt: skip
    (config / "hyperparameters.json").write_text(json.dumps(hps))
    env = {
        **os.environ,
        "SM_INPUT_CONFIG_DIR": str(config), "SM_CHANNEL_TRAIN": str(dataset),
        "SM_OUTPUT_DATA_DIR": str(root / "opt/ml/output/data"), "SM_MODEL_DIR": str(root / "opt/ml/model"),
        "GPUSCOUT_CHECKPOINT_DIR": str(root / "opt/ml/checkpoints"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    # and W&B offline tracking, as a SageMaker job gets it: rank 0 tracks, and every rank leaves through
    # train_distributed.leave_together (os._exit after W&B's teardown)
    tracking = JobTracking(wandb=WandbDestination(project="gpuscout-test", mode="offline",
                                                  dir=str(root / "opt/ml/output/data"), log_artifacts=False),
                           variant="ddp", instance_count=1, spot=False)  # fmt: skip
    env |= {TRACKING_ENV: tracking.model_dump_json(), "WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    env |= {f"WANDB_{name}_DIR": str(tmp_path / f"wandb-{name.lower()}") for name in ("CONFIG", "DATA", "CACHE")}
    env.pop("WANDB_API_KEY", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", TRAIN_MODULE]  # fmt: skip
    # When it trains with validation every 2 steps, Then it finishes (a hang fails at the timeout)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        _, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired as err:  # the old validation loop hung here
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks
        proc.communicate()
        raise AssertionError("2 DDP ranks hung in validation") from err
    assert proc.returncode == 0, stderr[-3000:]
    result = _result(root)
    assert result.status == "completed" and result.hardware.world_size == 2
    assert result.loss is not None and [p.step for p in result.loss.validation] == [2, 4]
    # and rank 0's W&B run is complete (one run, every step, the end record written before the exit)
    (run_file,) = wb.run_files(root / "opt/ml/output/data")
    records = wb.read_records(run_file)
    assert [row["_step"] for row in wb.history(records) if "loss" in row] == [1, 2, 3, 4]
    assert wb.of_type(records, "exit")


def test_a_failing_final_validation_is_a_note_and_the_measurement_stands(dataset: Path, tmp_path: Path) -> None:
    import shutil

    import numpy as np

    broken = tmp_path / "data"
    shutil.copytree(dataset, broken)
    shard = ds.load_summary(broken).splits["validation"].shards[0]["input_ids"]
    ids = np.load(broken / shard)
    ids[0, 5] = 10**6  # a token id past the vocabulary: the validation forward fails, the training never sees it
    np.save(broken / shard, ids)
    hps = {**HPS, "max_steps": "6", "eval_interval": "0", "checkpoint_interval": "0"}
    env = job_environment(tmp_path / "job", broken, hps)
    done = subprocess.run([sys.executable, "-m", TRAIN_MODULE], env=env, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the final validation failed; the measurement stands" in done.stdout
    result = _result(tmp_path / "job")
    assert result.status == "completed" and result.throughput is not None and result.throughput.tokens_per_s > 0
    assert result.loss is not None and result.loss.final_validation_loss is None
    assert "IndexError" in (result.loss.validation_error or "")
