"""The measured result of a training job (benchmark.json): what the job learned about itself during set-up
(``RunFacts``: hardware, software, model, data, precision, optimizations) and how the timed steps become the
result (throughput of non-padding tokens, MFU and HFU, memory, loss, the stop, the disturbance verdict).

The timed loop (trainer.py) fills the facts as set-up learns them, has ``report_step`` print each step's metric
line on rank 0, and calls ``build_result`` after its steps, or ``failed_result`` when the job failed;
``write_result`` writes benchmark.json on rank 0.

Imported by trainer.py and train.py; may import gpuscout.domain and the components beside it."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from gpuscout_data.dataset import DatasetSummary

from gpuscout.domain import flops
from gpuscout.domain.adapters import Adapter
from gpuscout.domain.benchmark import (
    BenchmarkResult,
    DatasetInfo,
    Disturbance,
    Efficiency,
    Hardware,
    LoraInfo,
    Loss,
    Memory,
    Software,
    StepAccount,
    StopInfo,
    Throughput,
    Timing,
    TrainConfig,
)
from gpuscout.domain.disturbance import detect
from gpuscout.domain.metric_lines import OBJECTIVE_KEY, format_metric_line, usd_per_million_tokens
from gpuscout.domain.models import Architecture

from .args import Hyperparameters
from .distributed import Dist
from .facts import CPU_NOTE
from .metrics import GpuSampler, StepStats, step_accounts
from .state import Progress, StepWork
from .tracking import JobTracker


@dataclass
class RunFacts:
    """What the result says about the job beside its measurements; set-up fills the model's and the data's part."""

    hp: Hyperparameters
    dist: Dist
    precision: str
    hardware: Hardware
    software: Software
    sampler: GpuSampler  # GPU utilization and power over the timed steps
    started: float  # perf_counter at the process's start: wall and start-up times include the imports
    import_time_s: float | None  # process start to main(): the interpreter and train.py's imports
    model_name: str
    sequence_length: int
    summary: DatasetSummary | None = None
    arch: Architecture | None = None
    params_total: int = 0
    params_trainable: int = 0
    adapter_model: Any = None  # an adapter run's peft PeftModel (what saves the adapters alone), else None
    optimizations: list[str] = field(default_factory=list)
    t_eff: float = 0.0  # effective attended context per token (documents shorter than the block attend less)


@dataclass
class Outcome:
    """How the steps went, beside their records: where they resumed, validation, memory before validation."""

    progress: Progress
    warmup: int
    startup_s: float
    stop_reason: str
    resumed_from: int | None = None
    validation_error: str | None = None
    trained_memory: Memory | None = None  # read before the final validation (its peaks are the steps')


def report_step(
    facts: RunFacts, tracker: JobTracker, stats: StepStats, step: int, work: StepWork, *,
    totals: tuple[float, float, float], seconds: float, timed: bool,
) -> None:  # fmt: skip
    """Rank 0's metric line of one step (``totals``: its tokens, samples and mean loss over the ranks), with the
    running $ per 1M tokens once enough steps were timed (a search's objective), and the trackers' record of it."""
    hp, dist = facts.hp, facts.dist
    tokens, samples, loss = totals
    mem = torch.cuda.max_memory_allocated(dist.device) / 1e9 if dist.device.type == "cuda" else None
    metrics: dict[str, float | int | None] = {
        "step": step,
        "loss": loss,
        "tokens_per_s": tokens / seconds,
        "samples_per_s": samples / seconds,
        "step_time_s": seconds,
        "lr": work.lr,
        "grad_norm": work.grad_norm,  # None under DeepSpeed (it clips internally)
        "gpu_mem_gb": mem,
    }
    timed_records = [r for r in stats.timed if r.seconds > 0]
    timed_totals = tuple(float(sum(getattr(r, n) for r in timed_records)) for n in ("tokens", "samples", "seconds"))
    if hp.price_per_hour_usd and timed and len(timed_records) >= hp.objective_min_timed_steps:
        metrics[OBJECTIVE_KEY] = usd_per_million_tokens(hp.price_per_hour_usd, timed_totals[0] / timed_totals[2])
    print(format_metric_line(metrics), flush=True)
    metrics["gpu_util_pct"] = facts.sampler.recent_utilization()  # for the trackers; rates are the timed steps'
    tracker.log_step(step, metrics, timed_totals=timed_totals if timed and timed_totals[2] > 0 else None)


def train_config(facts: RunFacts) -> TrainConfig:
    arch, hp = facts.arch, facts.hp
    return TrainConfig(
        model=facts.model_name,
        params_total=facts.params_total,
        method=hp.method,  # args.CHOICES holds it to full | lora | qlora
        params_trainable=facts.params_trainable or facts.params_total,
        lora=lora_info(hp.adapter()),
        params_matmul=flops.matmul_params(arch) if arch else 0,
        num_layers=arch.num_hidden_layers if arch else 0,
        num_heads=arch.num_attention_heads if arch else 0,
        head_dim=arch.attention_head_dim if arch else 0,
        sequence_length=facts.sequence_length,
        per_device_batch_size=hp.per_device_train_batch_size,
        gradient_accumulation_steps=hp.gradient_accumulation_steps,
        global_batch_size=hp.per_device_train_batch_size * hp.gradient_accumulation_steps * facts.dist.world_size,
        precision=facts.precision,
        packing=hp.packing,
        attention=hp.attention_implementation,
        torch_compile=hp.torch_compile,
        gradient_checkpointing=hp.gradient_checkpointing,
        deepspeed_stage=hp.deepspeed_stage,
        dataloader_workers=hp.dataloader_num_workers,
        learning_rate=hp.learning_rate,
        seed=hp.seed,
        optimizations=facts.optimizations,
    )


def lora_info(adapter: Adapter | None) -> LoraInfo | None:
    if adapter is None:
        return None
    return LoraInfo(rank=adapter.rank, alpha=adapter.alpha, dropout=adapter.dropout,
                    target_modules=list(adapter.target_modules))  # fmt: skip


def dataset_info(facts: RunFacts) -> DatasetInfo:
    s = facts.summary
    if s is None:
        return DatasetInfo(sha256="", documents=0, tokens=0, padding_fraction=0.0, tokenizer="")
    return DatasetInfo(
        sha256=s.sha256,
        documents=s.documents,
        tokens=s.splits["train"].tokens,
        padding_fraction=s.splits["train"].padding_fraction,
        tokenizer=str(s.tokenizer["id"]),
    )


def memory(facts: RunFacts) -> Memory:
    """Peak memory so far (stops the GPU sampler: its means cover what was timed)."""
    util, power = facts.sampler.stop()
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux -> GB
    device = facts.dist.device
    if device.type != "cuda":
        return Memory(host_rss_peak_gb=round(host, 3))
    return Memory(
        peak_allocated_gb=torch.cuda.max_memory_allocated(device) / 1e9,
        peak_reserved_gb=torch.cuda.max_memory_reserved(device) / 1e9,
        gpu_utilization_mean=util,
        power_w_mean=power,
        host_rss_peak_gb=round(host, 3),
    )


def failed_result(facts: RunFacts, reason: str) -> BenchmarkResult:
    hp = facts.hp
    return BenchmarkResult(
        status="failed",
        job_name=hp.job_name,
        run_id=hp.run_id or None,
        instance_type=hp.instance_type,
        failure_reason=reason[:4000],
        hardware=facts.hardware,
        software=facts.software,
        config=train_config(facts),
        dataset=dataset_info(facts),
        memory=memory(facts),
    )


def efficiency(facts: RunFacts, tokens_per_s: float, positions_per_token: float) -> Efficiency:
    """MFU from the useful work (T_eff, real tokens); HFU from what the kernels execute: attention over the whole
    block unless flex skips the masked blocks, every padded position (``positions_per_token`` = positions computed
    per real token in the timed steps), and the forward pass again under gradient checkpointing."""
    hp, dist = facts.hp, facts.dist
    assert facts.arch is not None
    adapter = hp.adapter()
    flops_per_token = flops.model_flops_per_token(facts.arch, facts.t_eff, adapter=adapter)
    packed_flex = hp.packing and hp.attention_implementation == "flex"
    executed_context = facts.t_eff if packed_flex else facts.sequence_length
    hw_flops = positions_per_token * flops.hardware_flops_per_token(
        facts.arch, float(executed_context), activation_recompute=hp.gradient_checkpointing, adapter=adapter
    )
    peak = facts.hardware.peak_tflops_per_gpu
    gpus = dist.world_size if dist.device.type == "cuda" else 0
    if gpus and peak:
        mfu: float | None = flops.mfu(tokens_per_s, flops_per_token, gpus, peak)
        hfu: float | None = flops.mfu(tokens_per_s, hw_flops, gpus, peak)
        note = None
    else:
        mfu = hfu = None
        note = CPU_NOTE if dist.device.type != "cuda" else f"no dense peak known for {facts.hardware.gpu_name}"
    return Efficiency(
        flops_per_token=flops_per_token,
        hardware_flops_per_token=hw_flops,
        t_eff=facts.t_eff,
        mfu=mfu,
        hfu=hfu,
        note=note,
    )


def build_result(facts: RunFacts, stats: StepStats, outcome: Outcome, *, provisional: bool = False) -> BenchmarkResult:
    """The benchmark result of the timed steps; ``provisional``: written before the final validation (no final
    validation loss yet, nothing printed: the final result prints its lines once)."""
    hp, dist = facts.hp, facts.dist
    s = stats.summary()
    tokens_per_s = float(s["tokens_per_s"])
    gpus = dist.world_size if dist.device.type == "cuda" else 0
    timed_tokens = sum(r.tokens for r in stats.timed)
    positions = sum(r.samples for r in stats.timed) * facts.sequence_length
    measured = efficiency(facts, tokens_per_s, positions / timed_tokens if timed_tokens else 1.0)
    progress = outcome.progress
    steps = step_accounts(stats.records)  # benchmark.json's steps and what the detector judges
    disturbance = Disturbance(**detect(steps))
    validated = not (provisional or outcome.validation_error or not progress.validation_loss)
    result = BenchmarkResult(
        status="completed",
        job_name=hp.job_name,
        run_id=hp.run_id or None,
        instance_type=hp.instance_type,
        hardware=facts.hardware,
        software=facts.software,
        config=train_config(facts),
        dataset=dataset_info(facts),
        timing=Timing(
            warmup_steps=outcome.warmup,
            timed_steps=int(s["timed_steps"]),
            total_steps=progress.step,
            step_time_mean_s=s["step_time_mean_s"],
            step_time_p50_s=s["step_time_p50_s"],
            step_time_p90_s=s["step_time_p90_s"],
            wall_time_s=time.perf_counter() - facts.started,
            train_time_s=s["train_time_s"],
            dataloader_wait_fraction=s["dataloader_wait_fraction"],
            startup_time_s=outcome.startup_s,
            import_time_s=facts.import_time_s,
        ),
        throughput=Throughput(
            tokens_per_s=tokens_per_s,
            tokens_per_s_ci95=s["tokens_per_s_ci95"],
            tokens_per_s_per_gpu=tokens_per_s / gpus if gpus else None,
            samples_per_s=s["samples_per_s"],
            tokens_timed=int(s["tokens_timed"]),
        ),
        efficiency=measured,
        memory=outcome.trained_memory or memory(facts),
        loss=Loss(
            train=progress.train_loss,
            validation=progress.validation_loss,
            final_train_loss=progress.train_loss[-1].loss if progress.train_loss else None,
            final_validation_loss=progress.validation_loss[-1].loss if validated else None,
            validation_error=outcome.validation_error,
        ),
        stop=StopInfo(
            rule=hp.stop_rule, reason=outcome.stop_reason, steps=progress.step, resumed_from_step=outcome.resumed_from
        ),
        steps=[StepAccount(**row) for row in steps],
        disturbance=disturbance,
    )
    if provisional or not dist.is_main:
        return result
    if disturbance.disturbed:
        print(f"[train] disturbed measurement: {disturbance.evidence}", flush=True)
    summary = {
        "tokens_per_s": tokens_per_s,
        "mfu": measured.mfu,
        "hfu": measured.hfu,
        "step_time_p50_s": s["step_time_p50_s"],
        "step_time_p90_s": s["step_time_p90_s"],
        "peak_gpu_mem_gb": result.memory.peak_allocated_gb,
        "final_loss": result.loss.final_train_loss if result.loss else None,
        "final_val_loss": result.loss.final_validation_loss if result.loss else None,
    }
    print(format_metric_line(summary, summary=True), flush=True)
    return result


def write_result(dist: Dist, output_dir: Path, result: BenchmarkResult) -> Path | None:
    """benchmark.json in ``output_dir``, on rank 0 (None elsewhere)."""
    if not dist.is_main:
        return None
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "benchmark.json"
    path.write_text(result.model_dump_json(indent=2) + "\n")
    return path
