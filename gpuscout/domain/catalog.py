"""The instance catalog: configs/instances/*.json, one file per instance type, validated when loaded.

Each file states the hardware facts of one SageMaker instance type (GPU SKU and count, memory, vCPU, RAM, NVMe,
network, EFA), suggested training settings and an on-demand price with its region, date and source. GPU facts that
belong to the SKU (dense peaks, supported precisions) come from :mod:`gpuscout.domain.hardware`, so they are stated
once; a file's ``gpu_memory_gb`` must equal its SKU's.

``local.json`` describes "the machine you are on": its hardware is detected at run time by
:func:`detect_local_hardware` (torch is imported lazily there, because the Lambdas import this module).
"""

from __future__ import annotations

import functools
import json
import os
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpuscout import paths
from gpuscout.domain.cpu import cpuinfo_field, detect_cpu_precisions
from gpuscout.domain.hardware import SKUS, GpuSku, detect_sku
from gpuscout.errors import CatalogError

LOCAL = "local"
Role = Literal["training", "processing", "local"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class InstanceDefaults(_Strict):
    """Settings suggested for a ~7B model (or the largest model that sensibly fits) on this instance."""

    per_device_batch_size: int = Field(ge=1)
    gradient_accumulation_steps: int = Field(ge=1)
    deepspeed_stage: Literal[0, 2, 3]


class InstanceType(_Strict):
    instance_type: str = Field(pattern=r"^(ml\.[a-z0-9-]+\.[a-z0-9]+|local)$")
    role: Role
    gpu_sku: str | None
    gpu_count: int = Field(ge=0)
    gpu_memory_gb: float | None = Field(default=None, gt=0)
    vcpus: int | None = Field(default=None, ge=1)
    memory_gib: float | None = Field(default=None, gt=0)
    nvme_gb: float = Field(ge=0)
    network_gbps: float = Field(ge=0)
    efa: bool
    on_demand_usd_per_hour: float | None = Field(default=None, gt=0)
    price_region: str | None = None
    price_date: str | None = Field(default=None, pattern=r"^\d{4}-\d{2}-\d{2}$")
    price_source: str = Field(min_length=1)
    defaults: InstanceDefaults | None = None
    notes: str = ""

    @model_validator(mode="after")
    def _consistent(self) -> InstanceType:
        if self.gpu_sku is not None:
            if self.gpu_sku not in SKUS:
                raise ValueError(f"gpu_sku {self.gpu_sku!r} is not a known SKU; known: {', '.join(sorted(SKUS))}")
            sku = SKUS[self.gpu_sku]
            if self.gpu_count < 1:
                raise ValueError("an instance with a gpu_sku needs gpu_count >= 1")
            if self.gpu_memory_gb != sku.memory_gb:
                raise ValueError(f"gpu_memory_gb {self.gpu_memory_gb} differs from {self.gpu_sku}'s {sku.memory_gb} GB")
        elif self.gpu_count != 0 or self.gpu_memory_gb is not None:
            raise ValueError("gpu_count must be 0 and gpu_memory_gb null when gpu_sku is null")
        if self.role == "local":
            if self.instance_type != LOCAL:
                raise ValueError("role 'local' is reserved for instance_type 'local'")
        else:
            missing = [
                name
                for name in ("vcpus", "memory_gib", "on_demand_usd_per_hour", "price_region", "price_date")
                if getattr(self, name) is None
            ]
            if missing:
                raise ValueError(f"a cloud instance type must state {', '.join(missing)}")
        if self.role == "training" and self.defaults is None:
            raise ValueError("a training instance type must state defaults")
        return self

    @property
    def sku(self) -> GpuSku | None:
        return SKUS[self.gpu_sku] if self.gpu_sku else None

    @property
    def is_local(self) -> bool:
        return self.role == "local"

    @property
    def total_gpu_memory_gb(self) -> float:
        return self.gpu_count * (self.gpu_memory_gb or 0.0)

    @property
    def precisions(self) -> tuple[str, ...]:
        """Training precisions the hardware supports natively (fp32 only on CPU)."""
        return self.sku.precisions if self.sku else ("fp32",)

    def peak_tflops(self, precision: str) -> float | None:
        """Dense peak TFLOPS per GPU at ``precision``; None on CPU or when the GPU lacks that precision."""
        return self.sku.peak_for(precision) if self.sku else None


class Catalog:
    """All instance types, keyed by type name."""

    def __init__(self, instances: dict[str, InstanceType], source: Path | None = None) -> None:
        self._instances = dict(sorted(instances.items()))
        self.source = source

    def __contains__(self, instance_type: object) -> bool:
        return instance_type in self._instances

    def __iter__(self) -> Iterator[InstanceType]:
        return iter(self._instances.values())

    def __len__(self) -> int:
        return len(self._instances)

    @property
    def types(self) -> list[str]:
        return list(self._instances)

    @property
    def training_types(self) -> list[str]:
        """Types a manifest may target: SageMaker training instances and ``local``."""
        return [t for t, i in self._instances.items() if i.role in ("training", "local")]

    def get(self, instance_type: str) -> InstanceType:
        try:
            return self._instances[instance_type]
        except KeyError as err:
            raise CatalogError(f"unknown instance type {instance_type!r}; known: {', '.join(self.types)}") from err


def _load_file(path: Path) -> InstanceType:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CatalogError(f"{path}: cannot read instance file: {err}") from err
    try:
        inst = InstanceType.model_validate(raw)
    except ValidationError as err:
        details = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(file)'}: {e['msg']}" for e in err.errors(include_url=False)
        )
        raise CatalogError(f"{path}: invalid instance file: {details}") from err
    if path.stem != inst.instance_type:
        raise CatalogError(f"{path}: file name must be {inst.instance_type}.json (instance_type inside the file)")
    return inst


@functools.cache
def _load_dir(directory: str) -> Catalog:
    folder = Path(directory)
    files = sorted(folder.glob("*.json"))
    if not files:
        raise CatalogError(f"{folder}: no instance files (*.json); set GPUSCOUT_CONFIG_DIR to the configs folder")
    instances: dict[str, InstanceType] = {}
    for path in files:
        inst = _load_file(path)
        instances[inst.instance_type] = inst
    return Catalog(instances, source=folder)


def load_catalog(config_dir: Path | str | None = None) -> Catalog:
    """Load and validate ``<config_dir>/instances/*.json`` (default: gpuscout.paths.CONFIG_DIR). Cached per folder."""
    base = Path(config_dir) if config_dir is not None else paths.CONFIG_DIR
    return _load_dir(str((base / "instances").resolve()))


class LocalHardware(BaseModel):
    """What ``local`` is on this machine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: Literal["cpu", "cuda"]
    gpu_name: str | None = None
    gpu_sku: str | None = None  # gpuscout.domain.hardware key; None on CPU or for an unrecognised GPU
    gpu_count: int = Field(default=0, ge=0)
    gpu_memory_gb: float | None = None
    cpu_model: str | None = None
    cpu_count: int = Field(default=1, ge=1)
    memory_gib: float | None = None
    startup_s: float | None = Field(default=None, ge=0)  # measured start-up of a training process (probe)
    # Whether the CPU multiplies bf16 matrices natively (gpuscout.domain.cpu), and why; None when not detected
    cpu_bf16_native: bool | None = None
    cpu_bf16_reason: str | None = None

    @property
    def sku(self) -> GpuSku | None:
        return SKUS.get(self.gpu_sku) if self.gpu_sku else None

    @property
    def precisions(self) -> tuple[str, ...]:
        if self.device == "cpu":
            return ("fp32",)
        if self.sku:
            return self.sku.precisions
        return ("bf16", "fp16", "fp32") if self._cuda_bf16 else ("fp16", "fp32")

    # Unknown GPUs: assume bf16 unless the name says Volta/Turing-era or older.
    @property
    def _cuda_bf16(self) -> bool:
        name = (self.gpu_name or "").upper()
        return not any(old in name for old in ("V100", "T4", "P100", "K80", "M60", "TITAN V", "RTX 20", "GTX"))


def _cpu_model() -> str | None:
    return cpuinfo_field("model name") or platform.processor() or None


def _memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def detect_local_hardware() -> LocalHardware:
    """Describe this machine: CUDA GPUs via torch when importable and available, else the CPU."""
    bf16 = detect_cpu_precisions()
    cpu = {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count() or 1,
        "memory_gib": _memory_gib(),
        "cpu_bf16_native": bf16.bf16_native,
        "cpu_bf16_reason": bf16.reason,
    }
    try:
        import torch
    except ImportError:
        return LocalHardware(device="cpu", **cpu)
    if not torch.cuda.is_available():
        return LocalHardware(device="cpu", **cpu)
    props = torch.cuda.get_device_properties(0)
    memory_gb = props.total_memory / 1e9
    sku = detect_sku(props.name, memory_gb)
    return LocalHardware(
        device="cuda",
        gpu_name=props.name,
        gpu_sku=sku.sku if sku else None,
        gpu_count=torch.cuda.device_count(),
        gpu_memory_gb=round(memory_gb, 1),
        **cpu,
    )
