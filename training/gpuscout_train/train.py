"""gpuscout's standardized causal-LM fine-tuning benchmark (in the spirit of transformers' run_clm.py).

Hyperparameters come from SageMaker (/opt/ml/input/config/hyperparameters.json or the SM_HPS variable) and/or
the command line (``--name value``); names are those of docs/internals.md and an unknown name is an error.
Reads the prepared dataset from SM_CHANNEL_TRAIN, writes SM_OUTPUT_DATA_DIR/benchmark.json (status completed or
failed), checkpoints to /opt/ml/checkpoints (GPUSCOUT_CHECKPOINT_DIR) and resumes from the newest one there that
verifies against its marker's file manifest and loads (checkpoints.py). With GPUSCOUT_TRACKING set, rank 0 also
logs the job to MLflow and/or Weights & Biases (tracking.py).
Run it with ``python -m gpuscout_train.train`` on one device or under torchrun (launcher.py) on several.

This file is the job's story, ``main()``: arguments, the ranks, the experiment trackers, the timed benchmark, its
benchmark.json (a failure too), leaving together. The components it composes are listed in __init__.py.
"""

from __future__ import annotations

from . import startup_gc

if __name__ == "__main__":  # a job's own process: no cyclic collection while it loads and sets up (startup_gc.py)
    startup_gc.pause()

# The imports below load torch and the rest after the pause (pyproject.toml allows E402 in this file for it)
import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from gpuscout.errors import TrainingError

from .args import parse_hyperparameters
from .distributed import init_distributed, leave_together
from .facts import process_age_s
from .stop_signal import StoppedBeforeStartError, StopSignal
from .tracking import JobTracker
from .trainer import Trainer


def main(argv: Sequence[str] | None = None) -> int:
    import_time_s = process_age_s()  # the interpreter's start and the imports above, before any of the job's work
    # CUDA's caching allocator reads this at its first allocation: segments that grow in place leave less memory
    # reserved-but-unusable between variable-sized blocks (the image sets it too; a user's own setting stands)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        hp = parse_hyperparameters(argv)
    except TrainingError as err:
        print(f"train: error: {err}", file=sys.stderr, flush=True)
        return 2
    dist = init_distributed()
    tracker = JobTracker.from_environment(is_main=dist.is_main)
    # the job's parameters for its experiment trackers (their start counts in the start-up time)
    params = {**dataclasses.asdict(hp), "device": dist.device.type, "world_size": dist.world_size}
    tracker.start(params, variant=hp.search_candidate or None)  # a tuning trial is its candidate
    stop = StopSignal()
    try:  # train.main may run in a process that goes on (tests, profile_train): it leaves SIGTERM as it was
        bench = Trainer(hp, dist, tracker, import_time_s=import_time_s, stop=stop)
        try:
            # PID 1 in a one-process container: SIGTERM is ignored unless handled (stop_signal.py)
            if dist.world_size == 1:
                stop.install()
            result = bench.run()
        except (Exception, StoppedBeforeStartError) as err:  # every failure becomes a failed benchmark.json
            reason = (
                str(err) if isinstance(err, TrainingError | StoppedBeforeStartError) else f"{type(err).__name__}: {err}"
            )
            if isinstance(err, torch.OutOfMemoryError):
                reason = f"CUDA out of memory: {err}"
            print(f"train: error: {reason}", file=sys.stderr, flush=True)
            failed = bench.failed(reason)
            try:
                bench.write(failed)
                if dist.is_main:
                    failure = Path(os.environ.get("SM_OUTPUT_DATA_DIR", "/opt/ml/output/data")).parent / "failure"
                    failure.write_text(reason[:1000])
            except OSError:
                pass
            bench.tracker.finish(failed, bench.output_dir / "benchmark.json")
            if not isinstance(err, TrainingError | StoppedBeforeStartError):
                raise
            return 1
        bench.write(result)
        bench.tracker.finish(result, bench.output_dir / "benchmark.json")
        if dist.world_size > 1:
            leave_together()
        return 0
    finally:
        stop.uninstall()
        torch.set_flush_denormal(False)  # the CPU's default again (trainer.device_arithmetic), for a process going on


if __name__ == "__main__":
    try:
        code = main()
    finally:  # a job that ended before its steps: collection on again (profile_train.py goes on in this process)
        startup_gc.end()
    sys.exit(code)
