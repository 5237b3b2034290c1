"""`make gpu-check`: the GPU-only paths checked on a GPU machine's own torch, every step run and reported.

Runs with the GPU machine's Python (standard library only), which holds its CUDA torch, triton and numpy:

1. ``install``: an overlay environment (a venv with no packages of its own whose ``.pth`` puts the machine's
   site-packages behind it) gets benchmarks/gpu-check-requirements.txt *with their dependencies*: from the wheels in
   .whl/ (`make gpu-wheels`) with ``--no-index`` when that folder holds wheels, else from the package index. The
   machine's torch, triton and numpy are pinned by a constraints file to the versions installed, so pip keeps them
   (it never uninstalls what lies outside the overlay) and a dependency needing another torch fails the install
   instead of replacing it. Afterwards the overlay's torch is checked to be the machine's. The machine's own
   environment is never written to. Reused while .whl/ and the requirements are unchanged.
2. ``cuda-tests``: ``pytest -m cuda tests/gpu`` (each check's outcome and recorded numbers);
3. ``smoke``: benchmarks/hopper.py, the optimized row of Qwen2.5-0.5B for 8 steps;
4. ``loss-paths``: benchmarks/hopper.py, the 1.5B optimized row with each ``cross_entropy_kernel`` (chunked, liger,
   torch), timed;
5. ``memory-probe`` (only when asked for): benchmarks/memory_probe_gpu.py.

Every requested step runs even when an earlier one failed (a step that needs the install is skipped, with the
reason, when the install failed), each under its own time limit, and one JSON holds them all:
``<out>/gpu-check-<gpu>-<date>[-<name>].json`` with the machine, each step's exit status, time and output tail, and the
CUDA checks' outcomes. Exit status 0 only when every step that ran passed.

``--no-gpu-ok`` runs the same recipe on a machine whose torch sees no GPU (the CPU emulation of an offline GPU box):
the CUDA tests skip themselves and the GPU-only steps are recorded as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from gpu_check_report import CheckOutcome, report_payload, slug  # beside this file (standard library only)

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "benchmarks" / "gpu-check-requirements.txt"
# The checkout's sources on PYTHONPATH, as in the training image (gpuscout.paths.SOURCE_ROOTS, which this script cannot
# import before its own environment is set up): gpuscout and the training packages
SOURCE_ROOTS = (ROOT, ROOT / "training")
# What the GPU machine brings and the install must keep (benchmarks/gpu_wheels.py leaves them out of .whl/).
MACHINE_PACKAGES = ("torch", "triton", "numpy")
STAMP = "gpuscout-gpu-check.json"


@dataclass
class Step:
    name: str
    command: list[str]
    timeout_s: int
    needs_gpu: bool = False
    needs_install: bool = True
    what: str = ""


@dataclass
class StepOutcome:
    name: str
    status: str  # passed | failed | timed-out | skipped
    seconds: float
    returncode: int | None = None
    command: list[str] = field(default_factory=list)
    reason: str | None = None
    tail: str = ""


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_step(step: Step, *, env: dict[str, str], cwd: Path = ROOT) -> StepOutcome:
    """Run one step to its end or its time limit; its output is echoed and its tail kept."""
    print(f"[gpu-check] {step.name}: {step.what or ' '.join(step.command)} (limit {step.timeout_s} s)", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        try:
            # its own process group, stopped whole at the step's limit: SIGTERM first, so hopper.py stops its row
            # (train.py, which holds the GPU, in a group of its own) before exiting, then SIGKILL for what is left;
            # a row whose hopper.py died outright gets SIGKILL from the kernel (PR_SET_PDEATHSIG)
            proc = subprocess.Popen(step.command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
            try:
                code: int | None = proc.wait(timeout=step.timeout_s)
                status = "passed" if code == 0 else "failed"
            except subprocess.TimeoutExpired:
                stop_group(proc)
                status, code = "timed-out", None
        except OSError as err:
            status, code = "failed", None
            log.write(f"could not start: {err}\n")
        log.seek(0)
        text = log.read()
    print(_tail(text, 25), flush=True)
    seconds = round(time.perf_counter() - started, 1)
    print(f"[gpu-check] {step.name}: {status} in {seconds} s", flush=True)
    reason = f"stopped at its {step.timeout_s} s limit" if status == "timed-out" else None
    return StepOutcome(step.name, status, seconds, code, step.command, reason, _tail(text))


STOP_GRACE_S = 10  # between a stopped step's SIGTERM and SIGKILL (hopper.py's own grace for its row is 5 s)


def stop_group(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM the step's process group, SIGKILL it after STOP_GRACE_S (or at once once the leader is gone).
    gpuscout.local.process_control.stop_process_group does the same; this script runs on the GPU machine's bare
    Python before gpu-check's install, so it imports nothing of gpuscout."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# a step is not started with less time than this left before the call's deadline (it could not finish)
MIN_STEP_S = 10


def run_steps(
    steps: list[Step], *, env: dict[str, str], gpu: bool, installed: bool | None = None, deadline: float | None = None
) -> list[StepOutcome]:
    """Every step in order, whatever the others did; a GPU step is skipped without a GPU, a step that needs the
    install is skipped when the install failed (``installed`` False), and no step runs past ``deadline``
    (time.monotonic()), so the report is written inside a device call's limit."""
    outcomes = []
    for step in steps:
        skip = None
        if step.needs_gpu and not gpu:
            skip = "torch sees no CUDA GPU (--no-gpu-ok)"
        elif step.needs_install and installed is False:
            skip = "the install step failed"
        elif deadline is not None and deadline - time.monotonic() < MIN_STEP_S:
            skip = "no time left in this call's --budget-s"
        if skip:
            outcomes.append(StepOutcome(step.name, "skipped", 0.0, command=step.command, reason=skip))
            continue
        limit = step.timeout_s if deadline is None else max(1, min(step.timeout_s, int(deadline - time.monotonic())))
        outcomes.append(run_step(replace(step, timeout_s=limit), env=env))
    return outcomes


# ---------------------------------------------------------------- the overlay environment


def _probe(python: str, code: str, cwd: Path | None = None) -> Any:
    done = subprocess.run([python, "-c", code], cwd=cwd, capture_output=True, text=True, check=True, timeout=120)
    return json.loads(done.stdout)


def machine_facts(python: str) -> dict[str, Any]:
    """The interpreter's version, its site-packages, and the installed versions and paths of MACHINE_PACKAGES."""
    code = (
        "import json, os, site, sys\n"
        "from importlib import metadata\n"
        "user = site.getusersitepackages() if site.ENABLE_USER_SITE else None\n"  # a torch in ~/.local counts too
        "paths = site.getsitepackages() + ([user] if user and os.path.isdir(user) else [])\n"
        "out = {'python': '.'.join(map(str, sys.version_info[:3])), 'site': paths, 'packages': {}}\n"
        f"for name in {list(MACHINE_PACKAGES)!r}:\n"
        "    try:\n"
        "        d = metadata.distribution(name)\n"
        "        out['packages'][name] = {'version': d.version, 'path': str(d.locate_file(''))}\n"
        "    except metadata.PackageNotFoundError:\n"
        "        pass\n"
        "print(json.dumps(out))\n"
    )
    return dict(_probe(python, code))


def wheels_digest(wheel_dir: Path, requirements: Path) -> str:
    h = hashlib.sha256(requirements.read_bytes())
    for wheel in sorted(wheel_dir.glob("*.whl")):
        h.update(wheel.name.encode())
        h.update(str(wheel.stat().st_size).encode())
    return h.hexdigest()


def overlay_python(env_dir: Path) -> Path:
    return env_dir / "bin" / "python"


def make_overlay(box_python: str, env_dir: Path, facts: dict[str, Any]) -> Path:
    """A venv with nothing of its own in front of the machine's site-packages (a .pth lists them)."""
    subprocess.run([box_python, "-m", "venv", "--without-pip", "--clear", str(env_dir)], check=True, timeout=300)
    python = overlay_python(env_dir)
    purelib = Path(_probe(str(python), "import json, sysconfig; print(json.dumps(sysconfig.get_paths()['purelib']))"))
    (purelib / "_gpuscout_machine_site.pth").write_text("".join(f"{path}\n" for path in facts["site"]))
    return python


def pip_command(python: Path, wheel_dir: Path) -> list[str]:
    """pip for the overlay: the machine's own (seen through the .pth) or, where it has none, the pip wheel carried in
    .whl/ (a wheel runs as a zip application)."""
    has_pip = subprocess.run([str(python), "-c", "import pip"], capture_output=True, check=False, timeout=120)
    if has_pip.returncode == 0:
        return [str(python), "-m", "pip"]
    carried = sorted(wheel_dir.glob("pip-*.whl"))
    if not carried:
        raise RuntimeError(f"this Python has no pip and {wheel_dir} holds no pip wheel (make gpu-wheels carries one)")
    return [str(python), str(carried[-1] / "pip")]


def install(
    box_python: str, env_dir: Path, wheel_dir: Path, requirements: Path, *, timeout_s: float = 900
) -> dict[str, Any]:
    """Create (or reuse) the overlay and install the requirements with their dependencies, the machine's torch,
    triton and numpy held; returns what it did. Raises RuntimeError naming the failure."""
    facts = machine_facts(box_python)
    if "torch" not in facts["packages"]:
        raise RuntimeError(f"{box_python} has no torch: gpu-check measures the machine's own torch")
    offline = any(wheel_dir.glob("*.whl"))
    digest = wheels_digest(wheel_dir, requirements) if offline else None
    stamp = env_dir / STAMP
    python = overlay_python(env_dir)
    if digest and stamp.is_file() and python.exists():
        old = json.loads(stamp.read_text())
        if old.get("digest") == digest and old.get("machine_packages") == facts["packages"]:
            print(f"[gpu-check] install: {env_dir} is up to date with {wheel_dir}", flush=True)
            return {**old, "reused": True}
    python = make_overlay(box_python, env_dir, facts)
    constraints = env_dir / "machine-constraints.txt"
    constraints.write_text("".join(f"{n}=={p['version']}\n" for n, p in facts["packages"].items()))
    source = ["--no-index", "--find-links", str(wheel_dir)] if offline else []
    command = [*pip_command(python, wheel_dir), "install", "--disable-pip-version-check", "--no-compile",
               "--no-cache-dir", *source, "-r", str(requirements), "-c", str(constraints)]  # fmt: skip
    print("[gpu-check] install: " + " ".join(command), flush=True)
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=max(10, timeout_s))
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"pip did not finish within {timeout_s:.0f} s (the call's --budget-s)") from err
    if done.returncode != 0:
        raise RuntimeError("pip could not install the requirements beside the machine's torch:\n"
                           + _tail(done.stdout + done.stderr, 30))  # fmt: skip
    after = machine_facts(str(python))["packages"]
    moved = {n: (facts["packages"][n], after.get(n)) for n in facts["packages"] if after.get(n) != facts["packages"][n]}
    if moved:
        raise RuntimeError(f"the install changed the machine's packages: {moved}")
    record = {"digest": digest, "offline": offline, "python": facts["python"], "machine_packages": facts["packages"],
              "constraints": constraints.read_text().split(), "pip": _tail(done.stdout, 5)}  # fmt: skip
    stamp.write_text(json.dumps(record, indent=2) + "\n")
    return {**record, "reused": False}


# ---------------------------------------------------------------- the recipe


def steps_for(python: str, *, out: Path, loss_steps: int) -> dict[str, Step]:
    hopper = [python, "benchmarks/hopper.py"]
    probe_json = out / f"memory-probe-gpu-{dt.datetime.now(dt.UTC):%Y-%m-%d}.json"
    pytest = [python, "-m", "pytest", "-m", "cuda", "tests/gpu", "-p", "no:cacheprovider", "-q", "-rs"]
    smoke = [*hopper, "--models", "qwen2.5-0.5b", "--steps", "8", "--rows", "optimized", "--piece", "gpu-check-smoke"]
    losses = [*hopper, "--models", "qwen2.5-1.5b", "--steps", str(loss_steps), "--rows", "optimized,ce-liger,ce-torch",
              "--piece", "loss-paths"]  # fmt: skip
    probe = [python, "benchmarks/memory_probe_gpu.py", "--models", "qwen2.5-0.5b,qwen2.5-1.5b"]
    probe += ["--out", str(probe_json)]
    return {
        "cuda-tests": Step("cuda-tests", pytest, 1500, what="pytest -m cuda tests/gpu"),
        "smoke": Step(
            "smoke", [*smoke, "--out", str(out)], 900, needs_gpu=True, what="hopper.py: the 0.5B optimized row, 8 steps"
        ),
        "loss-paths": Step(
            "loss-paths",
            [*losses, "--out", str(out)],
            1500,
            needs_gpu=True,
            what="hopper.py: the 1.5B optimized row with each cross_entropy_kernel",
        ),
        "memory-probe": Step(
            "memory-probe", probe, 1500, needs_gpu=True, what="memory_probe_gpu.py: peak memory against the planner"
        ),
    }


DEFAULT_STEPS = ("install", "cuda-tests", "smoke", "loss-paths")


def gpu_visible(python: str) -> bool:
    code = "import json, torch; print(json.dumps(torch.cuda.is_available()))"
    try:
        return bool(_probe(python, code))
    except (subprocess.SubprocessError, json.JSONDecodeError, OSError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-dir", type=Path, default=Path(tempfile.gettempdir()) / "gpuscout-gpu-env")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl")
    parser.add_argument("--requirements", type=Path, default=REQUIREMENTS)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--steps", default=",".join(DEFAULT_STEPS),
                        help="comma-separated: install, cuda-tests, smoke, loss-paths, memory-probe")  # fmt: skip
    parser.add_argument("--loss-steps", type=int, default=20, help="optimizer steps per loss-paths row")
    parser.add_argument("--name", default=None, help="suffix of the JSON's name (one per 10-minute call)")
    parser.add_argument("--no-gpu-ok", action="store_true", help="run without a CUDA GPU (CPU emulation)")
    parser.add_argument("--budget-s", type=float, default=0,
                        help="stop starting or running steps this many seconds after the start, with time left to "
                             "write the report (a device call's limit); 0 = no limit")  # fmt: skip
    a = parser.parse_args(argv)
    wanted = [s.strip() for s in a.steps.split(",") if s.strip()]
    deadline = time.monotonic() + a.budget_s - 20 if a.budget_s else None
    box = sys.executable
    gpu = gpu_visible(box)
    if not gpu and not a.no_gpu_ok:
        print("gpu-check: torch sees no CUDA GPU on this machine (--no-gpu-ok runs the recipe anyway)", file=sys.stderr)
        return 2
    out = a.out.resolve()
    checks_file = Path(tempfile.mkdtemp(prefix="gpuscout-gpu-check-")) / "checks.json"
    python = str(overlay_python(a.env_dir))
    steps = steps_for(python, out=out, loss_steps=a.loss_steps)
    unknown = [s for s in wanted if s != "install" and s not in steps]
    if unknown:
        parser.error(f"unknown step(s) {', '.join(unknown)}; known: install, {', '.join(steps)}")
    outcomes: list[StepOutcome] = []
    install_record: dict[str, Any] | None = None
    installed: bool | None = None
    if "install" in wanted or not overlay_python(a.env_dir).exists():
        started = time.perf_counter()
        try:
            left = deadline - time.monotonic() if deadline is not None else 900
            install_record = install(box, a.env_dir, a.wheels, a.requirements, timeout_s=min(900, left))
            installed = True
            outcomes.append(StepOutcome("install", "passed", round(time.perf_counter() - started, 1)))
        except (RuntimeError, subprocess.SubprocessError, OSError) as err:
            installed = False
            outcomes.append(StepOutcome("install", "failed", round(time.perf_counter() - started, 1), reason=str(err)))
            print(f"[gpu-check] install: failed: {err}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GPUSCOUT_GPU_CHECK_CHECKS": str(checks_file)}
    # Inductor's compiled kernels in one folder of the checkout, so a later 10-minute call can carry them back in
    # (docs/performance.md "First hour") instead of compiling the same graphs again
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".inductor-cache"))
    # what the caller's PYTHONPATH names first, then the roots (as gpuscout.paths.source_pythonpath orders them)
    env["PYTHONPATH"] = os.pathsep.join([*filter(None, [env.get("PYTHONPATH")]), *(str(root) for root in SOURCE_ROOTS)])
    chosen = [steps[s] for s in wanted if s in steps]
    outcomes += run_steps(chosen, env=env, gpu=gpu, installed=installed, deadline=deadline)
    path = write(out, name=a.name, python=python if installed is not False else box, outcomes=outcomes,
                 checks_file=checks_file, install_record=install_record, gpu=gpu)  # fmt: skip
    print(f"[gpu-check] wrote {path}", flush=True)
    return 0 if json.loads(path.read_text())["passed"] else 1


def write(
    out: Path,
    *,
    name: str | None,
    python: str,
    outcomes: list[StepOutcome],
    checks_file: Path,
    install_record: dict[str, Any] | None,
    gpu: bool,
) -> Path:
    """The one JSON: the machine as the overlay sees it, every step, every CUDA check."""
    code = "import json, gpu_check_report as g; print(json.dumps(g.machine(), default=str))"
    try:
        info = dict(_probe(python, code, cwd=ROOT / "benchmarks"))  # -c imports from its working folder
    except (subprocess.SubprocessError, json.JSONDecodeError, OSError) as err:
        info = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "error": str(err)}
    info["python"] = ".".join(map(str, sys.version_info[:3]))
    info["platform"] = sysconfig.get_platform()
    checks = [CheckOutcome(**c) for c in json.loads(checks_file.read_text())] if checks_file.is_file() else []
    payload = report_payload(info, checks)
    step_dicts = [asdict(o) for o in outcomes]
    ran = [o for o in outcomes if o.status != "skipped"]
    payload["steps"] = step_dicts
    payload["install"] = install_record
    payload["emulation_without_gpu"] = not gpu
    payload["passed"] = bool(gpu and ran and all(o.status == "passed" for o in ran) and
                             (payload["passed"] or not checks))  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu-check-{slug(info.get('gpu'))}-{str(info.get('date', ''))[:10]}"
    if name:
        stem += "-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", name)
    path = out / f"{stem}.json"
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


if __name__ == "__main__":
    sys.exit(main())
