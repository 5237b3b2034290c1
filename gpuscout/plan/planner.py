"""Planner: a validated manifest -> one JobSpec per target x variant x repetition, each with a time/cost prediction.

Prediction (docs/manifest.md "How the planner predicts"):

* GPU targets use the FLOPs model. tokens/s = u x GPUs x dense peak(precision) / FLOPs per token, FLOPs per token
  from :mod:`gpuscout.domain.flops` with T_eff = sequence_length (an upper bound for packed data). ``u`` is the assumed
  utilization of the GPU (``assumed_mfu`` in its configs/gpus file, with its basis), times :data:`ZERO3_FACTOR`
  under ZeRO-3 and :data:`MULTI_NODE_FACTOR` across instances. A cloud GPU without a published dense peak or an
  assumed utilization is refused: gpuscout cannot predict it. With gradient checkpointing ``u`` is applied to the
  hardware FLOPs (forward recomputed), so the predicted MFU drops by model/hardware FLOPs.
* ``local`` on CPU (or a GPU gpuscout has no SKU for) times a short matmul on the device (~0.3 s) and assumes
  :data:`MEASURED_EFFICIENCY` of that rate for training; ``mfu_assumed`` is None there.
* Memory: :mod:`gpuscout.plan.memory` (states at 16 bytes/parameter sharded by ZeRO, autocast weight copies,
  activations and loss bytes measured on the model code by benchmarks/memory_probe.py, the dense mask, 1.5 GB CUDA
  context). Must fit in 90 % of the GPU memory (host memory on CPU), else PlanError, which says what would fit.
* Cost = (training + overhead) / 3600 x price x instance_count; overhead = 360 s in the cloud (provisioning, image
  pull, data download, upload), 0 locally. A spot target without a spot price is planned at the on-demand price.
* max_runtime_seconds = 3 x predicted training + overhead + 10 min, clamped to [30 min, 5 days].
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from gpuscout.domain.catalog import Catalog, InstanceType, LocalHardware, detect_local_hardware
from gpuscout.domain.flops import hardware_flops_per_token, model_flops_per_token
from gpuscout.domain.hardware import GpuSku
from gpuscout.domain.jobspec import JobSpec, Prediction
from gpuscout.domain.manifest import Manifest
from gpuscout.domain.manifest_targets import Target
from gpuscout.domain.manifest_training import Variant, fewest_max_steps, timed_steps_problem
from gpuscout.domain.models import QWEN_TOKENIZER_VOCAB, Architecture, training_vocab
from gpuscout.domain.search_plan import SearchPlan, TargetSearch
from gpuscout.errors import JobsRefusedError, PlanError, Problem
from gpuscout.plan import memory, search
from gpuscout.plan.device_fit import device_refusal
from gpuscout.plan.job_section import Calibration, plan_job_section
from gpuscout.plan.jobs import (
    CLOUD_OVERHEAD_S,
    LOCAL_OVERHEAD_S,
    MAX_RUNTIME_S,
    MIN_RUNTIME_S,
    RUNTIME_MARGIN_S,
    RUNTIME_SAFETY_FACTOR,
    Plan,
    hyperparameters,
    planned_price,
    repeated_specs,
)
from gpuscout.plan.memory import StepSettings

ZERO3_FACTOR = 0.90  # parameter all-gathers per layer, partly overlapped
MULTI_NODE_FACTOR = 0.90  # gradient/parameter traffic over EFA instead of NVLink only
MEASURED_EFFICIENCY = 0.30  # share of a bare matmul's FLOPS a training step reaches on CPU / unknown GPU
MEMORY_USABLE_FRACTION = 0.90
DEEPSPEED_CONFIGS = {2: "zero2.json", 3: "zero3.json"}


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


def architecture(manifest: Manifest) -> Architecture:
    """The built-in model's shape as trained: its vocabulary is the tokenizer's."""
    arch = manifest.builtin()[0].flops_architecture()
    if arch is None:  # the manifest validator guarantees one
        raise PlanError("model has no known architecture; set model.architecture")
    tokenizer = manifest.tokenizer
    tokenizer_vocab = QWEN_TOKENIZER_VOCAB if tokenizer.kind == "qwen" else tokenizer.resolved_vocab_size
    return arch.with_vocab(training_vocab(arch.name, arch.vocab_size, tokenizer_vocab))


def step_settings(variant: Variant, *, precision: str, accumulation: int | None = None) -> StepSettings:
    """The memory model's settings for ``variant``; ``accumulation`` (micro-batches per optimizer step) defaults
    to the variant's own, or 2 when it sets none (gradients counted at the loss: the larger estimate)."""
    kernel = variant.cross_entropy_kernel
    return StepSettings(
        precision=precision,
        attention=variant.attention,
        gradient_checkpointing=variant.gradient_checkpointing,
        fused_cross_entropy=variant.fused_cross_entropy,
        packing=variant.packing,
        deepspeed_stage=variant.deepspeed_stage,
        cross_entropy_kernel="chunked" if kernel == "auto" else kernel,
        torch_compile=variant.torch_compile,
        gradient_accumulation_steps=accumulation or variant.gradient_accumulation_steps or 2,
        adapter=variant.adapter(),
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
    accumulation: int | None = None,
) -> float:
    """Peak memory per GPU (the host's on ``device="cpu"``) in GB: the calibrated model of
    :mod:`gpuscout.plan.memory`. ``stage`` overrides the variant's deepspeed_stage; ``accumulation`` its
    gradient_accumulation_steps (step_settings)."""
    return memory_estimate(
        arch, seq=seq, batch=batch, precision=precision, stage=stage, world=world, variant=variant, device=device,
        accumulation=accumulation,
    ).total_gb  # fmt: skip


def memory_estimate(
    arch: Architecture, *, seq: int, batch: int, precision: str, stage: int, world: int, variant: Variant,
    device: str = "cuda", accumulation: int | None = None,
) -> memory.MemoryEstimate:  # fmt: skip
    """memory_per_gpu_gb's estimate by part, with its stated uncertainty."""
    settings = replace(step_settings(variant, precision=precision, accumulation=accumulation), deepspeed_stage=stage)
    return memory.estimate(arch, seq=seq, batch=batch, settings=settings, world=world, device=device)


def what_fits(
    arch: Architecture, *, seq: int, batch: int, precision: str, world: int, variant: Variant, device: str,
    limit_gb: float, accumulation: int | None = None,
) -> list[str]:  # fmt: skip
    """Changes to ``variant`` that would bring its peak under ``limit_gb``, most similar first; ``accumulation`` is
    the one the refused estimate used (smaller micro-batches keep the global batch with more of it)."""

    accumulation = accumulation or variant.gradient_accumulation_steps or 2

    def fits(v: Variant, b: int) -> bool:
        need = memory_per_gpu_gb(
            arch, seq=seq, batch=b, precision=precision, stage=v.deepspeed_stage, world=world, variant=v, device=device,
            accumulation=accumulation * max(batch // max(b, 1), 1),
        )  # fmt: skip
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
    if device == "cuda" and world > 1 and variant.deepspeed_stage != 3 and variant.method == "full":
        changes.append(("deepspeed_stage: 3", {"deepspeed_stage": 3}))
    if device == "cuda" and variant.method == "lora":  # the same adapters on a 4-bit base
        changes.append(("method: qlora", {"method": "qlora"}))
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


def local_refusals(manifest: Manifest, catalog: Catalog, hw: LocalHardware) -> list[Problem]:
    """What ``local`` on this machine (``hw``) refuses in the manifest, with field paths: a precision it does not run
    and a variant's setting it cannot train with (the planner's own refusals, all at once; `gpuscout validate`)."""
    problems: list[Problem] = []
    for ti, target in enumerate(manifest.targets):
        if not catalog.get(target.instance_type).is_local:
            continue
        machine = (hw.gpu_name or "a GPU") if hw.device == "cuda" else f"a CPU ({hw.cpu_model or 'model unknown'})"
        precision = manifest.resolved_precision(target, catalog, hw)
        if precision not in hw.precisions:
            problems.append(Problem(
                "training.precision",
                f"{precision} is not supported by targets[{ti}] local, which is this machine: {machine}, training in "
                f"{', '.join(hw.precisions)}" + _cpu_precision_reason(hw, precision).replace(":", ";", 1),
            ))  # fmt: skip
        if manifest.job is not None or manifest.search is not None:  # a search skips such candidates itself
            continue
        world = max(hw.gpu_count if hw.device == "cuda" else 0, 1) * target.instance_count
        for vi, variant in enumerate(manifest.variants):
            if not variant.runs_on(target.instance_type):
                continue
            refusal = device_refusal(
                deepspeed_stage=variant.deepspeed_stage,
                attention=variant.attention,
                device=hw.device,
                world=world,
                method=variant.method,
                local=True,
            )
            if refusal is not None:
                problems.append(Problem(f"variants[{vi}]", f"{variant.name!r} on targets[{ti}] local: {refusal}"))
    return problems


def cannot_predict(inst: InstanceType, precision: str) -> str:
    """Why the FLOPs model cannot predict a cloud GPU type (no dense peak or no assumed utilization for its GPU)."""
    sku = inst.sku
    name = sku.sku if sku else inst.gpu_sku or "its GPU"
    missing = []
    if sku is None or not sku.peak_for(precision):
        missing.append(f"no published dense {precision} peak")
    if sku is None or sku.assumed_mfu is None:
        missing.append("no assumed utilization")
    return (
        f"cannot predict throughput on {name} ({' and '.join(missing)} in configs/gpus/{name}.json), so neither "
        "time nor cost; measure it on a rented box with `gpuscout local`, or leave this type out"
    )


def predict_tokens_per_s(
    *,
    arch: Architecture,
    seq: int,
    precision: str,
    gpus_total: int,
    sku: GpuSku | None,
    variant: Variant,
    instance_count: int,
    device: str,
) -> tuple[float, float | None, str]:
    adapter = variant.adapter()  # an adapter run computes fewer FLOPs per token (no frozen weight gradients)
    model_flops = model_flops_per_token(arch, float(seq), adapter=adapter)
    hw_flops = hardware_flops_per_token(
        arch, float(seq), activation_recompute=variant.gradient_checkpointing, adapter=adapter
    )
    peak_tflops = sku.peak_for(precision) if sku else None
    if sku is not None and sku.assumed_mfu is not None and peak_tflops:
        util = sku.assumed_mfu
        factors = [f"{sku.sku} assumed utilization {util:.2f}"]
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
            f"{', recompute' if variant.gradient_checkpointing else ''}{f', {adapter.label}' if adapter else ''})"
        )
        if adapter is not None and adapter.method == "qlora":
            method += "; QLoRA's 4-bit dequantization is not modelled: an optimistic prediction"
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
) -> tuple[list[Variant], TargetSearch]:  # fmt: skip
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
    return variants, TargetSearch(
        target_index=ti, instance_type=target.instance_type, dimensions=searched,
        candidates=[v.name for v in variants], skipped=skipped, max_trials=manifest.search.max_trials,
    )  # fmt: skip


def _target_refusal(
    inst: InstanceType,
    hw: LocalHardware | None,
    *,
    precision: str,
    supported: Sequence[str],
    device: str,
    sku: GpuSku | None,
) -> str | None:
    """Why no job can be planned on a target: a precision it does not run, or a GPU the model cannot predict."""
    if precision not in supported:
        return f"precision {precision} is not supported here ({', '.join(supported)})" + _cpu_precision_reason(
            hw, precision
        )
    if hw is None and device == "cuda" and not (sku and sku.plannable and sku.peak_for(precision)):
        return cannot_predict(inst, precision)
    return None


def _memory_refusal(
    arch: Architecture,
    variant: Variant,
    *,
    seq: int,
    batch: int,
    accum: int,
    precision: str,
    world: int,
    device: str,
    capacity: float | None,
) -> str | None:
    """Why a variant does not fit one GPU (or this host) by the memory model, with what would fit; None if it fits
    (or when the capacity is unknown)."""
    if capacity is None:
        return None
    estimate = memory_estimate(
        arch, seq=seq, batch=batch, precision=precision, stage=variant.deepspeed_stage, world=world,
        variant=variant, device=device, accumulation=accum,
    )  # fmt: skip
    need, usable = estimate.total_gb, MEMORY_USABLE_FRACTION * capacity
    if need <= usable:
        return None
    fixes = what_fits(arch, seq=seq, batch=batch, precision=precision, world=world, variant=variant,
                      device=device, limit_gb=usable, accumulation=accum)  # fmt: skip
    advice = "would fit: " + "; or ".join(fixes) if fixes else "nothing but a larger instance would fit"
    return (
        f"needs ~{need:.1f} GB (+-{estimate.uncertainty / 1e9:.1f} GB, the memory model's stated uncertainty) per "
        f"{'GPU' if device == 'cuda' else 'host'} but only {usable:.1f} GB of its {capacity:.0f} GB is usable "
        f"({MEMORY_USABLE_FRACTION:.0%}) for {arch.name} at sequence_length {seq}, per_device_batch_size {batch}; "
        f"{advice}"
    )


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
    arch = architecture(manifest)
    seq = manifest.builtin()[2]
    training = manifest.training
    jobs: list[JobSpec] = []
    target_searches: list[TargetSearch] = []
    refusals: list[str] = []  # every target's and variant's, raised together: one `plan` shows them all
    for ti, target in enumerate(manifest.targets):
        inst: InstanceType = catalog.get(target.instance_type)
        hw = (local_hardware or detect_local_hardware()) if inst.is_local else None
        if hw is not None:
            local_hardware = hw
            gpus_per_instance = hw.gpu_count if hw.device == "cuda" else 0
            sku = hw.sku
            gpu_memory_gb = hw.gpu_memory_gb
            device = hw.device
        else:
            gpus_per_instance = inst.gpu_count
            sku = inst.sku
            gpu_memory_gb = inst.gpu_memory_gb
            device = "cuda" if inst.gpu_count else "cpu"
        world = max(gpus_per_instance, 1) * target.instance_count
        precision = manifest.resolved_precision(target, catalog, hw)
        supported = hw.precisions if hw is not None else inst.precisions
        where = f"targets[{ti}] {target.instance_type}"
        unplannable = _target_refusal(inst, hw, precision=precision, supported=supported, device=device, sku=sku)
        if unplannable is not None:
            refusals.append(f"{where}: {unplannable}")
            continue
        listed = planned_price(target, inst, where, catalog)
        price = listed.usd_per_hour
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
            if not variant.runs_on(target.instance_type):
                continue
            batch = variant.per_device_batch_size or (defaults.per_device_batch_size if defaults else 1)
            accum = variant.gradient_accumulation_steps or (defaults.gradient_accumulation_steps if defaults else 1)
            refusal = device_refusal(
                deepspeed_stage=variant.deepspeed_stage,
                attention=variant.attention,
                device=device,
                world=world,
                method=variant.method,
                local=inst.is_local,
            )
            if refusal is not None:
                refusals.append(f"{where}, variant {variant.name!r}: {refusal}")
                continue
            too_big = _memory_refusal(arch, variant, seq=seq, batch=batch, accum=accum, precision=precision,
                                      world=world, device=device, capacity=capacity)  # fmt: skip
            if too_big is not None:
                refusals.append(f"{where}, variant {variant.name!r}: {too_big}")
                continue
            tokens_per_step = batch * accum * world * seq
            max_steps = training.max_steps or math.ceil((training.max_tokens or 0) / tokens_per_step)
            if training.max_steps is None and (short := timed_steps_problem(max_steps, training.warmup_steps)):
                fewest = fewest_max_steps(training.warmup_steps) * tokens_per_step
                refusals.append(
                    f"{where}, variant {variant.name!r}: training.max_tokens {training.max_tokens:,} is {max_steps} "
                    f"step(s) of {tokens_per_step:,} tokens, and {short}: give max_tokens {fewest:,} or more"
                )
                continue
            tokens_per_s, mfu_assumed, method = predict_tokens_per_s(
                arch=arch,
                seq=seq,
                precision=precision,
                gpus_total=gpus_per_instance * target.instance_count,
                sku=sku,
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
                price=listed,
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
    if refusals:
        raise JobsRefusedError(refusals)
    names = [j.job_name for j in jobs]
    if len(set(names)) != len(names):  # unique by construction (t/v/r indices in the head); guards the contract
        raise PlanError("job names are not unique")
    # Interleaved repetitions: repetition 0 of every target x variant, then repetition 1, ... (a stable sort keeps
    # the manifest's order inside each round), so a slow period of a shared machine hits every variant, not one.
    jobs.sort(key=lambda job: job.repetition)
    search_plan = None
    if manifest.search is not None:
        pruning = manifest.search.pruning
        search_plan = SearchPlan(
            targets=target_searches,
            max_cost_usd=manifest.search.max_cost_usd or manifest.constraints.budget_usd,
            max_parallel_trials=manifest.search.max_parallel_trials,
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
