"""Python's cyclic garbage collector paused while a training process starts, and what start-up built frozen after.

A training process loads torch, transformers (which loads torch._dynamo) and, for ZeRO, DeepSpeed: with Qwen2's
modeling imported, about 360,000 objects the collector tracks, nearly all of them alive until the process ends. A full
collection walks them all (about 190 ms on a 2-core Xeon). Python runs automatic collections as objects are
allocated (a tiny job's process ran 940, 6 of them full) and collects again while the interpreter shuts down.

``pause`` (train.py as ``__main__``, before its imports) turns automatic collection off; ``resume`` (the benchmark
loop, once the data, model, optimizer and engine are set up) collects once, which frees whatever cycles start-up
left, then ``gc.freeze()`` moves the survivors to the permanent generation and collection is on again for the steps.
Frozen objects are not walked again: not by a full collection during the steps, and not by the shutdown's. ``end``
turns collection on again (no collection, no freeze) when a job ends before ``resume``.

Measured on a 2-core Xeon with the test suite's kernels (2026-11-26), a 20-step tiny job (qwen2-tiny, checkpoints every
5 steps, as tests/training/test_train.py runs it) as a whole process started from Python: 940 automatic collections
(0.55-0.9 s) became 11 and the one at ``resume`` (0.36-0.6 s); the process used about 1.5 CPU-seconds after its last
exit handler without this, 0.2 s with it; and the whole process, its launching script included, took a median 4.3-5.5
CPU-seconds against 5.7-7.4 (three series of 6-8 alternating runs, ratios 0.74-0.76): the gain is mostly the shutdown's.
Peak memory of that job: +2 MiB (385 MiB). A large model's set-up, whose cyclic garbage now waits for ``resume``: a
494M-parameter Qwen2.5-0.5B-shaped job (3 steps, micro-batch 1, 64 tokens, fp32, AdamW) on a 2-core AMD EPYC (Zen 4, the
suite's kernels, 2026-11-26), alternating against the same job started by a process that imports train.py and calls
main() (Python's default collector), peak RSS paused vs default: random init, 4 pairs, a median 9,768 vs 9,858 MiB
(9,145-9,916 vs 9,650-10,186); from_pretrained of a local safetensors copy, 6 pairs, 9,661 vs 9,677 MiB (9,640-10,179 vs
9,140-10,500); under DeepSpeed ZeRO-3 in one process (its engine built at set-up), 3 pairs, 19,958 vs 19,934 MiB
(19,658-20,727 vs 19,927-20,014: one paused run 0.8 GiB over its pair, the other two equal or lower); resuming from a
step-2 checkpoint (model and AdamW state, 4 pairs), 10,491 vs 10,441 MiB (9,913-10,532 vs 10,374-10,507: three pairs
25-91 MiB higher paused, one 528 MiB lower; a trial pair before them, +274 MiB). The medians are within 0.1 GiB in every
case, single runs of one kind vary by up to 1.4 GiB (ZeRO-3: one paused run 0.8 GiB over its pair, while its default
runs varied by 87 MiB): no increase beyond the run-to-run spread; on resume perhaps tens of MiB (under 1 %). A rank of a
multi-rank job leaves with ``os._exit`` (train_distributed.leave_together), which skips the shutdown's collections
either way: test_multiprocess's ZeRO-3 kill-and-resume case, 2 ranks, took 1.04 times its CPU without the pause
(0.94-1.13, four alternating pairs), no gain. How often a full collection would have hit a timed step without the freeze
was not counted (Python skips a full collection until the objects new since the last one are a quarter of the old ones).

Only a job's own process pauses: train.py calls ``pause`` when it runs as ``__main__`` (``python train.py``, torchrun's
ranks, and profile_train.py, which runs it as ``__main__`` in its own process after importing torch). A process that
imports train.py (the tests) keeps its collector as it was, and ``resume`` changes nothing there.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass


@dataclass
class _Pause:
    paused: bool = False  # this module turned automatic collection off, and resume has not turned it on again


_state = _Pause()


def pause() -> None:
    """Pause automatic collection until ``resume`` (a no-op if it is already off: someone else owns it)."""
    if gc.isenabled():
        gc.disable()
        _state.paused = True


def resume() -> None:
    """Collect once, freeze what survives, and collect automatically again; only after this module's ``pause``."""
    if not _state.paused:
        return
    gc.collect()
    gc.freeze()
    gc.enable()
    _state.paused = False


def end() -> None:
    """Automatic collection on again, without a collection or a freeze, if ``pause`` turned it off and ``resume``
    never ran (a job that failed or stopped before its steps, in a process that may go on)."""
    if _state.paused:
        gc.enable()
        _state.paused = False


def is_paused() -> bool:
    return _state.paused
