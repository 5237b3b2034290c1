"""GPU SKU detection and the peak table MFU divides by."""

from __future__ import annotations

import pytest

from gpuscout.domain.hardware import SKUS, detect_sku


@pytest.mark.parametrize(
    ("name", "memory_gb", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 79.6, "H100-SXM5-80GB"),
        ("NVIDIA H200", 139.8, "H200-SXM-141GB"),
        ("NVIDIA A100-SXM4-40GB", 39.4, "A100-SXM4-40GB"),
        ("NVIDIA A100-SXM4-80GB", 79.2, "A100-SXM4-80GB"),
        ("NVIDIA A10G", 22.0, "A10G-24GB"),
        ("Tesla V100-SXM2-16GB", 15.8, "V100-SXM2-16GB"),
    ],
)
def test_detects_the_gpus_sagemaker_instances_carry(name: str, memory_gb: float, expected: str) -> None:
    sku = detect_sku(name, memory_gb)
    assert sku is not None
    assert sku.sku == expected


def test_unknown_device_is_not_guessed() -> None:
    # Given a GPU gpuscout has no peak for, MFU must be n/a rather than computed against a wrong peak.
    assert detect_sku("NVIDIA GeForce RTX 4090", 24.0) is None


def test_hopper_dense_peak_is_half_the_sparse_figure() -> None:
    # NVIDIA quotes 1,979 TFLOPS BF16 "with sparsity" for H100/H200 SXM; dense is half.
    for key in ("H100-SXM5-80GB", "H200-SXM-141GB"):
        assert SKUS[key].peak_for("bf16") == pytest.approx(1979 / 2, rel=1e-3)


def test_volta_has_no_bf16() -> None:
    v100 = SKUS["V100-SXM2-16GB"]
    assert "bf16" not in v100.precisions
    assert v100.peak_for("bf16") is None
