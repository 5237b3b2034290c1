"""train.py's arguments: the hyperparameters (a dataclass, as transformers' run_clm.py has), read from SageMaker's
hyperparameters.json or SM_HPS and the command line, every name checked; a tuning trial's candidate name turned into
its settings.

Imported by train.py; may import gpuscout.domain and gpuscout.errors."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuscout.domain.adapters import DEFAULT_ALPHA, DEFAULT_DROPOUT, DEFAULT_RANK, DEFAULT_TARGET_MODULES, Adapter
from gpuscout.domain.candidates import parse_candidate_name
from gpuscout.domain.models import PRESETS
from gpuscout.errors import TrainingError

SM_CONFIG_DIR = Path(os.environ.get("SM_INPUT_CONFIG_DIR", "/opt/ml/input/config"))
ATTENTION_IMPLEMENTATIONS = {"sdpa": "sdpa", "eager": "eager", "flex": "flex_attention"}
# The hyperparameters that take one of a few values, and those values.
CHOICES: dict[str, tuple[Any, ...]] = {
    "precision": ("auto", "bf16", "fp16", "fp32"),
    "attention_implementation": tuple(ATTENTION_IMPLEMENTATIONS),
    "deepspeed_stage": (0, 2, 3),
    "cross_entropy_kernel": ("auto", "chunked", "liger", "torch"),
    "host_allocator": ("training", "system"),
    "stop_rule": ("fixed", "steady_state"),
    "method": ("full", "lora", "qlora"),
}


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
    # which fused loss (packing.FUSED_LOSSES) with fused_cross_entropy: auto = chunked, the project's own
    cross_entropy_kernel: str = "auto"
    fused_adamw: bool = False
    host_allocator: str = "training"  # training | system (host_allocator.py)
    # full | lora | qlora, and the adapters' knobs (adapters.py; gpuscout.domain.adapters has the defaults)
    method: str = "full"
    lora_rank: int = DEFAULT_RANK
    lora_alpha: int = DEFAULT_ALPHA
    lora_dropout: float = DEFAULT_DROPOUT
    lora_target_modules: str = ",".join(DEFAULT_TARGET_MODULES)
    stop_rule: str = "fixed"  # fixed | steady_state
    ci_tolerance: float = 0.02  # fraction of the mean
    min_timed_steps: int = 10
    # steady_state also waits for this much timed work; < 0 = auto: 60 s on CUDA (clocks and power settle over
    # tens of seconds; a few 0.4 s steps can look steady before they do), none on a CPU
    min_timed_seconds: float = -1.0
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
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                problems.append(f"{name} must be one of {', '.join(map(str, allowed))}")
        problems += self._adapter_problems()
        if self.cross_entropy_kernel != "auto" and not self.fused_cross_entropy:
            problems.append(f"cross_entropy_kernel {self.cross_entropy_kernel} needs fused_cross_entropy true")
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

    def _adapter_problems(self) -> list[str]:
        if self.method == "full":
            return []
        problems = []
        try:
            self.adapter()
        except ValueError as err:
            problems.append(f"lora: {err}")
        if self.deepspeed_stage:
            problems.append(f"method {self.method} runs with deepspeed_stage 0 (only the adapters train)")
        if not 0 <= self.lora_dropout < 1 or self.lora_alpha <= 0:
            problems.append("lora_dropout is a fraction in [0, 1) and lora_alpha is positive")
        return problems

    def adapter(self) -> Adapter | None:
        """The adapter ``method`` trains, or None for full fine-tuning (ValueError for unknown target modules)."""
        if self.method == "full":
            return None
        modules = tuple(m.strip() for m in self.lora_target_modules.split(",") if m.strip())
        return Adapter(method="qlora" if self.method == "qlora" else "lora", rank=self.lora_rank,
                       alpha=self.lora_alpha, dropout=self.lora_dropout, target_modules=modules)  # fmt: skip


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
    "method": "method",
    "lora_rank": "lora_rank",
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
