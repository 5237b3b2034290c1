"""GPU SKUs: memory, dense tensor-core peaks and supported precisions, and detection from a device name.

Peaks are *dense* (no 2:4 sparsity) tensor-core TFLOPS per GPU as published by NVIDIA; MFU divides by these.
Sources are listed per SKU so a reader can check them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GpuSku:
    sku: str  # stable key used by the catalog and benchmark.json, e.g. "H100-SXM5-80GB"
    model: str  # marketing name, e.g. "NVIDIA H100 SXM5"
    memory_gb: float
    peak_tflops: dict[str, float]  # dense tensor-core TFLOPS by precision: "bf16", "fp16", "fp32" (tf32 off)
    precisions: tuple[str, ...]  # training precisions the GPU supports natively
    name_patterns: tuple[str, ...]  # regexes matched (case-insensitive) against torch/NVML device names
    source: str = ""
    memory_range_gb: tuple[float, float] = field(default=(0.0, 1e9))  # disambiguates 40 GB vs 80 GB parts
    compute_capability: tuple[int, int] | None = None  # set where it decides what software runs (Volta: 7.0)

    def peak_for(self, precision: str) -> float | None:
        return self.peak_tflops.get(precision)


SKUS: dict[str, GpuSku] = {
    s.sku: s
    for s in (
        GpuSku(
            sku="A100-SXM4-40GB",
            model="NVIDIA A100 SXM4 40GB",
            memory_gb=40,
            peak_tflops={"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
            precisions=("bf16", "fp16", "fp32"),
            name_patterns=(r"A100.*(SXM|PCIE)?.*40GB", r"A100-SXM4-40GB"),
            memory_range_gb=(30, 50),
            source="NVIDIA A100 datasheet (2021): BF16/FP16 tensor 312 TFLOPS dense",
        ),
        GpuSku(
            sku="A100-SXM4-80GB",
            model="NVIDIA A100 SXM4 80GB",
            memory_gb=80,
            peak_tflops={"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
            precisions=("bf16", "fp16", "fp32"),
            name_patterns=(r"A100.*80GB",),
            memory_range_gb=(70, 90),
            source="NVIDIA A100 datasheet (2021): BF16/FP16 tensor 312 TFLOPS dense",
        ),
        GpuSku(
            sku="H100-SXM5-80GB",
            model="NVIDIA H100 SXM5 80GB",
            memory_gb=80,
            peak_tflops={"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
            precisions=("bf16", "fp16", "fp32"),
            name_patterns=(r"H100.*(SXM|HBM3)", r"H100 80GB HBM3"),
            memory_range_gb=(70, 90),
            source="NVIDIA H100 datasheet: SXM BF16/FP16 tensor 1,979 TFLOPS with sparsity = 989.4 dense",
        ),
        GpuSku(
            sku="H200-SXM-141GB",
            model="NVIDIA H200 SXM 141GB",
            memory_gb=141,
            peak_tflops={"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
            precisions=("bf16", "fp16", "fp32"),
            name_patterns=(r"H200",),
            memory_range_gb=(130, 150),
            source="NVIDIA H200 datasheet: SXM BF16/FP16 tensor 1,979 TFLOPS with sparsity = 989.4 dense",
        ),
        GpuSku(
            sku="A10G-24GB",
            model="NVIDIA A10G",
            memory_gb=24,
            peak_tflops={"bf16": 70.0, "fp16": 70.0, "fp32": 35.0},
            precisions=("bf16", "fp16", "fp32"),
            name_patterns=(r"A10G",),
            memory_range_gb=(20, 30),
            source=(
                "NVIDIA does not publish an A10G datasheet; 70 TFLOPS dense BF16/FP16 tensor and 35 TFLOPS FP32 as "
                "compiled in Baseten's 'NVIDIA A10 vs A10G' comparison (the A10 is 125 TFLOPS)"
            ),
        ),
        GpuSku(
            sku="V100-SXM2-16GB",
            model="NVIDIA Tesla V100 SXM2 16GB",
            memory_gb=16,
            peak_tflops={"fp16": 125.0, "fp32": 15.7},
            precisions=("fp16", "fp32"),
            name_patterns=(r"V100",),
            memory_range_gb=(12, 20),
            source="NVIDIA V100 datasheet: SXM2 tensor 125 TFLOPS (FP16); no BF16 support (Volta)",
            compute_capability=(7, 0),
        ),
    )
}


def detect_sku(device_name: str, memory_gb: float | None = None) -> GpuSku | None:
    """Map a device name as torch/NVML report it (e.g. "NVIDIA H100 80GB HBM3") to a known SKU, or None.

    ``memory_gb`` (total device memory) disambiguates parts that share a name (A100 40 GB vs 80 GB).
    """
    candidates = [s for s in SKUS.values() if any(re.search(p, device_name, re.IGNORECASE) for p in s.name_patterns)]
    if memory_gb is not None and len(candidates) > 1:
        by_memory = [s for s in candidates if s.memory_range_gb[0] <= memory_gb <= s.memory_range_gb[1]]
        candidates = by_memory or candidates
    if not candidates and "A100" in device_name.upper():
        candidates = [SKUS["A100-SXM4-80GB" if (memory_gb or 0) > 60 else "A100-SXM4-40GB"]]
    return candidates[0] if candidates else None
