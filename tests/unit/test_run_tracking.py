"""A cloud job's W&B runs out of its output.tar.gz (gpuscout.cloud.run_tracking.extract_wandb_runs): only the files
and folders under wandb/, never a link or a path that leaves the destination."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from gpuscout.cloud.run_tracking import extract_wandb_runs
from gpuscout.errors import GpuscoutError


def _archive(path: Path, members: list[tuple[str, bytes | None, str | None]]) -> Path:
    """(name, content or None for a folder, link target or None) as SageMaker's tar of SM_OUTPUT_DATA_DIR would."""
    with tarfile.open(path, "w:gz") as archive:
        for name, content, link in members:
            info = tarfile.TarInfo(name)
            if link is not None:
                info.type, info.linkname = tarfile.SYMTYPE, link
                archive.addfile(info)
            elif content is None:
                info.type = tarfile.DIRTYPE
                archive.addfile(info)
            else:
                info.size = len(content)
                archive.addfile(info, io.BytesIO(content))
    return path


def test_only_the_wandb_run_folders_are_extracted(tmp_path: Path) -> None:
    # Given an archive with a benchmark, two W&B runs (one named with a leading ./), wandb's links and hostile names
    archive = _archive(
        tmp_path / "output.tar.gz",
        [
            ("benchmark.json", b"{}", None),
            ("wandb", None, None),
            ("wandb/offline-run-1-a", None, None),
            ("wandb/offline-run-1-a/run-a.wandb", b"A", None),
            ("./wandb/offline-run-2-b/files/benchmark.json", b"B", None),
            ("wandb/latest-run", None, "offline-run-2-b"),
            ("wandb/offline-run-1-a/logs/debug-core.log", None, "/root/.cache/wandb/logs/core.log"),
            ("wandb/../../escaped.txt", b"X", None),
            ("/wandb/absolute.txt", b"X", None),
            ("wandb/debug.log", b"top-level file, not a run", None),
        ],
    )
    # When the W&B runs are extracted
    runs = extract_wandb_runs(archive, tmp_path / "out")
    # Then exactly the two run folders with their files, no link, nothing outside
    out = tmp_path / "out"
    assert runs == [out / "wandb" / "offline-run-1-a", out / "wandb" / "offline-run-2-b"]
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() or p.is_symlink())
    assert files == [
        "wandb/debug.log",
        "wandb/offline-run-1-a/run-a.wandb",
        "wandb/offline-run-2-b/files/benchmark.json",
    ]
    assert not any(p.is_symlink() for p in out.rglob("*"))
    assert not (tmp_path / "escaped.txt").exists()


def test_an_output_without_wandb_runs_gives_none(tmp_path: Path) -> None:
    archive = _archive(tmp_path / "output.tar.gz", [("benchmark.json", b"{}", None)])
    assert extract_wandb_runs(archive, tmp_path / "out") == []


def test_an_unreadable_archive_is_a_clear_error(tmp_path: Path) -> None:
    broken = tmp_path / "output.tar.gz"
    broken.write_bytes(b"not a tar archive")
    with pytest.raises(GpuscoutError, match=r"cannot read the W&B runs in .*output.tar.gz"):
        extract_wandb_runs(broken, tmp_path / "out")
