"""`make gpu-wheels` carries the dependency closure of gpu-check's requirements minus the GPU machine's own torch
branch (benchmarks/gpu_wheels.py), computed from pip's installation report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gpu_wheels
import pytest

from tests.pins import pins

ROOT = Path(__file__).resolve().parents[2]


def _item(name: str, version: str, *requires: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "version": version, "requires_dist": list(requires)},
        "download_info": {"url": f"https://files.example/{name}-{version}.whl"},
    }


REPORT = {
    "install": [
        _item("transformers", "5.23.0", "numpy>=1.17", "tokenizers<0.24,>=0.22", "torch>=2.4; extra == 'torch'"),
        _item("Liger_Kernel", "0.8.5", "torch>=2.1.2", "triton>=2.3.1"),
        _item("tokenizers", "0.23.3", "huggingface-hub<3,>=1"),
        _item("huggingface_hub", "2.4.0", "pywin32; sys_platform == 'win32'", "typing-extensions>=4"),
        _item("typing_extensions", "4.16.0"),
        _item("torch", "2.10.0", "sympy>=1.13", "nvidia-cublas-cu12; platform_system == 'Linux'", "typing-extensions"),
        _item("triton", "3.6.0"),
        _item("numpy", "2.5.5"),
        _item("sympy", "1.14.0", "mpmath"),
        _item("mpmath", "1.3.0"),
        _item("nvidia-cublas-cu12", "12.8.4.1"),
    ]
}


def test_the_closure_leaves_the_machines_torch_branch_out() -> None:
    keep, left_out = gpu_wheels.closure(REPORT, ["transformers", "liger-kernel"], "3.12")
    assert [d["name"] for d in keep] == ["huggingface_hub", "Liger_Kernel", "tokenizers", "transformers",
                                         "typing_extensions"]  # fmt: skip
    # torch, triton, numpy and what only they need stay with the machine; a dependency torch shares with the
    # carried packages (typing-extensions) is carried; extras' and other platforms' requirements are not followed
    assert left_out == ["mpmath", "numpy", "nvidia-cublas-cu12", "sympy", "torch", "triton"]
    assert all(d["url"].startswith("https://files.example/") for d in keep)


def test_markers_are_evaluated_for_the_target_python() -> None:
    environment = gpu_wheels.marker_environment("3.12")
    assert gpu_wheels.needs(["tomli; python_version < '3.11'", "a; python_version >= '3.12'"], environment) == ["a"]
    assert gpu_wheels.needs(["tomli; python_version < '3.11'"], gpu_wheels.marker_environment("3.10")) == ["tomli"]


def test_the_requirements_roots_are_gpu_checks_pins() -> None:
    roots = gpu_wheels.root_names(gpu_wheels.REQUIREMENTS)
    assert "transformers" in roots and "liger-kernel" in roots and "torch" not in roots


@pytest.mark.parametrize("args", [[], ["PY=3.12"], ["PY=3.11"]])
def test_make_gpu_wheels_passes_the_python_version_and_keeps_the_venvs_interpreter(args: list[str]) -> None:
    """`make gpu-wheels PY=3.12` once overrode the venv's own interpreter variable too (and plain `make gpu-wheels`
    passed `.venv/bin/python` as the version)."""
    import subprocess

    done = subprocess.run(
        ["make", "-n", "-W", "requirements.txt", "gpu-wheels", *args],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, check=True,
    )  # fmt: skip
    version = args[0].split("=")[1] if args else "3.12"
    assert f"gpu_wheels.py --python-version {version} --out .whl" in done.stdout
    assert ".venv/bin/python -m pip install" in done.stdout  # the venv recipe still uses the venv's python
    assert f"\n{version} -m pip" not in done.stdout


def test_the_gpu_machine_gets_the_versions_the_tests_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The closure is resolved under constraints.txt: without it, what gpu-check adds (huggingface-hub, regex, typer,
    ...) was the index's newest of the day, not what the suite runs here (regex 2026.11.19 against 2026.11.15, typer
    0.29.2 against 0.29.1 in the .whl/ of 2026-11-25)."""
    constrained: list[dict[str, str]] = []

    def run(command: list[str], **_: Any) -> Any:
        constrained.append(pins(Path(command[command.index("-c") + 1])))
        Path(command[command.index("--report") + 1]).write_text(json.dumps(REPORT))
        return type("Done", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr(gpu_wheels.subprocess, "run", run)
    assert gpu_wheels.resolve(gpu_wheels.REQUIREMENTS, "3.12") == REPORT
    # Then pip resolves under the lock, but for the machine's own torch, triton and numpy (the lock holds the CPU
    # torch; constraining it made pip look for that torch's CUDA wheels for the target, which the index lacked)
    lock = pins(ROOT / "constraints.txt")
    assert constrained == [{n: v for n, v in lock.items() if n not in ("torch", "triton", "numpy")}]
    assert "regex" in constrained[0] and "huggingface-hub" in constrained[0]
    # and the lock agrees with gpu-check's own pins wherever both name a package (else pip could not resolve)
    roots = pins(gpu_wheels.REQUIREMENTS)
    assert {n: (v, lock[n]) for n, v in roots.items() if n in lock and lock[n] != v} == {}
