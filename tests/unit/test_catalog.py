"""The instance catalog: every file loads, the hardware facts, how each type is sold, the price snapshot joined in."""

import datetime as dt
import json
import shutil
from pathlib import Path

import botocore.session
import pytest

from gpuscout.domain.catalog import LocalHardware, detect_local_hardware, load_catalog
from gpuscout.domain.hardware import load_skus
from gpuscout.domain.prices import STALE_AFTER_DAYS, CatalogPrice, load_price_file
from gpuscout.errors import CatalogError
from gpuscout.paths import CONFIG_DIR, INSTANCES_DIR

EXPECTED = {
    "ml.p4d.24xlarge", "ml.p4de.24xlarge", "ml.p5.48xlarge", "ml.p5.4xlarge", "ml.p5e.48xlarge", "ml.p5en.48xlarge",
    "ml.p6-b200.48xlarge", "ml.p6-b300.48xlarge", "ml.g5.xlarge", "ml.g5.8xlarge", "ml.g5.12xlarge",
    "ml.g6.xlarge", "ml.g6.12xlarge", "ml.g6.48xlarge",
    "ml.g6e.xlarge", "ml.g6e.2xlarge", "ml.g6e.4xlarge", "ml.g6e.12xlarge", "ml.g6e.48xlarge",
    "ml.g7e.2xlarge", "ml.g7e.12xlarge", "ml.g7e.48xlarge",
    "ml.p3.2xlarge", "ml.p3.8xlarge", "ml.m5.large", "ml.m5.xlarge", "local",
}  # fmt: skip


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def test_every_file_loads(catalog):
    assert {p.stem for p in INSTANCES_DIR.glob("*.json")} == EXPECTED
    assert set(catalog.types) == EXPECTED


def test_every_cloud_type_is_one_sagemaker_accepts(catalog):
    # botocore's SageMaker model is the source of the names: a type outside its enum is refused by CreateTrainingJob
    model = botocore.session.get_session().get_service_model("sagemaker")
    training = set(model.shape_for("TrainingInstanceType").enum)
    processing = set(model.shape_for("ProcessingInstanceType").enum)
    for inst in catalog:
        if inst.role == "training":
            assert inst.instance_type in training, inst.instance_type
        elif inst.role == "processing":
            assert inst.instance_type in processing, inst.instance_type


def test_memory_matches_sku_and_totals(catalog):
    skus = load_skus()
    for inst in catalog:
        if inst.gpu_sku is None:
            assert inst.gpu_count == 0 and inst.total_gpu_memory_gb == 0
            continue
        assert inst.sku is skus[inst.gpu_sku]
        assert inst.gpu_memory_gb == skus[inst.gpu_sku].memory_gb
        assert inst.total_gpu_memory_gb == inst.gpu_count * skus[inst.gpu_sku].memory_gb


@pytest.mark.parametrize(
    ("itype", "sku", "count", "vcpus", "ram", "efa", "interconnect"),
    [
        ("ml.p4d.24xlarge", "A100-SXM4-40GB", 8, 96, 1152, True, "nvlink"),
        ("ml.p4de.24xlarge", "A100-SXM4-80GB", 8, 96, 1152, True, "nvlink"),
        ("ml.p5.48xlarge", "H100-SXM5-80GB", 8, 192, 2048, True, "nvlink"),
        ("ml.p5.4xlarge", "H100-SXM5-80GB", 1, 16, 256, True, None),
        ("ml.p5e.48xlarge", "H200-SXM-141GB", 8, 192, 2048, True, "nvlink"),
        ("ml.p5en.48xlarge", "H200-SXM-141GB", 8, 192, 2048, True, "nvlink"),
        ("ml.p6-b200.48xlarge", "B200-180GB", 8, 192, 2048, True, "nvlink"),
        ("ml.p6-b300.48xlarge", "B300-288GB", 8, 192, 4096, True, "nvlink"),
        ("ml.g5.xlarge", "A10G-24GB", 1, 4, 16, False, None),
        ("ml.g5.8xlarge", "A10G-24GB", 1, 32, 128, True, None),
        ("ml.g5.12xlarge", "A10G-24GB", 4, 48, 192, True, "pcie"),
        ("ml.g6.xlarge", "L4-24GB", 1, 4, 16, False, None),
        ("ml.g6.12xlarge", "L4-24GB", 4, 48, 192, True, "pcie"),
        ("ml.g6.48xlarge", "L4-24GB", 8, 192, 768, True, "pcie"),
        ("ml.g6e.xlarge", "L40S-48GB", 1, 4, 32, False, None),
        ("ml.g6e.2xlarge", "L40S-48GB", 1, 8, 64, False, None),
        ("ml.g6e.4xlarge", "L40S-48GB", 1, 16, 128, False, None),
        ("ml.g6e.12xlarge", "L40S-48GB", 4, 48, 384, True, "pcie"),
        ("ml.g6e.48xlarge", "L40S-48GB", 8, 192, 1536, True, "pcie"),
        ("ml.g7e.2xlarge", "RTX-PRO-6000-Server-96GB", 1, 8, 64, False, None),
        ("ml.g7e.12xlarge", "RTX-PRO-6000-Server-96GB", 2, 48, 512, True, "pcie"),
        ("ml.g7e.48xlarge", "RTX-PRO-6000-Server-96GB", 8, 192, 2048, True, "pcie"),
        ("ml.p3.2xlarge", "V100-SXM2-16GB", 1, 8, 61, False, None),
        ("ml.p3.8xlarge", "V100-SXM2-16GB", 4, 32, 244, False, "nvlink"),
    ],
)
def test_hardware_facts(catalog, itype, sku, count, vcpus, ram, efa, interconnect):
    inst = catalog.get(itype)
    assert (inst.gpu_sku, inst.gpu_count, inst.vcpus, inst.memory_gib) == (sku, count, vcpus, ram)
    assert (inst.efa, inst.interconnect) == (efa, interconnect)
    assert inst.sources and inst.sources_date and not inst.unconfirmed


def test_p5_family_network_and_storage(catalog):
    p5 = catalog.get("ml.p5.48xlarge")
    assert (p5.network_gbps, p5.efa, p5.nvme_gb) == (3200, True, 8 * 3800)  # DescribeInstanceTypes' decimal GB
    p4d = catalog.get("ml.p4d.24xlarge")
    assert (p4d.network_gbps, p4d.nvme_gb) == (400, 8000)
    for itype in ("ml.p5e.48xlarge", "ml.p5en.48xlarge"):
        assert catalog.get(itype).gpu_memory_gb == 141
        assert "H100" not in catalog.get(itype).gpu_sku
    assert "Sapphire Rapids" in catalog.get("ml.p5en.48xlarge").notes
    assert catalog.get("ml.p6-b300.48xlarge").network_gbps == 6400


def test_how_each_type_is_sold(catalog):
    # p5e comes through SageMaker training plans only (EC2 sells it as capacity blocks only); the G families on
    # demand and as spot; p6 on demand and through plans, spot unconfirmed
    inst = catalog.get("ml.p5e.48xlarge")
    assert inst.training_plan_only and not inst.on_demand and not inst.spot_offered
    for itype in ("ml.p6-b200.48xlarge", "ml.p6-b300.48xlarge", "ml.p5en.48xlarge"):
        assert catalog.get(itype).purchase_options == ("on_demand", "training_plan"), itype
    for itype in ("ml.p5.4xlarge", "ml.p5.48xlarge", "ml.p4d.24xlarge"):
        assert set(catalog.get(itype).purchase_options) == {"on_demand", "spot", "training_plan"}
    for itype in catalog.types:
        inst = catalog.get(itype)
        if itype.startswith(("ml.g5.", "ml.g6", "ml.g7e.")):
            assert inst.purchase_options == ("on_demand", "spot"), itype


def test_prices_are_training_rates_with_date_and_source(catalog):
    # SageMaker training rates after AWS's June 2025 P4/P5 cut, not EC2's and not the old ones
    expected = {"ml.p5.48xlarge": 63.296, "ml.p5.4xlarge": 7.912, "ml.p4d.24xlarge": 25.2513,
                "ml.g5.8xlarge": 3.06, "ml.g6e.xlarge": 2.61, "ml.g6.xlarge": 1.127}  # fmt: skip
    for itype, usd in expected.items():
        price = catalog.get(itype).price
        assert price is not None and price.usd_per_hour == usd
        assert (price.kind, price.region, price.component) == ("snapshot", "us-east-1", "Training")
        assert dt.date.fromisoformat(price.date) and price.source
    for inst in catalog:
        if not inst.is_local and inst.price is not None:
            assert inst.price.date and inst.price.source and inst.price.kind == "snapshot"
            assert inst.price.component == ("Processing" if inst.role == "processing" else "Training")


def test_a_type_without_a_confirmed_rate_stays_unpriced_with_the_reason(catalog):
    unpriced = load_price_file().unpriced
    for itype in ("ml.p5e.48xlarge", "ml.p6-b300.48xlarge", "ml.p6-b200.48xlarge", "ml.p3.2xlarge"):
        assert catalog.get(itype).price is None and catalog.get(itype).on_demand_usd_per_hour is None
        assert unpriced[itype]


def test_a_snapshot_price_older_than_90_days_is_stale():
    price = CatalogPrice(usd_per_hour=1.0, kind="snapshot", region="us-east-1", date="2026-01-01", source="t")
    assert not price.stale(dt.date(2026, 1, 1) + dt.timedelta(days=STALE_AFTER_DAYS))
    assert price.stale(dt.date(2026, 1, 1) + dt.timedelta(days=STALE_AFTER_DAYS + 1))
    assert "STALE (91 d)" in price.label(dt.date(2026, 4, 2))
    manifest = price.model_copy(update={"kind": "manifest"})
    assert not manifest.stale(dt.date(2030, 1, 1)) and manifest.label() == "manifest"


def test_unknown_type_lists_known(catalog):
    with pytest.raises(CatalogError, match=r"ml\.p5\.48xlarge"):
        catalog.get("ml.p9.huge")


def _config(folder: Path, *, instances: bool = False) -> Path:
    """A config folder with the shipped GPU files and price snapshot (and instance files when asked)."""
    shutil.copytree(CONFIG_DIR / "gpus", folder / "gpus")
    shutil.copytree(CONFIG_DIR / "pricing", folder / "pricing")
    (folder / "instances").mkdir()
    if instances:
        for path in INSTANCES_DIR.glob("*.json"):
            shutil.copy(path, folder / "instances")
    return folder


def _write(folder: Path, name: str, text: str) -> Path:
    (folder / "instances").mkdir(exist_ok=True)
    (folder / "instances" / name).write_text(text)
    return folder


def test_bad_file_names_the_file(tmp_path):
    src = (INSTANCES_DIR / "ml.g5.8xlarge.json").read_text().replace('"gpu_memory_gb": 24', '"gpu_memory_gb": 48')
    _write(_config(tmp_path), "ml.g5.8xlarge.json", src)
    with pytest.raises(CatalogError, match=r"ml\.g5\.8xlarge\.json.*differs"):
        load_catalog(tmp_path)


def test_malformed_json_and_wrong_name(tmp_path):
    a = _config(tmp_path / "a")
    _write(a, "x.json", "{not json")
    with pytest.raises(CatalogError, match=r"x\.json"):
        load_catalog(a)
    b = _config(tmp_path / "b")
    _write(b, "ml.other.json", (INSTANCES_DIR / "ml.p3.2xlarge.json").read_text())
    with pytest.raises(CatalogError, match="file name must be"):
        load_catalog(b)


def test_empty_folder(tmp_path):
    with pytest.raises(CatalogError, match="no instance files"):
        load_catalog(_config(tmp_path))


def test_a_fact_left_null_must_be_named_unconfirmed(tmp_path):
    raw = json.loads((INSTANCES_DIR / "ml.g6e.xlarge.json").read_text())
    folder = _config(tmp_path, instances=True)
    _write(folder, "ml.g6e.xlarge.json", json.dumps({**raw, "nvme_gb": None}))
    with pytest.raises(CatalogError, match="nvme_gb is null: state it, or name it in unconfirmed"):
        load_catalog(folder)
    _write(folder, "ml.g6e.xlarge.json", json.dumps({**raw, "nvme_gb": None, "unconfirmed": ["nvme_gb"]}))
    assert load_catalog(folder).get("ml.g6e.xlarge").nvme_gb is None  # unknown, and says so


def test_a_cloud_type_names_its_sources_and_how_it_is_sold(tmp_path):
    raw = json.loads((INSTANCES_DIR / "ml.g6e.xlarge.json").read_text())
    folder = _config(tmp_path, instances=True)
    _write(folder, "ml.g6e.xlarge.json", json.dumps({**raw, "sources": []}))
    with pytest.raises(CatalogError, match="must name its sources"):
        load_catalog(folder)
    _write(folder, "ml.g6e.xlarge.json", json.dumps({**raw, "purchase_options": []}))
    with pytest.raises(CatalogError, match="purchase_options"):
        load_catalog(folder)


def test_every_type_is_priced_or_listed_unpriced(tmp_path):
    folder = _config(tmp_path, instances=True)
    snapshot = json.loads((folder / "pricing" / "sagemaker.json").read_text())
    del snapshot["prices"]["ml.g6e.xlarge"]
    (folder / "pricing" / "sagemaker.json").write_text(json.dumps(snapshot))
    with pytest.raises(CatalogError, match=r"ml\.g6e\.xlarge is neither priced nor listed under 'unpriced'"):
        load_catalog(folder)
    snapshot["prices"]["ml.g9.huge"] = {
        "usd_per_hour": 1.0,
        "component": "Training",
        "date": "2026-11-01",
        "source": "t",
    }
    snapshot["unpriced"]["ml.g6e.xlarge"] = "test"
    (folder / "pricing" / "sagemaker.json").write_text(json.dumps(snapshot))
    with pytest.raises(CatalogError, match=r"prices for types not in .*ml\.g9\.huge"):
        load_catalog(folder)


def test_no_price_snapshot_says_how_to_make_one(tmp_path):
    folder = _config(tmp_path, instances=True)
    (folder / "pricing" / "sagemaker.json").unlink()
    with pytest.raises(CatalogError, match="gpuscout catalog --refresh"):
        load_catalog(folder)


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
