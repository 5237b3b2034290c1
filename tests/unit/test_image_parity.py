"""The training image runs the library versions the tests run, can prepare every bundled corpus, and builds
without a registry login."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.pins import pins

ROOT = Path(__file__).resolve().parents[2]

RUNTIME = pins(ROOT / "requirements.txt")
IMAGE = pins(ROOT / "training" / "requirements.txt")
GPU_CHECK = pins(ROOT / "benchmarks" / "gpu-check-requirements.txt")
# In the image only: CUDA-only packages, pinned for `make gpu-check` in benchmarks/gpu-check-requirements.txt, except
# bitsandbytes (QLoRA's 4-bit base): its 43 MB wheel does not fit the carried wheels of a short GPU rental beside the
# others, and the GPU checks do not run QLoRA.
IMAGE_ONLY = {"nvidia-ml-py", "liger-kernel", "bitsandbytes"}
NOT_IN_GPU_CHECK = {"bitsandbytes"}


def test_the_image_pins_what_the_tests_run() -> None:
    # Given the local runtime's pins (the tests run these) and the image's
    different = {n: (v, RUNTIME[n]) for n, v in IMAGE.items() if n in RUNTIME and RUNTIME[n] != v}
    assert not different, f"training/requirements.txt differs from requirements.txt (image, tests): {different}"
    # Then the libraries that decide what training does are pinned in the image, torch included
    for name in ("torch", "transformers", "tokenizers", "accelerate", "deepspeed", "safetensors", "numpy"):
        assert name in IMAGE, f"training/requirements.txt does not pin {name}: the base image would decide it"
    assert set(IMAGE) - set(RUNTIME) == IMAGE_ONLY
    for name in IMAGE_ONLY - NOT_IN_GPU_CHECK:
        assert GPU_CHECK.get(name) == IMAGE[name], f"{name}: gpu-check and the image pin different versions"


def test_every_bundled_corpus_package_is_in_the_image_and_here() -> None:
    from gpuscout_data import sources as data_sources

    from gpuscout.domain.manifest_training import BUNDLED_SOURCES

    assert set(data_sources.BUNDLED_PACKAGES) == set(BUNDLED_SOURCES)
    for source, package in data_sources.BUNDLED_PACKAGES.items():
        assert package in IMAGE, f"{source} needs {package}, which the training image does not install"
        assert package in RUNTIME, f"{source} needs {package}, which `gpuscout local` does not install"


@pytest.mark.parametrize("source", ["bundled:hebrew-bible", "bundled:hebrew-chatterbot"])
def test_every_bundled_corpus_reads_with_the_pinned_packages(source: str) -> None:
    from gpuscout_data import sources as data_sources

    documents = list(data_sources._bundled_documents(source))
    assert len(documents) > 10 and all(isinstance(d, str) and d.strip() for d in documents[:10])
    assert any("\u05d0" <= ch <= "\u05ea" for ch in documents[0]), "not Hebrew text"


def _dockerfile() -> str:
    return (ROOT / "training" / "Dockerfile").read_text()


def test_the_image_base_needs_no_registry_login_and_brings_the_pinned_torch() -> None:
    from stacks.config import dlc_torch_version

    text = _dockerfile()
    default = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.MULTILINE)
    assert default, "training/Dockerfile: no ARG BASE_IMAGE=<image> default"
    assert default.group(1).startswith("public.ecr.aws/deep-learning-containers/pytorch:")
    assert "-sagemaker" in default.group(1), "the SageMaker flavour of the DLC (EFA, OFI NCCL, CUDA compat)"
    (from_line,) = re.findall(r"^FROM (.+)$", text, re.MULTILINE)
    assert from_line.strip() == "${BASE_IMAGE}"
    assert "dkr.ecr" not in text.replace("# ", ""), "a private ECR registry needs `docker login`"
    # and the base's torch is the pinned one: nothing of torch or its CUDA wheels is installed again
    assert dlc_torch_version(default.group(1)) == IMAGE["torch"]


def _install_step() -> str:
    """The Dockerfile's RUN that installs training/requirements.txt, as the shell runs it."""
    text = _dockerfile().replace("\\\n", " ")
    (step,) = [line for line in text.splitlines() if line.startswith("RUN ") and "requirements.txt" in line]
    return step.removeprefix("RUN ")


def _fake_python(folder: Path, torch: str, *, pip: bool) -> Path:
    """A ``python`` (and ``uv``) on PATH that reports ``torch`` and records every call in calls.log."""
    folder.mkdir()
    log = folder / "calls.log"
    script = f"""#!/bin/bash
echo "$(basename "$0") $*" >> {log}
case "$*" in
  *"print(torch.__version__)"*) echo {torch} ;;
  "-m pip --version") {"echo pip 25" if pip else "exit 1"} ;;
esac
"""
    for name in ("python", "uv"):
        (folder / name).write_text(script)
        (folder / name).chmod(0o755)
    return log


@pytest.mark.parametrize("pip", [True, False])
def test_the_image_installs_the_pins_over_the_bases_own_torch(tmp_path: Path, pip: bool) -> None:
    import os
    import subprocess

    step = _install_step().replace("/opt/ml/code/training/requirements.txt", str(ROOT / "training/requirements.txt"))
    step = step.replace("/opt/ml/code/training/constraints.txt", str(ROOT / "training/constraints.txt"))
    step = step.replace("/tmp/torch-constraint.txt", str(tmp_path / "constraint.txt"))
    # Given a base whose torch is the pinned one (with the CUDA build's local label)
    log = _fake_python(tmp_path / "bin", f"{IMAGE['torch']}+cu130", pip=pip)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    # When the Dockerfile's install step runs
    done = subprocess.run(["sh", "-c", step], env=env, capture_output=True, text=True, check=False)
    # Then it installs the pins with torch held at the base's exact build, and checks it afterwards
    assert done.returncode == 0, done.stderr
    calls = log.read_text()
    installer = "python -m pip install -r" if pip else "uv pip install --python"
    (install,) = [line for line in calls.splitlines() if line.startswith(installer)]
    assert f"training/requirements.txt -c {ROOT / 'training/constraints.txt'} -c " in install and "mlflow" in calls
    assert f"assert torch.__version__ == '{IMAGE['torch']}+cu130'" in calls


LOCK = pins(ROOT / "training" / "constraints.txt")
TORCH_STACK = re.compile(r"^(torch|triton|cuda-[a-z-]+|nvidia-(cu|nv|nccl)[a-z0-9-]*)$")


def test_the_image_installs_under_its_own_lock_at_the_tests_versions() -> None:
    # Given the image's lock (make lock-image) and the tests' (constraints.txt, make lock)
    tests_lock = pins(ROOT / "constraints.txt")
    # Then it holds every pin of training/requirements.txt at its version (torch aside: the base's own build) ...
    assert {n: v for n, v in IMAGE.items() if n != "torch"} == {n: LOCK.get(n) for n in IMAGE if n != "torch"}
    # ... every package both locks hold at one version (the image runs what the tests run) ...
    different = {n: (v, tests_lock[n]) for n, v in LOCK.items() if n in tests_lock and tests_lock[n] != v}
    assert not different, f"training/constraints.txt and constraints.txt differ: {different}; run make lock-image"
    # ... and nothing of torch's CUDA stack, which the base image's torch brings (a pin would replace the base's)
    assert not [n for n in LOCK if TORCH_STACK.match(n)]
    assert "nvidia-ml-py" in LOCK  # NVML's bindings are gpuscout's own (the GPU sampler), not torch's


def test_the_image_lock_is_closed_over_the_dependencies_installed_here() -> None:
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    # For every locked package this machine has too, each dependency it needs on the image's Linux, CPython 3.12
    # (markers evaluated there, no extras) is itself locked, or is torch's CUDA stack
    image_env = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
                 "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}  # fmt: skip
    missing: dict[str, list[str]] = {}
    checked = 0
    for name in LOCK:
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        checked += 1
        for text in requires:
            requirement = Requirement(text)
            if requirement.marker is not None and not requirement.marker.evaluate(image_env):
                continue
            dependency = canonicalize_name(requirement.name)
            if dependency not in LOCK and not TORCH_STACK.match(dependency):
                missing.setdefault(name, []).append(dependency)
    assert checked > 60 and not missing, f"unlocked dependencies (run make lock-image): {missing}"


def test_a_base_with_another_torch_stops_the_build_naming_both(tmp_path: Path) -> None:
    import os
    import subprocess

    step = _install_step().replace("/opt/ml/code/training/requirements.txt", str(ROOT / "training/requirements.txt"))
    log = _fake_python(tmp_path / "bin", "2.10.0+cu130", pip=True)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    done = subprocess.run(["sh", "-c", step], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 1
    assert (
        f"the base image has torch 2.10.0+cu130, training/requirements.txt pins torch {IMAGE['torch']}" in done.stderr
    )
    assert "install" not in log.read_text()  # nothing was installed


def test_the_entrypoint_passes_sagemakers_argument_to_the_launcher() -> None:
    import json
    import subprocess

    (entry,) = re.findall(r"^ENTRYPOINT (.+)$", _dockerfile(), re.MULTILINE)
    argv = json.loads(entry)
    assert argv[:2] == ["bash", "-c"] and argv[-1] == "--"
    assert "start_cuda_compat.sh" in argv[2], "the DLC's CUDA forward compatibility, which its own entry point runs"
    # SageMaker runs `<entrypoint> train`: the launcher must get "train" (the compat script is absent here)
    script = argv[2].replace("exec python -m gpuscout_train.launcher", "echo launcher")
    done = subprocess.run(["bash", "-c", script, "--", "train"], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "launcher train"


def test_the_image_and_train_py_let_cuda_segments_expand() -> None:
    """The planner's memory model compares against 90 % of the GPU with no fragmentation factor: the caching
    allocator's expandable segments keep reserved-but-unusable memory small. Set in the image and, for a local GPU
    run, by train.py itself (a user's own PYTORCH_CUDA_ALLOC_CONF stands)."""
    dockerfile = (ROOT / "training" / "Dockerfile").read_text()
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in dockerfile
    train = (ROOT / "training" / "gpuscout_train" / "train.py").read_text()
    assert 'os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")' in train
