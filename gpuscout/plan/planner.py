"""Planner: a validated manifest -> one JobSpec per target x variant x repetition, each with a time/cost prediction.

Prediction (docs/manifest.md "How the planner predicts"):

* GPU targets use the FLOPs model. tokens/s = u x GPUs x dense peak(precision) / FLOPs per token, FLOPs per token
  from :mod:`gpuscout.domain.flops` with T_eff = sequence_length (an upper bound for packed data). ``u`` is the assumed
  utilization of the GPU family (:data:`ASSUMED_MFU`), times :data:`ZERO3_FACTOR` under ZeRO-3 and
  :data:`MULTI_NODE_FACTOR` across instances. With gradient checkpointing ``u`` is applied to the hardware FLOPs
  (forward recomputed), so the predicted MFU drops by model/hardware FLOPs.
* ``local`` on CPU (or a GPU gpuscout has no SKU for) times a short matmul on the device (~0.3 s) and assumes
  :data:`MEASURED_EFFICIENCY` of that rate for training; ``mfu_assumed`` is None there.
* Memory: :mod:`gpuscout.plan.memory` (states at 16 bytes/parameter sharded by ZeRO, autocast weight copies,
  activations and loss bytes measured on the model code by training/memory_probe.py, the dense mask, 1.5 GB CUDA
  context). Must fit in 90 % of the GPU memory (host memory on CPU), else PlanError, which says what would fit.
* Cost = (training + overhead) / 3600 x price x instance_count; overhead = 360 s in the cloud (provisioning, image
  pull, data download, upload), 0 locally. A spot target without a spot price is planned at the on-demand price.
* max_runtime_seconds = 3 x predicted training + overhead + 10 min, clamped to [30 min, 5 days].
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial
from typing import Any

from pydantic import BaseModel, ConfigDict

from gpuscout.domain.catalog import Catalog, InstanceType, LocalHardware, detect_local_hardware
from gpuscout.domain.flops import hardware_flops_per_token, model_flops_per_token
from gpuscout.domain.jobspec import JOB_NAME_RE, JobCode, JobSpec, Prediction
from gpuscout.domain.manifest import Manifest
from gpuscout.domain.manifest_targets import Target
from gpuscout.domain.manifest_training import Variant
from gpuscout.domain.models import QWEN_TOKENIZER_VOCAB, Architecture, training_vocab
from gpuscout.errors import BudgetExceededError, PlanError
from gpuscout.plan import memory, search
from gpuscout.plan.memory import StepSettings
from gpuscout.plan.search import SearchPlan

# Assumed model-FLOPs utilization per GPU SKU for fine-tuning a decoder with HF Trainer + SDPA, no custom kernels.
# A100: ~40 % is what well-tuned Megatron/DeepSpeed runs report at 7B scale (e.g. the BLOOM and OPT logs ~35-50 %);
# H100/H200: lower fraction of a much higher peak because the same software stack does not use FP8/TMA features;
# A10G: PCIe, no NVLink, small memory forces small batches; V100: fp16 with loss scaling on first-gen tensor cores.
ASSUMED_MFU: dict[str, float] = {
    "A100-SXM4-40GB": 0.40,
    "A100-SXM4-80GB": 0.40,
    "H100-SXM5-80GB": 0.38,
    "H200-SXM-141GB": 0.38,
    "A10G-24GB": 0.30,
    "V100-SXM2-16GB": 0.25,
}
ZERO3_FACTOR = 0.90  # parameter all-gathers per layer, partly overlapped
MULTI_NODE_FACTOR = 0.90  # gradient/parameter traffic over EFA instead of NVLink only
MEASURED_EFFICIENCY = 0.30  # share of a bare matmul's FLOPS a training step reaches on CPU / unknown GPU
CLOUD_OVERHEAD_S = 360.0
LOCAL_OVERHEAD_S = 0.0
RUNTIME_SAFETY_FACTOR = 3.0
RUNTIME_MARGIN_S = 600
MIN_RUNTIME_S = 1800
MAX_RUNTIME_S = 5 * 24 * 3600
MEMORY_USABLE_FRACTION = 0.90
DEEPSPEED_CONFIGS = {2: "zero2.json", 3: "zero3.json"}


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_id: str
    manifest_name: str
    budget_usd: float
    jobs: list[JobSpec]
    search: SearchPlan | None = None  # a settings search: jobs are its candidates, launched as trials

    @property
    def predicted_cost_usd(self) -> float:
        """Every job's predicted cost; for a search, what its trials can cost at most: each target's
        ``max_trials`` costliest candidates run in full, capped by the search's spend cap."""
        if self.search is None:
            return sum(j.prediction.cost_usd for j in self.jobs)
        total = 0.0
        for target in self.search.targets:
            costs = sorted((j.prediction.cost_usd for j in self.jobs if j.target_index == target.target_index),
                           reverse=True)  # fmt: skip
            total += sum(costs[: target.max_trials])
        return min(total, self.search.max_cost_usd)

    @property
    def predicted_seconds(self) -> float:
        """Longest single job (jobs run in parallel in the cloud)."""
        return max((j.prediction.training_seconds + j.prediction.overhead_seconds for j in self.jobs), default=0.0)

    def check_budget(self) -> None:
        if self.predicted_cost_usd > self.budget_usd:
            raise BudgetExceededError(self.predicted_cost_usd, self.budget_usd)


def _slug(text: str) -> str:
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]+", "-", text.lower())).strip("-")


def make_run_id(name: str, *, key: str | None = None, etag: str | None = None) -> str:
    """Run id: ``<name>-<hash of key+etag>`` when given (the same S3 object twice -> the same id, so a re-delivered
    event does not start a second run), else ``<name>-<UTC yyyymmdd-hhmmss>-<random>``. Lowercase letters, digits
    and hyphens, at most 48 characters, so it fits in SageMaker names and tags."""
    base = _slug(name)[:24].strip("-") or "run"
    if key is not None or etag is not None:
        digest = hashlib.sha256(f"{key or ''}\x00{etag or ''}".encode()).hexdigest()[:12]
        return f"{base}-{digest}"
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"{base}-{stamp}-{secrets.token_hex(3)}"


def _same_arguments(arguments: dict[str, str], *, job_name: str) -> dict[str, str]:
    """A user's job passes the same arguments under every job name."""
    return dict(arguments)


def repeated_specs(
    manifest: Manifest,
    run_id: str,
    *,
    ti: int,
    target: Target,
    vi: int,
    variant: Variant,
    hyperparameters_for: Callable[..., dict[str, str]],
    **fields: Any,
) -> list[JobSpec]:
    """One JobSpec per repetition of a target x variant: names, indices, the target's instance fields and the
    manifest's tracking here, the rest (prices, precision, runtime, prediction, ...) in ``fields``;
    ``hyperparameters_for(job_name=...)``."""
    specs = []
    for rep in range(manifest.repetitions):
        name = job_name(run_id, target_index=ti, target=target, variant_index=vi, variant=variant, rep=rep)
        specs.append(
            JobSpec(
                job_name=name,
                run_id=run_id,
                target_index=ti,
                variant_name=variant.name,
                repetition=rep,
                instance_type=target.instance_type,
                instance_count=target.instance_count,
                spot=target.spot,
                hyperparameters=hyperparameters_for(job_name=name),
                tracking=manifest.resolved_tracking(),
                **fields,
            )
        )
    return specs


def job_name(run_id: str, *, target_index: int, target: Target, variant_index: int, variant: Variant, rep: int) -> str:
    """``gs-<run hash>-t<i>v<j>r<k>-<instance>-<variant>``, at most 63 characters. The head is unique by
    construction; the descriptive tail is cut to fit."""
    run_hash = hashlib.sha256(run_id.encode()).hexdigest()[:6]
    head = f"gs-{run_hash}-t{target_index}v{variant_index}r{rep}"
    tail = f"{_slug(target.instance_type.removeprefix('ml.'))}-{_slug(variant.name)}"
    name = f"{head}-{tail}"[:63].rstrip("-")
    if not JOB_NAME_RE.match(name):  # cannot happen with slugs; guards the contract
        raise PlanError(f"could not form a valid SageMaker job name from {name!r}")
    return name


@functools.cache
def measure_matmul_flops(device: str = "cpu", dtype_name: str = "float32", seconds: float = 0.3) -> float:
    """Achievable matmul FLOP/s on ``device``: square matmuls for about ``seconds``. Cached per process."""
    try:
        import torch
    except ImportError:
        import numpy as np

        a = np.random.default_rng(0).standard_normal((512, 512), dtype=np.float32)
        return _time_matmuls(lambda: a @ a, 512, seconds, sync=lambda: None)
    dtype = getattr(torch, dtype_name)
    n = 1024 if device == "cpu" else 4096
    x = torch.randn(n, n, device=device, dtype=dtype)

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize()

    return _time_matmuls(lambda: x @ x, n, seconds, sync=sync)


def _time_matmuls(fn: Callable[[], object], n: int, seconds: float, *, sync: Callable[[], None]) -> float:
    fn()
    sync()
    count = 0
    start = time.perf_counter()
    while True:
        fn()
        count += 1
        if count % 4 == 0:
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return 2.0 * n**3 * count / elapsed


def _architecture(manifest: Manifest) -> Architecture:
    arch = manifest.builtin()[0].flops_architecture()
    if arch is None:  # the manifest validator guarantees one
        raise PlanError("model has no known architecture; set model.architecture")
    tokenizer = manifest.tokenizer
    tokenizer_vocab = QWEN_TOKENIZER_VOCAB if tokenizer.kind == "qwen" else tokenizer.resolved_vocab_size
    return arch.with_vocab(training_vocab(arch.name, arch.vocab_size, tokenizer_vocab))


def step_settings(variant: Variant, *, precision: str) -> StepSettings:
    return StepSettings(
        precision=precision,
        attention=variant.attention,
        gradient_checkpointing=variant.gradient_checkpointing,
        fused_cross_entropy=variant.fused_cross_entropy,
        packing=variant.packing,
        deepspeed_stage=variant.deepspeed_stage,
    )


def memory_per_gpu_gb(
    arch: Architecture,
    *,
    seq: int,
    batch: int,
    precision: str,
    stage: int,
    world: int,
    variant: Variant,
    device: str = "cuda",
) -> float:
    """Peak memory per GPU (the host's on ``device="cpu"``) in GB: the calibrated model of
    :mod:`gpuscout.plan.memory`. ``stage`` overrides the variant's deepspeed_stage."""
    settings = replace(step_settings(variant, precision=precision), deepspeed_stage=stage)
    return memory.estimate(arch, seq=seq, batch=batch, settings=settings, world=world, device=device).total_gb


def what_fits(
    arch: Architecture, *, seq: int, batch: int, precision: str, world: int, variant: Variant, device: str,
    limit_gb: float,
) -> list[str]:  # fmt: skip
    """Changes to ``variant`` that would bring its peak under ``limit_gb``, most similar first."""

    def fits(v: Variant, b: int) -> bool:
        need = memory_per_gpu_gb(
            arch, seq=seq, batch=b, precision=precision, stage=v.deepspeed_stage, world=world, variant=v, device=device
        )
        return need <= limit_gb

    def largest_batch(v: Variant) -> int:
        low, high = 0, batch  # fits(low) (or low == 0), not fits(high)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(v, mid) else (low, mid)
        return low

    out: list[str] = []
    most = largest_batch(variant)
    same_global = max((d for d in range(1, most + 1) if batch % d == 0), default=0)
    if same_global:
        note = f"; up to {most} fits" if most > same_global else ""
        out.append(f"per_device_batch_size {same_global} with {batch // same_global}x the "
                   f"gradient_accumulation_steps (the same global batch{note})")  # fmt: skip
    changes: list[tuple[str, dict[str, object]]] = []
    if not variant.gradient_checkpointing:
        changes.append(("gradient_checkpointing: true", {"gradient_checkpointing": True}))
    if not variant.fused_cross_entropy:
        changes.append(("fused_cross_entropy: true", {"fused_cross_entropy": True}))
    if device == "cuda" and world > 1 and variant.deepspeed_stage != 3:
        changes.append(("deepspeed_stage: 3", {"deepspeed_stage": 3}))
    for text, change in changes:
        if fits(variant.model_copy(update=change), batch):
            out.append(text)
    if not out and len(changes) > 1:
        both = variant.model_copy(update={k: v for _, c in changes for k, v in c.items()})
        b = largest_batch(both) if not fits(both, batch) else batch
        if b:
            out.append(" + ".join(text for text, _ in changes) + f" at per_device_batch_size {b}")
    return out


def _cpu_precision_reason(hw: LocalHardware | None, precision: str) -> str:
    """Why a local CPU refuses a 16-bit precision: train.py trains in fp32 on a CPU, and on a CPU without native bf16
    a 16-bit matmul runs at about 1 % of fp32 speed (gpuscout.domain.cpu)."""
    if hw is None or hw.device != "cpu":
        return ""
    why = ": train.py trains in fp32 on a CPU (autocast to 16 bits is for GPUs)"
    if hw.cpu_bf16_native is False and hw.cpu_bf16_reason:
        why += f", and {hw.cpu_bf16_reason}: its {precision} matmuls would run at about 1 % of fp32 speed"
    return why + "; use precision auto or fp32"


def _predict_tokens_per_s(
    *,
    arch: Architecture,
    seq: int,
    precision: str,
    gpus_total: int,
    sku_name: str | None,
    peak_tflops: float | None,
    variant: Variant,
    instance_count: int,
    device: str,
) -> tuple[float, float | None, str]:
    model_flops = model_flops_per_token(arch, float(seq))
    hw_flops = hardware_flops_per_token(arch, float(seq), activation_recompute=variant.gradient_checkpointing)
    if sku_name in ASSUMED_MFU and peak_tflops:
        util = ASSUMED_MFU[sku_name]
        factors = [f"{sku_name} assumed utilization {util:.2f}"]
        if variant.deepspeed_stage == 3:
            util *= ZERO3_FACTOR
            factors.append(f"x{ZERO3_FACTOR} ZeRO-3")
        if instance_count > 1:
            util *= MULTI_NODE_FACTOR
            factors.append(f"x{MULTI_NODE_FACTOR} multi-node")
        tokens_per_s = util * gpus_total * peak_tflops * 1e12 / hw_flops
        predicted_mfu = util * model_flops / hw_flops
        method = (
            f"FLOPs model: {'; '.join(factors)}; {gpus_total} GPU x {peak_tflops:g} TFLOPS dense {precision}; "
            f"{hw_flops / 1e9:.3g} GFLOP/token (T_eff={seq}"
            f"{', recompute' if variant.gradient_checkpointing else ''})"
        )
        return tokens_per_s, predicted_mfu, method
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[precision] if device != "cpu" else "float32"
    achieved = measure_matmul_flops(device, dtype)
    devices = max(gpus_total, 1)
    tokens_per_s = MEASURED_EFFICIENCY * achieved * devices / hw_flops
    method = (
        f"measured: {achieved / 1e9:.1f} GFLOP/s {dtype} matmul on this {device} x {devices} x efficiency "
        f"{MEASURED_EFFICIENCY}; {hw_flops / 1e9:.3g} GFLOP/token"
    )
    return tokens_per_s, None, method


def _search_candidates(
    manifest: Manifest, ti: int, target: Target, *, arch: Architecture, seq: int, precision: str, world: int,
    device: str, defaults: Any, capacity: float | None,
) -> tuple[list[Variant], search.TargetSearch]:  # fmt: skip
    """A search target's launchable candidates (memory model and divisibility, gpuscout.plan.search)."""
    assert manifest.search is not None

    def need_gb(variant: Variant, batch: int) -> float:
        return memory_per_gpu_gb(
            arch, seq=seq, batch=batch, precision=precision, stage=variant.deepspeed_stage, world=world,
            variant=variant, device=device,
        )  # fmt: skip

    variants, skipped, searched = search.expand(
        manifest, target,
        default_batch=defaults.per_device_batch_size if defaults else 1,
        default_accumulation=defaults.gradient_accumulation_steps if defaults else 1,
        world=world, device=device, capacity_gb=capacity, usable_fraction=MEMORY_USABLE_FRACTION, need_gb=need_gb,
    )  # fmt: skip
    if not variants:
        reasons = "; ".join(f"{c.name}: {c.reason}" for c in skipped[:3])
        raise PlanError(
            f"targets[{ti}] {target.instance_type}: no search candidate can run ({len(skipped)} skipped: {reasons})"
        )
    return variants, search.TargetSearch(
        target_index=ti, instance_type=target.instance_type, dimensions=searched,
        candidates=[v.name for v in variants], skipped=skipped, max_trials=manifest.search.max_trials,
    )  # fmt: skip


def plan(
    manifest: Manifest,
    catalog: Catalog,
    *,
    run_id: str,
    local_hardware: LocalHardware | None = None,
    calibration: Mapping[str, Calibration] | None = None,
) -> Plan:
    """Expand targets x variants x repetitions into JobSpecs with predictions; PlanError if one cannot fit.
    ``calibration``: a job section's measured rates per variant on this machine (no job.estimate)."""
    if manifest.job is not None:
        return plan_job_section(
            manifest, catalog, run_id=run_id, local_hardware=local_hardware, calibration=calibration
        )
    arch = _architecture(manifest)
    seq = manifest.builtin()[2]
    training = manifest.training
    jobs: list[JobSpec] = []
    target_searches: list[search.TargetSearch] = []
    for ti, target in enumerate(manifest.targets):
        inst: InstanceType = catalog.get(target.instance_type)
        hw = (local_hardware or detect_local_hardware()) if inst.is_local else None
        if hw is not None:
            local_hardware = hw
            gpus_per_instance = hw.gpu_count if hw.device == "cuda" else 0
            sku_name = hw.gpu_sku if hw.sku else None
            gpu_memory_gb = hw.gpu_memory_gb
            device = hw.device
        else:
            gpus_per_instance = inst.gpu_count
            sku_name = inst.gpu_sku
            gpu_memory_gb = inst.gpu_memory_gb
            device = "cuda" if inst.gpu_count else "cpu"
        world = max(gpus_per_instance, 1) * target.instance_count
        precision = manifest.resolved_precision(target, catalog, hw)
        supported = hw.precisions if hw is not None else inst.precisions
        where = f"targets[{ti}] {target.instance_type}"
        if precision not in supported:
            raise PlanError(f"{where}: precision {precision} is not supported here ({', '.join(supported)})"
                            + _cpu_precision_reason(hw, precision))  # fmt: skip
        peak = None
        if sku_name and (sku := (hw.sku if hw is not None else inst.sku)):
            peak = sku.peak_for(precision)
        price = target.price_per_hour_usd or inst.on_demand_usd_per_hour
        if price is None:
            raise PlanError(f"{where}: no price; set price_per_hour_usd")
        spot_price = target.spot_price_per_hour_usd if target.spot else None
        billed_price = spot_price if spot_price is not None else price
        defaults = inst.defaults
        host_gb = hw.memory_gib * 2**30 / 1e9 if hw is not None and hw.memory_gib else None
        capacity = gpu_memory_gb if device == "cuda" else host_gb
        variants = list(manifest.variants)
        if manifest.search is not None:
            found = _search_candidates(
                manifest, ti, target, arch=arch, seq=seq, precision=precision, world=world, device=device,
                defaults=defaults, capacity=capacity,
            )  # fmt: skip
            variants = found[0]
            target_searches.append(found[1])
        for vi, variant in enumerate(variants):
            batch = variant.per_device_batch_size or (defaults.per_device_batch_size if defaults else 1)
            accum = variant.gradient_accumulation_steps or (defaults.gradient_accumulation_steps if defaults else 1)
            if variant.deepspeed_stage and device == "cpu":
                raise PlanError(f"{where} runs on CPU; variant {variant.name!r} needs deepspeed_stage 0")
            if variant.deepspeed_stage and world < 2:
                raise PlanError(f"{where} has one GPU; variant {variant.name!r} needs deepspeed_stage 0")
            need = memory_per_gpu_gb(
                arch,
                seq=seq,
                batch=batch,
                precision=precision,
                stage=variant.deepspeed_stage,
                world=world,
                variant=variant,
                device=device,
            )
            if capacity is not None and need > MEMORY_USABLE_FRACTION * capacity:
                fixes = what_fits(arch, seq=seq, batch=batch, precision=precision, world=world, variant=variant,
                                  device=device, limit_gb=MEMORY_USABLE_FRACTION * capacity)  # fmt: skip
                advice = "would fit: " + "; or ".join(fixes) if fixes else "nothing but a larger instance would fit"
                raise PlanError(
                    f"{where}, variant {variant.name!r}: needs ~{need:.1f} GB per "
                    f"{'GPU' if device == 'cuda' else 'host'} but {capacity:.0f} GB is available "
                    f"({MEMORY_USABLE_FRACTION:.0%} usable) for {arch.name} at "
                    f"sequence_length {seq}, per_device_batch_size {batch}; {advice}"
                )
            tokens_per_step = batch * accum * world * seq
            max_steps = training.max_steps or math.ceil((training.max_tokens or 0) / tokens_per_step)
            tokens_per_s, mfu_assumed, method = _predict_tokens_per_s(
                arch=arch,
                seq=seq,
                precision=precision,
                gpus_total=gpus_per_instance * target.instance_count,
                sku_name=sku_name,
                peak_tflops=peak,
                variant=variant,
                instance_count=target.instance_count,
                device=device,
            )
            training_s = max_steps * tokens_per_step / tokens_per_s
            overhead_s = CLOUD_OVERHEAD_S
            if inst.is_local:
                overhead_s = hw.startup_s if hw is not None and hw.startup_s is not None else LOCAL_OVERHEAD_S
                method += f"; start-up {overhead_s:.1f} s" + (" (measured)" if hw and hw.startup_s else "")
            cost = (training_s + overhead_s) / 3600.0 * billed_price * target.instance_count
            runtime = int(RUNTIME_SAFETY_FACTOR * training_s + overhead_s + RUNTIME_MARGIN_S)
            runtime = min(max(runtime, MIN_RUNTIME_S), MAX_RUNTIME_S)
            jobs += repeated_specs(
                manifest, run_id, ti=ti, target=target, vi=vi, variant=variant,
                hyperparameters_for=partial(
                    hyperparameters, manifest, run_id=run_id, instance_type=target.instance_type, variant=variant,
                    batch=batch, accum=accum, max_steps=max_steps, precision=precision,
                ),
                gpus_per_instance=gpus_per_instance,
                price_per_hour_usd=price,
                spot_price_per_hour_usd=spot_price,
                precision=precision,
                deepspeed_config=DEEPSPEED_CONFIGS.get(variant.deepspeed_stage),
                max_runtime_seconds=runtime,
                prediction=Prediction(
                    tokens_per_s=tokens_per_s,
                    mfu_assumed=mfu_assumed,
                    training_seconds=training_s,
                    overhead_seconds=overhead_s,
                    cost_usd=cost,
                    method=method,
                ),
            )  # fmt: skip
    names = [j.job_name for j in jobs]
    if len(set(names)) != len(names):  # unique by construction (t/v/r indices in the head); guards the contract
        raise PlanError("job names are not unique")
    # Interleaved repetitions: repetition 0 of every target x variant, then repetition 1, ... (a stable sort keeps
    # the manifest's order inside each round), so a slow period of a shared machine hits every variant, not one.
    jobs.sort(key=lambda job: job.repetition)
    search_plan = None
    if manifest.search is not None:
        pruning = manifest.search.pruning
        search_plan = search.SearchPlan(
            targets=target_searches,
            max_cost_usd=manifest.search.max_cost_usd or manifest.constraints.budget_usd,
            pruning=pruning.enabled,
            min_timed_steps=pruning.min_timed_steps,
            reduction_factor=pruning.reduction_factor,
            seed=manifest.search.seed if manifest.search.seed is not None else training.seed,
            objective=manifest.objective,
        )
    return Plan(
        run_id=run_id, manifest_name=manifest.name, budget_usd=manifest.constraints.budget_usd, jobs=jobs,
        search=search_plan,
    )  # fmt: skip


def _flag(value: bool) -> str:
    return "true" if value else "false"


def hyperparameters(
    manifest: Manifest,
    *,
    run_id: str,
    job_name: str,
    instance_type: str,
    variant: Variant,
    batch: int,
    accum: int,
    max_steps: int,
    precision: str,
) -> dict[str, str]:
    """train.py's hyperparameters (docs/internals.md), all strings; warmup_steps omitted for auto."""
    t = manifest.training
    model, _, sequence_length = manifest.builtin()
    hp: dict[str, str] = {"run_id": run_id, "job_name": job_name, "instance_type": instance_type}
    if model.preset:
        hp["model_preset"] = model.preset
    else:
        hp["model_name_or_path"] = model.hf_id or model.path or ""
    hp.update(
        {
            "sequence_length": str(sequence_length),
            "per_device_train_batch_size": str(batch),
            "gradient_accumulation_steps": str(accum),
            "max_steps": str(max_steps),
            "learning_rate": repr(t.learning_rate),
            "weight_decay": repr(t.weight_decay),
            "seed": str(t.seed),
            "precision": precision,
            "packing": _flag(variant.packing),
            "attention_implementation": variant.attention,
            "gradient_checkpointing": _flag(variant.gradient_checkpointing),
            "torch_compile": _flag(variant.torch_compile),
            "dataloader_num_workers": str(variant.dataloader_workers),
            "deepspeed_stage": str(variant.deepspeed_stage),
            "fused_cross_entropy": _flag(variant.fused_cross_entropy),
            "fused_adamw": _flag(variant.fused_adamw),
            "stop_rule": t.stop_rule.kind,
            "ci_tolerance": repr(t.stop_rule.ci_tolerance),
            "min_timed_steps": str(t.stop_rule.min_timed_steps),
            "eval_interval": str(t.eval_interval),
            "checkpoint_interval": str(t.checkpoint_interval),
            "checkpoint_keep": str(t.checkpoint_keep),
            "validation_batches": str(t.validation_batches),
        }
    )
    if t.warmup_steps is not None:
        hp["warmup_steps"] = str(t.warmup_steps)
    return hp


# -- a job section: the user's own code ---------------------------------------------------------------------------


def argument_text(value: object) -> str:
    if isinstance(value, bool):
        return _flag(value)
    return repr(value) if isinstance(value, float) else str(value)


def job_section_environment(manifest: Manifest, *, max_steps: int) -> dict[str, str]:
    """What the gpuscout_report helper reads (training/gpuscout_report.py): the unit, warm-up and stop rule."""
    t = manifest.training
    assert manifest.job is not None
    env = {
        "GPUSCOUT_UNIT": manifest.job.unit,
        "GPUSCOUT_MAX_STEPS": str(max_steps),
        "GPUSCOUT_STOP_RULE": t.stop_rule.kind,
        "GPUSCOUT_CI_TOLERANCE": repr(t.stop_rule.ci_tolerance),
        "GPUSCOUT_MIN_TIMED_STEPS": str(t.stop_rule.min_timed_steps),
    }
    if t.warmup_steps is not None:
        env["GPUSCOUT_WARMUP_STEPS"] = str(t.warmup_steps)
    if manifest.job.items_per_sample is not None:
        env["GPUSCOUT_ITEMS_PER_SAMPLE"] = repr(manifest.job.items_per_sample)
    return env


def _job_target_devices(
    target: Target, inst: InstanceType, local_hardware: LocalHardware | None, *, single: bool
) -> tuple[int, int, LocalHardware | None]:
    """(GPUs per instance, devices the job uses in all, the local hardware) of a target. ``single``: one process
    per host (job.distribution), which uses one device of each host."""
    if inst.is_local:
        hw = local_hardware or detect_local_hardware()
        gpus = hw.gpu_count if hw.device == "cuda" else 0
        return gpus, 1 if single else max(gpus, 1), hw
    per_host = 1 if single else max(inst.gpu_count, 1)
    return inst.gpu_count, per_host * target.instance_count, local_hardware


def rate_text(value: float) -> str:
    """20,000 / 412 / 3.75: whole numbers with separators from 100 up, three significant digits below."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


@dataclass(frozen=True)
class Calibration:
    """A short run of one variant of the user's code on this machine (gpuscout.local.runner.calibrate_job)."""

    rate: float  # work units per second (the job's unit), the whole job
    step_seconds: float  # mean timed optimizer step
    timed_steps: int


def _calibrated_prediction(
    where: str, variant: Variant, calibration: Mapping[str, Calibration] | None, *, unit: str, max_steps: int
) -> tuple[float, float, str]:
    """(rate, training seconds, method) of a local target without job.estimate, from its variant's calibration."""
    measured = (calibration or {}).get(variant.name)
    if measured is None:
        raise PlanError(
            f"{where}, variant {variant.name!r}: no job.estimate and no calibration run; `gpuscout local` and "
            "`gpuscout plan` calibrate a local target by running a few steps first"
        )
    method = (
        f"calibrated: {rate_text(measured.rate)} {unit}/s, {measured.step_seconds:.3g} s/step measured over "
        f"{measured.timed_steps} timed steps of this variant on this machine"
    )
    return measured.rate, max_steps * measured.step_seconds, method


def plan_job_section(
    manifest: Manifest,
    catalog: Catalog,
    *,
    run_id: str,
    local_hardware: LocalHardware | None = None,
    calibration: Mapping[str, Calibration] | None = None,
) -> Plan:
    """A job section's JobSpecs. There is no FLOPs model for the user's code, so the prediction is the user's own
    estimate (job.estimate: units/s per device, per instance type when given) x devices, or, with no estimate, a
    calibration: a few steps of each variant measured on this machine (local targets only); the method says which."""
    job = manifest.job
    assert job is not None
    max_steps = manifest.training.max_steps or 0
    estimate = job.estimate
    env = job_section_environment(manifest, max_steps=max_steps)
    jobs: list[JobSpec] = []
    for ti, target in enumerate(manifest.targets):
        inst = catalog.get(target.instance_type)
        gpus, devices, local_hardware = _job_target_devices(
            target, inst, local_hardware, single=job.distribution == "single"
        )
        precision = manifest.resolved_precision(target, catalog, local_hardware if inst.is_local else None)
        price = target.price_per_hour_usd or inst.on_demand_usd_per_hour
        if price is None:
            raise PlanError(f"targets[{ti}] {target.instance_type}: no price; set price_per_hour_usd")
        spot_price = target.spot_price_per_hour_usd if target.spot else None
        billed_price = spot_price if spot_price is not None else price
        where = f"targets[{ti}] {target.instance_type}"
        if estimate is None and not inst.is_local:
            raise PlanError(
                f"{where}: job.estimate is required for a cloud target: there is no FLOPs model for your code and "
                "gpuscout cannot measure an instance before launching it; state units_per_s per GPU (`gpuscout "
                "local` on a machine with that GPU measures it)"
            )
        overhead_s = CLOUD_OVERHEAD_S
        if inst.is_local:
            hw = local_hardware
            overhead_s = hw.startup_s if hw is not None and hw.startup_s is not None else LOCAL_OVERHEAD_S
        for vi, variant in enumerate(manifest.variants):
            if estimate is None:
                rate, training_s, method = _calibrated_prediction(
                    where, variant, calibration, unit=job.unit, max_steps=max_steps
                )
            else:
                per_device = estimate.units_per_s_by_instance_type.get(target.instance_type, estimate.units_per_s)
                typed = (
                    " for this instance type" if target.instance_type in estimate.units_per_s_by_instance_type else ""
                )
                rate = per_device * devices
                units_per_step = manifest.units_per_step(variant) * devices  # per device (process) x devices
                training_s = max_steps * units_per_step / rate
                method = (
                    f"user's estimate (job.estimate{typed}): {rate_text(per_device)} {job.unit}/s per device x "
                    f"{devices} device{'s' if devices != 1 else ''}; {units_per_step:g} {job.unit}/step; no FLOPs "
                    "model for your own code"
                )
            cost = (training_s + overhead_s) / 3600.0 * billed_price * target.instance_count
            runtime = int(RUNTIME_SAFETY_FACTOR * training_s + overhead_s + RUNTIME_MARGIN_S)
            runtime = min(max(runtime, MIN_RUNTIME_S), MAX_RUNTIME_S)
            if job.unit == "samples":
                tokens_rate = rate * job.items_per_sample if job.items_per_sample else None
                rates: dict[str, float | None] = {"samples_per_s": rate, "tokens_per_s": tokens_rate}
            else:
                rates = {"tokens_per_s": rate}
            args = {**job.arguments, **variant.hyperparameters}
            arguments = {k: argument_text(v) for k, v in args.items()}
            jobs += repeated_specs(
                manifest, run_id, ti=ti, target=target, vi=vi, variant=variant,
                hyperparameters_for=partial(_same_arguments, arguments),
                gpus_per_instance=gpus,
                price_per_hour_usd=price,
                spot_price_per_hour_usd=spot_price,
                precision=precision,
                max_runtime_seconds=runtime,
                prediction=Prediction(
                    **rates,
                    unit=job.unit,
                    mfu_assumed=None,
                    training_seconds=training_s,
                    overhead_seconds=overhead_s,
                    cost_usd=cost,
                    method=method,
                ),
                job_code=JobCode(
                    source_dir=job.source_dir,
                    entry_point=job.entry_point,
                    requirements=job.requirements,
                    unit=job.unit,
                    items_per_sample=job.items_per_sample,
                    distribution=job.distribution,
                    canary_arguments={k: argument_text(v) for k, v in job.canary_arguments.items()},
                    environment=env,
                ),
            )  # fmt: skip
    jobs.sort(key=lambda j: j.repetition)
    return Plan(run_id=run_id, manifest_name=manifest.name, budget_usd=manifest.constraints.budget_usd, jobs=jobs)
