"""Where a train.py step's time goes: a torch profiler table of the top kernels (GPU) or operators (CPU) over a few
optimizer steps of one training run, such as benchmarks/hopper.py's ``optimized`` row (docs/performance.md).

One command on an H100/H200 box (after ``make install`` and a ``hopper.py`` run that prepared the data); everything
after ``--`` is train.py's command line, and the SM_* / GPUSCOUT_* variables are train.py's, taken as given:

    SM_CHANNEL_TRAIN=runs/hopper-data/hebrew-bible-qwen-4096 SM_OUTPUT_DATA_DIR=runs/profile/output \\
    SM_MODEL_DIR=runs/profile/model GPUSCOUT_CHECKPOINT_DIR=runs/profile/checkpoints \\
    .venv/bin/python benchmarks/profile_train.py --wait 5 --active 3 --rows 30 --out runs/profile -- \\
        --model_preset=qwen2.5-1.5b --max_steps=12 --precision=auto --eval_interval=0 --packing=true \\
        --attention_implementation=flex --fused_cross_entropy=true --cross_entropy_kernel=chunked \\
        --torch_compile=true --fused_adamw=true --pin_memory=true --gradient_checkpointing=false \\
        --per_device_train_batch_size=2 --gradient_accumulation_steps=2

(hopper.py's table gives the row's micro-batch and accumulation; set GPUSCOUT_CHECKPOINT_DIR to a fresh folder, or
train.py resumes from the newest checkpoint there, /opt/ml/checkpoints by default.)

1. enters ``torch.profiler.profile`` (CPU, plus CUDA when there is a GPU) with the schedule wait ``--wait``, warmup 1,
   active ``--active``, once, and registers a global optimizer step post hook that advances the profiler once per
   ``optimizer.step()``: here a step is one optimizer step, with all its gradient-accumulation micro-batches (from
   just after one ``optimizer.step()`` to just after the next; the first waiting step also holds train.py's set-up,
   so keep ``--wait`` past torch.compile's first steps);
2. runs gpuscout_train.train in this process (as ``__main__``, sys.argv as given after ``--``);
3. when the active steps are done, prints the table (sorted by self CUDA time on a GPU, self CPU time on a CPU) and
   writes ``<out>/profile-<time>.txt`` (a header line with the device, torch version and window, then the table)
   and ``<out>/profile-<time>.json`` (the top ``--rows`` entries and the totals).

train.py needs at least wait + 1 + active optimizer steps (``--max_steps``); a run that ends before the window is
complete writes nothing and exits non-zero saying so. With fp16, a step that the gradient scaler skips calls no
``optimizer.step()``, so the hook does not fire and two steps count as one (bf16 and fp32 are not affected).
Otherwise the exit status is train.py's. One process only (not under torchrun); under DeepSpeed the engine steps its
own optimizer and the hook may never fire.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import runpy
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule

from gpuscout.paths import REPO_DIR, TRAIN_MODULE

WARMUP = 1  # the profiler's warm-up steps (recorded, then dropped) between waiting and the active window


@dataclass
class Window:
    """The profiler window and what happened to it during the run."""

    wait: int
    active: int
    rows: int
    out: Path
    cuda: bool
    steps: int = 0  # optimizer steps seen by the hook
    written: list[Path] = field(default_factory=list)

    @property
    def needed(self) -> int:
        """Optimizer steps that complete the window: the profiler's step() closes a step, the first at wait."""
        return self.wait + WARMUP + self.active


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """This script's arguments and train.py's (everything after the first ``--``)."""
    args = list(argv)
    if "--" in args:
        i = args.index("--")
        return args[:i], args[i + 1 :]
    return args, []


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="profile_train.py",
        description="Profile a few optimizer steps of gpuscout_train/train.py; train.py's arguments follow --.",
    )
    parser.add_argument("--wait", type=int, default=5, help="optimizer steps before the profiler warms up (default 5)")
    parser.add_argument("--active", type=int, default=3, help="optimizer steps recorded (default 3)")
    parser.add_argument("--rows", type=int, default=30, help="rows of the table and the JSON (default 30)")
    parser.add_argument("--out", type=Path, default=REPO_DIR / "benchmarks" / "results", help="output folder")
    a = parser.parse_args(argv)
    if a.wait < 0 or a.active < 1 or a.rows < 1:
        parser.error("--wait must be >= 0, --active and --rows >= 1")
    return a


def _time_us(evt: Any, *names: str) -> float:
    """The first of ``names`` that ``evt`` has (torch renamed the CUDA fields *_device_*), in microseconds."""
    for name in names:
        value = getattr(evt, name, None)
        if value is not None:
            return float(value)
    return 0.0


def self_device_us(evt: Any) -> float:
    return _time_us(evt, "self_device_time_total", "self_cuda_time_total")


def is_device_event(evt: Any) -> bool:
    """A kernel or memory copy on the device (its time is the device total's; a CPU op's device time repeats it)."""
    kind = getattr(evt, "device_type", DeviceType.CPU)
    return kind != DeviceType.CPU or bool(getattr(evt, "is_legacy", False))


def summarize(events: Sequence[Any], rows: int, cuda: bool) -> dict[str, Any]:
    """The top ``rows`` entries of ``key_averages()`` in the table's order, and the totals the table's footer gives."""
    total_device = sum((self_device_us(e) for e in events if is_device_event(e)), 0.0)
    total_cpu = sum((_time_us(e, "self_cpu_time_total") for e in events), 0.0)
    key = self_device_us if cuda else (lambda e: _time_us(e, "self_cpu_time_total"))
    top = sorted(events, key=key, reverse=True)[:rows]

    def share(part: float, whole: float) -> float | None:
        return round(100.0 * part / whole, 3) if whole > 0 else None

    entries = [
        {
            "name": e.key,
            "count": int(e.count),
            "self_device_time_us": round(self_device_us(e), 3),
            "self_cpu_time_us": round(_time_us(e, "self_cpu_time_total"), 3),
            "self_device_pct": share(self_device_us(e), total_device),
            "self_cpu_pct": share(_time_us(e, "self_cpu_time_total"), total_cpu),
        }
        for e in top
    ]
    return {"total_self_device_time_us": round(total_device, 3), "total_self_cpu_time_us": round(total_cpu, 3),
            "entries": entries}  # fmt: skip


def device_name(cuda: bool) -> str:
    if cuda:
        return torch.cuda.get_device_name()
    return f"CPU only ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def write_profile(prof: profile, window: Window, train_argv: Sequence[str]) -> None:
    """on_trace_ready: the table to stdout and both files, once the whole window was recorded."""
    if window.steps < window.needed:  # the run ended inside the window: the profiler stops with a partial trace
        return
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")
    sort_by = "self_cuda_time_total" if window.cuda else "self_cpu_time_total"
    averages = prof.key_averages()
    table = averages.table(sort_by=sort_by, row_limit=window.rows)
    header = (
        f"# {device_name(window.cuda)}; torch {torch.__version__}; wait {window.wait}, warmup {WARMUP}, "
        f"active {window.active} optimizer steps (steps {window.wait + WARMUP + 1}..{window.needed} of the run); "
        f"sorted by {sort_by}"
    )
    summary = {
        "device": device_name(window.cuda),
        "torch": torch.__version__,
        "wait": window.wait,
        "warmup": WARMUP,
        "active": window.active,
        "sort_by": sort_by,
        "train_argv": list(train_argv),
        **summarize(list(averages), window.rows, window.cuda),
    }
    window.out.mkdir(parents=True, exist_ok=True)
    txt, js = window.out / f"profile-{stamp}.txt", window.out / f"profile-{stamp}.json"
    txt.write_text(f"{header}\n{table}")
    js.write_text(json.dumps(summary, indent=2) + "\n")
    window.written += [txt, js]
    print(f"{header}\n{table}", flush=True)
    print(f"[profile_train] wrote {txt} and {js}", flush=True)


def run_train(train_argv: Sequence[str]) -> int:
    """gpuscout_train.train as ``__main__`` in this process (``python -m`` would run it so); its exit status."""
    saved = sys.argv
    sys.argv = [TRAIN_MODULE, *train_argv]
    try:
        runpy.run_module(TRAIN_MODULE, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        code = done.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
    return 0


def profile_run(window: Window, train_argv: Sequence[str]) -> int:
    """train.py under the profiler, one profiler step per optimizer step; train.py's exit status."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if window.cuda else [])
    with profile(
        activities=activities,
        schedule=schedule(wait=window.wait, warmup=WARMUP, active=window.active, repeat=1),
        record_shapes=False,
        on_trace_ready=lambda p: write_profile(p, window, train_argv),
    ) as prof:

        def step_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            window.steps += 1
            if window.steps <= window.needed:  # past the window the profiler has nothing more to do
                prof.step()

        handle = register_optimizer_step_post_hook(step_hook)
        try:
            return run_train(train_argv)
        finally:
            handle.remove()


def main(argv: Sequence[str] | None = None) -> int:
    ours, train_argv = split_argv(sys.argv[1:] if argv is None else argv)
    a = parse_args(ours)
    # train.py's main() sets this default too, but the profiler may touch CUDA first: set it before anything does
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    window = Window(wait=a.wait, active=a.active, rows=a.rows, out=a.out, cuda=torch.cuda.is_available())
    code = profile_run(window, train_argv)
    if not window.written:
        print(
            f"[profile_train] error: the profiler window was never completed: train.py made {window.steps} optimizer "
            f"step(s), the window needs {window.needed} (wait {window.wait} + warmup {WARMUP} + active "
            f"{window.active}); nothing was written. Raise --max_steps or lower --wait/--active.",
            file=sys.stderr,
            flush=True,
        )
        return code or 1
    return code


if __name__ == "__main__":
    sys.exit(main())
