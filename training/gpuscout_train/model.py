"""Building what train.py trains: the model (a preset with random weights, a local path, the SageMaker "model"
channel, an S3 download, or for a canary the part of an S3 or hub checkpoint its layers need), its architecture facts
for FLOPs, and DeepSpeed's configuration and collectives.

Imported by train.py; may import gpuscout.domain, gpuscout.errors, gpuscout.paths, gpuscout_data.dataset, packing,
partial_checkpoint and args."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from gpuscout_data.dataset import DatasetSummary

from gpuscout.domain.models import PRESETS, Architecture
from gpuscout.errors import TrainingError

from .args import ATTENTION_IMPLEMENTATIONS, Hyperparameters
from .packing import install_flex_autocast_cast

MODEL_CHANNEL_DIR = "/opt/ml/input/data/model"  # where SageMaker puts the "model" input channel


def architecture_from_config(name: str, config: Any) -> Architecture:
    return Architecture(
        name=name,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        vocab_size=config.vocab_size,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        head_dim=getattr(config, "head_dim", None),
    )


def _download_s3_model(uri: str, target: Path) -> Path:
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3")
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix) :].lstrip("/")
                if rel and not rel.endswith("/"):
                    (target / rel).parent.mkdir(parents=True, exist_ok=True)
                    s3.download_file(bucket, obj["Key"], str(target / rel))
    except (BotoCoreError, ClientError) as err:
        raise TrainingError(f"cannot download model {uri}: {err}") from err
    return target


def _hub_offline() -> bool:
    """huggingface_hub's own switch (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE, 1/true/yes/on)."""
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def _canary_model(source: str, layers: int) -> str:
    """What a canary loads for an S3 or hub model: the part its first ``layers`` layers need (partial_checkpoint),
    else, said on stdout with why, the whole checkpoint (S3: downloaded; hub: the id, which from_pretrained fetches).
    One process per machine reads it, into a folder under GPUSCOUT_CANARY_MODEL_DIR (default: the temp folder); the
    other ranks wait on its lock and load the same files."""
    import fcntl
    import hashlib

    root = Path(os.environ.get("GPUSCOUT_CANARY_MODEL_DIR") or tempfile.gettempdir()) / "gpuscout-canary-model"
    folder = root / hashlib.sha256(f"{source}|{layers}".encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = folder / "done.json"
        if done.is_file():
            path = str(json.loads(done.read_text())["path"])
            print(f"train: canary: loading {path} (read by another rank)", flush=True)
            return path
        path = _fetch_canary_model(source, layers, folder)
        done.write_text(json.dumps({"path": path}))
        return path


def _fetch_canary_model(source: str, layers: int, folder: Path) -> str:
    from .partial_checkpoint import CannotReadInPartError, HubSource, RangeSource, S3Source, fetch_first_layers

    reader: RangeSource = S3Source(source) if source.startswith("s3://") else HubSource(source)
    try:
        fetched = fetch_first_layers(reader, layers, folder / "part")
    except (CannotReadInPartError, TrainingError, ValueError, KeyError) as why:
        print(f"train: canary: loading the whole checkpoint: {why}", flush=True)
        return str(_download_s3_model(source, folder / "whole")) if source.startswith("s3://") else source
    print(f"train: canary: {fetched.summary(reader.description)}", flush=True)
    return str(fetched.directory)


def build_model(
    hp: Hyperparameters, summary: DatasetSummary, workdir: Path, *, quantized: Any = None,
    dtype: torch.dtype | None = None,
) -> tuple[Any, Architecture, str]:  # fmt: skip
    """The causal LM (fp32 master weights), its architecture and the name benchmark.json reports. ``quantized``:
    QLoRA's load (adapters.qlora_load), the model placed on its GPU with its decoder linears in 4 bits (a
    checkpoint's: a preset's random weights are not quantized). ``dtype``: the weights' dtype
    (an adapter run's frozen base: read in it, never held in fp32 on the host); None = fp32."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    attention = ATTENTION_IMPLEMENTATIONS[hp.attention_implementation]
    if hp.attention_implementation == "flex":
        install_flex_autocast_cast()  # q/k/v in one dtype under autocast, on every torch version
    vocab = int(summary.tokenizer["vocab_size"])
    torch.manual_seed(hp.seed)
    if hp.model_preset:
        preset = PRESETS[hp.model_preset]
        # the tiny preset takes the tokenizer's vocabulary; real presets keep their (padded) size if it fits
        arch = preset.with_vocab(vocab if hp.model_preset == "qwen2-tiny" else max(vocab, preset.vocab_size))
        if hp.canary_layers:
            arch = dataclasses.replace(arch, num_hidden_layers=min(hp.canary_layers, arch.num_hidden_layers))
        kwargs: dict[str, Any] = dict(arch.to_qwen2_config_kwargs())
        config = Qwen2Config(
            **kwargs,
            use_cache=False,
            eos_token_id=summary.tokenizer["eos_token_id"],
            pad_token_id=summary.tokenizer["pad_token_id"],
            bos_token_id=None,
        )
        config._attn_implementation = attention
        if quantized is not None:  # the manifest refuses it; a hand-made job is told why
            raise TrainingError("method qlora quantizes pretrained weights: give model_name_or_path, not a preset")
        return Qwen2ForCausalLM._from_config(config, dtype=dtype or torch.float32), arch, hp.model_preset
    source = hp.model_name_or_path
    # an S3 model the control plane passed as the "model" channel; the image's entry point is not SageMaker's
    # training toolkit, so SM_CHANNEL_MODEL is usually unset: the channel's fixed path is the default
    channel = os.environ.get("SM_CHANNEL_MODEL", MODEL_CHANNEL_DIR)
    if source.startswith("s3://") and Path(channel).is_dir() and any(Path(channel).iterdir()):
        source = channel
    elif hp.canary_layers and not Path(source).exists() and (source.startswith("s3://") or not _hub_offline()):
        source = _canary_model(source, hp.canary_layers)
    elif source.startswith("s3://"):
        source = str(_download_s3_model(source, workdir / "model"))
    model: Any
    try:
        layers: dict[str, Any] = {"num_hidden_layers": hp.canary_layers} if hp.canary_layers else {}
        load: dict[str, Any] = quantized if quantized is not None else {"dtype": dtype or torch.float32}
        model = AutoModelForCausalLM.from_pretrained(source, attn_implementation=attention, **load, **layers)
    except (OSError, ValueError) as err:
        hint = (
            " (HF_HUB_OFFLINE=1: hub models need network; use model_preset or a local path)" if _hub_offline() else ""
        )
        raise TrainingError(f"cannot load model {hp.model_name_or_path!r}{hint}: {err}") from err
    model.config.use_cache = False
    if model.get_input_embeddings().weight.shape[0] < vocab:
        model.resize_token_embeddings(vocab)
    return model, architecture_from_config(hp.model_name_or_path, model.config), hp.model_name_or_path


def import_deepspeed() -> ModuleType:
    """``deepspeed``, imported without MLflow.

    ``import deepspeed`` imports its autotuner (deepspeed.runtime.config -> deepspeed.autotuning.autotuner), which
    imports mlflow whenever it is installed, to log autotuning trials. Training never runs the autotuner (that is the
    ``deepspeed --autotuning`` launcher's mode), but the training image installs MLflow for experiment tracking, so
    every DeepSpeed rank imported MLflow with its SQL parser, FastAPI and OpenTelemetry modules: about 1.1 s of a
    1.4 s ``import deepspeed`` (2-core Xeon, DeepSpeed 0.19.8, mlflow-skinny 3.17.2), in every rank of every
    ZeRO job, tracked or not. Unless MLflow is imported already (a job tracked with it), DeepSpeed is imported with
    mlflow marked absent, so the autotuner notes it has none; the mark is removed at once, and the job's own tracker
    imports mlflow later as usual."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed

        return deepspeed
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError meanwhile
    try:
        import deepspeed
    finally:
        if "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    return deepspeed


def deepspeed_collectives_through_torch() -> None:
    """On a CPU, DeepSpeed's collectives go through torch.distributed (gloo), as they do (NCCL) on the GPUs it is
    benchmarked on.

    On a CPU, DeepSpeed's TorchBackend would first JIT-compile its shared-memory allreduce op (``deepspeed_shm_comm``:
    g++ and ninja at run time, about 1 to 2 minutes on a 2-core machine the first time, then cached in
    ~/.cache/torch_extensions) and route allreduce through it. On CUDA that op does not exist (the CUDA accelerator
    has no ShareMemCommBuilder), so every collective there is torch.distributed's. ZeRO on a CPU is only this
    project's stand-in for the GPU path (the planner refuses ZeRO on a CPU target), and a stand-in should run the
    same collectives: no compiler at run time. ``build_shm_op`` builds nothing for an op that
    ``deepspeed.ops.__compatible_ops__`` (DeepSpeed's own table of which ops may be built here) marks incompatible."""
    import_deepspeed()
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # DeepSpeed's CPU accelerator counts its "devices" (ZeRO-3 reads it as the local world size on every gradient
    # reduce) from LOCAL_SIZE, which DeepSpeed's own launcher sets to the local process count; without it, every call
    # starts `numactl --hardware` and counts NUMA nodes. Under torchrun that was 1 device for 2 local ranks, and each
    # subprocess start reset Python's warning registry, so a torch deprecation DeepSpeed triggers was printed on every
    # call: 538 lines in a 12-step two-rank ZeRO-3 job's log (torch 2.13, DeepSpeed 0.19.8). torchrun's
    # LOCAL_WORLD_SIZE is the value DeepSpeed's launcher would set.
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))


def deepspeed_config(hp: Hyperparameters, precision: str, world_size: int, hidden_size: int) -> dict[str, Any]:
    from gpuscout.paths import DEEPSPEED_DIR

    candidates = [DEEPSPEED_DIR, Path(__file__).resolve().parents[2] / "configs" / "deepspeed"]
    path = next(
        (d / f"zero{hp.deepspeed_stage}.json" for d in candidates if (d / f"zero{hp.deepspeed_stage}.json").is_file()),
        None,
    )
    if path is None:
        raise TrainingError(f"zero{hp.deepspeed_stage}.json not found in {', '.join(map(str, candidates))}")
    autos = {
        "train_micro_batch_size_per_gpu": hp.per_device_train_batch_size,
        "gradient_accumulation_steps": hp.gradient_accumulation_steps,
        "train_batch_size": hp.per_device_train_batch_size * hp.gradient_accumulation_steps * world_size,
        "gradient_clipping": 1.0,
        "reduce_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "stage3_param_persistence_threshold": 10 * hidden_size,
    }

    def fill(node: Any, parent: str) -> Any:
        if isinstance(node, dict):
            return {k: fill(v, k) if k != "enabled" else v for k, v in node.items()} | (
                {"enabled": precision == parent} if parent in ("bf16", "fp16") else {}
            )
        if node == "auto":
            if parent not in autos:
                raise TrainingError(f"{path}: no value for 'auto' at {parent!r}")
            return autos[parent]
        return node

    config = fill(json.loads(path.read_text()), "")
    config["steps_per_print"] = 10**9
    config["wall_clock_breakdown"] = False
    return config
