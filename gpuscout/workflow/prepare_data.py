"""Prepare data (state "Prepare data"): the built-in job's data tokenized once into the prepared format training
reads (training/gpuscout_data), then checked before anything is measured. The cloud's driver runs the preparation as
a SageMaker Processing job (skipped when the data bucket already holds it); the local one runs the same module as a
subprocess with a cache (local/data_cache.py). A job section (the user's own script) reads its own data: nothing to
prepare.

``check_prepared_data``: degenerate data (domain.dataset_checks) is shown loudly; a job whose global batch the
training split cannot fill is recorded FAILED with the fix and not run."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gpuscout.domain.dataset_checks import dataset_problems, global_batch_blocks
from gpuscout.domain.jobspec import JobSpec
from gpuscout.errors import DataPreparationError
from gpuscout.store.base import JobStatus, ResultStore
from gpuscout.workflow.train_and_record import record_job

if TYPE_CHECKING:
    from gpuscout.domain.manifest import Manifest


def check_prepared_data(
    data_dir: Path,
    manifest: Manifest,
    specs: Sequence[JobSpec],
    *,
    store: ResultStore,
    on_warning: Callable[[str], None],
) -> set[str]:
    """Degenerate data, before anything is measured: warnings go to ``on_warning``; a job whose global batch the
    training split cannot fill is recorded FAILED with the fix and not run. Returns those jobs' names."""
    try:
        summary = json.loads((data_dir / "dataset.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DataPreparationError(f"prepared data in {data_dir} is unreadable ({err}); delete the folder") from err
    requested = manifest.tokenizer.resolved_vocab_size
    for problem in dataset_problems(summary, requested_vocab_size=requested):
        on_warning(f"data: {problem.message}")
    refused: set[str] = set()
    for spec in specs:
        batch = global_batch_blocks(spec.hyperparameters, spec.gpus_per_instance * spec.instance_count or 1)
        for problem in dataset_problems(summary, global_batch=batch):
            if problem.severity == "refuse":
                reason = f"not run: degenerate data: {problem.message}"
                record_job(store, spec, JobStatus.FAILED, reason=reason)
                on_warning(f"{spec.job_name}: {reason}")
                refused.add(spec.job_name)
    return refused
