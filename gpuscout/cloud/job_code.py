"""The user's code folder (a manifest's job section) on its way to a cloud job.

`gpuscout submit` uploads ``job.source_dir`` to ``s3://<data bucket>/raw/code/<manifest name>-<digest>/`` (the
digest is over every file's path and bytes, so changed code is a new folder and a running job's code never changes
under it), then submits a copy of the manifest whose ``job.source_dir`` is that S3 folder. The training job gets the
folder as its ``code`` input channel (gpuscout.cloud.sagemaker_requests); the image's launcher runs the entry point
from there (training/gpuscout_train/launcher.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from gpuscout.domain.manifest_loader import parse_document
from gpuscout.domain.names import CODE_PREFIX, RAW_PREFIX
from gpuscout.errors import ManifestError, Problem

# Never uploaded: caches, version control, virtual environments (they would make the digest change for nothing).
IGNORED_DIRS = frozenset({"__pycache__", ".git", ".hg", ".venv", "venv", ".mypy_cache", ".pytest_cache", ".ruff_cache"})
IGNORED_SUFFIXES = (".pyc", ".pyo")
MAX_FILES = 1000
MAX_BYTES = 200 * 1024 * 1024  # a code folder, not a data set: data belongs under raw/ as its own channel


@dataclass(frozen=True)
class CodeFile:
    relative: str  # POSIX path inside the folder
    data: bytes  # read once: the digest and the upload are of the same bytes


def code_files(folder: Path) -> list[CodeFile]:
    """Every file to upload, in a stable order; ValueError (with what to do) for a folder too large to be code, a
    linked folder (not followed: copy it in) or a linked file that points outside the folder."""
    files: list[CodeFile] = []
    total = 0
    root_dir = folder.resolve()
    for root, dirs, names in os.walk(folder):
        for name in dirs:
            if (Path(root) / name).is_symlink() and name not in IGNORED_DIRS:
                raise ValueError(f"{Path(root) / name} is a link to a folder; copy the folder into source_dir")
        dirs[:] = sorted(d for d in dirs if d not in IGNORED_DIRS and not (Path(root) / d).is_symlink())
        for name in sorted(names):
            path = Path(root) / name
            if name.endswith(IGNORED_SUFFIXES) or not path.is_file():
                continue
            if path.is_symlink() and not path.resolve().is_relative_to(root_dir):
                raise ValueError(f"{path} links to {path.resolve()}, outside source_dir; copy the file in")
            data = path.read_bytes()
            files.append(CodeFile(path.relative_to(folder).as_posix(), data))
            total += len(data)
            if len(files) > MAX_FILES or total > MAX_BYTES:
                raise ValueError(
                    f"{folder} has more than {MAX_FILES} files or {MAX_BYTES // 2**20} MiB; a code folder is uploaded "
                    "with every job: keep data and checkpoints out of it (upload data under raw/ and read it there)"
                )
    return files


def code_digest(files: list[CodeFile]) -> str:
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.relative.encode() + b"\0" + hashlib.sha256(f.data).digest())
    return digest.hexdigest()


def code_prefix(manifest_name: str, digest: str) -> str:
    """``raw/code/<manifest name>-<16 hex digits>/``: under raw/, the only prefix the SageMaker role reads."""
    return f"{RAW_PREFIX}{CODE_PREFIX}{manifest_name}-{digest[:16]}/"


def with_source_dir(body: bytes, *, json_format: bool, source_dir: str, source: str) -> bytes:
    """The manifest with ``job.source_dir`` replaced, parsed by the manifest's own parser (so a value reads the
    same as in the file) and written as JSON or YAML. The bytes depend only on the manifest and the code (the run
    id is made from them): comments are not kept, and the header says so."""
    data = parse_document(body, source)
    job = data.get("job") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(job, dict):  # submit validated it first: a job section is there
        raise ManifestError(source, [Problem("job", "a job section names the code folder to upload")])
    job["source_dir"] = source_dir
    if json_format:
        return (json.dumps(data, indent=2) + "\n").encode()
    header = (
        "# Uploaded by `gpuscout submit`: job.source_dir is the uploaded copy of the code folder.\n"
        "# (Written from the parsed manifest: the original's comments are not kept.)\n"
    )
    return (header + yaml.safe_dump(data, sort_keys=False, allow_unicode=True)).encode()


def folder_problem(folder: Path, err: Exception) -> Problem:
    return Problem("job.source_dir", f"{folder}: {err}")
