"""`make gpu-wheels PY=3.12`: the wheels `make gpu-check` needs on a GPU machine without a package index, for that
machine's Python, in .whl/ (which a device call carries, 64 MiB at most).

What goes in: the full dependency closure of benchmarks/gpu-check-requirements.txt for CPython ``PY`` on x86-64
Linux, except torch, triton and numpy and whatever only they need (CUDA wheels, sympy, ...): the machine's own
torch is the one measured, and is never replaced. pip resolves the closure once here (``pip install --dry-run --report``
for the target Python and platform: metadata only, no wheel downloaded), the torch branch is pruned from the
dependency graph, and each remaining distribution is downloaded as a binary wheel at its resolved version. The
resolve is constrained by constraints.txt (make lock), so what the GPU machine adds runs at the versions the tests
run here (huggingface-hub, regex, typer, ... as well as the pinned roots).
.whl/manifest.json records the Python, the wheels and what was left out, and `make gpu-check`
(benchmarks/gpu_check.py) installs from exactly that set with pip's resolver (--no-index), so a missing dependency
fails there, loudly. pip's own wheel goes along for a machine whose Python has none.

Needs a package index (run it where pip works). Standard library and ``packaging`` only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "benchmarks" / "gpu-check-requirements.txt"
LOCK = ROOT / "constraints.txt"
# The GPU machine's own: torch and triton (measured as they are, never replaced) and numpy (every torch machine has
# it; 15 MiB would not fit the carry beside the rest), with everything reachable only through them.
PROVIDED_BY_THE_MACHINE = frozenset({"torch", "triton", "numpy"})
CARRY_LIMIT_BYTES = 64 * 1024 * 1024
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
MANIFEST = "manifest.json"


def canonical(name: str) -> str:
    from packaging.utils import canonicalize_name

    return str(canonicalize_name(name))


def marker_environment(python_version: str) -> dict[str, str]:
    """PEP 508 marker values of CPython ``python_version`` (e.g. 3.12) on x86-64 Linux."""
    return {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "extra": "",
    }


def needs(requires_dist: Iterable[str], environment: Mapping[str, str]) -> list[str]:
    """The canonical names a distribution needs in ``environment`` (its extras' requirements left out)."""
    from packaging.requirements import Requirement

    names = []
    for text in requires_dist:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate(dict(environment)):
            names.append(canonical(requirement.name))
    return names


def closure(
    report: Mapping[str, Any], roots: Iterable[str], python_version: str
) -> tuple[list[dict[str, str]], list[str]]:
    """From pip's installation report: the distributions reachable from ``roots`` without passing through torch or
    triton (name, version, url), and the names left out (torch's branch)."""
    environment = marker_environment(python_version)
    items = {canonical(i["metadata"]["name"]): i for i in report["install"]}
    keep: dict[str, dict[str, str]] = {}
    todo = [canonical(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in keep or name in PROVIDED_BY_THE_MACHINE:
            continue
        if name not in items:
            raise SystemExit(f"gpu-wheels: pip's resolution has no {name} (needed by the closure)")
        item = items[name]
        keep[name] = {
            "name": item["metadata"]["name"],
            "version": item["metadata"]["version"],
            "url": item["download_info"]["url"],
        }
        todo += needs(item["metadata"].get("requires_dist") or [], environment)
    left_out = sorted(set(items) - set(keep))
    return sorted(keep.values(), key=lambda d: canonical(d["name"])), left_out


def requirement_lines(path: Path) -> list[str]:
    """The requirement lines of a requirements or constraints file, comments and blank lines dropped."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def root_names(requirements: Path) -> list[str]:
    from packaging.requirements import Requirement

    return [Requirement(line).name for line in requirement_lines(requirements)]


def _pip_platform_args(python_version: str) -> list[str]:
    args = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


def machine_free_constraints(constraints: Path, out: Path) -> Path:
    """``constraints`` without the GPU machine's own packages, written to ``out``. The lock is this machine's (torch's
    CPU build); constraining torch would make pip resolve that torch's CUDA dependencies for the target, which the
    index need not have for it (nvidia-nccl-cu13==2.29.7 for CPython 3.12: none, 2026-11-26), and the torch branch
    is left to the machine anyway."""
    from packaging.requirements import Requirement

    lines = requirement_lines(constraints)
    kept = [line for line in lines if canonical(Requirement(line).name) not in PROVIDED_BY_THE_MACHINE]
    out.write_text("\n".join(kept) + "\n")
    return out


def resolve(requirements: Path, python_version: str, constraints: Path = LOCK) -> dict[str, Any]:
    """pip's installation report for ``requirements`` under ``constraints`` (the machine's own packages aside) on
    CPython ``python_version``, x86-64 Linux (dry run)."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        pinned = machine_free_constraints(constraints, Path(scratch) / "constraints.txt")
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                   "--report", str(report), "--target", str(Path(scratch) / "target"),
                   *_pip_platform_args(python_version), "-r", str(requirements), "-c", str(pinned)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"gpu-wheels: pip could not resolve {requirements.name} for Python {python_version}:\n"
                             + done.stderr[-3000:])  # fmt: skip
        return dict(json.loads(report.read_text()))


def pip_pin() -> str:
    """pip itself, at this machine's version: carried so the install runs where the GPU machine's Python has no pip
    (a pip wheel runs as a zip application, benchmarks/gpu_check.py)."""
    from importlib import metadata

    return f"pip=={metadata.version('pip')}"


def download(distributions: list[dict[str, str]], python_version: str, out: Path) -> list[str]:
    """Each distribution's wheel for the target into ``out``, and pip's; the wheel file names."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    pins = [f"{d['name']}=={d['version']}" for d in distributions] + [pip_pin()]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *_pip_platform_args(python_version),
               "-d", str(out), *pins]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit("gpu-wheels: pip download failed:\n" + done.stderr[-3000:])
    return sorted(p.name for p in out.glob("*.whl"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", required=True, help="the GPU machine's Python, e.g. 3.12")
    parser.add_argument("--out", type=Path, default=ROOT / ".whl")
    parser.add_argument("--requirements", type=Path, default=REQUIREMENTS)
    parser.add_argument("--constraints", type=Path, default=LOCK, help="the versions to resolve to (make lock)")
    args = parser.parse_args(argv)
    print(f"gpu-wheels: resolving {args.requirements.name} for CPython {args.python_version} (x86-64 Linux)")
    report = resolve(args.requirements, args.python_version, args.constraints)
    keep, left_out = closure(report, root_names(args.requirements), args.python_version)
    wheels = download(keep, args.python_version, args.out)
    size = sum((args.out / w).stat().st_size for w in wheels)
    manifest = {
        "python_version": args.python_version,
        "requirements": args.requirements.name,
        "constraints": args.constraints.name,
        "wheels": wheels,
        "distributions": [{"name": d["name"], "version": d["version"]} for d in keep],
        "tools": [pip_pin()],
        "provided_by_the_machine": sorted(PROVIDED_BY_THE_MACHINE),
        "left_out": left_out,
        "bytes": size,
    }
    (args.out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"gpu-wheels: {len(wheels)} wheels, {size / 2**20:.1f} MiB in {args.out}; left to the machine: "
          f"{', '.join(left_out)}")  # fmt: skip
    if size > CARRY_LIMIT_BYTES:
        print(f"gpu-wheels: {size / 2**20:.1f} MiB is over the {CARRY_LIMIT_BYTES // 2**20} MiB one device call "
              "carries", file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
