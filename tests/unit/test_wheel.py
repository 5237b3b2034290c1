"""gpuscout installs as a tool (`pipx install .`, `uv tool install .`): the wheel carries configs/ and the training
packages, and the installed command validates and plans from any folder, with no checkout beside it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_config_folder_is_in_the_wheel() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = {p.removeprefix("gpuscout._bundled.").replace(".", "/") for p in setuptools["packages"] if "_bundled" in p}
    folders = {str(d.relative_to(ROOT)) for d in (ROOT / "configs").rglob("*") if d.is_dir()} | {"configs"}
    assert listed == folders, "list every configs/ folder in pyproject.toml's packages and package-data"
    kinds = {f.suffix for f in (ROOT / "configs").rglob("*") if f.is_file()}
    globs = " ".join(" ".join(v) for v in setuptools["package-data"].values())
    assert all(f"*{kind}" in globs for kind in kinds), (kinds, globs)


@pytest.mark.slow(seconds=15)
def test_the_installed_wheel_validates_and_plans_from_any_folder(tmp_path: Path) -> None:
    # Given the wheel, installed into a fresh environment (its dependencies: this environment's, by a .pth line)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(wheels),
         str(ROOT)],
        check=True, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = wheels.glob("gpuscout-*.whl")
    env_dir = tmp_path / "tool"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", "--no-compile",
         str(wheel)],
        check=True, capture_output=True,
    )  # fmt: skip
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())  # fmt: skip
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # When its gpuscout runs in a folder with nothing of the checkout, on a manifest copied there
    work = tmp_path / "elsewhere"
    work.mkdir()
    shutil.copy(ROOT / "configs" / "manifests" / "quickstart.yaml", work / "mine.yaml")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCOUT_") and k != "PYTHONPATH"}
    env["GPUSCOUT_HOME"] = str(tmp_path / "home")

    def gpuscout(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([env_dir / "bin" / "gpuscout", *args], cwd=work, env=env, capture_output=True,
                              text=True, timeout=120, check=False)  # fmt: skip

    # Then it finds its configuration inside the installed package, and the jobs' packages beside it, not the checkout
    code = (
        "import importlib.util as u, gpuscout.paths as p; print(p.CONFIG_DIR)\n"
        "for m in ('gpuscout_train.train', 'gpuscout_train.launcher', 'gpuscout_data.__main__', 'gpuscout_report'):\n"
        "    print(u.find_spec(m).origin)"
    )
    where = subprocess.run([python, "-c", code], cwd=work, env=env, check=True, capture_output=True,
                           text=True).stdout.split()  # fmt: skip
    assert Path(where[0]) == site / "gpuscout" / "_bundled" / "configs"
    assert [Path(w) for w in where[1:]] == [
        site / "gpuscout_train" / "train.py",
        site / "gpuscout_train" / "launcher.py",
        site / "gpuscout_data" / "__main__.py",
        site / "gpuscout_report" / "__init__.py",
    ]
    # and validate, plan and catalog work as from the checkout
    validated = gpuscout("validate", "mine.yaml")
    assert validated.returncode == 0 and "3 job(s)" in validated.stdout, validated.stderr
    planned = gpuscout("plan", "mine.yaml")
    assert planned.returncode == 0 and "within budget" in planned.stdout, planned.stderr
    listed = gpuscout("catalog", "ml.p5.4xlarge")
    assert listed.returncode == 0 and "H100" in listed.stdout, listed.stderr
