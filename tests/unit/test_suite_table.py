"""docs/testing.md's table of `make test` times is the one benchmarks/suite_table.py makes from the recorded runs."""

from __future__ import annotations

import importlib.util
import json

from gpuscout.paths import REPO_DIR


def test_the_suite_table_is_generated_from_the_recorded_runs() -> None:
    spec = importlib.util.spec_from_file_location("suite_table", REPO_DIR / "benchmarks" / "suite_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    data = json.loads(module.DATA.read_text())
    assert all(run["machine"] in data["machines"] for run in data["runs"])
    doc = module.DOC.read_text()
    assert doc.split(module.BEGIN, 1)[1].split(module.END, 1)[0].strip() == module.table(data), (
        "run benchmarks/suite_table.py"
    )
