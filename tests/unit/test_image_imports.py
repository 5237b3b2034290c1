"""The training packages resolve one way everywhere: an install (this checkout's editable one, a wheel) imports them
as it imports gpuscout; the training image, which is not an install, puts the same two source roots on PYTHONPATH
(gpuscout.paths.SOURCE_ROOTS). Every job starts as a module, so nothing inserts into sys.path."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import gpu_check
import pytest

from gpuscout import paths
from gpuscout.domain.manifest_loader import load_manifest
from gpuscout.local.data_cache import data_preparation_command

ROOT = Path(__file__).resolve().parents[2]
CODE = "/opt/ml/code"  # the image's WORKDIR and first source root (training/Dockerfile)
PACKAGES = ("gpuscout_train", "gpuscout_data", "gpuscout_report")
# what each process the image or the runner starts runs, as modules
ENTRY_MODULES = (
    "gpuscout_train.launcher",
    "gpuscout_train.train",
    "gpuscout_data.__main__",
    "gpuscout_report.__main__",
)


def _dockerfile() -> str:
    return (ROOT / "training" / "Dockerfile").read_text()


def _image_pythonpath() -> str:
    (value,) = re.findall(r"^ENV PYTHONPATH=(\S+)$", _dockerfile(), re.MULTILINE)
    return value


def test_the_image_the_gpu_checks_and_gpuscout_name_the_same_source_roots() -> None:
    in_image = [str(root).replace(str(paths.REPO_DIR), CODE) for root in paths.SOURCE_ROOTS]
    assert _image_pythonpath() == os.pathsep.join(in_image) == f"{CODE}:{CODE}/training"
    assert tuple(gpu_check.SOURCE_ROOTS) == paths.SOURCE_ROOTS
    assert paths.source_pythonpath("x").split(os.pathsep) == ["x", *map(str, paths.SOURCE_ROOTS)]


def test_no_bare_module_sits_at_the_top_of_the_image_path() -> None:
    # training/ holds packages and the image's build files only: nothing importable by a bare name like `packing`
    assert sorted(p.name for p in (ROOT / "training").glob("*.py")) == []
    packages = sorted(p.parent.name for p in (ROOT / "training").glob("*/__init__.py"))
    assert packages == sorted(PACKAGES)
    # and the image copies folders, not top-level modules, into /opt/ml/code
    copied = re.findall(rf"^COPY (\S+) {CODE}/\S*$", _dockerfile(), re.MULTILINE)
    assert copied and not [c for c in copied if c.endswith(".py")]


def test_pyproject_installs_the_packages_from_training() -> None:
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package in PACKAGES:
        assert package in setuptools["packages"]
        assert setuptools["package-dir"][package] == f"training/{package}"
    # this install finds them there (the tests import them so)
    for module in ENTRY_MODULES:
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin is not None
        assert Path(spec.origin).is_relative_to(ROOT / "training")


@pytest.fixture
def image_code(tmp_path: Path) -> Path:
    """/opt/ml/code as the image lays it out (training/Dockerfile's COPY lines), as links into this checkout."""
    code = tmp_path / "opt" / "ml" / "code"
    code.mkdir(parents=True)
    for folder in ("gpuscout", "configs", "training"):
        (code / folder).symlink_to(ROOT / folder)
    return code


def _image_env(code: Path, **extra: str) -> dict[str, str]:
    """The image's environment and nothing of this process's: PATH, and PYTHONPATH with /opt/ml/code at ``code``."""
    return {"PATH": os.environ["PATH"], "PYTHONPATH": _image_pythonpath().replace(CODE, str(code)), **extra}


def test_every_entry_module_resolves_from_the_image_path_alone(image_code: Path) -> None:
    # Given an interpreter without site-packages (-S: no install, no editable finder), in the image's folder
    probe = (
        f"import importlib.util as u, json; print(json.dumps({{m: u.find_spec(m).origin for m in {ENTRY_MODULES!r}}}))"
    )
    done = subprocess.run([sys.executable, "-S", "-c", probe], cwd=image_code, env=_image_env(image_code),
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    # Then every entry module is found under the image's source roots
    origins = json.loads(done.stdout)
    assert all(Path(origin).is_relative_to(image_code / "training") for origin in origins.values()), origins


def test_the_image_entry_point_starts_the_launcher_and_the_launcher_starts_train(
    image_code: Path, tmp_path: Path
) -> None:
    # Given the image's ENTRYPOINT, its python without site-packages (the launcher needs only the standard library and
    # gpuscout's stdlib modules), one CPU host, and a hyperparameter train.py refuses
    (entry,) = re.findall(r"^ENTRYPOINT (.+)$", _dockerfile(), re.MULTILINE)
    script = json.loads(entry)[2].replace("exec python -m", f"exec {sys.executable} -S -m")
    config = tmp_path / "config"
    config.mkdir()
    (config / "hyperparameters.json").write_text(json.dumps({"no_such_hyperparameter": "1"}))
    env = _image_env(image_code, SM_INPUT_CONFIG_DIR=str(config), SM_NUM_GPUS="0",
                     SM_OUTPUT_DATA_DIR=str(tmp_path / "output" / "data"), HOME=str(tmp_path))  # fmt: skip
    # When SageMaker runs `<entrypoint> train`
    done = subprocess.run(["bash", "-c", script, "--", "train"], cwd=image_code, env=env, capture_output=True,
                          text=True, timeout=180, check=False)  # fmt: skip
    # Then the launcher ran train.py as a module on this host, and train.py read the hyperparameters and refused
    launched = [line for line in done.stdout.splitlines() if line.startswith("[launcher] host localhost")]
    assert launched and launched[0].endswith(f"-m {paths.TRAIN_MODULE}"), done.stdout + done.stderr
    assert done.returncode == 2 and "no_such_hyperparameter" in done.stderr, done.stdout + done.stderr


def test_the_local_runner_starts_the_data_preparation_as_a_module(tmp_path: Path) -> None:
    manifest = load_manifest(paths.MANIFESTS_DIR / "quickstart.yaml")
    command = data_preparation_command(manifest, tmp_path / "out", workers=1)
    assert command[:3] == [sys.executable, "-m", paths.DATA_PREPARATION_MODULE]


def test_the_data_cache_key_covers_every_module_of_the_preparation_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuscout.local.data_cache import data_cache_key, preparation_code_sha256

    manifest = load_manifest(paths.MANIFESTS_DIR / "quickstart.yaml")
    real, key = preparation_code_sha256(), data_cache_key(manifest)
    assert real is not None
    # Given a gpuscout_data found first on the path (as a job would find it), with the real package's modules
    package = tmp_path / "gpuscout_data"
    spec = importlib.util.find_spec(paths.DATA_PREPARATION_MODULE)
    assert spec is not None and spec.submodule_search_locations
    (source,) = spec.submodule_search_locations
    package.mkdir()
    for module in Path(source).glob("*.py"):
        (package / module.name).write_bytes(module.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.split(".")[0] == paths.DATA_PREPARATION_MODULE]:
        monkeypatch.delitem(sys.modules, name)  # an import in this process would answer instead of the path
    assert preparation_code_sha256() == real
    # When any one of its modules changes (the tokenizer, not only the pipeline's entry), the data is prepared again
    for name in ("tokenizer.py", "dataset.py", "sources.py", "prepare.py"):
        original = (package / name).read_bytes()
        (package / name).write_bytes(original + b"\n# changed\n")
        assert preparation_code_sha256() != real and data_cache_key(manifest) != key, name
        (package / name).write_bytes(original)
    assert data_cache_key(manifest) == key
