"""A canary's model, read in part: only the tensors its first few decoder layers, the embeddings, the final norm and
the head need, taken by byte range from an S3 or Hugging Face Hub checkpoint instead of downloading all of it.

The cloud canary keeps CLOUD_CANARY_LAYERS decoder layers (gpuscout.plan.canary). Downloading a whole checkpoint to
keep two layers costs minutes and disk: Qwen2.5-7B is ~15 GB in four shards, of which the canary needs ~3 GB (the
untied embedding and head, two layers, the norm). The safetensors format allows reading a part: each file starts with
an 8-byte little-endian header length, then a JSON header naming every tensor's dtype, shape and byte offsets
(https://huggingface.co/docs/safetensors/index#format); a sharded checkpoint's ``model.safetensors.index.json`` names
the file of every tensor. So the canary reads the index, the headers of the files that hold what it keeps, and those
tensors' byte ranges (adjacent ones in one request), and writes them into one local ``model.safetensors`` beside a
``config.json`` that says how many layers it has. Files holding only later layers are never opened.

A checkpoint without safetensors weights (``pytorch_model.bin``: a pickle, whose parts cannot be found without
reading it whole) cannot be read in part: ``CannotReadInPartError`` says why, and train.py then loads the
whole checkpoint as a full job does.

Imported by model; may import gpuscout.errors.
"""

from __future__ import annotations

import json
import re
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gpuscout.errors import TrainingError

CONFIG = "config.json"
OPTIONAL_FILES = ("generation_config.json",)
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
BIN_CHECKPOINTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
CHUNK_BYTES = 64 * 1024 * 1024  # one range request reads at most this much (memory stays bounded)
RETRIES = 4  # attempts per hub request (huggingface_hub's own downloads retry too); S3: botocore's retries
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class CannotReadInPartError(Exception):
    """This checkpoint cannot be read in part; the message says why."""


class RangeSource(Protocol):
    """Where a checkpoint's files are: read a byte range [start, end) of one file, or all of it."""

    description: str

    def read(self, name: str, start: int | None = None, end: int | None = None) -> bytes | None:
        """The bytes of ``name`` (all of it when start is None), or None when the file does not exist."""
        ...


def keeps(tensor: str, layers: int) -> bool:
    """Whether a cut to the first ``layers`` decoder layers keeps ``tensor``: everything but later layers' tensors
    (``model.layers.<i>.`` with i >= layers)."""
    match = _LAYER.search(tensor)
    return match is None or int(match.group(1)) < layers


@dataclass(frozen=True)
class PartialFetch:
    directory: Path  # config.json (+ generation_config.json) and model.safetensors: from_pretrained loads it
    layers: int  # decoder layers kept
    of_layers: int  # decoder layers in the checkpoint
    tensors: int  # tensors kept
    bytes_read: int  # weight bytes read (headers and tensors)
    checkpoint_bytes: int | None  # the whole checkpoint's weight bytes, where the index or header says
    files_opened: int  # weight files whose header was read
    files_total: int  # weight files in the checkpoint

    def summary(self, source: str) -> str:
        whole = f" of {self.checkpoint_bytes / 1e9:.2f} GB" if self.checkpoint_bytes else ""
        return (
            f"read {self.bytes_read / 1e9:.2f} GB{whole} from {source} ({self.files_opened} of {self.files_total} "
            f"weight files; {self.tensors} tensors: {self.layers} of {self.of_layers} decoder layers, embeddings, "
            "norm, head)"
        )


@dataclass(frozen=True)
class _Tensor:
    name: str
    file: str
    dtype: str
    shape: list[int]
    start: int  # absolute offset in its file
    end: int


def _header(source: RangeSource, file: str) -> tuple[int, dict[str, Any]]:
    """The data section's offset in ``file`` and its JSON header."""
    head = source.read(file, 0, 8)
    if head is None:
        raise TrainingError(f"{source.description}: {file} is named by the index but does not exist")
    if len(head) != 8:
        raise TrainingError(f"{source.description}: {file} is not a safetensors file (shorter than 8 bytes)")
    (length,) = struct.unpack("<Q", head)
    if length > 100 * 1024 * 1024:
        raise TrainingError(f"{source.description}: {file} is not a safetensors file (a {length}-byte header)")
    raw = source.read(file, 8, 8 + length)
    try:
        header = json.loads(raw or b"")
    except ValueError as err:
        raise TrainingError(f"{source.description}: {file}'s safetensors header is not JSON: {err}") from err
    return 8 + length, header


def _spans(tensors: list[_Tensor]) -> Iterator[tuple[int, int]]:
    """Byte ranges covering ``tensors`` (sorted by offset), adjacent ones merged, each cut to CHUNK_BYTES."""
    merged: list[list[int]] = []
    for t in tensors:
        if merged and merged[-1][1] == t.start:
            merged[-1][1] = t.end
        else:
            merged.append([t.start, t.end])
    for start, end in merged:
        for at in range(start, end, CHUNK_BYTES):
            yield at, min(end, at + CHUNK_BYTES)


def _write_safetensors(path: Path, tensors: list[_Tensor], metadata: dict[str, str], source: RangeSource) -> int:
    """One safetensors file of ``tensors`` (in the given order), their bytes read from ``source``; the bytes read."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        size = t.end - t.start
        header[t.name] = {"dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    read = 0
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(encoded)) + encoded)
        by_file: dict[str, list[_Tensor]] = {}
        for t in tensors:
            by_file.setdefault(t.file, []).append(t)
        for file, group in by_file.items():
            for start, end in _spans(group):
                chunk = source.read(file, start, end)
                if chunk is None or len(chunk) != end - start:
                    got = "nothing" if chunk is None else f"{len(chunk)} bytes"
                    raise TrainingError(f"{source.description}: {file} bytes {start}-{end}: got {got}")
                out.write(chunk)
                read += len(chunk)
    return read


def _config(source: RangeSource, layers: int) -> tuple[dict[str, Any], int]:
    raw = source.read(CONFIG)
    if raw is None:
        raise CannotReadInPartError(f"{source.description} has no {CONFIG}")
    config = json.loads(raw)
    total = int(config.get("num_hidden_layers", 0))
    if total <= 0:
        raise CannotReadInPartError(f"{source.description}/{CONFIG} has no num_hidden_layers")
    kept = min(layers, total)
    config["num_hidden_layers"] = kept
    if isinstance(config.get("layer_types"), list):  # one entry per layer (transformers checks the length)
        config["layer_types"] = config["layer_types"][:kept]
    return config, total


def _weight_files(source: RangeSource) -> tuple[list[str], dict[str, str] | None, int | None]:
    """Every weight file, the index's tensor -> file map (None for one unsharded file) and the index's total size."""
    index = source.read(INDEX)
    if index is not None:
        parsed = json.loads(index)
        weight_map: dict[str, str] = parsed["weight_map"]
        total = parsed.get("metadata", {}).get("total_size")
        return sorted(set(weight_map.values())), weight_map, int(total) if total else None
    if source.read(SINGLE, 0, 8) is not None:
        return [SINGLE], None, None
    found = [name for name in BIN_CHECKPOINTS if source.read(name, 0, 1) is not None]
    if found:
        raise CannotReadInPartError(
            f"{source.description} has {found[0]}, not safetensors: a PyTorch .bin checkpoint is a pickle, whose "
            "tensors cannot be located without reading all of it"
        )
    raise CannotReadInPartError(f"{source.description} has neither {INDEX} nor {SINGLE}")


def fetch_first_layers(source: RangeSource, layers: int, target: Path) -> PartialFetch:
    """Write into ``target`` a checkpoint of ``source``'s model cut to its first ``layers`` decoder layers, reading
    only the bytes those tensors occupy (module docstring). Raises CannotReadInPartError when the format does
    not allow it, TrainingError when the checkpoint is broken or unreadable."""
    if layers <= 0:
        raise ValueError("layers must be positive")
    config, of_layers = _config(source, layers)
    files, weight_map, total_bytes = _weight_files(source)
    wanted = files if weight_map is None else sorted({f for n, f in weight_map.items() if keeps(n, layers)})
    tensors: list[_Tensor] = []
    metadata: dict[str, str] = {"format": "pt"}
    header_bytes = 0
    for file in wanted:
        data_at, header = _header(source, file)
        header_bytes += data_at
        metadata = {**header.get("__metadata__", {}), **metadata} if file == wanted[0] else metadata
        entries = [
            _Tensor(name, file, info["dtype"], list(info["shape"]), data_at + info["data_offsets"][0],
                    data_at + info["data_offsets"][1])
            for name, info in header.items()
            if name != "__metadata__" and keeps(name, layers)
        ]  # fmt: skip
        tensors += sorted(entries, key=lambda t: t.start)
        if weight_map is None and total_bytes is None:
            ends = [info["data_offsets"][1] for name, info in header.items() if name != "__metadata__"]
            total_bytes = data_at + max(ends, default=0)
    if not tensors:
        raise TrainingError(f"{source.description}: no tensor kept for {layers} layer(s)")
    names = weight_map.keys() if weight_map is not None else [t.name for t in tensors]
    if not any(_LAYER.search(name) for name in names):
        raise CannotReadInPartError(
            f"{source.description}: no tensor is named like '<prefix>.layers.<i>.', so its decoder layers cannot be "
            "told apart"
        )
    target.mkdir(parents=True, exist_ok=True)
    read = _write_safetensors(target / SINGLE, tensors, metadata, source)
    (target / CONFIG).write_text(json.dumps(config, indent=2))
    for name in OPTIONAL_FILES:
        raw = source.read(name)
        if raw is not None:
            (target / name).write_bytes(raw)
    return PartialFetch(
        directory=target, layers=config["num_hidden_layers"], of_layers=of_layers, tensors=len(tensors),
        bytes_read=read + header_bytes, checkpoint_bytes=total_bytes, files_opened=len(wanted),
        files_total=len(files),
    )  # fmt: skip


class S3Source:
    """A checkpoint under an S3 prefix (the manifest's model.path), read with the job's role (GetObject; the role's
    ListBucket on the prefix makes a missing file a 404, not a 403)."""

    def __init__(self, uri: str, client: Any = None) -> None:
        import boto3

        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        self.bucket, self.prefix = bucket, prefix.rstrip("/")
        self.description = f"s3://{bucket}/{self.prefix}"
        self._s3 = client or boto3.client("s3")

    def read(self, name: str, start: int | None = None, end: int | None = None) -> bytes | None:
        from botocore.exceptions import BotoCoreError, ClientError

        key = f"{self.prefix}/{name}" if self.prefix else name
        try:
            if start is None:
                response = self._s3.get_object(Bucket=self.bucket, Key=key)
            else:
                response = self._s3.get_object(
                    Bucket=self.bucket, Key=key, Range=f"bytes={start}-{(end or start + 1) - 1}"
                )
            return bytes(response["Body"].read())
        except ClientError as err:
            code = err.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404", "NotFound"):
                return None
            if code == "InvalidRange":  # a range past the end of a shorter file
                return b""
            raise TrainingError(f"cannot read s3://{self.bucket}/{key}: {err}") from err
        except BotoCoreError as err:
            raise TrainingError(f"cannot read s3://{self.bucket}/{key}: {err}") from err


class HubSource:
    """A Hugging Face Hub model repository, read over HTTP range requests as huggingface_hub reads safetensors
    headers itself (HfApi.parse_safetensors_file_metadata): the same URLs, session, token (HF_TOKEN) and offline
    switch (HF_HUB_OFFLINE)."""

    def __init__(self, repo_id: str, *, revision: str | None = None, endpoint: str | None = None) -> None:
        self.repo_id, self.revision, self.endpoint = repo_id, revision, endpoint
        self.description = f"hf://{repo_id}" + (f"@{revision}" if revision else "")

    def read(self, name: str, start: int | None = None, end: int | None = None) -> bytes | None:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        url = hf_hub_url(self.repo_id, name, revision=self.revision, endpoint=self.endpoint)
        headers = build_hf_headers()
        headers["accept-encoding"] = "identity"  # a CDN ignores Range for a compressed answer (file_download.py)
        if start is not None:
            headers["range"] = f"bytes={start}-{(end or start + 1) - 1}"
        for attempt in range(1, RETRIES + 1):
            try:
                # streamed: the status is checked before a body is read (a server ignoring Range sends a whole shard)
                with get_session().stream("GET", url, headers=headers, timeout=60) as response:
                    if response.status_code == 404:
                        return None
                    if response.status_code == 416:  # a range past the end of a shorter file
                        return b""
                    if response.status_code in RETRY_STATUSES and attempt < RETRIES:
                        time.sleep(2**attempt)
                        continue
                    hf_raise_for_status(response)
                    if start is not None and response.status_code != 206:
                        raise CannotReadInPartError(
                            f"{url} answered a byte-range request with HTTP {response.status_code}, not 206 "
                            "(partial content)"
                        )
                    return bytes(response.read())
            except CannotReadInPartError:
                raise
            except Exception as err:  # httpx and huggingface_hub errors alike: retry, then name the file and why
                if attempt == RETRIES or "offline mode" in str(err).lower():
                    raise TrainingError(f"cannot read {name} of {self.description}: {err}") from err
                time.sleep(2**attempt)
        raise AssertionError("unreachable")
