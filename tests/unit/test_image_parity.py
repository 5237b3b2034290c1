"""The training image runs the library versions the tests run, can prepare every bundled corpus, and builds
without a registry login (issue: production parity; cloud first deploy)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "training"))


def _pins(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)(\[[^\]]+\])?==([^\s;]+)", line)
        assert match, f"{path.name}: {line!r} is not an exact pin (name==version)"
        pins[match.group(1).lower()] = match.group(3)
    return pins


RUNTIME = _pins(ROOT / "requirements.txt")
IMAGE = _pins(ROOT / "training" / "requirements.txt")
GPU_CHECK = _pins(ROOT / "benchmarks" / "gpu-check-requirements.txt")
# In the image only: CUDA-only packages, pinned for `make gpu-check` in benchmarks/gpu-check-requirements.txt.
IMAGE_ONLY = {"nvidia-ml-py", "liger-kernel"}


def test_the_image_pins_what_the_tests_run() -> None:
    # Given the local runtime's pins (the tests run these) and the image's
    different = {n: (v, RUNTIME[n]) for n, v in IMAGE.items() if n in RUNTIME and RUNTIME[n] != v}
    assert not different, f"training/requirements.txt differs from requirements.txt (image, tests): {different}"
    # Then the libraries that decide what training does are pinned in the image, torch included
    for name in ("torch", "transformers", "tokenizers", "accelerate", "deepspeed", "safetensors", "numpy"):
        assert name in IMAGE, f"training/requirements.txt does not pin {name}: the base image would decide it"
    assert set(IMAGE) - set(RUNTIME) == IMAGE_ONLY
    for name in IMAGE_ONLY:
        assert GPU_CHECK.get(name) == IMAGE[name], f"{name}: gpu-check and the image pin different versions"


def test_every_bundled_corpus_package_is_in_the_image_and_here() -> None:
    import data_sources

    from gpuscout.domain.manifest_training import BUNDLED_SOURCES

    assert set(data_sources.BUNDLED_PACKAGES) == set(BUNDLED_SOURCES)
    for source, package in data_sources.BUNDLED_PACKAGES.items():
        assert package in IMAGE, f"{source} needs {package}, which the training image does not install"
        assert package in RUNTIME, f"{source} needs {package}, which `gpuscout local` does not install"


@pytest.mark.parametrize("source", ["bundled:hebrew-bible", "bundled:hebrew-chatterbot"])
def test_every_bundled_corpus_reads_with_the_pinned_packages(source: str) -> None:
    import data_sources

    documents = list(data_sources._bundled_documents(source))
    assert len(documents) > 10 and all(isinstance(d, str) and d.strip() for d in documents[:10])
    assert any("\u05d0" <= ch <= "\u05ea" for ch in documents[0]), "not Hebrew text"


def _dockerfile() -> str:
    return (ROOT / "training" / "Dockerfile").read_text()


def test_the_image_base_needs_no_registry_login() -> None:
    text = _dockerfile()
    default = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.MULTILINE)
    assert default, "training/Dockerfile: no ARG BASE_IMAGE=<image> default"
    assert default.group(1).startswith("public.ecr.aws/deep-learning-containers/pytorch-training:")
    assert "-sagemaker" in default.group(1), "the SageMaker flavour of the DLC (its toolkit, EFA, OFI NCCL)"
    (from_line,) = re.findall(r"^FROM (.+)$", text, re.MULTILINE)
    assert from_line.strip() == "${BASE_IMAGE}"
    assert "dkr.ecr" not in text.replace("# ", ""), "a private ECR registry needs `docker login`"
    # and the pinned requirements are what the image installs
    assert "pip install -r /opt/ml/code/training/requirements.txt" in text


def test_the_entrypoint_passes_sagemakers_argument_to_the_launcher() -> None:
    import json
    import subprocess

    (entry,) = re.findall(r"^ENTRYPOINT (.+)$", _dockerfile(), re.MULTILINE)
    argv = json.loads(entry)
    assert argv[:2] == ["bash", "-c"] and argv[-1] == "--"
    assert "start_cuda_compat.sh" in argv[2], "the DLC's CUDA forward compatibility, which its own entry point runs"
    # SageMaker runs `<entrypoint> train`: the launcher must get "train" (the compat script is absent here)
    script = argv[2].replace("exec python /opt/ml/code/training/launcher.py", "echo launcher")
    done = subprocess.run(["bash", "-c", script, "--", "train"], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "launcher train"
