"""The suite runs the kernels of the slowest CPU in the pool on every machine (make test sets them).

Machines that run CI and developers' sessions are drawn from a pool of 2-core Intel Xeons with native bf16 and 2-core
AMD EPYCs with AVX2 only, where torch's CPU bf16 matmuls run ~100x slower than fp32. ``ATEN_CPU_CAPABILITY=avx2``
alone does not reproduce that (it picks ATen's own vectorised kernels, not oneDNN's matmuls); with
``ONEDNN_MAX_CPU_ISA=AVX2`` too, a Xeon runs bf16 matmuls as slowly as the EPYC, so a test that would take an hour
there takes an hour everywhere and is seen before it lands.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from packaging.utils import canonicalize_name

from gpuscout.paths import REPO_DIR
from tests.pins import pins

SLOWEST_KIND = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def test_the_suite_runs_with_the_slowest_cpus_kernels():
    missing = {k: v for k, v in SLOWEST_KIND.items() if os.environ.get(k) != v}
    assert not missing, (
        "run the suite with `make test`, or set " + " ".join(f"{k}={v}" for k, v in missing.items()) + " yourself"
    )
    import torch

    assert torch.backends.cpu.get_cpu_capability() == "AVX2"


def test_make_test_sets_them():
    """The Makefile's test target exports both (so .ci/run, which runs make test, does too)."""
    makefile = (REPO_DIR / "Makefile").read_text()
    for name, value in SLOWEST_KIND.items():
        assert re.search(rf"^test: export {name} := {value}$", makefile, re.M), name
    assert Path(REPO_DIR / ".ci" / "run").read_text().strip().endswith("make test")


def test_the_run_names_its_machine_and_kernels_beside_its_times():
    """Every make test log ends with the CPU it ran on and the kernels it ran, so its times can be compared."""
    from gpuscout.domain.cpu import cpuinfo_field, detect_cpu_precisions
    from tests.conftest import machine_lines

    machine, kernels = machine_lines()
    assert machine.startswith(f"machine: {cpuinfo_field('model name')}, {os.cpu_count()} cores")
    for name, value in SLOWEST_KIND.items():
        assert f"{name}={value}" in kernels
    assert kernels.endswith(detect_cpu_precisions().reason)
    assert ("bf16 matmuls native" in kernels) is detect_cpu_precisions().bf16_native


def test_tests_run_with_what_collection_loaded_frozen_and_fewer_full_collections():
    """tests/conftest.py: the test files are imported with automatic collection off, what they loaded is frozen,
    and the tests run with the collector on and full collections a tenth as often as Python's default."""
    import gc

    from tests.conftest import WORKER_FULL_COLLECTION_EVERY

    assert gc.isenabled()
    assert gc.get_freeze_count() > 0  # what collection loaded (a few hundred thousand objects in a whole run)
    assert gc.get_threshold()[2] == WORKER_FULL_COLLECTION_EVERY == 100


def test_the_venvs_bytecode_is_written_when_first_imported():
    """make install leaves bytecode to Python (pip --no-compile): every module is compiled on its first import and
    kept. With PYTHONDONTWRITEBYTECODE set (these machines' environment sets it) nothing would be kept, and every
    process of the suite would compile torch's and transformers' modules again; make unexports it."""
    import sys

    assert not sys.flags.dont_write_bytecode, "run the suite with `make test` (it unexports PYTHONDONTWRITEBYTECODE)"
    makefile = (REPO_DIR / "Makefile").read_text()
    assert re.search(r"^unexport PYTHONDONTWRITEBYTECODE$", makefile, re.M)
    assert re.search(r"^PIP_PINNED := --quiet --no-compile ", makefile, re.M)
    assert re.search(r"-m pip install \$\(PIP_PINNED\) -r requirements-dev.txt$", makefile, re.M)


def module_file(name: str) -> Path | None:
    """Where ``import name`` would load ``name`` from, found as the import system finds it (a .py file, a package, an
    extension module, a namespace package) without importing it or its parents."""
    import importlib.machinery
    import importlib.util

    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)
    for part in rest:
        if spec is None or spec.submodule_search_locations is None:
            return None
        # str(): an imported package's locations may be Paths (transformers sets them so), which PathFinder skips
        spec = importlib.machinery.PathFinder.find_spec(part, [str(p) for p in spec.submodule_search_locations])
    if spec is None:
        return None
    return Path(spec.origin) if spec.origin else Path(next(iter(spec.submodule_search_locations or [])))


def test_the_install_compiles_the_heavy_libraries_once_and_each_name_it_imports_exists():
    """make install ends with warm-bytecode: the libraries' modules are compiled by two processes, not by every
    process that starts first in the suite. A name that no longer exists (a library moved a module) would stop the
    install, so each must exist here (found as the import system finds it; importing them is the install's job)."""
    makefile = (REPO_DIR / "Makefile").read_text()
    install = makefile.split("$(VENV)/.stamp-install:", 1)[1].split("\n\n", 1)[0]
    assert "$(MAKE) --no-print-directory warm-bytecode" in install
    names = [
        name
        for variable in ("WARM_TRAINING", "WARM_CLOUD")
        for name in re.search(rf"^{variable} := (.+)$", makefile, re.M).group(1).split()  # type: ignore[union-attr]
    ]
    assert {"torch._dynamo", "deepspeed", "moto"} <= set(names)
    missing = [name for name in names if module_file(name) is None]
    assert not missing, f"Makefile warm-bytecode imports modules this venv does not have: {missing}"
    assert module_file("no_such_library.anywhere") is None and module_file("torch.no_such_module") is None
    assert module_file("torch._C") is not None  # an extension module


def test_builds_from_source_use_one_pinned_setuptools():
    """pip builds two things from source in isolated environments: the editable gpuscout (pyproject.toml's
    build-system requires) and DeepSpeed (its release is a source archive, built with pip's default
    ``setuptools>=40.8.0``). Unpinned, each fresh clone builds them with the index's newest setuptools of that day,
    and pip's ``-c`` constraints do not reach isolated builds: only ``--build-constraint`` does. Both are pinned to
    one version. (The pin guards against new releases; setuptools also turns its announced deprecations into errors
    on their due date in any version, so the license is an SPDX string, PEP 639, not the table form
    ``{ text = ... }`` that stops building on 2027-02-18.)"""
    import tomllib

    pyproject = tomllib.loads((REPO_DIR / "pyproject.toml").read_text())
    requires = pyproject["build-system"]["requires"]
    assert requires and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.]*", r) for r in requires), requires
    assert isinstance(pyproject["project"]["license"], str)
    build = pins(REPO_DIR / "build-constraints.txt")
    assert {f"{name}=={version}" for name, version in build.items()} == set(requires)
    assert pins(REPO_DIR / "constraints.txt")["setuptools"] == build["setuptools"]  # torch needs it at run time
    makefile = (REPO_DIR / "Makefile").read_text()
    assert re.search(r"^PIP_PINNED := .*--build-constraint build-constraints.txt", makefile, re.M)
    # and pip itself, which the install upgrades first, is pinned too
    assert re.search(r"^PIP_PIN := pip==[0-9.]+$", makefile, re.M)
    assert (
        len(re.findall(r"-m pip install --quiet --no-compile \$\(PIP_PIN\)", makefile)) == 2
    )  # make install, make lock


def test_the_install_is_locked_and_this_environment_is_the_lock():
    """make install installs requirements-dev.txt with constraints.txt (make lock): every package, the requirements'
    dependencies included, at one version, so two fresh clones of a commit get the same packages whatever the index
    has released since (a new release of a dependency no requirement pins could otherwise break every fresh clone
    from one day on). The lock agrees with every direct pin, and the packages installed here are the lock's."""
    from importlib.metadata import PackageNotFoundError, distributions, version

    makefile = (REPO_DIR / "Makefile").read_text()
    assert re.search(r"^PIP_PINNED := .*-c constraints.txt", makefile, re.M)
    assert re.search(r"-m pip install \$\(PIP_PINNED\) -r requirements-dev.txt$", makefile, re.M)
    lock = pins(REPO_DIR / "constraints.txt")
    direct = pins(REPO_DIR / "requirements.txt") | pins(REPO_DIR / "requirements-dev.txt")
    assert {n: v for n, v in direct.items() if lock.get(n) != v} == {}, "run make lock after changing requirements"
    installed = {}
    for name in lock:
        try:
            installed[name] = version(name).split("+", 1)[0]  # torch 2.13.0+cpu is torch==2.13.0
        except PackageNotFoundError:
            installed[name] = None
    assert {n: (v, installed[n]) for n, v in lock.items() if installed[n] != v} == {}, "run make install"
    # and nothing the install brought is missing from the lock (pip and gpuscout itself aside)
    here = {canonicalize_name(d.metadata["Name"]) for d in distributions()}
    assert here - set(lock) - {"pip", "gpuscout"} == set(), "make lock leaves these out"
