"""Process control for ``gpuscout local``: signals, child processes and liveness.

- SIGTERM and SIGHUP (an ssh drop) behave like Ctrl-C while a run goes on: they raise KeyboardInterrupt in the main
  thread, so the same clean-up runs (``SignalGuard``).
- The final bookkeeping (status, analysis of finished jobs, report) runs after ``SignalGuard.defer()``: a second
  Ctrl-C, SIGTERM or SIGHUP is recorded, not raised, so it cannot leave a run ANALYZING with half a report; the
  guard says so at once (``on_deferred``), and one more Ctrl-C after that quits on purpose (``QuitNow``).
- Children (train.py, gpuscout_data/prepare.py) start in their own process group and get SIGTERM when the parent dies
  (Linux ``PR_SET_PDEATHSIG``), so a SIGKILLed ``gpuscout local`` never leaves a training process holding a GPU;
  ``stop_process_group`` stops the child with everything it started (dataloader workers, torchrun ranks).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

INTERRUPT_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s)
_PR_SET_PDEATHSIG = 1


def signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class Interrupted(KeyboardInterrupt):
    """KeyboardInterrupt raised for a signal; ``signal_name`` says which (Ctrl-C, SIGTERM, SIGHUP)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signal_name = signal_name(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class QuitNow(Interrupted):
    """A Ctrl-C pressed again after the guard said the run's final bookkeeping goes on first: the user wants out now."""


class SignalGuard:
    """For a whole run: SIGINT, SIGTERM and SIGHUP raise ``Interrupted`` until ``defer()``; after it they are only
    recorded in ``received``. Switching mode instead of swapping handlers leaves no moment with Python's default
    handler in between, so the final bookkeeping cannot be cut short by a second signal.

    A deferred Ctrl-C or SIGTERM is not silent: ``on_deferred(name)`` is called (the runner says what it is finishing
    and how to quit). One more Ctrl-C after that raises ``QuitNow``, once: a person at the terminal who presses it
    twice means it. SIGTERM and SIGHUP never force (a scheduler's SIGKILL follows anyway; after an ssh drop there is
    no terminal to tell)."""

    def __init__(self, on_deferred: Callable[[str], None] | None = None) -> None:
        self.deferring = False
        self.received: list[str] = []
        self._previous: dict[int, Any] = {}
        self._on_deferred = on_deferred
        self._told = False
        self._quit = False

    def defer(self) -> None:
        self.deferring = True

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.received.append(signal_name(signum))
        if not self.deferring:
            raise Interrupted(signum)
        if signum == signal.SIGINT and self._told and not self._quit:
            self._quit = True
            raise QuitNow(signum)
        if signum != getattr(signal, "SIGHUP", None) and not self._told and self._on_deferred is not None:
            self._told = True
            with contextlib.suppress(Exception):  # a terminal that cannot be written must not break the bookkeeping
                self._on_deferred(signal_name(signum))

    def __enter__(self) -> SignalGuard:
        if _in_main_thread():
            self._previous = {s: signal.getsignal(s) for s in INTERRUPT_SIGNALS}
            for s in INTERRUPT_SIGNALS:
                signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, old in self._previous.items():
            signal.signal(s, old)


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up in the parent: between fork and exec the child may only call it (a lookup there runs
    ``ldconfig``, unsafe in a child of a process with threads)."""
    libc_name = ctypes.util.find_library("c")
    return ctypes.CDLL(libc_name, use_errno=True).prctl if libc_name else None


def _die_with_parent(prctl: Callable[..., int], death_signal: int) -> Callable[[], None]:
    def in_child() -> None:  # pragma: no cover - runs in the child between fork and exec
        prctl(_PR_SET_PDEATHSIG, death_signal, 0, 0, 0)
        if os.getppid() == 1:  # the parent died before prctl took effect
            os.kill(os.getpid(), death_signal)

    return in_child


def child_popen_kwargs(death_signal: int = signal.SIGTERM) -> dict[str, Any]:
    """Popen arguments for a child of ``gpuscout local``: its own process group (signals from the terminal reach
    the runner, which stops the child on purpose) and, on Linux, ``death_signal`` when the parent dies (SIGTERM: a
    training job stops after its step; a benchmark row that must not hold the GPU a moment longer, SIGKILL)."""
    kwargs: dict[str, Any] = {"start_new_session": True}
    prctl = _prctl() if sys.platform.startswith("linux") else None
    if prctl is not None:
        kwargs["preexec_fn"] = _die_with_parent(prctl, death_signal)
    return kwargs


def stop_process_group(proc: subprocess.Popen[Any], grace_s: float) -> None:
    """SIGTERM the child's whole process group, SIGKILL it after ``grace_s``; waits for the child."""
    if proc.poll() is not None:
        _kill_group(proc.pid, signal.SIGKILL)  # the child is gone; anything it left behind goes too
        return
    _kill_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid, signal.SIGKILL)
        proc.wait()
    _kill_group(proc.pid, signal.SIGKILL)


def _kill_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def this_host() -> str:
    return socket.gethostname()


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
