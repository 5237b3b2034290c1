"""What a benchmark records about where it ran: the precision the device supports, the hardware (GPU SKU and dense
peak, CPU, memory, ranks and nodes) and the software versions.

Imported by train.py; may import gpuscout.domain, gpuscout.errors, metrics and distributed."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path

import torch

import gpuscout
from gpuscout.domain.benchmark import (
    Hardware,
    Software,
)
from gpuscout.domain.hardware import detect_sku
from gpuscout.errors import TrainingError

from .distributed import Dist
from .metrics import GpuSampler
from .nvidia_versions import nvidia_versions

CPU_NOTE = "n/a on CPU: no dense tensor-core peak"


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat's start time against /proc/uptime, 10 ms
    resolution), or None where that cannot be read: the benchmark's clock then starts when it is asked."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22, after the command name
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


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


def software_info(host_allocator: str | None = None) -> Software:
    import transformers

    return Software(
        **nvidia_versions(),
        host_allocator=host_allocator,
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        deepspeed=_version("deepspeed"),
        gpuscout=_version("gpuscout") or gpuscout.__version__,
        image_digest=os.environ.get("GPUSCOUT_IMAGE_DIGEST") or None,
    )
