"""GPU SKUs (configs/gpus/*.json): detection from the names torch/NVML report, and the dense peaks MFU divides by."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gpuscout.domain.hardware import detect_sku, load_skus
from gpuscout.errors import CatalogError
from gpuscout.paths import CONFIG_DIR


@pytest.mark.parametrize(
    ("name", "memory_gb", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 79.6, "H100-SXM5-80GB"),
        ("NVIDIA H100 PCIe", 85.0, "H100-PCIe-80GB"),
        ("NVIDIA H100 NVL", 99.9, "H100-NVL-94GB"),
        ("NVIDIA H200", 139.8, "H200-SXM-141GB"),
        ("NVIDIA A100-SXM4-40GB", 39.4, "A100-SXM4-40GB"),
        ("NVIDIA A100-SXM4-80GB", 79.2, "A100-SXM4-80GB"),
        ("NVIDIA A10G", 22.0, "A10G-24GB"),
        ("NVIDIA L4", 23.6, "L4-24GB"),
        ("NVIDIA L40S", 47.7, "L40S-48GB"),
        ("NVIDIA B200", 192.3, "B200-180GB"),
        ("NVIDIA B300 SXM6 AC", 288.4, "B300-288GB"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 102.0, "RTX-PRO-6000-Server-96GB"),
        ("Tesla V100-SXM2-16GB", 15.8, "V100-SXM2-16GB"),
    ],
)
def test_detects_the_gpus_users_rent(name: str, memory_gb: float, expected: str) -> None:
    sku = detect_sku(name, memory_gb)
    assert sku is not None
    assert sku.sku == expected


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4090", "NVIDIA GB200", "NVIDIA H200 NVL", "NVIDIA L40"])
def test_unknown_device_is_not_guessed(name: str) -> None:
    # a GPU gpuscout has no peak for (or a lookalike with other peaks): MFU must be n/a, never computed wrongly
    assert detect_sku(name, 100.0) is None


def test_every_file_names_sources_and_matches_its_device_names() -> None:
    for sku in load_skus().values():
        assert sku.sources and sku.source_date
        for device_name in sku.device_names:
            assert detect_sku(device_name) is sku or detect_sku(device_name, sku.memory_gb) is sku, device_name
        if sku.assumed_mfu is not None:
            assert sku.assumed_mfu_basis


def test_dense_peaks_are_half_nvidias_sparse_figures() -> None:
    skus = load_skus()
    # NVIDIA quotes BF16 'with sparsity': H100/H200 SXM 1,979, H100 PCIe 1,513, H100 NVL 1,671, L4 242, B200 4,500
    sparse = {"H100-SXM5-80GB": 1979, "H200-SXM-141GB": 1979, "H100-PCIe-80GB": 1513, "H100-NVL-94GB": 1671,
              "L4-24GB": 242, "B200-180GB": 4500}  # fmt: skip
    for key, figure in sparse.items():
        assert skus[key].peak_for("bf16") == pytest.approx(figure / 2, rel=2e-3), key
    assert skus["L40S-48GB"].peak_for("bf16") == 362.05  # the L40S datasheet prints its dense figure (733 sparse)


def test_a_peak_nvidia_does_not_publish_stays_unknown() -> None:
    rtx = load_skus()["RTX-PRO-6000-Server-96GB"]
    assert rtx.peak_for("bf16") is None and rtx.assumed_mfu is None and not rtx.plannable
    assert rtx.peak_for("fp32") == 120.0


def test_volta_has_no_bf16() -> None:
    v100 = load_skus()["V100-SXM2-16GB"]
    assert "bf16" not in v100.precisions
    assert v100.peak_for("bf16") is None


def test_a_bad_gpu_file_names_the_file(tmp_path: Path) -> None:
    shutil.copytree(CONFIG_DIR / "gpus", tmp_path / "gpus")
    path = tmp_path / "gpus" / "L4-24GB.json"
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "device_names": ["NVIDIA L40S"]}))
    with pytest.raises(CatalogError, match=r"L4-24GB\.json.*match none of device_names"):
        load_skus(tmp_path)
    path.write_text(json.dumps({**raw, "assumed_mfu_basis": ""}))
    with pytest.raises(CatalogError, match="assumed_mfu needs assumed_mfu_basis"):
        load_skus(tmp_path)
