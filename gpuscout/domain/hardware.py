"""GPU SKUs: configs/gpus/*.json, one file per GPU, validated when loaded; and detection from a device name.

A SKU file states what belongs to the GPU rather than to an instance: memory, the *dense* (no 2:4 sparsity)
tensor-core peaks MFU divides by, the precisions it trains in natively, the device names torch/NVML report, and the
model-FLOPs utilization the planner assumes before anything is measured (``assumed_mfu``, with its basis). Every file
names its sources and their date. A peak NVIDIA does not publish stays absent: then MFU is not computed and the planner
says it cannot predict from the FLOPs model (locally it times matmuls on the device instead).

Adding a GPU is one file; :func:`load_skus` reads them (cached per folder).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpuscout import paths
from gpuscout.domain.config_files import read_config_file
from gpuscout.errors import CatalogError

PeakPrecision = Literal["bf16", "fp16", "fp32"]


class GpuSku(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    sku: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9.-]*$")  # stable key used by the catalog and benchmark.json
    model: str = Field(min_length=1)  # marketing name, e.g. "NVIDIA H100 SXM5 80GB"
    memory_gb: float = Field(gt=0)
    # dense tensor-core TFLOPS by precision ("fp32": tf32 off); a precision NVIDIA publishes no dense figure for is
    # absent, never guessed
    peak_tflops: dict[PeakPrecision, float] = Field(default_factory=dict)
    precisions: tuple[PeakPrecision, ...] = Field(min_length=1)  # training precisions the GPU supports natively
    name_patterns: tuple[str, ...] = Field(min_length=1)  # regexes matched (case-insensitive) against device names
    device_names: tuple[str, ...] = ()  # names torch/NVML are known to report (the tests check the patterns match)
    memory_range_gb: tuple[float, float] = (0.0, 1e9)  # total device memory as reported; tells 40 GB from 80 GB
    compute_capability: tuple[int, int] | None = None
    assumed_mfu: float | None = Field(default=None, gt=0, le=1)  # the planner's starting utilization
    assumed_mfu_basis: str = ""
    sources: tuple[str, ...] = Field(min_length=1)
    source_date: str = Field(pattern=r"^\d{4}-\d{2}(-\d{2})?$")  # when the sources were read
    notes: str = ""

    @field_validator("peak_tflops")
    @classmethod
    def _positive(cls, v: dict[PeakPrecision, float]) -> dict[PeakPrecision, float]:
        bad = [k for k, x in v.items() if x <= 0]
        if bad:
            raise ValueError(f"peaks must be positive: {', '.join(bad)}")
        return v

    @field_validator("name_patterns")
    @classmethod
    def _compiles(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in v:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"name pattern {pattern!r} is not a regular expression: {err}") from err
        return v

    @model_validator(mode="after")
    def _consistent(self) -> GpuSku:
        low, high = self.memory_range_gb
        if not low <= high:
            raise ValueError("memory_range_gb must be (low, high) with low <= high")
        if self.assumed_mfu is not None and not self.assumed_mfu_basis:
            raise ValueError("assumed_mfu needs assumed_mfu_basis: why this utilization")
        unmatched = [name for name in self.device_names if not self.matches(name)]
        if unmatched:
            raise ValueError(f"name_patterns match none of device_names {unmatched}")
        return self

    def peak_for(self, precision: str) -> float | None:
        return next((tflops for name, tflops in self.peak_tflops.items() if name == precision), None)

    def matches(self, device_name: str) -> bool:
        return any(re.search(p, device_name, re.IGNORECASE) for p in self.name_patterns)

    @property
    def plannable(self) -> bool:
        """Whether the planner's FLOPs model can predict on this GPU: a dense peak and an assumed utilization."""
        return self.assumed_mfu is not None and bool(self.peak_tflops)


def _load_sku_file(path: Path) -> GpuSku:
    sku = read_config_file(path, GpuSku, "GPU file")
    if path.stem != sku.sku:
        raise CatalogError(f"{path}: file name must be {sku.sku}.json (sku inside the file)")
    return sku


@functools.cache
def _load_sku_dir(directory: str) -> Mapping[str, GpuSku]:
    folder = Path(directory)
    files = sorted(folder.glob("*.json"))
    if not files:
        raise CatalogError(f"{folder}: no GPU files (*.json); set GPUSCOUT_CONFIG_DIR to the configs folder")
    return {sku.sku: sku for sku in map(_load_sku_file, files)}


def load_skus(config_dir: Path | str | None = None) -> Mapping[str, GpuSku]:
    """Load and validate ``<config_dir>/gpus/*.json`` (default: gpuscout.paths.CONFIG_DIR). Cached per folder."""
    base = Path(config_dir) if config_dir is not None else paths.CONFIG_DIR
    return _load_sku_dir(str((base / "gpus").resolve()))


def detect_sku(
    device_name: str, memory_gb: float | None = None, skus: Mapping[str, GpuSku] | None = None
) -> GpuSku | None:
    """Map a device name as torch/NVML report it (e.g. "NVIDIA H100 80GB HBM3") to a known SKU, or None.

    ``memory_gb`` (total device memory) disambiguates parts that share a name (A100 40 GB vs 80 GB). A name that
    still matches two SKUs is not guessed: None, so MFU is not computed against a peak that may be wrong.
    """
    table = skus if skus is not None else load_skus()
    candidates = [s for s in table.values() if s.matches(device_name)]
    if memory_gb is not None and len(candidates) > 1:
        candidates = [s for s in candidates if s.memory_range_gb[0] <= memory_gb <= s.memory_range_gb[1]]
    return candidates[0] if len(candidates) == 1 else None
