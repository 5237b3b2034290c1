"""A cloud job's W&B runs out of its output.tar.gz (gpuscout.cloud.run_tracking.extract_wandb_runs): only the files
and folders under wandb/, never a link or a path that leaves the destination."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from gpuscout.cloud import run_tracking
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
    # Given an archive with a benchmark, two W&B runs (one named with a leading ./), wandb's links and top-level
    # files, and hostile names
    archive = _archive(
        tmp_path / "output.tar.gz",
        [
            ("benchmark.json", b"{}", None),
            ("wandb", None, None),
            ("wandb/offline-run-1-a", None, None),
            ("wandb/offline-run-1-a/run-a.wandb", b"A", None),
            ("./wandb/offline-run-2-b/files/benchmark.json", b"B", None),
            ("wandb/latest-run", None, "offline-run-2-b"),
            ("wandb/latest-run/files/x", b"through the link's name", None),
            ("wandb/offline-run-1-a/logs/debug-core.log", None, "/root/.cache/wandb/logs/core.log"),
            ("wandb/offline-run-1-a/../../escaped.txt", b"X", None),
            ("/wandb/offline-run-3-c/absolute.txt", b"X", None),
            ("wandb/debug.log", b"wandb's top-level file, not a run", None),
        ],
    )
    # When the W&B runs are extracted
    extracted = extract_wandb_runs(archive, tmp_path / "out")
    # Then exactly the two run folders with their files, no link, nothing outside
    out = tmp_path / "out"
    assert extracted.runs == [out / "wandb" / "offline-run-1-a", out / "wandb" / "offline-run-2-b"]
    assert extracted.skipped == []
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() or p.is_symlink())
    assert files == ["wandb/offline-run-1-a/run-a.wandb", "wandb/offline-run-2-b/files/benchmark.json"]
    assert not (tmp_path / "escaped.txt").exists()


def test_a_link_already_on_disk_is_never_written_through(tmp_path: Path) -> None:
    # Given a download folder where wandb left a link inside a run folder (as it does for logs/debug-core.log)
    out = tmp_path / "out"
    outside = tmp_path / "outside.log"
    outside.write_text("wandb's cache")
    (out / "wandb" / "offline-run-1-a" / "logs").mkdir(parents=True)
    (out / "wandb" / "offline-run-1-a" / "logs" / "debug-core.log").symlink_to(outside)
    (out / "wandb" / "offline-run-1-a" / "files").symlink_to(tmp_path, target_is_directory=True)
    archive = _archive(
        tmp_path / "output.tar.gz",
        [
            ("wandb/offline-run-1-a/logs/debug-core.log", b"overwrite?", None),
            ("wandb/offline-run-1-a/files/planted.txt", b"through a folder link?", None),
            ("wandb/offline-run-1-a/run-a.wandb", b"A", None),
        ],
    )
    # When the archive is extracted there
    extracted = extract_wandb_runs(archive, out)
    # Then nothing went through either link, and both are reported
    assert outside.read_text() == "wandb's cache" and not (tmp_path / "planted.txt").exists()
    assert [s.split(" ")[0] for s in extracted.skipped] == [
        "wandb/offline-run-1-a/logs/debug-core.log",
        "wandb/offline-run-1-a/files/planted.txt",
    ]
    assert (out / "wandb" / "offline-run-1-a" / "run-a.wandb").read_bytes() == b"A"


def test_an_oversized_file_is_not_extracted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_tracking, "MAX_WANDB_FILE_BYTES", 4)
    archive = _archive(
        tmp_path / "output.tar.gz",
        [("wandb/offline-run-1-a/run-a.wandb", b"A", None), ("wandb/offline-run-1-a/huge.bin", b"12345", None)],
    )
    extracted = extract_wandb_runs(archive, tmp_path / "out")
    assert extracted.skipped == ["wandb/offline-run-1-a/huge.bin (5 bytes)"]
    assert not (tmp_path / "out" / "wandb" / "offline-run-1-a" / "huge.bin").exists()


def test_an_output_without_wandb_runs_gives_none(tmp_path: Path) -> None:
    archive = _archive(tmp_path / "output.tar.gz", [("benchmark.json", b"{}", None)])
    assert extract_wandb_runs(archive, tmp_path / "out").runs == []


def test_an_unreadable_archive_is_a_clear_error(tmp_path: Path) -> None:
    broken = tmp_path / "output.tar.gz"
    broken.write_bytes(b"not a tar archive")
    with pytest.raises(GpuscoutError, match=r"cannot read the W&B runs in .*output.tar.gz"):
        extract_wandb_runs(broken, tmp_path / "out")
