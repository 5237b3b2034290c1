"""SIGTERM for a single-process job: stop at the next step boundary, keep what was measured, exit within seconds.

SageMaker stops a training job (StopTrainingJob from the budget guard or early stopping, a spot interruption,
MaxRuntime) with SIGTERM to the container's PID 1 and SIGKILL 120 s later. A single-process built-in job runs
train.py as PID 1 (launcher.py execs it), and the kernel ignores a signal whose action is the default for a
namespace's init process: without a handler train.py never noticed, and every stop waited the 120 s, billed.

``StopSignal.install`` (rank 0 of a one-process job only: under torchrun the agent stops its workers) sets the handler.
Inside the step loop it only records the signal; the loop ends after the current step, writes a checkpoint when the job
checkpoints, skips the final validation and writes benchmark.json with ``stop.reason`` "stopped on SIGTERM after step
N" (a measurement with too few timed steps is refused by the analysis as usual). Before the loop (data, model,
compile) the handler raises ``StoppedBeforeStartError``, which train.py writes as a failed benchmark.json and exits 1.

Imported by train.py and trainer; may import gpuscout.domain (the stop reason's wording, which the local runner
reads back)."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from gpuscout.domain.benchmark import signal_stop_reason


class StoppedBeforeStartError(BaseException):
    """A stop signal arrived before the first step: the job ends without a measurement. A BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` on the way (a checkpoint load that falls back to an older
    checkpoint) mistakes it for a failure of its own; train.py catches it by name."""


class StopSignal:
    def __init__(self) -> None:
        self.received: str | None = None  # the signal's name once one arrived
        self.in_loop = False  # True while the step loop runs: the signal is only recorded
        self._previous: Any = None  # SIGTERM's handler before install(), restored by uninstall()
        self._installed = False

    def install(self) -> bool:
        """Handle SIGTERM from now on; False where a handler cannot be set (not the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True
        return True

    def uninstall(self) -> None:
        """SIGTERM's handler as it was before install() (nothing if install() did not set one)."""
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        first = self.received is None
        self.received = name
        print(f"[train] {name} received: stopping at the next step boundary", flush=True)
        if not self.in_loop and first:
            raise StoppedBeforeStartError(signal_stop_reason(name, "before the first step: nothing was measured"))

    def reason(self, step: int) -> str:
        return signal_stop_reason(str(self.received), f"after step {step}")
