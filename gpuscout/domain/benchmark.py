"""benchmark.json: what one training job measured. Written by gpuscout_train/train.py, read by the store and analysis.

The schema is versioned (SCHEMA_VERSION); docs/metrics.md documents every field and
``BenchmarkResult.model_json_schema()`` is the machine-readable form. Bump the minor version for added optional
fields, the major version for anything a reader of an older file would misread.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = "1.6"  # 1.1: unit, samples throughput, job (the user's own code); config/dataset optional
# 1.2: steps[], disturbance, timing.import_time_s; 1.3: software.nvidia_driver, cuda_driver, cuda_runtime
# 1.4: steps[].compiled_graphs, disturbance.compiled_graphs_timed; 1.5: disturbance.compiled_graphs_slow,
# compile_explains; 1.6: config.method, params_trainable, lora (adapter runs)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Hardware(_Strict):
    device: Literal["cuda", "cpu"]
    gpu_name: str | None = None  # as the driver reports it
    gpu_sku: str | None = None  # gpuscout.domain.hardware key, None when not recognised or on CPU
    gpus_per_node: int = Field(ge=0)
    nodes: int = Field(ge=1)
    world_size: int = Field(ge=1)
    peak_tflops_per_gpu: float | None = None  # dense peak for the precision used; None on CPU / unknown SKU
    gpu_memory_gb: float | None = None
    driver_version: str | None = None
    cuda_version: str | None = None
    cpu_model: str | None = None
    cpu_count: int | None = None


class Software(_Strict):
    python: str
    torch: str | None = None  # None: the user's own job did not import it
    transformers: str | None = None
    deepspeed: str | None = None
    gpuscout: str
    image_digest: str | None = None
    host_allocator: str | None = None  # the host memory allocator in effect and its settings (train.py)
    # The GPU host's NVIDIA driver (e.g. "580.95.05"), the newest CUDA it supports ("13.0") and the CUDA runtime torch
    # was built with ("12.8"): None on a host without an NVIDIA driver, or where it could not be read
    nvidia_driver: str | None = None
    cuda_driver: str | None = None
    cuda_runtime: str | None = None


class LoraInfo(_Strict):
    """The adapters an adapter run trained (gpuscout.domain.adapters)."""

    rank: int
    alpha: int
    dropout: float
    target_modules: list[str]


class TrainConfig(_Strict):
    model: str  # preset name, HF id or path
    params_total: int
    # what trained: every weight (full), LoRA adapters on a frozen base, or QLoRA's on a 4-bit one; the trainable
    # parameters (None in results written before methods existed: every parameter, a full fine-tune)
    method: Literal["full", "lora", "qlora"] = "full"
    params_trainable: int | None = None
    lora: LoraInfo | None = None
    params_matmul: int
    num_layers: int
    num_heads: int
    head_dim: int
    sequence_length: int
    per_device_batch_size: int
    gradient_accumulation_steps: int
    global_batch_size: int  # micro batch x accumulation x world size, in sequences
    precision: Literal["bf16", "fp16", "fp32"]
    packing: bool
    attention: str
    torch_compile: bool
    gradient_checkpointing: bool
    deepspeed_stage: int = Field(ge=0, le=3)
    dataloader_workers: int
    learning_rate: float
    seed: int
    optimizations: list[str] = Field(default_factory=list)  # e.g. ["fused_adamw", "liger_cross_entropy"]


class DatasetInfo(_Strict):
    sha256: str
    documents: int
    tokens: int  # non-padding training tokens available
    padding_fraction: float = Field(ge=0, le=1)
    tokenizer: str


class Timing(_Strict):
    warmup_steps: int  # optimizer steps excluded from every throughput figure
    timed_steps: int
    total_steps: int
    step_time_mean_s: float
    step_time_p50_s: float
    step_time_p90_s: float
    wall_time_s: float  # whole script, from the process's start to the end
    train_time_s: float  # sum of all optimizer-step times, warmup included
    dataloader_wait_fraction: float = Field(ge=0, le=1)
    startup_time_s: float = 0.0  # from the process's start to step 1: imports, model build, data load
    import_time_s: float | None = None  # the part of startup_time_s spent before the script's main() began


class Throughput(_Strict):
    # tokens: non-padding tokens of all ranks per second over timed steps; None for a samples job that reports none
    tokens_per_s: float | None
    tokens_per_s_ci95: tuple[float, float] | None  # 95 % confidence interval of the mean
    tokens_per_s_per_gpu: float | None = None
    samples_per_s: float
    samples_per_s_ci95: tuple[float, float] | None = None  # samples jobs: the interval of the ranked rate
    tokens_timed: int  # non-padding tokens processed during timed steps (0 when the job reports none)
    samples_timed: int | None = None


class Efficiency(_Strict):
    # model FLOPs (PaLM convention, docs/metrics.md); an adapter run's count only what it computes (no weight
    # gradients of the frozen base), so its MFU is not the same work as a full fine-tune's
    flops_per_token: float
    hardware_flops_per_token: float
    t_eff: float  # effective attention context used in flops_per_token
    mfu: float | None = None  # fraction; None on CPU or an unknown SKU
    hfu: float | None = None
    note: str | None = None  # why mfu is None


class Memory(_Strict):
    peak_allocated_gb: float | None = None
    peak_reserved_gb: float | None = None
    gpu_utilization_mean: float | None = None  # percent, NVML
    power_w_mean: float | None = None  # watts per GPU, NVML
    host_rss_peak_gb: float | None = None


class LossPoint(_Strict):
    step: int
    tokens: int  # cumulative non-padding tokens (all ranks) at this step (0 when the job reports none)
    samples: int | None = None  # cumulative samples (the user's own job)
    elapsed_s: float  # cumulative training time at this step
    loss: float


class Loss(_Strict):
    train: list[LossPoint]
    validation: list[LossPoint] = Field(default_factory=list)
    final_train_loss: float | None = None
    final_validation_loss: float | None = None
    # the final validation failed after the timed steps (the measurement stands; the loss at the end is unknown)
    validation_error: str | None = None


SIGNAL_STOP_PREFIX = "stopped on SIG"  # a stop reason that starts so: the job stopped itself on a signal


def signal_stop_reason(signal_name: str, when: str) -> str:
    """``stop.reason`` (or the failure) of a job that stopped itself on a signal (gpuscout_train/stop_signal.py)."""
    assert signal_name.startswith("SIG")
    return f"stopped on {signal_name} {when}"


def stopped_by_signal(reason: object) -> bool:
    return isinstance(reason, str) and reason.startswith(SIGNAL_STOP_PREFIX)


class StopInfo(_Strict):
    rule: Literal["fixed", "steady_state"]
    reason: str  # e.g. "max_steps reached", "throughput CI within +-2.0 % after 37 steps"
    steps: int
    resumed_from_step: int | None = None


class StepAccount(_Strict):
    """One optimizer step as rank 0 measured it: its time and what the process used meanwhile (getrusage of the
    training process, all its threads; NVML on a GPU). Resource fields are None where not measured (a job whose
    steps come from its printed metric lines)."""

    step: int
    seconds: float
    timed: bool  # False: warm-up, excluded from every throughput figure
    tokens: int = 0  # non-padding tokens of all ranks (0 when the job reports none)
    samples: int = 0
    dataloader_wait_s: float = 0.0  # rank 0's wait for its next batches, part of seconds
    user_s: float | None = None  # CPU seconds in user mode
    system_s: float | None = None  # CPU seconds in the kernel on the process's behalf (page faults, syscalls)
    minor_faults: int | None = None
    major_faults: int | None = None
    voluntary_switches: int | None = None
    involuntary_switches: int | None = None
    sm_clock_mhz: float | None = None
    throttle_reasons: int | None = None  # NVML clock-event reason bits at the step's end
    compiled_graphs: int | None = None  # graphs torch.compile compiled during the step (None: dynamo not loaded)


class Disturbance(_Strict):
    """The disturbance detector's verdict on the timed steps (gpuscout/domain/disturbance.py, docs/metrics.md)."""

    disturbed: bool
    evidence: str | None = None  # one line: what the steps and the accounting show
    timed_steps: int
    slow_steps: int  # timed steps slower than SLOW_FACTOR x the reference step
    reference_step_s: float | None = None  # median of the fastest quarter of the timed steps
    slow_median_ratio: float | None = None  # median slow step / reference step
    phase_ratio: float | None = None  # the two-phase split's slower median / faster median (>= 1)
    system_share_slow: float | None = None  # kernel CPU time / step time during the slow steps
    system_share_fast: float | None = None
    minor_faults_per_s_slow: float | None = None
    minor_faults_per_s_fast: float | None = None
    throttled_steps: int = 0  # timed steps whose GPU reported a thermal or hardware slowdown
    system_share: float | None = None  # kernel CPU time / step time over all timed steps (not a disturbance itself)
    minor_faults_per_s: float | None = None  # over all timed steps
    compiled_graphs_timed: int | None = None  # graphs torch.compile compiled during the timed steps (a recompile)
    compiled_graphs_slow: int | None = None  # of those, the ones compiled in the steps that made it disturbed
    # disturbed, and with its compiling steps at the reference step's time it would not be: the compile is the cause
    compile_explains: bool | None = None


class JobInfo(_Strict):
    """The user's own training code (a manifest's job section) and how it reported."""

    entry_point: str
    hyperparameters: dict[str, str] = Field(default_factory=dict)
    reporter: str  # "helper" (gpuscout_report), "hf_trainer", "lightning" or "stdout" (metric lines parsed)
    items_per_sample: float | None = None


class BenchmarkResult(_Strict):
    schema_version: str = SCHEMA_VERSION
    status: Literal["completed", "failed"]
    unit: Literal["tokens", "samples"] = "tokens"  # what the ranking counts as work
    job: JobInfo | None = None  # the user's own code; None = training/gpuscout_train/train.py
    job_name: str
    run_id: str | None = None
    instance_type: str
    failure_reason: str | None = None
    hardware: Hardware
    software: Software
    config: TrainConfig | None = None  # None for the user's own job (no built-in model)
    dataset: DatasetInfo | None = None  # None for the user's own job (it reads its own data)
    timing: Timing | None = None
    throughput: Throughput | None = None
    efficiency: Efficiency | None = None
    memory: Memory = Field(default_factory=Memory)
    loss: Loss | None = None
    stop: StopInfo | None = None
    steps: list[StepAccount] = Field(default_factory=list)  # every step of this process run, warm-up included
    disturbance: Disturbance | None = None
