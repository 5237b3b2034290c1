"""The job-output recorder streams the archive: its memory does not grow with what a job uploads beside its result."""

from __future__ import annotations

import io
import os
import tarfile
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from gpuscout.cloud.events import read_benchmark
from gpuscout.cloud.sagemaker_requests import output_tar_key
from gpuscout.errors import GpuscoutError
from gpuscout.paths import REPO_DIR

BENCHMARK = (REPO_DIR / "tests" / "fixtures" / "benchmarks" / "p4d-bs8-r0.json").read_bytes()
MIB = 1024 * 1024


class _RandomBytes(io.RawIOBase):
    """``size`` incompressible bytes, made a chunk at a time (never held whole)."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.left, MIB)
        buffer[:n] = os.urandom(n)
        self.left -= n
        return n


def _archive(path: Path, *, filler_bytes: int) -> Path:
    """An output.tar.gz as SageMaker uploads it: a job's large files first, benchmark.json last."""
    with tarfile.open(path, "w:gz", compresslevel=1) as archive:
        filler = tarfile.TarInfo("wandb/offline-run/run.wandb")
        filler.size = filler_bytes
        archive.addfile(filler, io.BufferedReader(_RandomBytes(filler_bytes)))
        result = tarfile.TarInfo("benchmark.json")
        result.size = len(BENCHMARK)
        archive.addfile(result, io.BytesIO(BENCHMARK))
    return path


class _FileObjects:
    """S3's get_object with the body a stream over a local file, as botocore's StreamingBody streams."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.keys: list[str] = []

    def get_object(self, *, Bucket: str, Key: str) -> Any:  # noqa: N803 - boto3 keyword names
        self.keys.append(Key)
        return {"Body": self.path.open("rb")}


def _peak_bytes_reading(path: Path) -> int:
    objects = _FileObjects(path)
    tracemalloc.start()
    try:
        result = read_benchmark(objects, "artifacts", "run-1", "gs-abc-t0v0r0-job")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result is not None and result.job_name  # the benchmark was found behind the filler
    assert objects.keys == [output_tar_key("run-1", "gs-abc-t0v0r0-job")]
    return peak


def test_the_recorders_memory_does_not_grow_with_the_archive(tmp_path: Path) -> None:
    # Given a job output of 4 MiB and one of 200 MiB (incompressible), benchmark.json last in both
    small = _peak_bytes_reading(_archive(tmp_path / "small.tar.gz", filler_bytes=4 * MIB))
    large = _peak_bytes_reading(_archive(tmp_path / "large.tar.gz", filler_bytes=200 * MIB))
    # Then reading the result of either takes the same few MiB (reading the archive whole took 200 MiB and more)
    assert large < 16 * MIB, f"peak {large / MIB:.1f} MiB"
    assert large < small + 4 * MIB, f"{small / MIB:.1f} MiB vs {large / MIB:.1f} MiB"


def test_an_archive_without_a_result_or_broken_off_is_said_plainly(tmp_path: Path) -> None:
    path = tmp_path / "no-result.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        info = tarfile.TarInfo("model/config.json")
        info.size = 2
        archive.addfile(info, io.BytesIO(b"{}"))
    assert read_benchmark(_FileObjects(path), "artifacts", "run-1", "job") is None
    truncated = tmp_path / "truncated.tar.gz"
    truncated.write_bytes(_archive(tmp_path / "whole.tar.gz", filler_bytes=MIB).read_bytes()[: 200 * 1024])
    with pytest.raises(GpuscoutError, match=r"not a readable tar archive|cannot read"):
        read_benchmark(_FileObjects(truncated), "artifacts", "run-1", "job")
