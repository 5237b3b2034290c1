from pathlib import Path

import pytest

from gpuscout.domain.catalog import LocalHardware, detect_local_hardware, load_catalog
from gpuscout.domain.hardware import SKUS
from gpuscout.errors import CatalogError
from gpuscout.paths import INSTANCES_DIR

EXPECTED = {
    "ml.p4d.24xlarge", "ml.p4de.24xlarge", "ml.p5.48xlarge", "ml.p5e.48xlarge", "ml.p5en.48xlarge",
    "ml.g5.8xlarge", "ml.g5.12xlarge", "ml.p3.2xlarge", "ml.p3.8xlarge", "ml.m5.large", "ml.m5.xlarge", "local",
}  # fmt: skip


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def test_every_file_loads(catalog):
    assert {p.stem for p in INSTANCES_DIR.glob("*.json")} == EXPECTED
    assert set(catalog.types) == EXPECTED


def test_memory_matches_sku_and_totals(catalog):
    for inst in catalog:
        if inst.gpu_sku is None:
            assert inst.gpu_count == 0 and inst.total_gpu_memory_gb == 0
            continue
        assert inst.gpu_memory_gb == SKUS[inst.gpu_sku].memory_gb
        assert inst.total_gpu_memory_gb == inst.gpu_count * SKUS[inst.gpu_sku].memory_gb
        assert inst.peak_tflops(inst.precisions[0]) == SKUS[inst.gpu_sku].peak_tflops[inst.precisions[0]]


@pytest.mark.parametrize(
    ("itype", "sku", "count", "vcpus", "ram"),
    [
        ("ml.p4d.24xlarge", "A100-SXM4-40GB", 8, 96, 1152),
        ("ml.p4de.24xlarge", "A100-SXM4-80GB", 8, 96, 1152),
        ("ml.p5.48xlarge", "H100-SXM5-80GB", 8, 192, 2048),
        ("ml.p5e.48xlarge", "H200-SXM-141GB", 8, 192, 2048),
        ("ml.p5en.48xlarge", "H200-SXM-141GB", 8, 192, 2048),
        ("ml.g5.8xlarge", "A10G-24GB", 1, 32, 128),
        ("ml.g5.12xlarge", "A10G-24GB", 4, 48, 192),
        ("ml.p3.2xlarge", "V100-SXM2-16GB", 1, 8, 61),
        ("ml.p3.8xlarge", "V100-SXM2-16GB", 4, 32, 244),
    ],
)
def test_hardware_facts(catalog, itype, sku, count, vcpus, ram):
    inst = catalog.get(itype)
    assert (inst.gpu_sku, inst.gpu_count, inst.vcpus, inst.memory_gib) == (sku, count, vcpus, ram)
    assert inst.on_demand_usd_per_hour and inst.price_source and inst.price_date and inst.price_region


def test_p5_family_network_and_storage(catalog):
    p5 = catalog.get("ml.p5.48xlarge")
    assert (p5.network_gbps, p5.efa, p5.nvme_gb) == (3200, True, 8 * 3840)
    p4d = catalog.get("ml.p4d.24xlarge")
    assert (p4d.network_gbps, p4d.nvme_gb) == (400, 8000)
    for itype in ("ml.p5e.48xlarge", "ml.p5en.48xlarge"):
        assert catalog.get(itype).gpu_memory_gb == 141
        assert "H100" not in catalog.get(itype).gpu_sku
    assert "Sapphire Rapids" in catalog.get("ml.p5en.48xlarge").notes


def test_v100_has_no_bf16(catalog):
    for itype in ("ml.p3.2xlarge", "ml.p3.8xlarge"):
        assert "bf16" not in catalog.get(itype).precisions
        assert catalog.get(itype).peak_tflops("bf16") is None
    assert "bf16" in catalog.get("ml.g5.8xlarge").precisions


def test_processing_instances_have_no_gpu(catalog):
    for itype in ("ml.m5.large", "ml.m5.xlarge"):
        inst = catalog.get(itype)
        assert inst.role == "processing" and inst.gpu_count == 0 and inst.precisions == ("fp32",)
    assert "ml.m5.xlarge" not in catalog.training_types


def test_unknown_type_lists_known(catalog):
    with pytest.raises(CatalogError, match=r"ml\.p5\.48xlarge"):
        catalog.get("ml.p9.huge")


def _write(folder: Path, name: str, text: str) -> Path:
    (folder / "instances").mkdir(exist_ok=True)
    (folder / "instances" / name).write_text(text)
    return folder


def test_bad_file_names_the_file(tmp_path):
    src = (INSTANCES_DIR / "ml.g5.8xlarge.json").read_text().replace('"gpu_memory_gb": 24', '"gpu_memory_gb": 48')
    _write(tmp_path, "ml.g5.8xlarge.json", src)
    with pytest.raises(CatalogError, match=r"ml\.g5\.8xlarge\.json.*differs"):
        load_catalog(tmp_path)


def test_malformed_json_and_wrong_name(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    _write(a, "x.json", "{not json")
    with pytest.raises(CatalogError, match=r"x\.json"):
        load_catalog(tmp_path / "a")
    b = tmp_path / "b"
    b.mkdir()
    _write(b, "ml.other.json", (INSTANCES_DIR / "ml.p3.2xlarge.json").read_text())
    with pytest.raises(CatalogError, match="file name must be"):
        load_catalog(b)


def test_empty_folder(tmp_path):
    with pytest.raises(CatalogError, match="no instance files"):
        load_catalog(tmp_path)


def test_detect_local_hardware_on_this_machine():
    hw = detect_local_hardware()
    assert hw.device in ("cpu", "cuda")
    assert hw.cpu_count >= 1
    if hw.device == "cpu":
        assert hw.precisions == ("fp32",) and hw.gpu_count == 0


def test_local_hardware_precisions():
    assert LocalHardware(
        device="cuda", gpu_name="Tesla V100-SXM2-16GB", gpu_sku="V100-SXM2-16GB", gpu_count=1
    ).precisions == ("fp16", "fp32")
    assert "bf16" in LocalHardware(device="cuda", gpu_name="NVIDIA RTX A6000", gpu_count=1).precisions
    assert "bf16" not in LocalHardware(device="cuda", gpu_name="Tesla T4", gpu_count=1).precisions
