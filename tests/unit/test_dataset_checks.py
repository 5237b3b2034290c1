"""Degenerate data is refused or loudly flagged before anything is measured."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from gpuscout import paths
from gpuscout.cli.local_view import RichRunObserver
from gpuscout.domain.catalog import load_catalog
from gpuscout.domain.dataset_checks import dataset_problems, global_batch_blocks
from gpuscout.local import job_process
from gpuscout.local import runner as local
from gpuscout.local.runner import run_local
from gpuscout.store.base import JobStatus
from gpuscout.store.sqlite import SqliteStore
from gpuscout.workflow.ports import JobOutcome
from tests.prepared_data import DATASET_SUMMARY

QUICKSTART = paths.MANIFESTS_DIR / "quickstart.yaml"


def _summary(**over: Any) -> dict[str, Any]:
    return {**DATASET_SUMMARY, **over}


def test_healthy_data_has_no_problems() -> None:
    assert dataset_problems(_summary(), requested_vocab_size=4096, global_batch=4) == []


def test_fewer_training_blocks_than_one_global_batch_is_refused_with_the_fix() -> None:
    data = _summary(splits={"train": {"blocks": 3}, "validation": {"blocks": 1}})
    [problem] = dataset_problems(data, global_batch=4)
    assert problem.severity == "refuse"
    assert "3 blocks of 256 tokens, fewer than one global batch (4 blocks)" in problem.message
    assert "per_device_batch_size x gradient_accumulation_steps" in problem.message
    assert global_batch_blocks({"per_device_train_batch_size": "2", "gradient_accumulation_steps": "4"}, 2) == 16


@pytest.mark.parametrize(
    ("over", "words"),
    [
        (
            {"splits": {"train": {"blocks": 50}, "validation": {"blocks": 0, "documents": 0}}},
            "validation split is empty",
        ),
        ({"tokenizer": {"kind": "bpe", "vocab_size": 1200}}, "far below the requested 4,096"),
        ({"documents_read": 1000, "dropped": {"invalid": 400}}, "400 of 1,000 records were invalid"),
    ],
)
def test_suspicious_data_is_flagged(over: dict[str, Any], words: str) -> None:
    [problem] = dataset_problems(_summary(**over), requested_vocab_size=4096)
    assert problem.severity == "warn" and words in problem.message


def test_the_runner_refuses_jobs_the_data_cannot_fill_and_runs_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given prepared data with 3 training blocks: the quickstart's variants need global batches of 4 blocks
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset.json").write_text(
        json.dumps(_summary(splits={"train": {"blocks": 3}, "validation": {"blocks": 0}}))
    )
    monkeypatch.setattr(local, "prepare_data", lambda *_a, **_k: data)
    ran: list[str] = []
    monkeypatch.setattr(
        job_process,
        "run_job",
        lambda spec, *_a, **_k: ran.append(spec.job_name) or JobOutcome(JobStatus.FAILED, None, "x", 0.1),
    )
    out = io.StringIO()
    store = SqliteStore(tmp_path / "g.db")
    run = run_local(
        QUICKSTART, store=store, runs_dir=tmp_path / "runs", observer=RichRunObserver(Console(file=out, width=300)),
        catalog=load_catalog(),
    )  # fmt: skip
    # Then nothing is measured, every job says why, and the warnings were printed
    assert ran == []
    jobs = store.list_jobs(run.run_id)
    assert {j.status for j in jobs} == {JobStatus.FAILED}
    assert all("not run: degenerate data" in (j.failure_reason or "") for j in jobs)
    assert "validation split is empty" in out.getvalue()
