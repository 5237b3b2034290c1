"""The prepared-data cache of local runs: ``gpuscout_data/prepare.py`` run once per (source, tokenizer, sequence
length) into ``runs/.cache/data/<key>``, verified against its own file list, staging folders of interrupted runs
removed. The prepared data is checked by the workflow's step (gpuscout.workflow.prepare_data).

May import: gpuscout.domain and gpuscout.local.job_process / process_control."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from gpuscout import paths
from gpuscout.errors import DataPreparationError, DiskFullError, says_disk_full
from gpuscout.local.job_process import (
    STDERR_TAIL_LINES,
    TERMINATE_GRACE_S,
    child_env,
    int_or_none,
    tail_lines,
)
from gpuscout.local.process_control import (
    child_popen_kwargs,
    process_alive,
    stop_process_group,
)

if TYPE_CHECKING:
    from gpuscout.domain.manifest import Manifest
    from gpuscout.domain.manifest_training import DatasetSpec

SMALL_CORPUS_DOCUMENTS = 2000


def preparation_code_sha256() -> str:
    """One hash over the data preparation package's modules (gpuscout_data), found the way its job imports it: a
    change to any of them prepares the data again."""
    spec = importlib.util.find_spec(paths.DATA_PREPARATION_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise DataPreparationError(
            f"the data preparation package {paths.DATA_PREPARATION_MODULE} is not importable here: install gpuscout "
            "(make install) or put the checkout's source roots on PYTHONPATH"
        )
    digest = hashlib.sha256()
    for folder in spec.submodule_search_locations:
        for module in sorted(Path(folder).glob("*.py")):
            digest.update(module.name.encode() + b"\0" + module.read_bytes())
    return digest.hexdigest()


def _dataset(manifest: Manifest) -> DatasetSpec:
    """The manifest's dataset section; a manifest with a job section instead reads its own data, so nothing here
    prepares data for it (the runner never asks)."""
    if manifest.dataset is None:
        raise DataPreparationError(f"manifest {manifest.name!r} has no dataset section: there is no data to prepare")
    return manifest.dataset


def data_cache_key(manifest: Manifest) -> str:
    """Hash of everything that determines the prepared data: source, tokenizer, sequence length, caps, script."""
    dataset, tokenizer = _dataset(manifest), manifest.tokenizer
    source = dataset.source
    if dataset.kind == "local":
        source = str(Path(source).expanduser().resolve())
    key = {
        "source": source,
        "format": dataset.format,
        "text_field": dataset.text_field,
        "max_documents": dataset.max_documents,
        "min_characters": dataset.min_characters,
        "validation_fraction": dataset.validation_fraction,
        "tokenizer": tokenizer.kind,
        "tokenizer_path": tokenizer.path,
        "vocab_size": tokenizer.resolved_vocab_size,
        "sequence_length": manifest.sequence_length,
        "code_sha256": preparation_code_sha256(),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def data_preparation_command(manifest: Manifest, output: Path, *, workers: int) -> list[str]:
    dataset, tokenizer = _dataset(manifest), manifest.tokenizer
    command = [
        sys.executable,
        "-m",
        paths.DATA_PREPARATION_MODULE,
        "--input",
        dataset.source,
        "--output",
        str(output),
        "--tokenizer",
        tokenizer.kind,
        "--sequence-length",
        str(manifest.sequence_length),
        "--validation-fraction",
        str(dataset.validation_fraction),
        "--min-characters",
        str(dataset.min_characters),
        "--text-field",
        dataset.text_field,
        "--format",
        dataset.format,
        "--workers",
        str(workers),
        "--seed",
        str(manifest.training.seed),
    ]
    if tokenizer.resolved_vocab_size is not None:
        command += ["--vocab-size", str(tokenizer.resolved_vocab_size)]
    if tokenizer.path is not None:
        command += ["--tokenizer-path", tokenizer.path]
    if dataset.max_documents is not None:
        command += ["--max-documents", str(dataset.max_documents)]
    return command


def prep_workers(max_documents: int | None) -> int:
    """Tokenizer processes for data preparation: one for small capped corpora (starting a process pool costs more
    than it saves on a few hundred documents), else up to four."""
    if max_documents is not None and max_documents <= SMALL_CORPUS_DOCUMENTS:
        return 1
    return max(1, min(4, os.cpu_count() or 1))


def verify_prepared(folder: Path) -> str | None:
    """Why a prepared dataset cannot be reused (a shard missing or changed: its sha256 over the shards, in the
    order gpuscout_data/prepare.py hashed them, differs from dataset.json's), or None when it is intact."""
    try:
        summary = json.loads((folder / "dataset.json").read_text(encoding="utf-8"))
        digest = hashlib.sha256()
        for split in ("train", "validation"):
            for shard in summary["splits"][split]["shards"]:
                for kind in ("input_ids", "segment_ids"):
                    with open(folder / shard[kind], "rb") as handle:
                        while chunk := handle.read(1 << 20):
                            digest.update(chunk)
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    if digest.hexdigest() != summary.get("sha256"):
        return "sha256 of the shards differs from dataset.json"
    return None


def remove_stale_staging(cache_dir: Path) -> list[Path]:
    """Remove staging folders (``.<key>.<pid>.tmp``) whose preparing process no longer exists."""
    removed = []
    for staging in cache_dir.glob(".*.*.tmp"):
        pid = int_or_none(staging.name.rsplit(".", 2)[-2])
        if staging.is_dir() and pid is not None and not process_alive(pid):
            shutil.rmtree(staging, ignore_errors=True)
            removed.append(staging)
    return removed


def _preparation_error(log_path: Path, returncode: int) -> str:
    """The one line that says why data preparation failed: its own error line, else the log's last line."""
    lines = [line.strip() for line in tail_lines(log_path, STDERR_TAIL_LINES).splitlines() if line.strip()]
    for line in reversed(lines):
        if "data_preparation: error:" in line:
            return line.split("data_preparation: error:", 1)[1].strip()
    return f"exit {returncode}" + (f": {lines[-1]}" if lines else "")


def prepare_data(manifest: Manifest, cache_dir: Path, notify: Callable[[str], None] = lambda _text: None) -> Path:
    """Prepared dataset folder for the manifest, reused from ``cache_dir`` when the same inputs were prepared."""
    key = data_cache_key(manifest)
    target = cache_dir / key
    if (target / "dataset.json").is_file():
        problem = verify_prepared(target)
        if problem is None:
            notify(f"data: reusing prepared data {target}")
            return target
        notify(f"data: the cached data in {target} is damaged ({problem}); preparing it again")
        shutil.rmtree(target, ignore_errors=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(cache_dir)
    staging = cache_dir / f".{key}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    workers = prep_workers(_dataset(manifest).max_documents)
    command = data_preparation_command(manifest, staging, workers=workers)
    log_path = cache_dir / f"{key}.prepare.log"
    notify(f"data: preparing {_dataset(manifest).source} ({manifest.tokenizer.kind} tokenizer) -> {target}")
    started = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=child_env({}), **child_popen_kwargs()
        )
        try:
            proc.wait()
        except BaseException:  # Ctrl-C, SIGTERM, SIGHUP: no half-prepared data and no orphan left behind
            stop_process_group(proc, TERMINATE_GRACE_S)
            shutil.rmtree(staging, ignore_errors=True)
            raise
    if proc.returncode != 0 or not (staging / "dataset.json").is_file():
        shutil.rmtree(staging, ignore_errors=True)
        reason = _preparation_error(log_path, proc.returncode)
        if says_disk_full(reason):
            raise DiskFullError(
                cache_dir, "preparing the data", hint=f"free space there or choose another --runs-dir (log: {log_path})"
            )
        raise DataPreparationError(f"data preparation failed: {reason} (log: {log_path})")
    try:
        staging.rename(target)
    except OSError:
        # Another process prepared the same data at the same time: use theirs.
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "dataset.json").is_file():
            raise
    notify(f"data: prepared in {time.monotonic() - started:.1f} s")
    return target
