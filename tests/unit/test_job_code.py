"""What `gpuscout submit` uploads of a job section's code folder, and the manifest it submits with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuscout.cloud.job_code import code_digest, code_files, with_source_dir
from gpuscout.domain.manifest_loader import parse_document


def test_links_out_of_the_folder_and_linked_folders_are_refused_with_the_fix(tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("print(1)\n")
    (tmp_path / "secret.txt").write_text("key")
    (code / "creds").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(ValueError, match="outside source_dir; copy the file in"):
        code_files(code)
    (code / "creds").unlink()
    (tmp_path / "lib").mkdir()
    (code / "lib").symlink_to(tmp_path / "lib")
    with pytest.raises(ValueError, match="is a link to a folder; copy the folder into source_dir"):
        code_files(code)
    (code / "lib").unlink()
    (code / "same.py").symlink_to(code / "train.py")  # a link inside the folder is uploaded as the file it names
    assert [(f.relative, f.data) for f in code_files(code)] == [("same.py", b"print(1)\n"), ("train.py", b"print(1)\n")]


def test_the_digest_covers_paths_and_bytes_and_skips_caches(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    first = code_digest(code_files(tmp_path))
    (tmp_path / "b.pyc").write_bytes(b"\1")
    assert code_digest(code_files(tmp_path)) == first
    (tmp_path / "a.py").write_text("x = 2\n")
    assert code_digest(code_files(tmp_path)) != first


def test_the_rewritten_manifest_reads_as_the_original_json_with_tabs_and_exponents_included() -> None:
    body = b'{\n\t"name": "m",\n\t"job": {"source_dir": ".", "lr": 1e-3}\n}\n'
    out = with_source_dir(body, json_format=True, source_dir="s3://b/raw/code/m-0/", source="m.json")
    assert json.loads(out) == {"name": "m", "job": {"source_dir": "s3://b/raw/code/m-0/", "lr": 0.001}}
    yaml_out = with_source_dir(b"name: m\njob: {source_dir: ., lr: 1.0e-3}\n", json_format=False,
                               source_dir="s3://b/raw/code/m-0/", source="m.yaml")  # fmt: skip
    assert parse_document(yaml_out, "m.yaml") == {
        "name": "m",
        "job": {"source_dir": "s3://b/raw/code/m-0/", "lr": 0.001},
    }
    # the bytes depend on the manifest and the code only (not on the path it was submitted from)
    assert b"m.yaml" not in yaml_out
