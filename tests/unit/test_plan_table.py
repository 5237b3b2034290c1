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
