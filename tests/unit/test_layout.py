"""The package map of docs/internals.md, enforced: imports between gpuscout's subpackages point down only, there are
no import cycles between modules, and the Lambdas that must stay light do not load the analysis' heavy libraries.

Every ``import``/``from ... import`` of a gpuscout module counts, lazy ones inside functions included: a lazy import
still couples the two modules. Test files import shared test modules by their package path, never a conftest.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "gpuscout"

# Subpackage -> the subpackages it may import. "base" = the top-level modules errors.py, paths.py and __init__.py.
ALLOWED: dict[str, set[str]] = {
    "base": set(),
    "domain": {"base"},
    "plan": {"base", "domain"},
    "store": {"base", "domain"},
    "analysis": {"base", "domain", "plan", "store"},
    "workflow": {"base", "domain", "plan", "store", "analysis"},
    "local": {"base", "domain", "plan", "store", "analysis", "workflow"},
    "cloud": {"base", "domain", "plan", "store", "analysis", "workflow"},
    "cli": {"base", "domain", "plan", "store", "analysis", "workflow", "local", "cloud"},
    "__main__": {"cli"},
}
BASE_MODULES = {"gpuscout", "gpuscout.errors", "gpuscout.paths"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> str:
    if module in BASE_MODULES:
        return "base"
    if module == "gpuscout.__main__":
        return "__main__"
    return module.split(".")[1]


def gpuscout_imports(path: Path, known: set[str]) -> list[tuple[int, str, bool]]:
    """(line, imported gpuscout module, at module level) for every import of a gpuscout module in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from gpuscout.analysis import costs` imports the module gpuscout.analysis.costs
            names = [
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                for alias in node.names
            ]
        for name in names:
            if name == "gpuscout" or name.startswith("gpuscout."):
                found.append((node.lineno, name, id(node) in top_level))
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_the_subpackages_are_the_ones_the_map_names() -> None:
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert subpackages == set(ALLOWED) - {"base", "__main__"}
    top_level = {p.name for p in PACKAGE.glob("*.py")}
    assert top_level == {"__init__.py", "__main__.py", "errors.py", "paths.py"}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_only(module: str) -> None:
    # Given a module of gpuscout, When its imports of other gpuscout modules are read (lazy ones included),
    # Then each lands in its own subpackage or in one the map allows.
    own = layer(module)
    wrong = [
        f"line {line}: {name} ({layer(name)})"
        for line, name, _ in gpuscout_imports(MODULES[module], set(MODULES))
        if layer(name) != own and layer(name) not in ALLOWED[own]
    ]
    assert not wrong, f"{module} ({own}) may import only {sorted(ALLOWED[own])}: " + "; ".join(wrong)


def test_no_folder_is_named_like_a_test_folder() -> None:
    """Tools that follow RSpec's and Jasmine's convention read `spec/` as tests and leave it out of the picture: the
    package of what a benchmark is was `spec/` and is `domain/`."""
    tops = [p for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "node_modules"]
    named = [p for top in tops for p in [top, *top.rglob("*")] if p.is_dir() and p.name in {"spec", "specs"}]
    assert not named, named


def test_every_subpackage_says_what_it_owns_and_may_import() -> None:
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        assert "May import" in doc, f"{init.relative_to(REPO)}: the docstring must say what the subpackage may import"


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of the graph (module -> modules it imports), as a path that ends where it started; []."""
    done: set[str] = set()

    def visit(node: str, trail: list[str]) -> list[str]:
        for nxt in sorted(graph.get(node, ())):
            if nxt in trail:
                return [*trail[trail.index(nxt) :], nxt]
            if nxt not in done:
                found = visit(nxt, [*trail, nxt])
                if found:
                    return found
        done.add(node)
        return []

    for start in sorted(graph):
        if start not in done:
            found = visit(start, [start])
            if found:
                return found
    return []


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycles_between_modules() -> None:
    # analysis <-> recommend was one: the models they share live in domain/run_analysis.py.
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in MODULES.items():
        for _, name, _ in gpuscout_imports(path, set(MODULES)):
            if name != module and name in MODULES and MODULES[name].name != "__init__.py":
                graph[module].add(name)
    assert find_cycle(graph) == [], "import cycle: " + " -> ".join(find_cycle(graph))


LIGHT_LAMBDAS = [
    "validate_manifest",
    "plan_jobs",
    "job_events",
    "record_job_failure",
    "record_job_result",
    "mark_run_failed",
    "budget_guard",
]


@pytest.mark.parametrize("function", LIGHT_LAMBDAS)
def test_lambdas_other_than_analyze_do_not_load_numpy_or_matplotlib(function: str) -> None:
    # Given a Lambda handler imported the way the runtime does (lambdas.<name>.handler, the stack's environment),
    # Then numpy, matplotlib, the analysis pipeline and the trackers (mlflow, wandb) stay unloaded: a cold start pays
    # only for what it uses.
    env = {
        **os.environ,
        "TABLE_NAME": "t",
        "DATA_BUCKET": "d",
        "ARTIFACTS_BUCKET": "a",
        "AWS_DEFAULT_REGION": "us-east-1",
        "POWERTOOLS_TRACE_DISABLED": "1",
        "POWERTOOLS_METRICS_NAMESPACE": "gpuscout",
    }
    code = (
        f"import sys, json, lambdas.{function}.handler; "
        "print(json.dumps(sorted(m for m in ('numpy', 'matplotlib', 'gpuscout.analysis.analyze', "
        "'gpuscout.analysis.report', 'rich', 'typer', 'mlflow', 'wandb') if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


TRAINING_MODULES = sorted(str(p.relative_to(REPO / "training")) for p in (REPO / "training").rglob("*.py"))


@pytest.mark.parametrize("module", TRAINING_MODULES)
def test_training_modules_import_only_what_the_image_can_load(module: str) -> None:
    # The training image carries pydantic and PyYAML, not the analysis (numpy/matplotlib) or the cloud (boto3) code.
    wrong = [
        f"line {line}: {name}"
        for line, name, _ in gpuscout_imports(REPO / "training" / module, set(MODULES))
        if layer(name) not in {"base", "domain"}
    ]
    assert not wrong, f"training/{module} imports beyond gpuscout.domain and the base modules: " + "; ".join(wrong)


def _package_imports(path: Path) -> set[str]:
    """The training packages a module imports (absolute imports; a relative one stays in its own package)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name.split(".")[0] in {"gpuscout_train", "gpuscout_data", "gpuscout_report"}}


def test_the_training_packages_depend_one_way() -> None:
    """gpuscout_data stands alone (its job runs before any training); gpuscout_train reads gpuscout_data's format
    only; the SDK (gpuscout_report) uses the training job's step accounting and GPU versions, which import no torch,
    so a user's script imports it without loading more than it asked for."""
    allowed = {
        "gpuscout_data": set(),
        "gpuscout_train": {"gpuscout_data.dataset"},
        "gpuscout_report": {"gpuscout_train.metrics", "gpuscout_train.nvidia_versions"},
    }
    wrong = []
    for module in TRAINING_MODULES:
        package = module.split("/")[0]
        outside = {n for n in _package_imports(REPO / "training" / module) if n.split(".")[0] != package}
        if outside - allowed[package]:
            wrong.append(f"training/{module}: {sorted(outside - allowed[package])}")
    assert not wrong, wrong
    done = subprocess.run(
        [sys.executable, "-c", "import sys, gpuscout_report; print(sorted({'torch', 'numpy'} & set(sys.modules)))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert done.stdout.strip() == "[]"


TRAINING_FILE_LINES = 400  # the training job's components: each readable in one sitting
TRAINER_CLASS_LINES = 300  # the timed loop itself


def test_the_training_components_are_small_and_the_loop_readable() -> None:
    long = [
        f"{m}: {n}"
        for m in TRAINING_MODULES
        if (n := (REPO / "training" / m).read_text().count("\n")) > TRAINING_FILE_LINES
    ]
    assert not long, f"over {TRAINING_FILE_LINES} lines: {long}"
    tree = ast.parse((REPO / "training" / "gpuscout_train" / "trainer.py").read_text())
    (trainer,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Trainer"]
    assert trainer.end_lineno is not None and trainer.end_lineno - trainer.lineno + 1 <= TRAINER_CLASS_LINES


LONGEST_FILE_LINES = 700


def test_no_file_is_longer_than_a_newcomer_can_read_in_one_sitting() -> None:
    """One room per stage: a module over LONGEST_FILE_LINES lines is split where its stages part (as the local runner,
    train.py and the manifest were), unless its opening docstring says why it must be one piece ("one piece")."""
    long = []
    for folder in ("gpuscout", "training", "stacks", "lambdas"):
        for path in sorted((REPO / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            lines = text.count("\n")
            if lines > LONGEST_FILE_LINES and "one piece" not in (ast.get_docstring(ast.parse(text)) or ""):
                long.append(f"{path.relative_to(REPO)}: {lines} lines")
    assert not long, long


# Modules imported by a bare name that break or split: every folder's conftest.py loads as the module ``conftest`` (the
# last one wins), and ``cloud_world`` as a bare name would be a second copy beside tests.integration.cloud_world, with
# its own QUOTAS that the fixture never clears.
BARE_TEST_MODULES = {"conftest", "cloud_world"}


def test_no_test_file_imports_a_conftest_by_its_bare_name() -> None:
    """With files from several test folders on one command line pytest loads each folder's conftest.py as the module
    ``conftest`` and the last one wins, so ``from conftest import X`` in a test file breaks such a run (it did for
    tests/integration with tests/training). Shared names live in a named module (tests/integration/cloud_world.py),
    imported by its package path."""
    bare = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if BARE_TEST_MODULES & set(names):
                bare.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not bare, bare
