"""Test-only reader of a W&B offline run file (``<dir>/wandb/offline-run-*/run-<id>.wandb``).

wandb 0.31 ships no Python reader for it. The format is leveldb-log style: a 7-byte file header (``b":W&B"``, the
magic 0xBEE1 little-endian, a version byte), then 32 KiB blocks of records, each with a 7-byte header ``<IHB``
(CRC-32 of the type byte and the payload, payload length, type: 1 full, 2 first, 3 middle, 4 last); a block tail
shorter than 7 bytes, or a zero length and type, is padding to the block's end. A (re-assembled) payload is a
``wandb.proto.wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32 * 1024
RECORD_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def run_files(wandb_parent: Path) -> list[Path]:
    """The ``run-*.wandb`` files of the offline runs under ``wandb_parent``/wandb/, oldest first."""
    return sorted((wandb_parent / "wandb").glob("offline-run-*/run-*.wandb"))


def read_records(path: Path) -> list[Any]:
    """Every record of a ``.wandb`` file, in order (CRCs checked)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[: len(HEADER)] == HEADER, f"{path}: not a W&B run file (header {data[:7]!r})"
    payloads: list[bytes] = []
    pending = b""
    pos = len(HEADER)
    while pos < len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < RECORD_HEADER:
            pos += left_in_block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos : pos + RECORD_HEADER])
        if length == 0 and kind == 0:
            pos += left_in_block
            continue
        payload = data[pos + RECORD_HEADER : pos + RECORD_HEADER + length]
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == checksum, f"{path}: CRC at {pos}"
        pos += RECORD_HEADER + length
        if kind == FULL:
            payloads.append(payload)
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            payloads.append(pending + payload)
    records = []
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def of_type(records: list[Any], kind: str) -> list[Any]:
    return [getattr(r, kind) for r in records if r.WhichOneof("record_type") == kind]


def _key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else str(item.key)


def history(records: list[Any]) -> list[dict[str, Any]]:
    """One dict per logged step: the values of run.log (with W&B's own _step, _runtime, _timestamp)."""
    return [{_key(item): json.loads(item.value_json) for item in h.item} for h in of_type(records, "history")]


def config(records: list[Any]) -> dict[str, Any]:
    """The run's config (run.config / wandb.init(config=...)), W&B's own _wandb key left out."""
    out: dict[str, Any] = {}
    for run in of_type(records, "run"):
        out |= {_key(item): json.loads(item.value_json) for item in run.config.update}
    for update in of_type(records, "config"):
        out |= {_key(item): json.loads(item.value_json) for item in update.update}
    out.pop("_wandb", None)
    return out


def summary(records: list[Any]) -> dict[str, Any]:
    """The run's final summary: every summary update applied in order."""
    out: dict[str, Any] = {}
    for update in of_type(records, "summary"):
        for item in update.update:
            out[_key(item)] = json.loads(item.value_json)
        for item in update.remove:
            out.pop(_key(item), None)
    return out


def run_info(records: list[Any]) -> Any:
    """The run record (project, group, job_type, display_name, tags, ...)."""
    (run,) = of_type(records, "run")[:1]
    return run


def artifact_files(records: list[Any]) -> dict[str, list[str]]:
    """Logged Artifacts: name -> the paths in its manifest."""
    return {a.name: [c.path for c in a.manifest.contents] for a in of_type(records, "artifact")}


def saved_files(records: list[Any]) -> set[str]:
    """Paths the run saved into its folder for upload (run.save, W&B's own files)."""
    return {f.path for files in of_type(records, "files") for f in files.files}
