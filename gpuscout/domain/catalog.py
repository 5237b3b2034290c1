"""The instance catalog: configs/instances/*.json, one file per instance type, validated when loaded.

Each file states the hardware facts of one SageMaker instance type (GPU SKU and count, memory, vCPU, RAM, NVMe,
network, EFA, NVLink or PCIe), how it can be bought (on demand, spot, SageMaker training plan), suggested training
settings and the sources of those facts; a fact that could not be confirmed is null and named in ``unconfirmed``.
GPU facts that belong to the SKU (dense peaks, supported precisions, assumed utilization) come from the GPU files
(:mod:`gpuscout.domain.hardware`), so they are stated once; a file's ``gpu_memory_gb`` must equal its SKU's. Prices
change apart from hardware, so they live in one dated snapshot (:mod:`gpuscout.domain.prices`) the loader joins in.
Adding an instance type is one file here (and a GPU file for a new GPU).

``local.json`` describes "the machine you are on": its hardware is detected at run time by
:func:`detect_local_hardware` (torch is imported lazily there, because the Lambdas import this module).
"""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, model_validator

from gpuscout import paths
from gpuscout.domain.config_files import read_config_file
from gpuscout.domain.cpu import cpuinfo_field, detect_cpu_precisions
from gpuscout.domain.hardware import GpuSku, detect_sku, load_skus
from gpuscout.domain.prices import CatalogPrice, PriceFile, catalog_price, load_price_file, price_file_path
from gpuscout.errors import CatalogError

LOCAL = "local"
Role = Literal["training", "processing", "local"]
# How SageMaker sells an instance type for training: on demand, Managed Spot Training, or only through a SageMaker
# training plan (capacity reserved ahead and paid up front; the job names it in ResourceConfig.TrainingPlanArn)
PurchaseOption = Literal["on_demand", "spot", "training_plan"]
Interconnect = Literal["nvlink", "pcie"]
# Facts a cloud file may leave null when they could not be confirmed (named in "unconfirmed")
CONFIRMABLE = ("vcpus", "memory_gib", "nvme_gb", "network_gbps", "interconnect")


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
    nvme_gb: float | None = Field(default=None, ge=0)
    network_gbps: float | None = Field(default=None, ge=0)
    efa: bool
    interconnect: Interconnect | None = None  # between the GPUs of one instance; None on CPU or unconfirmed
    purchase_options: tuple[PurchaseOption, ...] = ()
    defaults: InstanceDefaults | None = None
    sources: tuple[str, ...] = ()  # where the hardware facts and the purchase options come from
    sources_date: str | None = Field(default=None, pattern=r"^\d{4}-\d{2}(-\d{2})?$")  # when they were read
    unconfirmed: tuple[str, ...] = ()  # facts left null because no source confirmed them
    notes: str = ""
    _sku: GpuSku | None = PrivateAttr(default=None)
    _price: CatalogPrice | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> InstanceType:
        skus = (info.context or {}).get("skus") or load_skus()
        if self.gpu_sku is not None:
            if self.gpu_sku not in skus:
                raise ValueError(f"gpu_sku {self.gpu_sku!r} is not a known SKU; known: {', '.join(sorted(skus))}")
            sku = skus[self.gpu_sku]
            self._sku = sku
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
            self._check_cloud_facts()
        if self.role == "training" and self.defaults is None:
            raise ValueError("a training instance type must state defaults")
        return self

    def _check_cloud_facts(self) -> None:
        if not self.sources or self.sources_date is None:
            raise ValueError("a cloud instance type must name its sources and sources_date")
        if not self.purchase_options:
            raise ValueError("a cloud instance type must state purchase_options (on_demand, spot, training_plan)")
        if "spot" in self.purchase_options and "on_demand" not in self.purchase_options:
            raise ValueError("purchase_options: spot is offered only beside on_demand")
        unknown = set(self.unconfirmed) - set(CONFIRMABLE)
        if unknown:
            raise ValueError(f"unconfirmed may name only {', '.join(CONFIRMABLE)}, not {', '.join(sorted(unknown))}")
        for name in CONFIRMABLE:
            if name == "interconnect" and self.gpu_count < 2:
                continue  # one GPU: nothing to connect
            missing, unconfirmed = getattr(self, name) is None, name in self.unconfirmed
            if missing and not unconfirmed:
                raise ValueError(f"{name} is null: state it, or name it in unconfirmed")
            if unconfirmed and not missing:
                raise ValueError(f"{name} is named unconfirmed but has a value; leave it null")

    @property
    def sku(self) -> GpuSku | None:
        return self._sku

    @property
    def price(self) -> CatalogPrice | None:
        """The catalog's on-demand price (the snapshot's), None where none is listed (a manifest must state one)."""
        return self._price

    @property
    def on_demand_usd_per_hour(self) -> float | None:
        return self._price.usd_per_hour if self._price else None

    @property
    def on_demand(self) -> bool:
        return self.is_local or "on_demand" in self.purchase_options

    @property
    def spot_offered(self) -> bool:
        return "spot" in self.purchase_options

    @property
    def training_plan_only(self) -> bool:
        """Sold for training only through SageMaker training plans: a target must name one (training_plan_arn)."""
        return "training_plan" in self.purchase_options and "on_demand" not in self.purchase_options

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

    def __init__(
        self, instances: dict[str, InstanceType], source: Path | None = None, prices: PriceFile | None = None
    ) -> None:
        self._instances = dict(sorted(instances.items()))
        self.source = source
        self.prices = prices  # the snapshot the instances' prices came from

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


def _load_file(path: Path, skus: Mapping[str, GpuSku]) -> InstanceType:
    inst = read_config_file(path, InstanceType, "instance file", context={"skus": skus})
    if path.stem != inst.instance_type:
        raise CatalogError(f"{path}: file name must be {inst.instance_type}.json (instance_type inside the file)")
    return inst


@functools.cache
def _load_dir(base: str, price_stamp: tuple[int, int]) -> Catalog:
    """``price_stamp`` (the snapshot's mtime and size) keys the cache, so a refreshed snapshot is read again."""
    folder = Path(base) / "instances"
    files = sorted(folder.glob("*.json"))
    if not files:
        raise CatalogError(f"{folder}: no instance files (*.json); set GPUSCOUT_CONFIG_DIR to the configs folder")
    skus = load_skus(base)
    instances: dict[str, InstanceType] = {}
    for path in files:
        inst = _load_file(path, skus)
        instances[inst.instance_type] = inst
    prices = load_price_file(base)
    listed = set(prices.prices) | set(prices.unpriced)
    strays = sorted(listed - set(instances))
    if strays:
        raise CatalogError(f"{price_file_path(base)}: prices for types not in {folder}: {', '.join(strays)}")
    for inst in instances.values():
        if inst.is_local:
            continue
        if inst.instance_type not in listed:
            raise CatalogError(
                f"{price_file_path(base)}: {inst.instance_type} is neither priced nor listed under 'unpriced' "
                "(run `gpuscout catalog --refresh`, or add it to 'unpriced' with the reason)"
            )
        inst._price = catalog_price(prices, inst.instance_type)
    return Catalog(instances, source=folder, prices=prices)


def load_instance(instance_type: str, config_dir: Path | str | None = None) -> InstanceType | None:
    """One instance type's hardware facts from its own file, without the price snapshot (the training image's
    launcher needs its EFA flag, whatever state the prices are in); None when the catalog has no such type."""
    base = (Path(config_dir) if config_dir is not None else paths.CONFIG_DIR).resolve()
    path = base / "instances" / f"{instance_type}.json"
    if "/" in instance_type or not path.is_file():
        return None
    inst = _load_file(path, load_skus(base))
    return None if inst.is_local else inst


def load_catalog(config_dir: Path | str | None = None) -> Catalog:
    """Load and validate ``<config_dir>/instances/*.json`` with the GPU files and the price snapshot (default:
    gpuscout.paths.CONFIG_DIR). Cached per folder and snapshot (a refresh makes the next load see the new prices)."""
    base = (Path(config_dir) if config_dir is not None else paths.CONFIG_DIR).resolve()
    try:
        stat = price_file_path(base).stat()
        stamp = (stat.st_mtime_ns, stat.st_size)
    except OSError:
        stamp = (0, 0)  # no snapshot: _load_dir checks the instance files first, then says so
    return _load_dir(str(base), stamp)


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
        return load_skus().get(self.gpu_sku) if self.gpu_sku else None

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
