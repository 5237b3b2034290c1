"""gpuscout's standardized causal-LM fine-tuning benchmark (in the spirit of transformers' run_clm.py).

Hyperparameters come from SageMaker (/opt/ml/input/config/hyperparameters.json or the SM_HPS variable) and/or
the command line (``--name value``); names are those of docs/internals.md and an unknown name is an error.
Reads the prepared dataset from SM_CHANNEL_TRAIN, writes SM_OUTPUT_DATA_DIR/benchmark.json (status completed or
failed), checkpoints to /opt/ml/checkpoints (GPUSCOUT_CHECKPOINT_DIR) and resumes from the newest one there that
verifies against its marker's file manifest and loads (checkpoints.py). With GPUSCOUT_TRACKING set, rank 0 also
logs the job to MLflow and/or Weights & Biases (experiment_tracking.py).
Run it with ``python train.py`` on one device or under torchrun (launcher.py) on several.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import random
import resource
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from benchmark_callback import GpuSampler, StepRecord, StepStats, Stopwatch, default_warmup_steps
from checkpoints import DEEPSPEED, STATE, Checkpointer, PartlyLoadedError, checkpoint_root
from data_preparation import DatasetSummary, load_split, load_summary, piece_lengths
from experiment_tracking import JobTracker
from packing import CausalLMWithLoss, install_flex_autocast_cast, make_inputs, unpack_blocks

import gpuscout
from gpuscout.domain import flops
from gpuscout.domain.benchmark import (
    BenchmarkResult,
    DatasetInfo,
    Efficiency,
    Hardware,
    Loss,
    LossPoint,
    Memory,
    Software,
    StopInfo,
    Throughput,
    Timing,
    TrainConfig,
)
from gpuscout.domain.candidates import parse_candidate_name
from gpuscout.domain.hardware import detect_sku
from gpuscout.domain.metric_lines import OBJECTIVE_KEY, format_metric_line, usd_per_million_tokens
from gpuscout.domain.models import PRESETS, Architecture
from gpuscout.errors import TrainingError

SM_CONFIG_DIR = Path(os.environ.get("SM_INPUT_CONFIG_DIR", "/opt/ml/input/config"))
MODEL_CHANNEL_DIR = "/opt/ml/input/data/model"  # where SageMaker puts the "model" input channel
ATTENTION_IMPLEMENTATIONS = {"sdpa": "sdpa", "eager": "eager", "flex": "flex_attention"}
CPU_NOTE = "n/a on CPU: no dense tensor-core peak"


@dataclass
class Hyperparameters:
    run_id: str = ""
    job_name: str = "local"
    instance_type: str = "local"
    model_preset: str = ""
    model_name_or_path: str = ""
    sequence_length: int = 0  # 0 = the prepared dataset's block length; a divisor of it splits the blocks
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_steps: int = 20
    warmup_steps: int | None = None  # None = max(3, ceil(10 % of max_steps)); also the LR warmup length
    learning_rate: float = 3e-4
    weight_decay: float = 0.0
    seed: int = 0
    precision: str = "auto"  # auto | bf16 | fp16 | fp32
    packing: bool = True
    attention_implementation: str = "sdpa"
    gradient_checkpointing: bool = False
    torch_compile: bool = False
    dataloader_num_workers: int = 0
    pin_memory: bool = True  # page-locked host batches + non_blocking copies (CUDA only)
    deepspeed_stage: int = 0
    fused_cross_entropy: bool = False
    fused_adamw: bool = False
    stop_rule: str = "fixed"  # fixed | steady_state
    ci_tolerance: float = 0.02  # fraction of the mean
    min_timed_steps: int = 10
    eval_interval: int = 0  # 0 = validate only at the end
    checkpoint_interval: int = 0  # 0 = no checkpoints
    checkpoint_keep: int = 2  # complete checkpoints kept; 2 = one survives a failed write of the next
    validation_batches: int = 8
    # > 0: keep only this many decoder layers (the canary: the same code path, small enough for a cheap instance)
    canary_layers: int = 0
    # A SageMaker tuning trial of a settings search: the candidate's name stands for its settings (they replace the
    # static ones), and the step lines carry the running $/1M tokens at price_per_hour_usd (the whole job's) once
    # objective_min_timed_steps steps are timed: the objective the tuning job minimizes and stops trials early on.
    search_candidate: str = ""
    price_per_hour_usd: float = 0.0
    objective_min_timed_steps: int = 1

    def validate(self) -> None:
        problems = []
        if bool(self.model_preset) == bool(self.model_name_or_path):
            problems.append("give exactly one of model_preset and model_name_or_path")
        if self.model_preset and self.model_preset not in PRESETS:
            problems.append(f"model_preset {self.model_preset!r} is not one of {', '.join(PRESETS)}")
        if self.precision not in ("auto", "bf16", "fp16", "fp32"):
            problems.append("precision must be auto, bf16, fp16 or fp32")
        if self.attention_implementation not in ATTENTION_IMPLEMENTATIONS:
            problems.append(f"attention_implementation must be one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
        if self.deepspeed_stage not in (0, 2, 3):
            problems.append("deepspeed_stage must be 0, 2 or 3")
        if self.stop_rule not in ("fixed", "steady_state"):
            problems.append("stop_rule must be fixed or steady_state")
        if not 0 < self.ci_tolerance < 1:
            problems.append("ci_tolerance is a fraction in (0, 1), e.g. 0.02 for +-2 %")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "max_steps"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1")
        negative = ("dataloader_num_workers", "eval_interval", "checkpoint_interval", "validation_batches",
                    "canary_layers")  # fmt: skip
        problems += [f"{name} must not be negative" for name in negative if getattr(self, name) < 0]
        if self.checkpoint_keep < 1:
            problems.append("checkpoint_keep must be at least 1")
        if self.max_steps < 2:
            problems.append("max_steps must be at least 2 (one warmup step and one timed step)")
        if self.price_per_hour_usd < 0 or self.objective_min_timed_steps < 1:
            problems.append("price_per_hour_usd must not be negative and objective_min_timed_steps must be at least 1")
        if problems:
            raise TrainingError("invalid hyperparameters: " + "; ".join(problems))


def _convert(name: str, kind: Any, raw: Any) -> Any:
    if isinstance(raw, str):
        text = raw.strip()
        if len(text) >= 2 and text[0] == text[-1] == '"':  # the SageMaker SDK JSON-encodes string values
            text = json.loads(text)
    else:
        text = raw
    try:
        if kind in ("bool",):
            value = str(text).lower()
            if value not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(f"{text!r} is not true or false")
            return value in ("true", "1", "yes")
        if kind in ("int",):
            return int(text)
        if kind in ("int | None",):
            return None if text in ("", None, "auto", "none", "None") else int(text)
        if kind in ("float",):
            return float(text)
        return str(text)
    except (TypeError, ValueError) as err:
        raise TrainingError(f"hyperparameter {name}={raw!r}: {err}") from err


def parse_hyperparameters(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> Hyperparameters:
    """Merge hyperparameters.json < SM_HPS < command line; reject names train.py does not know."""
    env = os.environ if environ is None else environ
    raw: dict[str, Any] = {}
    config_file = Path(env.get("SM_INPUT_CONFIG_DIR", str(SM_CONFIG_DIR))) / "hyperparameters.json"
    if config_file.is_file():
        raw.update(json.loads(config_file.read_text()))
    if env.get("SM_HPS"):
        raw.update(json.loads(env["SM_HPS"]))
    args = list(sys.argv[1:] if argv is None else argv)
    while args:
        item = args.pop(0)
        if not item.startswith("--"):
            raise TrainingError(f"unexpected argument {item!r}; pass hyperparameters as --name value")
        name, eq, value = item[2:].partition("=")
        if not eq:
            if not args:
                raise TrainingError(f"--{name} needs a value")
            value = args.pop(0)
        raw[name.replace("-", "_")] = value
    fields = {f.name: f for f in dataclasses.fields(Hyperparameters)}
    # SageMaker adds its own: sagemaker_* (the SDK) and _tuning_objective_metric (a tuning job's trials)
    unknown = sorted(k for k in raw if k not in fields and not k.startswith(("sagemaker_", "_")))
    if unknown:
        raise TrainingError(f"unknown hyperparameter(s): {', '.join(unknown)}; known: {', '.join(fields)}")
    if "search_candidate" in raw:
        raw.update(_candidate_hyperparameters(_convert("search_candidate", "str", raw["search_candidate"]), env))
    values = {k: _convert(k, str(fields[k].type), v) for k, v in raw.items() if k in fields}
    hp = Hyperparameters(**values)
    hp.validate()
    return hp


# A candidate's settings (gpuscout.domain.candidates) -> train.py's hyperparameter names.
CANDIDATE_HYPERPARAMETERS = {
    "per_device_batch_size": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "deepspeed_stage": "deepspeed_stage",
    "gradient_checkpointing": "gradient_checkpointing",
    "torch_compile": "torch_compile",
    "attention": "attention_implementation",
    "fused_cross_entropy": "fused_cross_entropy",
    "dataloader_workers": "dataloader_num_workers",
}


def _candidate_hyperparameters(name: str, env: Mapping[str, str]) -> dict[str, Any]:
    """A tuning trial's settings from its candidate name, and its own job name: SageMaker names a tuning job's
    trials and tells the container (TRAINING_JOB_NAME); the static job_name is the tuning job's."""
    try:
        settings = parse_candidate_name(name)
    except ValueError as err:
        raise TrainingError(f"hyperparameter search_candidate: {err}") from err
    out: dict[str, Any] = {CANDIDATE_HYPERPARAMETERS[key]: value for key, value in settings.items()}
    if env.get("TRAINING_JOB_NAME"):
        out["job_name"] = env["TRAINING_JOB_NAME"]
    return out


# ---------------------------------------------------------------- environment


@dataclass
class Dist:
    world_size: int
    rank: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order."""
        if self.world_size == 1:
            return [value]
        values: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(values, value)
        return values

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        return [float(v) for v in t.tolist()]


SINGLE_PROCESS_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def single_process_environment() -> None:
    """Without a launcher (one process: `gpuscout local`, a one-GPU SageMaker instance), set the variables a
    launcher would. DeepSpeed otherwise "discovers" its environment: under SageMaker (SM_TRAINING_ENV is set, also by
    gpuscout local) it reads OMPI_COMM_WORLD_RANK (KeyError), elsewhere it imports mpi4py (not installed)."""
    if "WORLD_SIZE" in os.environ and os.environ["WORLD_SIZE"] != "1":
        return
    defaults = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def init_distributed() -> Dist:
    single_process_environment()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(world, rank, local_rank, local_world, device)


def resolve_precision(requested: str, device: torch.device) -> tuple[str, str | None]:
    """The precision to train in and a note when it differs from the request."""
    if device.type != "cuda":
        note = None if requested in ("auto", "fp32") else f"{requested} requested; CPU trains in fp32"
        return "fp32", note
    bf16 = torch.cuda.is_bf16_supported()
    if requested == "auto":
        return ("bf16" if bf16 else "fp16"), None
    if requested == "bf16" and not bf16:
        raise TrainingError(f"{torch.cuda.get_device_name()} does not support bf16; use fp16 or precision=auto")
    return requested, None


def hardware_info(dist: Dist, precision: str, sampler: GpuSampler) -> Hardware:
    cpu_model = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if dist.device.type != "cuda":
        return Hardware(
            device="cpu",
            gpus_per_node=0,
            nodes=dist.nodes,
            world_size=dist.world_size,
            cpu_model=cpu_model,
            cpu_count=os.cpu_count(),
        )
    props = torch.cuda.get_device_properties(dist.device)
    memory_gb = props.total_memory / 1e9
    sku = detect_sku(props.name, memory_gb)
    return Hardware(
        device="cuda",
        gpu_name=props.name,
        gpu_sku=sku.sku if sku else None,
        gpus_per_node=dist.local_world_size,
        nodes=dist.nodes,
        world_size=dist.world_size,
        peak_tflops_per_gpu=sku.peak_for(precision) if sku else None,
        gpu_memory_gb=round(memory_gb, 2),
        driver_version=sampler.driver_version(),
        cuda_version=torch.version.cuda,
        cpu_model=cpu_model,
        cpu_count=os.cpu_count(),
    )


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def software_info() -> Software:
    import transformers

    return Software(
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        deepspeed=_version("deepspeed"),
        gpuscout=_version("gpuscout") or gpuscout.__version__,
        image_digest=os.environ.get("GPUSCOUT_IMAGE_DIGEST") or None,
    )


# ---------------------------------------------------------------- model


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


def build_model(hp: Hyperparameters, summary: DatasetSummary, workdir: Path) -> tuple[Any, Architecture, str]:
    """The causal LM (fp32 master weights), its architecture and the name benchmark.json reports."""
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
        return Qwen2ForCausalLM(config), arch, hp.model_preset
    source = hp.model_name_or_path
    # an S3 model the control plane passed as the "model" channel; the image's entry point is not SageMaker's
    # training toolkit, so SM_CHANNEL_MODEL is usually unset: the channel's fixed path is the default
    channel = os.environ.get("SM_CHANNEL_MODEL", MODEL_CHANNEL_DIR)
    if source.startswith("s3://") and Path(channel).is_dir() and any(Path(channel).iterdir()):
        source = channel
    elif source.startswith("s3://"):
        source = str(_download_s3_model(source, workdir / "model"))
    model: Any
    try:
        layers: dict[str, Any] = {"num_hidden_layers": hp.canary_layers} if hp.canary_layers else {}
        model = AutoModelForCausalLM.from_pretrained(
            source, attn_implementation=attention, dtype=torch.float32, **layers
        )
    except (OSError, ValueError) as err:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = " (HF_HUB_OFFLINE=1: hub models need network; use model_preset or a local path)" if offline else ""
        raise TrainingError(f"cannot load model {hp.model_name_or_path!r}{hint}: {err}") from err
    model.config.use_cache = False
    if model.get_input_embeddings().weight.shape[0] < vocab:
        model.resize_token_embeddings(vocab)
    return model, architecture_from_config(hp.model_name_or_path, model.config), hp.model_name_or_path


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
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def deepspeed_config(hp: Hyperparameters, precision: str, world_size: int, hidden_size: int) -> dict[str, Any]:
    from gpuscout.paths import DEEPSPEED_DIR

    candidates = [DEEPSPEED_DIR, Path(__file__).resolve().parent.parent / "configs" / "deepspeed"]
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


# ---------------------------------------------------------------- data


class StepBatches(torch.utils.data.Sampler[list[int]]):
    """Block indices of this rank's micro-batches, step by step, from ``first_step`` to ``max_steps``.

    The order is a function of (seed, epoch) only, so a resumed run sees exactly the batches it would have seen.
    """

    def __init__(self, blocks: int, hp: Hyperparameters, dist: Dist, first_step: int) -> None:
        self.blocks, self.hp, self.dist, self.first_step = blocks, hp, dist, first_step
        self._perms: dict[int, np.ndarray] = {}

    def _block(self, k: int) -> int:
        epoch, pos = divmod(k, self.blocks)
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.hp.seed, epoch]).permutation(self.blocks)}
        return int(self._perms[epoch][pos])

    def __iter__(self) -> Iterator[list[int]]:
        b, ga, world = self.hp.per_device_train_batch_size, self.hp.gradient_accumulation_steps, self.dist.world_size
        for step in range(self.first_step, self.hp.max_steps + 1):
            for micro in range(ga):
                base = (((step - 1) * ga + micro) * world + self.dist.rank) * b
                yield [self._block(base + i) for i in range(b)]

    def __len__(self) -> int:
        return max(0, self.hp.max_steps - self.first_step + 1) * self.hp.gradient_accumulation_steps


class Blocks(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, ids: np.ndarray, seg: np.ndarray) -> None:
        self.ids, self.seg = ids, seg

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(self.ids[i]), torch.from_numpy(self.seg[i])


def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([i for i, _ in items]), torch.stack([s for _, s in items])


def split_blocks(ids: np.ndarray, seg: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of the dataset's length cut into rows of ``length`` (which must divide it)."""
    if length == ids.shape[1]:
        return ids, seg
    if ids.shape[1] % length:
        raise TrainingError(
            f"sequence_length {length} must equal or divide the prepared block length {ids.shape[1]}; "
            "prepare the data again with the wanted --sequence-length"
        )
    return ids.reshape(-1, length), seg.reshape(-1, length)


def token_counts(seg: torch.Tensor, packing: bool) -> tuple[int, int]:
    """(non-padding tokens, prediction targets) of a CPU micro-batch, without touching the device."""
    real = seg > 0
    tokens = int(real.sum())
    starts = seg[:, 1:] != seg[:, :-1] if packing else torch.zeros_like(seg[:, 1:], dtype=torch.bool)
    targets = int((real[:, 1:] & ~starts).sum())
    return tokens, targets


# ---------------------------------------------------------------- validation


def validation_starts(blocks: int, batch: int, world: int, rank: int, max_batches: int) -> list[int | None]:
    """The first block of each validation micro-batch of ``rank``; None where the rank has no real batch but must
    still run a forward. Every rank gets the same number of entries: the batches of the busiest rank."""
    per_round = batch * world
    rounds = min(max_batches, -(-blocks // per_round)) if blocks else 0
    starts: list[int | None] = []
    for r in range(rounds):
        start = (r * world + rank) * batch
        starts.append(start if start < blocks else None)
    return starts


# ---------------------------------------------------------------- the benchmark


@dataclass
class Progress:
    step: int = 0
    tokens: int = 0  # cumulative non-padding tokens, all ranks
    train_time_s: float = 0.0
    train_loss: list[LossPoint] = field(default_factory=list)
    validation_loss: list[LossPoint] = field(default_factory=list)
    records: list[StepRecord] = field(default_factory=list)

    def to_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens": self.tokens,
            "train_time_s": self.train_time_s,
            "train_loss": [p.model_dump() for p in self.train_loss],
            "validation_loss": [p.model_dump() for p in self.validation_loss],
            "records": [dataclasses.asdict(r) for r in self.records],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Progress:
        return cls(
            step=state["step"],
            tokens=state["tokens"],
            train_time_s=state["train_time_s"],
            train_loss=[LossPoint(**p) for p in state["train_loss"]],
            validation_loss=[LossPoint(**p) for p in state["validation_loss"]],
            records=[StepRecord(**r) for r in state["records"]],
        )


@dataclass
class Splits:
    """The prepared blocks (token ids, document segment ids) in the sequence length trained on."""

    train_ids: np.ndarray
    train_seg: np.ndarray
    val_ids: np.ndarray
    val_seg: np.ndarray


@dataclass
class Parts:
    """What the step loop drives and checkpoints save."""

    model: CausalLMWithLoss  # the module checkpoints save
    wrapped: Any  # what the forward runs through: the model, DDP or the DeepSpeed engine
    optimizer: Any
    scheduler: Any
    warmup: int  # benchmark warmup steps (also the LR warmup length)
    engine: Any = None  # DeepSpeed's engine, which owns optimizer and scheduler steps
    scaler: Any = None  # fp16 without DeepSpeed
    autocast: Any = field(default_factory=nullcontext)
    compute_dtype: torch.dtype = torch.float32


@dataclass
class StepWork:
    """One rank's counters of one optimizer step."""

    loss_sum: torch.Tensor
    tokens: int = 0
    samples: int = 0
    wait: float = 0.0
    grad_norm: float | None = None


class Benchmark:
    def __init__(self, hp: Hyperparameters, dist: Dist, tracker: JobTracker | None = None) -> None:
        self.hp = hp
        self.dist = dist
        self.tracker = tracker or JobTracker(None)  # experiment tracking (experiment_tracking.py); rank 0 only
        self.started = time.perf_counter()
        self.data_dir = Path(os.environ.get("SM_CHANNEL_TRAIN", "/opt/ml/input/data/train"))
        self.output_dir = Path(os.environ.get("SM_OUTPUT_DATA_DIR", "/opt/ml/output/data"))
        self.model_dir = Path(os.environ.get("SM_MODEL_DIR", "/opt/ml/model"))
        self.sampler = GpuSampler([dist.local_rank]) if dist.device.type == "cuda" else GpuSampler([])
        self.precision, self.precision_note = resolve_precision(hp.precision, dist.device)
        self.hardware = hardware_info(dist, self.precision, self.sampler)
        self.software = software_info()
        self.summary: DatasetSummary | None = None
        self.arch: Architecture | None = None
        self.model_name = hp.model_preset or hp.model_name_or_path
        self.params_total = 0
        self.optimizations: list[str] = []
        self.progress = Progress()
        self.resumed_from: int | None = None
        self.sequence_length = hp.sequence_length
        self.t_eff = 0.0

    def log(self, message: str) -> None:
        if self.dist.is_main:
            print(f"[train] {message}", flush=True)

    # ------------------------------------------------------------ result

    def train_config(self) -> TrainConfig:
        arch = self.arch
        hp = self.hp
        return TrainConfig(
            model=self.model_name,
            params_total=self.params_total,
            params_matmul=flops.matmul_params(arch) if arch else 0,
            num_layers=arch.num_hidden_layers if arch else 0,
            num_heads=arch.num_attention_heads if arch else 0,
            head_dim=arch.attention_head_dim if arch else 0,
            sequence_length=self.sequence_length,
            per_device_batch_size=hp.per_device_train_batch_size,
            gradient_accumulation_steps=hp.gradient_accumulation_steps,
            global_batch_size=hp.per_device_train_batch_size * hp.gradient_accumulation_steps * self.dist.world_size,
            precision=self.precision,
            packing=hp.packing,
            attention=hp.attention_implementation,
            torch_compile=hp.torch_compile,
            gradient_checkpointing=hp.gradient_checkpointing,
            deepspeed_stage=hp.deepspeed_stage,
            dataloader_workers=hp.dataloader_num_workers,
            learning_rate=hp.learning_rate,
            seed=hp.seed,
            optimizations=self.optimizations,
        )

    def dataset_info(self) -> DatasetInfo:
        s = self.summary
        if s is None:
            return DatasetInfo(sha256="", documents=0, tokens=0, padding_fraction=0.0, tokenizer="")
        return DatasetInfo(
            sha256=s.sha256,
            documents=s.documents,
            tokens=s.splits["train"].tokens,
            padding_fraction=s.splits["train"].padding_fraction,
            tokenizer=str(s.tokenizer["id"]),
        )

    def memory(self) -> Memory:
        util, power = self.sampler.stop()
        host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux -> GB
        if self.dist.device.type != "cuda":
            return Memory(host_rss_peak_gb=round(host, 3))
        return Memory(
            peak_allocated_gb=torch.cuda.max_memory_allocated(self.dist.device) / 1e9,
            peak_reserved_gb=torch.cuda.max_memory_reserved(self.dist.device) / 1e9,
            gpu_utilization_mean=util,
            power_w_mean=power,
            host_rss_peak_gb=round(host, 3),
        )

    def write(self, result: BenchmarkResult) -> None:
        if not self.dist.is_main:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "benchmark.json").write_text(result.model_dump_json(indent=2) + "\n")
        self.log(f"wrote {self.output_dir / 'benchmark.json'} ({result.status})")

    def failed(self, reason: str) -> BenchmarkResult:
        return BenchmarkResult(
            status="failed",
            job_name=self.hp.job_name,
            run_id=self.hp.run_id or None,
            instance_type=self.hp.instance_type,
            failure_reason=reason[:4000],
            hardware=self.hardware,
            software=self.software,
            config=self.train_config(),
            dataset=self.dataset_info(),
            memory=self.memory(),
        )

    # ------------------------------------------------------------ run

    def run(self) -> BenchmarkResult:
        """Set-up (data, model, optimizer, engine), resume, the timed step loop, the final validation, the result."""
        self._seed_and_check()
        data = self._load_data()
        parts = self._set_up()
        ckpt_root = checkpoint_root()
        if self.hp.search_candidate:  # a tuning job's trials share its checkpoint location: one folder each
            ckpt_root = ckpt_root / self.hp.job_name
        self._resume(ckpt_root, parts)
        stats = StepStats(warmup_steps=parts.warmup, records=list(self.progress.records))
        first_step = self.progress.step + 1
        loader = self._loader(data, first_step)
        self.log(
            f"model {self.model_name}: {self.params_total / 1e6:.2f} M parameters, {self.precision}, "
            f"{self.dist.world_size} rank(s) on {self.dist.device.type}; {len(data.train_ids)} train blocks of "
            f"{self.sequence_length}; T_eff {self.t_eff:.1f}; warmup {parts.warmup} steps; "
            f"steps {first_step}..{self.hp.max_steps}"
        )
        startup_s = time.perf_counter() - self.started
        self.sampler.start()
        stop_reason = self._train(parts, data, stats, iter(loader), ckpt_root)
        self._validate(parts, data)
        if os.environ.get("GPUSCOUT_SAVE_MODEL") == "1" and self.dist.is_main and parts.engine is None:
            parts.model.lm.save_pretrained(str(self.model_dir))  # type: ignore[operator]
        return self._result(stats, parts.warmup, startup_s, stop_reason)

    # ------------------------------------------------------------ set-up: data, model, optimizer, engine

    def _seed_and_check(self) -> None:
        hp, dist = self.hp, self.dist
        torch.manual_seed(hp.seed)
        random.seed(hp.seed)
        if dist.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = self.precision != "fp32"
            torch.backends.cudnn.allow_tf32 = self.precision != "fp32"
        if self.precision_note:
            self.log(self.precision_note)

    def _load_data(self) -> Splits:
        hp = self.hp
        self.summary = load_summary(self.data_dir)
        train_ids, train_seg = load_split(self.data_dir, "train")
        val_ids, val_seg = load_split(self.data_dir, "validation")
        self.sequence_length = hp.sequence_length or self.summary.sequence_length
        train_ids, train_seg = split_blocks(train_ids, train_seg, self.sequence_length)
        val_ids, val_seg = split_blocks(val_ids, val_seg, self.sequence_length)
        if not hp.packing:  # one padded row per document piece; padding is neither counted nor a target
            train_ids, train_seg = unpack_blocks(train_ids, train_seg)
            val_ids, val_seg = unpack_blocks(val_ids, val_seg)
        if len(train_ids) == 0:
            raise TrainingError(f"{self.data_dir}: the train split is empty")
        # Each token attends within its own document piece either way (document mask or a row of its own).
        self.t_eff = flops.effective_context(piece_lengths(train_seg))
        return Splits(train_ids, train_seg, val_ids, val_seg)

    def _set_up(self) -> Parts:
        model = self._build_model()
        warmup = self.hp.warmup_steps if self.hp.warmup_steps is not None else default_warmup_steps(self.hp.max_steps)
        if warmup >= self.hp.max_steps:
            raise TrainingError(f"warmup_steps={warmup} leaves no timed step with max_steps={self.hp.max_steps}")
        optimizer, scheduler = self._optimizer(model, warmup)
        parts = self._wrap(model, optimizer, scheduler, warmup)
        cuda_autocast = self.dist.device.type == "cuda" and self.precision != "fp32" and parts.engine is None
        if cuda_autocast:
            parts.autocast = torch.autocast("cuda", dtype=torch.bfloat16 if self.precision == "bf16" else torch.float16)
        parts.compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision, torch.float32)
        return parts

    def _build_model(self) -> CausalLMWithLoss:
        hp, dist = self.hp, self.dist
        assert self.summary is not None
        with tempfile.TemporaryDirectory(prefix="gpuscout-model-") as work:
            lm, self.arch, self.model_name = build_model(hp, self.summary, Path(work))
        self.params_total = sum(p.numel() for p in lm.parameters())
        if hp.gradient_checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.optimizations.append("gradient_checkpointing")
        loss_kind = "plain"
        if hp.fused_cross_entropy:
            from packing import liger_available

            liger = dist.device.type == "cuda" and hp.deepspeed_stage != 3 and liger_available()
            loss_kind = "liger" if liger else "chunked"
            self.optimizations.append("liger_cross_entropy" if liger else "chunked_cross_entropy")
        model = CausalLMWithLoss(lm, loss=loss_kind).to(dist.device)
        if hp.torch_compile:
            model.compile()
            self.optimizations.append("torch_compile")
        return model

    def _optimizer(self, model: CausalLMWithLoss, warmup: int) -> tuple[Any, Any]:
        hp, cuda = self.hp, self.dist.device.type == "cuda"
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        adam_kwargs: dict[str, Any] = {"lr": hp.learning_rate, "betas": (0.9, 0.95), "eps": 1e-8}
        if hp.fused_adamw:
            adam_kwargs["fused" if cuda else "foreach"] = True
            self.optimizations.append("fused_adamw" if cuda else "foreach_adamw")
        else:
            adam_kwargs["foreach"] = False
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            **adam_kwargs,
        )
        lr_warmup = max(1, warmup)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / lr_warmup))
        return optimizer, scheduler

    def _wrap(self, model: CausalLMWithLoss, optimizer: Any, scheduler: Any, warmup: int) -> Parts:
        """DeepSpeed's engine (it owns optimizer and scheduler), DDP across ranks, or the model itself."""
        hp, dist = self.hp, self.dist
        if hp.deepspeed_stage:
            import deepspeed

            if dist.device.type == "cpu":
                deepspeed_collectives_through_torch()
            assert self.arch is not None
            self.optimizations.append(f"deepspeed_zero{hp.deepspeed_stage}")
            ds_config = deepspeed_config(hp, self.precision, dist.world_size, self.arch.hidden_size)
            engine, optimizer, _, scheduler = deepspeed.initialize(
                model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
            )
            return Parts(model, engine, optimizer, scheduler, warmup, engine=engine)
        wrapped: Any = model
        if dist.world_size > 1:
            wrapped = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[dist.local_rank] if dist.device.type == "cuda" else None
            )
        scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" else None
        return Parts(model, wrapped, optimizer, scheduler, warmup, scaler=scaler)

    def _loader(self, data: Splits, first_step: int) -> torch.utils.data.DataLoader[Any]:
        hp = self.hp
        pinned = hp.pin_memory and self.dist.device.type == "cuda"
        if pinned:  # with pageable memory a non_blocking host-to-device copy is synchronous
            self.optimizations.append("pinned_memory")
        return torch.utils.data.DataLoader(
            Blocks(data.train_ids, data.train_seg),
            batch_sampler=StepBatches(len(data.train_ids), hp, self.dist, first_step),
            num_workers=hp.dataloader_num_workers,
            collate_fn=collate,
            pin_memory=pinned,
            persistent_workers=False,
        )

    # ------------------------------------------------------------ the timed step loop

    def _train(self, parts: Parts, data: Splits, stats: StepStats, batches: Iterator[Any], ckpt_root: Path) -> str:
        """Steps from the one after the resumed step to max_steps (or steady state); returns why it stopped."""
        hp = self.hp
        watch = Stopwatch(self.dist.synchronize)
        exit_after = int(os.environ.get("GPUSCOUT_EXIT_AFTER_STEP", "0"))
        parts.model.train()
        first_step = self.progress.step + 1
        for steps_here, step in enumerate(range(first_step, hp.max_steps + 1), start=1):
            t0 = watch.now()
            work = self._micro_batches(parts, batches)
            work.grad_norm = self._optimizer_step(parts)
            seconds = watch.now() - t0
            self._record_step(step, work, stats, parts, seconds=seconds, timed=not stats.is_warmup(steps_here))
            if hp.eval_interval and step % hp.eval_interval == 0 and step < hp.max_steps:
                self._validate(parts, data)
            if hp.checkpoint_interval and step % hp.checkpoint_interval == 0:
                self._save(ckpt_root, parts)
            if exit_after and step == exit_after:
                self.log(f"GPUSCOUT_EXIT_AFTER_STEP={exit_after}: exiting hard (interruption test)")
                sys.stdout.flush()
                os._exit(3)
            reason = self._steady_state(stats)
            if reason:
                return reason
        return "max_steps reached"

    def _micro_batches(self, parts: Parts, batches: Iterator[Any]) -> StepWork:
        """Forward and backward of the step's micro-batches (DeepSpeed steps its optimizer inside)."""
        hp, dist = self.hp, self.dist
        work = StepWork(loss_sum=torch.zeros((), device=dist.device))
        for micro in range(hp.gradient_accumulation_steps):
            tw = time.perf_counter()
            ids, seg = next(batches)
            work.wait += time.perf_counter() - tw
            n_tok, _ = token_counts(seg, hp.packing)
            work.tokens, work.samples = work.tokens + n_tok, work.samples + len(ids)
            ids = ids.to(dist.device, non_blocking=True)
            seg = seg.to(dist.device, non_blocking=True)
            inputs = make_inputs(
                ids, seg, packing=hp.packing, attention=hp.attention_implementation, dtype=parts.compute_dtype
            )
            last = micro == hp.gradient_accumulation_steps - 1
            no_sync = not last and parts.engine is None and dist.world_size > 1
            with parts.wrapped.no_sync() if no_sync else nullcontext(), parts.autocast:
                loss = parts.wrapped(inputs.input_ids, inputs.position_ids, inputs.attention_mask, inputs.labels)
            if parts.engine is not None:
                parts.engine.backward(loss)
                parts.engine.step()
            else:
                scaled = loss / hp.gradient_accumulation_steps
                (parts.scaler.scale(scaled) if parts.scaler else scaled).backward()
            work.loss_sum += loss.detach()
        return work

    def _optimizer_step(self, parts: Parts) -> float | None:
        """Clip, step and zero the gradients; the gradient norm (None under DeepSpeed: it clips internally)."""
        if parts.engine is not None:
            return None
        optimizer, scaler = parts.optimizer, parts.scaler
        if scaler:
            scaler.unscale_(optimizer)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(parts.model.parameters(), 1.0))
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        parts.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _record_step(
        self, step: int, work: StepWork, stats: StepStats, parts: Parts, *, seconds: float, timed: bool
    ) -> None:
        """Sum the step's counters over the ranks, record them and print rank 0's metric line."""
        hp, dist = self.hp, self.dist
        total_tokens, total_samples, total_loss = dist.all_reduce_sum(
            [work.tokens, work.samples, float(work.loss_sum) / hp.gradient_accumulation_steps]
        )
        mean_loss = total_loss / dist.world_size
        if not math.isfinite(mean_loss):
            raise TrainingError(f"loss is {mean_loss} at step {step}; lower learning_rate or use bf16")
        stats.add(
            StepRecord(
                step=step,
                seconds=seconds,
                tokens=int(total_tokens),
                samples=int(total_samples),
                dataloader_wait_s=work.wait,
                loss=mean_loss,
                timed=timed,
            )
        )
        prog = self.progress
        prog.step, prog.records = step, stats.records
        prog.tokens += int(total_tokens)
        prog.train_time_s += seconds
        prog.train_loss.append(LossPoint(step=step, tokens=prog.tokens, elapsed_s=prog.train_time_s, loss=mean_loss))
        if dist.is_main:
            mem = torch.cuda.max_memory_allocated(dist.device) / 1e9 if dist.device.type == "cuda" else None
            metrics = {
                "step": step,
                "loss": mean_loss,
                "tokens_per_s": total_tokens / seconds,
                "samples_per_s": total_samples / seconds,
                "step_time_s": seconds,
                "lr": float(parts.scheduler.get_last_lr()[0]),
                "grad_norm": work.grad_norm,  # None under DeepSpeed (it clips internally)
                "gpu_mem_gb": mem,
            }
            timed_records = [r for r in stats.timed if r.seconds > 0]
            if hp.price_per_hour_usd and timed and len(timed_records) >= hp.objective_min_timed_steps:
                rate = sum(r.tokens for r in timed_records) / sum(r.seconds for r in timed_records)
                metrics[OBJECTIVE_KEY] = usd_per_million_tokens(hp.price_per_hour_usd, rate)
            print(format_metric_line(metrics), flush=True)
            self.tracker.log_step(step, {**metrics, "gpu_util_pct": self.sampler.recent_utilization()})

    def _steady_state(self, stats: StepStats) -> str | None:
        """Why to stop now under stop_rule=steady_state (every rank follows rank 0's decision), else None."""
        hp, dist = self.hp, self.dist
        if hp.stop_rule != "steady_state":
            return None
        done, reason = stats.steady_state_reached(ci_tolerance=hp.ci_tolerance, min_timed_steps=hp.min_timed_steps)
        if dist.world_size > 1:  # every rank stops on rank 0's decision
            flag = torch.tensor([1.0 if done else 0.0], device=dist.device)
            torch.distributed.broadcast(flag, 0)
            done = bool(flag.item())
        return (reason or "throughput steady on rank 0") if done else None

    # ------------------------------------------------------------ the result

    def _efficiency(self, tokens_per_s: float) -> Efficiency:
        hp, dist = self.hp, self.dist
        assert self.arch is not None
        flops_per_token = flops.model_flops_per_token(self.arch, self.t_eff)
        hw_flops = flops.hardware_flops_per_token(self.arch, self.t_eff, activation_recompute=hp.gradient_checkpointing)
        peak = self.hardware.peak_tflops_per_gpu
        gpus = dist.world_size if dist.device.type == "cuda" else 0
        if gpus and peak:
            mfu: float | None = flops.mfu(tokens_per_s, flops_per_token, gpus, peak)
            hfu: float | None = flops.mfu(tokens_per_s, hw_flops, gpus, peak)
            note = None
        else:
            mfu = hfu = None
            note = CPU_NOTE if dist.device.type != "cuda" else f"no dense peak known for {self.hardware.gpu_name}"
        return Efficiency(
            flops_per_token=flops_per_token,
            hardware_flops_per_token=hw_flops,
            t_eff=self.t_eff,
            mfu=mfu,
            hfu=hfu,
            note=note,
        )

    def _result(self, stats: StepStats, warmup: int, startup_s: float, stop_reason: str) -> BenchmarkResult:
        hp = self.hp
        s = stats.summary()
        tokens_per_s = float(s["tokens_per_s"])
        gpus = self.dist.world_size if self.dist.device.type == "cuda" else 0
        efficiency = self._efficiency(tokens_per_s)
        progress = self.progress
        result = BenchmarkResult(
            status="completed",
            job_name=hp.job_name,
            run_id=hp.run_id or None,
            instance_type=hp.instance_type,
            hardware=self.hardware,
            software=self.software,
            config=self.train_config(),
            dataset=self.dataset_info(),
            timing=Timing(
                warmup_steps=warmup,
                timed_steps=int(s["timed_steps"]),
                total_steps=progress.step,
                step_time_mean_s=s["step_time_mean_s"],
                step_time_p50_s=s["step_time_p50_s"],
                step_time_p90_s=s["step_time_p90_s"],
                wall_time_s=time.perf_counter() - self.started,
                train_time_s=s["train_time_s"],
                dataloader_wait_fraction=s["dataloader_wait_fraction"],
                startup_time_s=startup_s,
            ),
            throughput=Throughput(
                tokens_per_s=tokens_per_s,
                tokens_per_s_ci95=s["tokens_per_s_ci95"],
                tokens_per_s_per_gpu=tokens_per_s / gpus if gpus else None,
                samples_per_s=s["samples_per_s"],
                tokens_timed=int(s["tokens_timed"]),
            ),
            efficiency=efficiency,
            memory=self.memory(),
            loss=Loss(
                train=progress.train_loss,
                validation=progress.validation_loss,
                final_train_loss=progress.train_loss[-1].loss if progress.train_loss else None,
                final_validation_loss=progress.validation_loss[-1].loss if progress.validation_loss else None,
            ),
            stop=StopInfo(
                rule=hp.stop_rule, reason=stop_reason, steps=progress.step, resumed_from_step=self.resumed_from
            ),
        )
        if self.dist.is_main:
            summary = {
                "tokens_per_s": tokens_per_s,
                "mfu": efficiency.mfu,
                "hfu": efficiency.hfu,
                "step_time_p50_s": s["step_time_p50_s"],
                "step_time_p90_s": s["step_time_p90_s"],
                "peak_gpu_mem_gb": result.memory.peak_allocated_gb,
                "final_loss": result.loss.final_train_loss if result.loss else None,
                "final_val_loss": result.loss.final_validation_loss if result.loss else None,
            }
            print(format_metric_line(summary, summary=True), flush=True)
        return result

    # ------------------------------------------------------------ validation and checkpoints

    def _validate(self, parts: Parts, data: Splits) -> None:
        hp, dist = self.hp, self.dist
        wrapped, ids, seg = parts.wrapped, data.val_ids, data.val_seg
        if hp.validation_batches == 0 or len(ids) == 0:
            return
        b = hp.per_device_train_batch_size
        loss_sum, target_sum = 0.0, 0
        wrapped.eval()
        with torch.no_grad():
            # Every rank runs the same number of forwards (DDP broadcasts buffers and ZeRO-3 gathers parameters in
            # each forward: a rank that stops early leaves the others waiting for ever); a rank without a real
            # batch of its own runs the split's first blocks and counts nothing.
            for start in validation_starts(len(ids), b, dist.world_size, dist.rank, hp.validation_batches):
                real = start is not None
                lo = start if start is not None else 0
                ids_b = torch.from_numpy(ids[lo : lo + b])
                seg_b = torch.from_numpy(seg[lo : lo + b])
                _, targets = token_counts(seg_b, hp.packing)
                inputs = make_inputs(
                    ids_b.to(dist.device), seg_b.to(dist.device), packing=hp.packing,
                    attention=hp.attention_implementation, dtype=parts.compute_dtype,
                )  # fmt: skip
                with parts.autocast:
                    loss = wrapped(inputs.input_ids, inputs.position_ids, inputs.attention_mask, inputs.labels)
                if real and targets > 0:
                    loss_sum += float(loss) * targets
                    target_sum += targets
        wrapped.train()
        total_loss, total_targets = self.dist.all_reduce_sum([loss_sum, float(target_sum)])
        if total_targets:
            value = total_loss / total_targets
            p = self.progress
            p.validation_loss.append(LossPoint(step=p.step, tokens=p.tokens, elapsed_s=p.train_time_s, loss=value))
            if dist.is_main:
                print(format_metric_line({"step": p.step, "val_loss": value}), flush=True)
                self.tracker.log_step(p.step, {"val_loss": value})

    def _checkpointer(self, root: Path) -> Checkpointer:
        return Checkpointer(root, self.dist, self.hp.checkpoint_keep, self.log)

    def _save(self, root: Path, parts: Parts) -> None:
        state: dict[str, Any] = {
            "progress": self.progress.to_state(),
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "python": random.getstate(),
            },
        }
        if parts.engine is None:  # under DeepSpeed its engine saves model, optimizer and scheduler (every rank)
            state["model"] = parts.model.state_dict()
            state["optimizer"] = parts.optimizer.state_dict()
            state["scheduler"] = parts.scheduler.state_dict()
            state["scaler"] = parts.scaler.state_dict() if parts.scaler else None
        self._checkpointer(root).save(self.progress.step, state, parts.engine)

    def _resume(self, root: Path, parts: Parts) -> None:
        """Continue from the newest checkpoint under ``root`` that verifies and loads, if any."""
        state = self._checkpointer(root).resume(lambda folder: self._load(folder, parts))
        if state is None:
            return
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        random.setstate(state["rng"]["python"])
        self.progress = Progress.from_state(state["progress"])
        self.resumed_from = self.progress.step

    @staticmethod
    def _load(folder: Path, parts: Parts) -> dict[str, Any]:
        """Read checkpoint ``folder`` into the model, optimizer and scheduler (or the engine); state.pt's content."""
        state: dict[str, Any] = torch.load(folder / STATE, map_location="cpu", weights_only=False)
        # a corrupt or truncated state.pt raises above, before anything changed; from here on the model changes
        try:
            if parts.engine is not None:
                loaded, _ = parts.engine.load_checkpoint(str(folder.parent / DEEPSPEED), tag=folder.name)
                if loaded is None:  # DeepSpeed warns and returns None for a missing tag folder
                    raise TrainingError(f"DeepSpeed found no checkpoint {folder.name} in {folder.parent / DEEPSPEED}")
            else:
                parts.model.load_state_dict(state["model"])
                parts.optimizer.load_state_dict(state["optimizer"])
                parts.scheduler.load_state_dict(state["scheduler"])
                if parts.scaler is not None and state.get("scaler"):
                    parts.scaler.load_state_dict(state["scaler"])
        except Exception as err:
            raise PartlyLoadedError(f"{type(err).__name__}: {err}") from err
        return state


def main(argv: Sequence[str] | None = None) -> int:
    try:
        hp = parse_hyperparameters(argv)
    except TrainingError as err:
        print(f"train: error: {err}", file=sys.stderr, flush=True)
        return 2
    dist = init_distributed()
    tracker = JobTracker.from_environment(is_main=dist.is_main)
    # the job's parameters for its experiment trackers; started before the benchmark's clock (not its start-up time)
    params = {**dataclasses.asdict(hp), "device": dist.device.type, "world_size": dist.world_size}
    tracker.start(params, variant=hp.search_candidate or None)  # a tuning trial is its candidate
    bench = Benchmark(hp, dist, tracker)
    try:
        result = bench.run()
    except Exception as err:  # every failure becomes a status=failed benchmark.json the analysis can classify
        reason = str(err) if isinstance(err, TrainingError) else f"{type(err).__name__}: {err}"
        if isinstance(err, torch.OutOfMemoryError):
            reason = f"CUDA out of memory: {err}"
        print(f"train: error: {reason}", file=sys.stderr, flush=True)
        failed = bench.failed(reason)
        try:
            bench.write(failed)
            if dist.is_main:
                failure = Path(os.environ.get("SM_OUTPUT_DATA_DIR", "/opt/ml/output/data")).parent / "failure"
                failure.write_text(reason[:1000])
        except OSError:
            pass
        bench.tracker.finish(failed, bench.output_dir / "benchmark.json")
        if not isinstance(err, TrainingError):
            raise
        return 1
    bench.write(result)
    bench.tracker.finish(result, bench.output_dir / "benchmark.json")
    if dist.world_size > 1:
        leave_together()
    return 0


def leave_together() -> NoReturn:
    """End a finished rank of a multi-rank job: every rank passes a barrier (all have written what they write),
    then the process exits without tearing the process group down. gloo's teardown (destroy_process_group, or the
    interpreter's C++ destructors) aborts a finished rank now and then ("terminate called without an active
    exception", exit -6, which SageMaker reports as a failed job): 2 of 40 two-rank torchrun runs of a minimal DDP
    script with barrier + destroy_process_group on a loaded 2-core machine, 0 of 60 with this exit."""
    torch.distributed.barrier()
    wandb = sys.modules.get("wandb")  # a tracked rank 0: W&B's service process is ended by an atexit hook
    if wandb is not None:
        wandb.teardown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
