"""Measure training peak memory on a CUDA GPU for a grid of configurations, the way gpuscout_train/train.py trains.

The planner's memory model (gpuscout/plan/memory.py) is calibrated on CPU (benchmarks/memory_probe.py counts the bytes
saved for backward); this probe measures what CUDA really holds (flex attention, Liger, the CUDA SDPA kernels), so a
GPU session can check or recalibrate the model. `make gpu-check` runs it and keeps the JSON; each row also carries
the planner's prediction for the same configuration.

    python3 benchmarks/memory_probe_gpu.py --models qwen2.5-0.5b,qwen2.5-1.5b --out benchmarks/results/memory-gpu.json

Each configuration builds the preset's Qwen2 model in fp32 on the GPU (master weights, as train.py keeps them),
wraps it in train.py's loss module (Liger fused linear cross-entropy, or full logits), optionally with gradient
checkpointing, and runs two optimizer steps (fused AdamW) under bf16 autocast on packed blocks (documents of about
800 tokens, the packed document mask as train.py builds it: dense 4D for SDPA, a block mask for flex). The second
step's peak over what was allocated before it is the step's transient memory (activations, logits, gradients);
the states (weights, gradients, AdamW moments) are measured too. Results are appended after every configuration,
so a timed-out probe keeps what it measured; an out-of-memory configuration is recorded with the peak at failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from gpuscout.domain.models import PRESETS, Architecture

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Probe:
    model: str
    batch: int
    seq: int
    attention: str  # "sdpa" (dense 4D document mask), "flex" (block mask), "sdpa-unpacked" (no mask)
    loss: str  # "plain" or a fused kernel: "chunked", "liger", "torch" (training/gpuscout_train/packing.py)
    checkpointing: bool
    layers: int | None = None  # None: the preset's


def grid(models: list[str]) -> list[Probe]:
    probes: list[Probe] = []
    for m in models:
        for attention in ("flex", "sdpa"):
            for loss in ("chunked", "plain"):
                for ckpt in (False, True):
                    probes.append(Probe(m, 1, 4096, attention, loss, ckpt))
        probes += [
            Probe(m, 2, 4096, "flex", "chunked", False),
            Probe(m, 2, 4096, "sdpa", "chunked", False),
            Probe(m, 2, 4096, "flex", "plain", False),
            Probe(m, 1, 2048, "flex", "chunked", False),
            Probe(m, 1, 4096, "flex", "liger", False),
            Probe(m, 1, 4096, "flex", "torch", False),
            Probe(m, 1, 2048, "sdpa", "chunked", False),
            Probe(m, 1, 4096, "sdpa-unpacked", "chunked", False),
            Probe(m, 2, 4096, "flex", "chunked", True),
        ]
    if models:
        probes += [Probe(models[0], 1, 4096, "flex", "chunked", False, layers=12),
                   Probe(models[0], 1, 4096, "sdpa", "plain", False, layers=12)]  # fmt: skip
    return probes


def architecture(probe: Probe) -> Architecture:
    """The preset's architecture, cut to the probe's layer count when it sets one (measured and predicted alike)."""
    arch = PRESETS[probe.model]
    return dataclasses.replace(arch, num_hidden_layers=probe.layers) if probe.layers else arch


def predicted(probe: Probe) -> dict[str, float]:
    """The planner's peak for the probe's configuration as torch allocates it (no CUDA context) and the uncertainty
    the estimate states for it, both in GB."""
    from gpuscout.domain.manifest_training import Variant
    from gpuscout.plan.planner import memory_estimate

    arch = architecture(probe)
    fused = probe.loss != "plain"
    variant = Variant(
        name="probe", per_device_batch_size=probe.batch, gradient_checkpointing=probe.checkpointing,
        fused_cross_entropy=fused, cross_entropy_kernel=probe.loss if fused else "auto",
        packing=probe.attention != "sdpa-unpacked", attention="flex" if probe.attention == "flex" else "sdpa",
        gradient_accumulation_steps=1,
    )  # fmt: skip
    e = memory_estimate(arch, seq=probe.seq, batch=probe.batch, precision="bf16", stage=0, world=1, variant=variant)
    return {"predicted_gb": e.allocated / 1e9, "predicted_uncertainty_gb": e.allocated_uncertainty / 1e9}


def measure(probe: Probe) -> dict[str, Any]:
    import torch
    from gpuscout_train.packing import CausalLMWithLoss, _missing_library, install_flex_autocast_cast, make_inputs
    from transformers import Qwen2Config, Qwen2ForCausalLM

    missing = _missing_library(probe.loss)
    if missing:  # a row the box cannot run is reported as such, not a crash of the whole probe
        return {**asdict(probe), "status": "skipped", "reason": missing, "peak_gb": float("nan"), "seconds": 0.0}
    arch = architecture(probe)
    kwargs: dict[str, Any] = dict(arch.to_qwen2_config_kwargs())
    config = Qwen2Config(**kwargs, use_cache=False)
    attention = "sdpa" if probe.attention.startswith("sdpa") else "flex_attention"
    if attention == "flex_attention":
        install_flex_autocast_cast()
    config._attn_implementation = attention
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    with torch.device("cuda"):
        lm = Qwen2ForCausalLM(config).train()
    if probe.checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = CausalLMWithLoss(lm, loss=probe.loss)
    params = sum(p.numel() for p in lm.parameters())
    weights = torch.cuda.memory_allocated()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, arch.vocab_size, (probe.batch, probe.seq), device="cuda", generator=gen)
    doc = 800
    seg = (torch.arange(probe.seq, device="cuda") // doc + 1).expand(probe.batch, probe.seq).contiguous()
    packed = probe.attention != "sdpa-unpacked"
    inputs = make_inputs(ids, seg, packing=packed, attention="flex" if attention == "flex_attention" else "sdpa",
                         dtype=torch.bfloat16)  # fmt: skip
    mask = inputs.attention_mask if packed else None
    result: dict[str, Any] = {**asdict(probe), "params": params, "layers": config.num_hidden_layers,
                              "hidden": config.hidden_size, "intermediate": config.intermediate_size,
                              "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
                              "vocab": config.vocab_size, "weights_gb": weights / 1e9}  # fmt: skip
    started = time.perf_counter()
    try:
        for step in range(2):
            if step == 1:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(inputs.input_ids, inputs.position_ids, mask, inputs.labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        result.update(status="completed", states_gb=before / 1e9, peak_gb=peak / 1e9,
                      reserved_gb=torch.cuda.max_memory_reserved() / 1e9, transient_gb=(peak - before) / 1e9,
                      loss=float(loss), **predicted(probe))  # fmt: skip
    except torch.cuda.OutOfMemoryError as err:
        result.update(status="out of memory", peak_gb=torch.cuda.max_memory_allocated() / 1e9, error=str(err)[:300])
    result["seconds"] = round(time.perf_counter() - started, 1)
    del model, lm, optimizer, inputs, mask
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    parser.add_argument("--out", type=Path, required=True)
    a = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("memory_probe: torch sees no CUDA GPU", file=sys.stderr)
        return 2
    versions: dict[str, str | None] = {}
    for name in ("torch", "transformers", "liger-kernel"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    payload: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "gpu_memory_gb": torch.cuda.get_device_properties(0).total_memory / 1e9,
        "cuda": torch.version.cuda,
        "versions": versions,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "probes": [],
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    probes = grid([m.strip() for m in a.models.split(",") if m.strip()])
    for i, probe in enumerate(probes, start=1):
        row = measure(probe)
        payload["probes"].append(row)
        a.out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"[memory] {i}/{len(probes)} {probe.model} L={row['layers']} b{probe.batch} s{probe.seq} "
              f"{probe.attention} {probe.loss} ckpt={probe.checkpointing}: {row['status']} "
              f"peak {row['peak_gb']:.2f} GB transient {row.get('transient_gb', float('nan')):.2f} GB "
              f"({row['seconds']} s)", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
