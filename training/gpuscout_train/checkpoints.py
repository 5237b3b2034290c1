"""Checkpoints for spot interruptions: layout, an upload-aware completion marker, resume fallback and pruning.

Layout under the checkpoint root (``/opt/ml/checkpoints``, or ``GPUSCOUT_CHECKPOINT_DIR``)::

    step-00000010/state.pt          progress and RNG; without DeepSpeed also model, optimizer, scheduler, scaler
    step-00000010/complete          the marker, written last: {"step", "deepspeed", "files": [{path, size, sha256}]}
    deepspeed/step-00000010/...     engine.save_checkpoint's files (every rank writes its ZeRO partition)
    deepspeed/latest                DeepSpeed's own pointer (unused: train.py always names the tag)

SageMaker uploads the root to ``checkpoint_s3_uri`` continuously and file by file, in no guaranteed order, and
after a spot interruption restores whatever reached S3. A marker written last therefore does not prove that the
checkpoint's other files were uploaded; so the marker carries the manifest of every file of its checkpoint (path
relative to the root, size, sha256), and resume checks that manifest against what is on disk. A checkpoint that does
not verify, or whose load raises, is skipped (with the reason logged) for the next older one; training starts fresh
only when none is left. After each new checkpoint is complete, all but the newest ``keep`` complete ones are deleted
(plain folders and DeepSpeed tag folders alike), so one complete checkpoint survives a failed write when keep >= 2.

Only rank 0 writes state.pt and the marker and decides what to prune; every rank hashes its share of the files
(sha256 runs at roughly 1-2 GB/s per rank: a 106 GB checkpoint costs about 10 s on 8 ranks, outside the timed steps)
and waits at the collectives; the first rank of each node deletes the pruned folders on its node's disk (DeepSpeed
partitions stay on the node that wrote them).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from gpuscout.errors import TrainingError

DEFAULT_CHECKPOINT_DIR = "/opt/ml/checkpoints"
MARKER = "complete"
STATE = "state.pt"
DEEPSPEED = "deepspeed"
_STEP = re.compile(r"^step-(\d{8})$")
_CHUNK = 16 * 1024 * 1024


class Ranks(Protocol):
    """What checkpointing needs of the process group (train.Dist)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    def all_gather(self, value: Any) -> list[Any]: ...

    def barrier(self) -> None: ...


class PartlyLoadedError(Exception):
    """A load that failed after it had started to overwrite the model or optimizer (DeepSpeed's load_checkpoint)."""


def checkpoint_root() -> Path:
    return Path(os.environ.get("GPUSCOUT_CHECKPOINT_DIR", DEFAULT_CHECKPOINT_DIR))


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    match = _STEP.match(name)
    return int(match.group(1)) if match else None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def describe(root: Path, relative: list[str]) -> list[dict[str, Any]]:
    """The manifest entries (path, size, sha256) of files given relative to ``root``."""
    return [{"path": rel, "size": (root / rel).stat().st_size, "sha256": sha256_of(root / rel)} for rel in relative]


def deepspeed_files(root: Path, step: int) -> list[str]:
    """The files of the DeepSpeed tag folder of ``step`` this process sees, relative to ``root``, sorted."""
    folder = root / DEEPSPEED / step_name(step)
    if not folder.is_dir():
        return []
    return sorted(str(p.relative_to(root)) for p in folder.rglob("*") if p.is_file())


def complete_steps(root: Path) -> list[int]:
    """Steps whose folder holds a marker, newest first (the marker is verified later, by :func:`verify`)."""
    if not root.is_dir():
        return []
    steps = [step_of(p.name) for p in root.iterdir() if (p / MARKER).is_file()]
    return sorted((s for s in steps if s is not None), reverse=True)


def _fsync_write(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_marker(root: Path, step: int, deepspeed: bool, files: list[dict[str, Any]]) -> Path:
    """Write the marker of ``step`` atomically (a temporary file renamed), after every file it lists."""
    folder = root / step_name(step)
    tmp = folder / f".{MARKER}.tmp"
    body = {"step": step, "deepspeed": deepspeed, "files": sorted(files, key=lambda e: e["path"])}
    _fsync_write(tmp, (json.dumps(body, indent=1) + "\n").encode())
    os.replace(tmp, folder / MARKER)
    return folder / MARKER


def verify(root: Path, step: int, index: int = 0, count: int = 1) -> list[str]:
    """Problems of checkpoint ``step`` against its marker's manifest; this process checks every ``count``-th file
    from ``index`` (the ranks share the hashing). An empty list: the share verifies."""
    try:
        marker = json.loads((root / step_name(step) / MARKER).read_text())
        files = marker["files"]
        if marker["step"] != step or not isinstance(files, list) or not files:
            raise ValueError("no file manifest")
        if not all(
            isinstance(e, dict) and isinstance(e.get("path"), str) and isinstance(e.get("size"), int) for e in files
        ):
            raise ValueError("a manifest entry without path or size")
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"its marker is unreadable or lists no files (written by an older train.py?): {err}"]
    problems = []
    for entry in files[index::count]:
        path = root / entry["path"]
        if not path.is_file():
            problems.append(f"{entry['path']} is missing")
        elif (size := path.stat().st_size) != entry["size"]:
            problems.append(f"{entry['path']} has {size} bytes, the marker says {entry['size']}")
        elif "sha256" in entry and sha256_of(path) != entry["sha256"]:
            problems.append(f"{entry['path']} has another sha256 than the marker's")
    return problems


def _remove(folder: Path) -> None:
    (folder / MARKER).unlink(missing_ok=True)  # first: a half-deleted checkpoint must never look complete
    shutil.rmtree(folder, ignore_errors=True)


def prune(root: Path, keep: set[int]) -> list[Path]:
    """Delete every checkpoint folder (plain and DeepSpeed tag) whose step is not in ``keep``, and leftover
    temporary folders. Steps newer than the kept ones are stale too: a resumed run skipped them."""
    removed = []
    for parent in (root, root / DEEPSPEED):
        if not parent.is_dir():
            continue
        for folder in sorted(parent.iterdir()):
            step = step_of(folder.name)
            stale_tmp = parent == root and folder.name.startswith(".step-") and folder.name.endswith(".tmp")
            if folder.is_dir() and ((step is not None and step not in keep) or stale_tmp):
                _remove(folder)
                removed.append(folder)
    return removed


class Checkpointer:
    """Saves, prunes and resumes the checkpoints of one training process (one of ``ranks``)."""

    def __init__(self, root: Path, ranks: Ranks, keep: int, log: Callable[[str], None]) -> None:
        if keep < 1:
            raise TrainingError("checkpoint_keep must be at least 1")
        self.root, self.ranks, self.keep, self.log = root, ranks, keep, log

    @property
    def _is_main(self) -> bool:
        return self.ranks.rank == 0

    @property
    def _is_node_main(self) -> bool:
        return self.ranks.local_rank == 0

    # ------------------------------------------------------------ save

    def save(self, step: int, state: dict[str, Any], engine: Any = None) -> Path:
        """Write checkpoint ``step``: DeepSpeed's partitions (every rank) and state.pt (rank 0), then the marker with
        the manifest of both (rank 0, last), then prune to the newest ``keep`` complete checkpoints."""
        import torch

        final = self.root / step_name(step)
        if self._is_node_main:  # a checkpoint of this step from an earlier life (it failed to verify or load)
            _remove(final)
            shutil.rmtree(self.root / DEEPSPEED / step_name(step), ignore_errors=True)
        self.ranks.barrier()
        if engine is not None:
            engine.save_checkpoint(str(self.root / DEEPSPEED), tag=step_name(step), client_state=state)
        self.ranks.barrier()
        entries: list[dict[str, Any]] = []
        if self._is_main:
            tmp = self.root / f".{step_name(step)}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            torch.save(state, tmp / STATE)
            with (tmp / STATE).open("rb") as f:
                os.fsync(f.fileno())
            tmp.rename(final)
            entries = describe(self.root, [f"{step_name(step)}/{STATE}"])
        # every node lists the tag folder it sees; its ranks hash a share each
        shared = deepspeed_files(self.root, step)[self.ranks.local_rank :: max(1, self.ranks.local_world_size)]
        entries += describe(self.root, shared)
        gathered = self.ranks.all_gather(entries)
        keep: set[int] | None = None
        listed = 0
        if self._is_main:
            files = {e["path"]: e for part in gathered for e in part}  # a path two nodes both see counts once
            write_marker(self.root, step, engine is not None, list(files.values()))
            listed = len(files)
            keep = {s for s in complete_steps(self.root) if s <= step}
            keep = set(sorted(keep, reverse=True)[: self.keep])
        keep = self.ranks.all_gather(keep)[0]
        if self._is_node_main:
            removed = prune(self.root, keep)
            if removed and self._is_main:
                self.log(f"pruned {', '.join(str(p.relative_to(self.root)) for p in removed)}")
        self.log(f"checkpoint {final} ({listed} files in its marker)")
        return final

    # ------------------------------------------------------------ resume

    def _problems(self, step: int) -> list[str]:
        mine = verify(self.root, step, self.ranks.rank, self.ranks.world_size)
        return sorted({p for part in self.ranks.all_gather(mine) for p in part})

    def resume(self, load: Callable[[Path], dict[str, Any]]) -> dict[str, Any] | None:
        """The state of the newest checkpoint that verifies and loads (``load`` reads it into the model, optimizer
        and engine and returns state.pt's content); None to start fresh. A checkpoint that fails is logged and
        skipped for the next older one."""
        steps: list[int] = self.ranks.all_gather(complete_steps(self.root) if self._is_main else None)[0]
        partly: str | None = None
        for step in steps:
            problems = self._problems(step)
            if problems:
                self.log(f"skipped {step_name(step)}: it does not verify: {'; '.join(problems[:5])}")
                continue
            failure: tuple[str, bool] | None = None
            try:
                state = load(self.root / step_name(step))
            except Exception as err:  # a corrupt file: fall back to the older checkpoint
                failure = (f"{type(err).__name__}: {err}", isinstance(err, PartlyLoadedError))
            failures = [f for f in self.ranks.all_gather(failure) if f]
            if failures:
                self.log(f"skipped {step_name(step)}: loading it failed: {failures[0][0][:500]}")
                if any(touched for _, touched in failures):
                    partly = f"{step_name(step)} ({failures[0][0][:200]})"
                continue
            self.log(f"resumed from {self.root / step_name(step)} (step {step})")
            return state
        if partly is not None:
            raise TrainingError(
                f"no checkpoint under {self.root} loads, and {partly} had already overwritten part of the model or "
                "optimizer: cannot start fresh from that; delete the checkpoints to start over"
            )
        if steps:
            self.log(f"no checkpoint under {self.root} verifies: training starts from step 1")
        return None
