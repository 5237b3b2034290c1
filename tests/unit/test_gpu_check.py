"""`make gpu-check` (benchmarks/gpu_check.py) on the CPU, the way an offline GPU box runs it: an overlay environment
in front of this venv's torch gets wheels from a folder with pip's resolver and no index, the machine's torch is kept
(a wheel that wants another torch fails the install, never replaces it), every step runs even when one fails, and one
JSON holds the steps and the CUDA checks (skipped here). The real .whl/ closure emulation (a clean venv holding the
GPU box's packages) is in docs/performance.md's "First hour" and the issue note; it needs a package index."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import gpu_check
import pytest

from gpuscout.local.process_control import process_alive


def _wheel(folder: Path, name: str, version: str, requires: list[str], code: str = "") -> Path:
    """A minimal pure-Python wheel: one module ``name`` and the metadata pip needs."""
    module = name.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    files = {
        f"{module}.py": code or f"VERSION = {version!r}\n",
        f"{dist_info}/METADATA": "Metadata-Version: 2.1\n"
        f"Name: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{dist_info}/RECORD,,")
    path = folder / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name_in_zip, text in files.items():
            archive.writestr(name_in_zip, text)
        archive.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return path


@pytest.fixture
def wheels(tmp_path: Path) -> tuple[Path, Path]:
    """A wheel folder with a root that needs a dependency that needs torch (which only the machine has)."""
    folder = tmp_path / "whl"
    folder.mkdir()
    _wheel(folder, "gpuscout-probe-root", "1.0", ["gpuscout-probe-dep>=1"])
    _wheel(folder, "gpuscout-probe-dep", "1.2", ["torch>=2"])
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("gpuscout-probe-root==1.0\n")
    return folder, requirements


def _in(python: Path, code: str) -> str:
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_the_install_brings_dependencies_from_the_folder_and_keeps_the_machines_torch(
    tmp_path: Path, wheels: tuple[Path, Path]
) -> None:
    folder, requirements = wheels
    env_dir = tmp_path / "env"
    record = gpu_check.install(sys.executable, env_dir, folder, requirements)
    python = gpu_check.overlay_python(env_dir)
    assert record["offline"] and not record["reused"]
    assert _in(python, "import gpuscout_probe_dep; print(gpuscout_probe_dep.VERSION)") == "1.2"  # the dependency too
    import torch

    assert _in(python, "import torch; print(torch.__file__)") == torch.__file__  # the machine's own, not a copy
    assert f"torch=={torch.__version__}" in record["constraints"]
    # nothing was written to the machine's environment
    here = subprocess.run([sys.executable, "-c", "import gpuscout_probe_dep"], capture_output=True, check=False)
    assert here.returncode != 0
    again = gpu_check.install(sys.executable, env_dir, folder, requirements)
    assert again["reused"]


def test_a_wheel_that_wants_another_torch_fails_the_install_and_replaces_nothing(
    tmp_path: Path, wheels: tuple[Path, Path]
) -> None:
    folder, requirements = wheels
    _wheel(folder, "gpuscout-probe-greedy", "1.0", ["torch==0.0.1"])
    requirements.write_text("gpuscout-probe-root==1.0\ngpuscout-probe-greedy==1.0\n")
    with pytest.raises(RuntimeError, match=r"(?s)pip could not install.*torch"):
        gpu_check.install(sys.executable, tmp_path / "env", folder, requirements)


def _step(name: str, code: str, timeout_s: int = 60, **kwargs: bool) -> gpu_check.Step:
    return gpu_check.Step(name, [sys.executable, "-c", code], timeout_s, **kwargs)


def test_every_step_runs_whatever_the_others_did(monkeypatch: pytest.MonkeyPatch) -> None:
    steps = [
        _step("fails", "import sys; print('boom'); sys.exit(3)"),
        _step("hangs", "import time; time.sleep(30)", timeout_s=1),
        _step("gpu-only", "print('never')", needs_gpu=True),
        _step("passes", "print('fine')"),
    ]
    outcomes = gpu_check.run_steps(steps, env={"PATH": "/usr/bin:/bin"}, gpu=False)
    assert [(o.name, o.status) for o in outcomes] == [
        ("fails", "failed"), ("hangs", "timed-out"), ("gpu-only", "skipped"), ("passes", "passed"),
    ]  # fmt: skip
    assert outcomes[0].returncode == 3 and "boom" in outcomes[0].tail
    assert "1 s limit" in str(outcomes[1].reason) and "no CUDA GPU" in str(outcomes[2].reason)
    late = gpu_check.run_steps([_step("late", "print(1)")], env={}, gpu=True, deadline=time.monotonic() + 5)
    assert late[0].status == "skipped" and "no time left" in str(late[0].reason)
    # a step's own limit is cut to the time left before the deadline (a 1 s minimum here instead of 10 s, so the
    # capped step waits 3 s, not 12)
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 1)
    capped = gpu_check.run_steps([_step("capped", "import time; time.sleep(30)", timeout_s=600)], env={}, gpu=True,
                                 deadline=time.monotonic() + 3)  # fmt: skip
    assert capped[0].status == "timed-out" and capped[0].seconds < 5
    assert str(capped[0].reason) in ("stopped at its 2 s limit", "stopped at its 3 s limit")  # not its own 600 s
    after_failed_install = gpu_check.run_steps([_step("tests", "print(1)")], env={}, gpu=True, installed=False)
    assert after_failed_install[0].status == "skipped" and "install step failed" in str(after_failed_install[0].reason)


def test_the_recipe_runs_to_the_end_without_a_gpu_and_one_json_holds_every_step(
    tmp_path: Path, wheels: tuple[Path, Path]
) -> None:
    folder, requirements = wheels
    out = tmp_path / "out"
    code = gpu_check.main(["--no-gpu-ok", "--env-dir", str(tmp_path / "env"), "--wheels", str(folder),
                           "--requirements", str(requirements), "--out", str(out), "--name", "emulation",
                           "--steps", "install,cuda-tests,smoke,loss-paths"])  # fmt: skip
    assert code == 1  # a run without a GPU is never a pass
    (path,) = out.glob("gpu-check-cpu-*-emulation.json")
    report = json.loads(path.read_text())
    assert [(s["name"], s["status"]) for s in report["steps"]] == [
        ("install", "passed"), ("cuda-tests", "passed"), ("smoke", "skipped"), ("loss-paths", "skipped"),
    ]  # fmt: skip
    assert report["emulation_without_gpu"] and report["passed"] is False
    assert report["checks"] and {c["outcome"] for c in report["checks"]} == {"skipped"}
    assert report["machine"]["torch"] and report["install"]["offline"]


def test_without_a_gpu_and_without_the_flag_it_stops_before_installing(tmp_path: Path) -> None:
    assert gpu_check.main(["--env-dir", str(tmp_path / "env"), "--out", str(tmp_path)]) == 2
    assert not (tmp_path / "env").exists()


def test_a_step_stopped_at_its_limit_takes_its_children_with_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(30)"
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(30)"
    (outcome,) = gpu_check.run_steps([_step("parent", parent, timeout_s=2)], env={"PATH": "/usr/bin:/bin"}, gpu=True)
    assert outcome.status == "timed-out"
    pid = int(pid_file.read_text())  # the grandchild had started
    deadline = time.monotonic() + 5
    while process_alive(pid) and time.monotonic() < deadline:  # a killed orphan may stay a zombie: that is gone
        time.sleep(0.05)
    assert not process_alive(pid)  # the grandchild (train.py under hopper.py) was stopped too


def test_the_suites_conftest_loads_on_a_python_without_botocore() -> None:
    """gpu-check's cuda-tests step runs pytest with the GPU machine's own Python, which has no botocore (H100,
    2026-11-25: the conftest's botocore import stopped the whole step before any CUDA test ran)."""
    code = "import runpy, sys; sys.modules['botocore'] = None; runpy.run_path('tests/conftest.py')"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
