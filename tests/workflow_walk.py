"""The walk of a driver through the workflow (gpuscout.workflow): which step modules it enters, in order."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

WORKFLOW = "gpuscout.workflow"


@contextmanager
def walked(into: list[str]) -> Iterator[list[str]]:
    """Record into ``into``, in this thread, each time a driver enters a step: a call of a public function of
    ``gpuscout.workflow.<step>`` from code outside gpuscout.workflow (a step's own calls into another step are part
    of it). Consecutive calls into the same step are one entry; ``ports`` holds types, not a step."""

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call" or frame.f_code.co_name.startswith("_"):
            return
        module = str(frame.f_globals.get("__name__", ""))
        if not module.startswith(f"{WORKFLOW}.") or module == f"{WORKFLOW}.ports":
            return
        caller = frame.f_back
        if caller is None or str(caller.f_globals.get("__name__", "")).startswith(WORKFLOW):
            return
        step = module.removeprefix(f"{WORKFLOW}.")
        if not into or into[-1] != step:
            into.append(step)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield into
    finally:
        sys.setprofile(previous)
