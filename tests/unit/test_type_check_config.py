"""The type check's configuration (pyproject.toml, [tool.mypy]) follows every aws_cdk module the checked code imports.

mypy does not follow aws_cdk's ~270 service modules (a cold run would spend half its time on them); the ones the
stacks and app.py import are listed to be followed. A module imported but missing from that list would be typed Any
without a word, so this test fails on it, and on a listed module nothing imports any more.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _mypy_config() -> dict[str, object]:
    config: dict[str, object] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    return config


def _checked_files() -> list[Path]:
    """What `make types` checks: its packages, and training/, benchmarks/ and app.py."""
    packages = [str(p) for p in _mypy_config()["packages"]]  # type: ignore[attr-defined]
    files = [f for package in packages for f in (REPO / package).rglob("*.py")]
    files += [*(REPO / "training").rglob("*.py"), *(REPO / "benchmarks").glob("*.py"), REPO / "app.py"]
    return [f for f in files if "__pycache__" not in f.parts]


def _aws_cdk_modules(path: Path) -> set[str]:
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names if alias.name.split(".")[0] == "aws_cdk"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "aws_cdk":
            imported.add(node.module)
            if node.module == "aws_cdk":  # from aws_cdk import aws_iam as iam: a module, or a class of aws_cdk
                imported |= {f"aws_cdk.{a.name}" for a in node.names if a.name.startswith(("aws_", "assertions"))}
    return imported


def test_every_aws_cdk_module_the_checked_code_imports_is_followed_and_no_other() -> None:
    overrides = _mypy_config()["overrides"]
    assert isinstance(overrides, list)
    skipped = [o for o in overrides if o.get("follow_imports") == "skip"]
    followed = [o for o in overrides if o.get("follow_imports") == "normal"]
    assert any("aws_cdk.*" in o["module"] for o in skipped)
    [listed] = [set(o["module"]) for o in followed]
    imported = set().union(*(_aws_cdk_modules(f) for f in _checked_files()))
    assert imported, "no aws_cdk import found: the scan is broken"
    assert imported <= listed, f"imported but not followed (typed Any): {sorted(imported - listed)}"
    assert listed <= imported, f"followed but imported nowhere: {sorted(listed - imported)}"


# `mypy --strict`'s flags that a per-module override can set (mypy's config reference; warn_unused_ignores is global
# here already). gpuscout/ is held to all of them.
STRICT_PER_MODULE = {
    "disallow_untyped_defs", "disallow_incomplete_defs", "disallow_untyped_calls", "disallow_untyped_decorators",
    "disallow_any_generics", "disallow_subclassing_any", "warn_return_any", "no_implicit_reexport", "strict_equality",
    "extra_checks",
}  # fmt: skip


def test_gpuscout_is_checked_strictly() -> None:
    overrides = _mypy_config()["overrides"]  # type: ignore[index]
    (strict,) = [o for o in overrides if "gpuscout.*" in o["module"]]  # type: ignore[attr-defined,index]
    assert {key for key, value in strict.items() if value is True} == STRICT_PER_MODULE
    assert set(strict["module"]) == {"gpuscout", "gpuscout.*"}
