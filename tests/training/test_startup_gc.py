"""The garbage collector during a training job's start-up (gpuscout_train/startup_gc.py): paused while train.py, as a
job's own process, imports torch and sets up; on, with start-up's objects frozen, when the timed steps run; and left
as it was in a process that only imports train.py."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gpuscout_train import startup_gc
from gpuscout_train import trainer as train_loop

from gpuscout.paths import TRAIN_MODULE
from tests.sagemaker_job import IMAGE_PYTHONPATH, job_environment

# train.py run as __main__ (runpy, as `python -m gpuscout_train.train` runs it) with a meta-path finder that notes
# whether automatic collection was on when torch and transformers were first imported, and the collector's state
# when the job is done
_PROBE = """
import gc, json, runpy, sys
seen = {}
class Note:
    def find_spec(self, name, path=None, target=None):
        if name in ("torch", "transformers") and name not in seen:
            seen[name] = gc.isenabled()
        return None
sys.meta_path.insert(0, Note())
sys.argv = [TRAIN]
try:
    runpy.run_module(TRAIN, run_name="__main__", alter_sys=True)
except SystemExit as done:
    seen["exit"] = done.code
seen["after"] = {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}
print(json.dumps(seen))
"""


def test_a_jobs_own_process_loads_its_libraries_with_collection_paused(dataset: Path, tmp_path: Path) -> None:
    hps = {"job_name": "gs-gc", "model_preset": "qwen2-tiny", "per_device_train_batch_size": "4", "max_steps": "4",
           "checkpoint_interval": "0", "validation_batches": "1"}  # fmt: skip
    env = job_environment(tmp_path, dataset, hps, PYTHONPATH=IMAGE_PYTHONPATH)
    probe = _PROBE.replace("TRAIN", repr(TRAIN_MODULE))
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=240,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # torch and transformers were imported with automatic collection off; the job completed (exit 0) and left the
    # collector on, with what its start-up built frozen (a few hundred thousand objects)
    assert (seen["torch"], seen["transformers"], seen["exit"]) == (False, False, 0), (seen, done.stderr[-2000:])
    assert seen["after"]["enabled"] and seen["after"]["frozen"] > 100_000, seen


def test_a_process_that_imports_train_keeps_its_collector() -> None:
    """A process that imports train.py (the tests do) is not a job's process: nothing pauses its collector. In a fresh
    process, as this worker imported train during collection, when the suite's conftest had collection off."""
    done = subprocess.run(
        [sys.executable, "-c",
         "import gc; from gpuscout_train import startup_gc, train; print(gc.isenabled(), startup_gc.is_paused())"],
        env={**os.environ, "PYTHONPATH": IMAGE_PYTHONPATH},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "False"]


def test_a_job_that_ends_before_its_steps_turns_collection_on_again() -> None:
    """train.py as __main__ with an unknown hyperparameter ends (exit 2) before any set-up: its collector is on again
    afterwards, unfrozen (profile_train.py runs train.py so, and goes on in the same process)."""
    probe = (
        "import gc, runpy, sys\n"
        f"sys.argv = [{TRAIN_MODULE!r}, '--no_such_hyperparameter', '1']\n"
        f"try:\n    runpy.run_module({TRAIN_MODULE!r}, run_name='__main__', alter_sys=True)\n"
        "except SystemExit as done:\n    print(done.code, gc.isenabled(), gc.get_freeze_count())\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": IMAGE_PYTHONPATH},
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["2", "True", "0"], done.stderr[-2000:]


@pytest.fixture
def collector_restored() -> Iterator[None]:
    """Whatever a test does to the collector, the worker collects automatically afterwards (nothing more frozen)."""
    yield
    startup_gc.end()
    gc.enable()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_pause_and_resume(collector_restored: None) -> None:
    frozen_before = gc.get_freeze_count()
    startup_gc.pause()
    assert not gc.isenabled() and startup_gc.is_paused()
    dropped = _Cycle()
    gone = weakref.ref(dropped)
    del dropped  # a cycle start-up made and let go: reference counting cannot free it, resume's collection does
    startup_gc.resume()
    assert gc.isenabled() and not startup_gc.is_paused()
    assert gc.get_freeze_count() > frozen_before
    assert gone() is None
    startup_gc.resume()  # a second resume, or one without a pause, changes nothing
    assert gc.isenabled()


def test_a_collector_someone_else_turned_off_stays_off(collector_restored: None) -> None:
    gc.disable()
    startup_gc.pause()
    assert not startup_gc.is_paused()
    startup_gc.resume()
    assert not gc.isenabled()  # not ours to turn on


def test_the_timed_steps_run_with_collection_on_and_start_up_frozen(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, collector_restored: None
) -> None:
    from tests.training.test_checkpoints import _train

    at_the_steps: dict[str, Any] = {}
    steps = train_loop.Trainer._train

    def noted(self: train_loop.Trainer, *args: Any, **kwargs: Any) -> Any:
        at_the_steps.update(enabled=gc.isenabled(), paused=startup_gc.is_paused(), frozen=gc.get_freeze_count())
        return steps(self, *args, **kwargs)

    monkeypatch.setattr(train_loop.Trainer, "_train", noted)
    # Given a job whose process paused collection as train.py's __main__ does
    startup_gc.pause()
    frozen_before = gc.get_freeze_count()
    # When it trains
    result = _train(dataset, tmp_path, max_steps="4", checkpoint_interval="0")
    # Then the steps ran with automatic collection on again, and the start-up's objects frozen before them
    assert result.status == "completed"
    assert at_the_steps["enabled"] and not at_the_steps["paused"]
    assert at_the_steps["frozen"] > frozen_before
