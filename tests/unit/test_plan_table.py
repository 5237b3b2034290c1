"""docs/costs.md's single-GPU table and its data file say what the planner says today (benchmarks/plan_table.py)."""

from __future__ import annotations

import importlib.util
import json

from gpuscout.paths import REPO_DIR


def _plan_table():
    spec = importlib.util.spec_from_file_location("plan_table", REPO_DIR / "benchmarks" / "plan_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_single_gpu_table_and_its_data_match_todays_plan() -> None:
    plan_table = _plan_table()
    rows = plan_table.rows(plan_table.DEFAULT_MANIFEST)
    stored = json.loads((REPO_DIR / "benchmarks" / "results" / "plan-single-gpu-2026.json").read_text())
    assert stored["rows"] == rows, "prices or the planner changed: run benchmarks/plan_table.py and review the diff"
    begin, end = plan_table.markers("single-gpu-2026")
    doc = (REPO_DIR / "docs" / "costs.md").read_text()
    assert doc.split(begin, 1)[1].split(end, 1)[0].strip() == plan_table.table(rows)
    # the rows a reader looks for: every GPU is priced and predicted, and memory refuses the 24 GB cards somewhere
    fits = {r["instance_type"] for r in rows if "refused" not in r}
    assert fits == {"ml.p5.4xlarge", "ml.g6e.xlarge", "ml.g6.xlarge", "ml.g5.xlarge"}
    assert {r["instance_type"] for r in rows if "refused" in r} == {"ml.g6.xlarge", "ml.g5.xlarge"}
    assert all(r["price"]["kind"] == "snapshot" and r["price"]["date"] for r in rows if "refused" not in r)


def test_the_7b_methods_table_admits_lora_on_one_l40s_and_refuses_a_full_fine_tune_there() -> None:
    plan_table = _plan_table()
    manifest = REPO_DIR / "configs" / "manifests" / "lora-vs-full-7b.yaml"
    rows = plan_table.rows(manifest)
    stored = json.loads((REPO_DIR / "benchmarks" / "results" / "plan-lora-vs-full-7b.json").read_text())
    assert stored["rows"] == rows, "prices or the planner changed: run benchmarks/plan_table.py --manifest ..."
    begin, end = plan_table.markers("lora-vs-full-7b")
    doc = (REPO_DIR / "docs" / "costs.md").read_text()
    assert doc.split(begin, 1)[1].split(end, 1)[0].strip() == plan_table.table(rows)
    fits = {(r["instance_type"], r["variant"]): r for r in rows if "refused" not in r}
    refused = {(r["instance_type"], r["variant"]): r["refused"] for r in rows if "refused" in r}
    # one 48 GB L40S: LoRA and QLoRA fit, a full fine-tune does not, whatever its memory savings
    assert {("ml.g6e.xlarge", "lora-r16"), ("ml.g6e.xlarge", "qlora-r16")} <= set(fits)
    assert fits[("ml.g6e.xlarge", "lora-r16")]["memory_gb"] < 0.9 * 48
    assert "needs ~" in refused[("ml.g6e.xlarge", "full-b1-ckpt")]
    # one 24 GB A10G: only QLoRA; LoRA's refusal says so
    assert ("ml.g5.xlarge", "qlora-r16") in fits and "would fit: method: qlora" in refused[("ml.g5.xlarge", "lora-r16")]
    # eight H100s: the full fine-tune with ZeRO-3
    assert ("ml.p5.48xlarge", "full-zero3") in fits
