"""Checkpoints under spot interruptions: the marker's file manifest, resume fallback, pruning (tiny model, CPU).

Training runs in-process through ``train.main`` (as SageMaker would start it, minus the subprocess); DeepSpeed's
part is covered with a stand-in engine that writes what ``engine.save_checkpoint`` writes on one rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from gpuscout_train import args as train_args
from gpuscout_train import checkpoints, train
from gpuscout_train import distributed as train_distributed
from gpuscout_train import state as train_state
from gpuscout_train import trainer as train_loop

from gpuscout.domain.benchmark import BenchmarkResult
from gpuscout.errors import TrainingError

HPS = {
    "job_name": "gs-test-ckpt",
    "model_preset": "qwen2-tiny",
    "per_device_train_batch_size": "4",
    "max_steps": "8",
    "learning_rate": "0.003",
    "seed": "7",
    "checkpoint_interval": "2",
    "validation_batches": "1",
}


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _train(dataset: Path, root: Path, **hps: str) -> BenchmarkResult:
    """One train.py job in-process; checkpoints under root/checkpoints, benchmark.json under root/output."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {
            "SM_INPUT_CONFIG_DIR": str(root / "no-config"), "SM_CHANNEL_TRAIN": str(dataset),
            "SM_OUTPUT_DATA_DIR": str(root / "output/data"), "SM_MODEL_DIR": str(root / "model"),
            "GPUSCOUT_CHECKPOINT_DIR": str(root / "checkpoints"),
            "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": _free_port(),
        }.items():  # fmt: skip
            mp.setenv(key, value)
        for key in ("SM_HPS", "GPUSCOUT_EXIT_AFTER_STEP", "GPUSCOUT_SAVE_MODEL"):
            mp.delenv(key, raising=False)
        argv = [item for name, value in {**HPS, **hps}.items() for item in (f"--{name}", value)]
        handler = signal.getsignal(signal.SIGTERM)
        assert train.main(argv) == 0
        # train.main handles SIGTERM while it runs and leaves it as it was: the test process goes on (before, a
        # SIGTERM handler of a finished job stayed installed and failed a later test of the same worker)
        assert signal.getsignal(signal.SIGTERM) is handler
    return BenchmarkResult.model_validate_json((root / "output/data/benchmark.json").read_text())


def _losses(result: BenchmarkResult) -> list[tuple[int, float]]:
    assert result.loss is not None
    return [(p.step, p.loss) for p in result.loss.train]


def _marker(root: Path, step: int) -> dict[str, Any]:
    return json.loads((root / f"step-{step:08d}" / "complete").read_text())


@pytest.fixture(scope="module")
def uninterrupted(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, float]]:
    """The losses of steps 1..8 of a run that was never interrupted."""
    return _losses(_train(dataset, tmp_path_factory.mktemp("uninterrupted"), checkpoint_interval="0"))


def _assert_same_losses(result: BenchmarkResult, expected: list[tuple[int, float]]) -> None:
    got = _losses(result)
    assert [s for s, _ in got] == [s for s, _ in expected]
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], abs=1e-5)


def test_pruning_keeps_the_newest_n_complete_checkpoints(dataset: Path, tmp_path: Path) -> None:
    # Given checkpoints every 2 of 8 steps and checkpoint_keep=3
    _train(dataset, tmp_path, checkpoint_keep="3")
    # Then the newest 3 are left, each complete
    ckpt = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000004", "step-00000006", "step-00000008"]
    assert all((p / "complete").is_file() for p in ckpt.iterdir())


class FakeDeepSpeedEngine:
    """Writes and reads what DeepSpeed's engine.save_checkpoint/load_checkpoint do on one rank:
    <save_dir>/<tag>/{model states, ZeRO optimizer partition} and <save_dir>/latest."""

    def __init__(self) -> None:
        self.loaded: str | None = None

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict[str, Any]) -> bool:
        folder = Path(save_dir) / tag
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"module": {"w": torch.ones(8)}, **client_state}, folder / "mp_rank_00_model_states.pt")
        torch.save({"optimizer": torch.zeros(64)}, folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        (Path(save_dir) / "latest").write_text(tag)
        return True

    def load_checkpoint(self, load_dir: str, tag: str) -> tuple[str | None, dict[str, Any] | None]:
        folder = Path(load_dir) / tag
        if not folder.is_dir():
            return None, None
        for path in sorted(folder.iterdir()):
            torch.load(path, weights_only=False)
        self.loaded = tag
        return str(folder), {}


def _deepspeed_bench() -> tuple[train_loop.Trainer, train_state.Parts, FakeDeepSpeedEngine]:
    hp = train_args.Hyperparameters(model_preset="qwen2-tiny", checkpoint_interval=2)
    bench = train_loop.Trainer(hp, train_distributed.Dist(1, 0, 0, 1, torch.device("cpu")))
    engine = FakeDeepSpeedEngine()
    parts = train_state.Parts(model=None, wrapped=engine, optimizer=None, scheduler=None, warmup=3, engine=engine)  # type: ignore[arg-type]
    return bench, parts, engine


def test_deepspeed_tag_folders_are_pruned_and_the_marker_lists_every_file_last(tmp_path: Path) -> None:
    # Given a DeepSpeed run (default checkpoint_keep=2) that checkpoints at steps 2, 4, 6 and 8
    bench, parts, _ = _deepspeed_bench()
    for step in (2, 4, 6, 8):
        bench.progress.step = step
        bench._save(tmp_path, parts)
    # Then only the newest 2 are left, the plain folders and the DeepSpeed tag folders alike; DeepSpeed's 'latest' stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deepspeed", "step-00000006", "step-00000008"]
    assert sorted(p.name for p in (tmp_path / "deepspeed").iterdir()) == ["latest", "step-00000006", "step-00000008"]
    # And the marker lists every file of its checkpoint (state.pt and the tag folder) with size and sha256
    marker = _marker(tmp_path, 8)
    files = sorted(
        str(p.relative_to(tmp_path))
        for folder in (tmp_path / "step-00000008", tmp_path / "deepspeed/step-00000008")
        for p in folder.rglob("*")
        if p.is_file() and p.name != "complete"
    )
    assert [e["path"] for e in marker["files"]] == files and len(files) == 3
    for entry in marker["files"]:
        data = (tmp_path / entry["path"]).read_bytes()
        assert entry["size"] == len(data) > 0
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    # And it was written after all of them
    written = (tmp_path / "step-00000008/complete").stat().st_mtime_ns
    assert all((tmp_path / f).stat().st_mtime_ns <= written for f in files)


def test_a_deepspeed_checkpoint_with_a_truncated_partition_falls_back_to_the_older_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given DeepSpeed checkpoints 6 and 8, and 8's optimizer partition only partly restored from S3
    bench, parts, engine = _deepspeed_bench()
    for step in (6, 8):
        bench.progress.step = step
        bench._save(tmp_path, parts)
    partition = tmp_path / "deepspeed/step-00000008/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    partition.write_bytes(partition.read_bytes()[:100])
    # When a new process resumes
    bench, parts, engine = _deepspeed_bench()
    bench._resume(tmp_path, parts)
    # Then it skips 8 (saying why) and loads 6 into the engine
    assert engine.loaded == "step-00000006" and bench.resumed_from == 6 and bench.progress.step == 6
    out = capsys.readouterr().out
    assert "skipped step-00000008: it does not verify" in out and "has 100 bytes" in out


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_checkpoint_with_a_missing_or_truncated_file_is_skipped_for_the_older_one(
    dataset: Path,
    tmp_path: Path,
    uninterrupted: list[tuple[int, float]],
    capsys: pytest.CaptureFixture[str],
    damage: str,
) -> None:
    # Given a job interrupted after step 6, with checkpoints 4 and 6, whose step-6 state.pt did not (fully) reach S3
    _train(dataset, tmp_path, max_steps="6")
    state = tmp_path / "checkpoints/step-00000006/state.pt"
    if damage == "missing":
        state.unlink()
    else:
        state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    capsys.readouterr()
    # When the job starts again
    resumed = _train(dataset, tmp_path)
    # Then it skips step 6, saying why, resumes from step 4 and gives the losses of the uninterrupted run
    out = capsys.readouterr().out
    assert "skipped step-00000006: it does not verify" in out
    assert ("is missing" if damage == "missing" else "bytes, the marker says") in out
    assert resumed.stop is not None and resumed.stop.resumed_from_step == 4 and resumed.stop.steps == 8
    _assert_same_losses(resumed, uninterrupted)


def test_a_corrupt_newest_checkpoint_whose_load_raises_falls_back_to_the_older_one(
    dataset: Path, tmp_path: Path, uninterrupted: list[tuple[int, float]], capsys: pytest.CaptureFixture[str]
) -> None:
    # Given checkpoints 4 and 6, 6's state.pt corrupt although it matches its marker (it was written corrupt)
    _train(dataset, tmp_path, max_steps="6")
    ckpt = tmp_path / "checkpoints"
    garbage = os.urandom(4096)
    (ckpt / "step-00000006/state.pt").write_bytes(garbage)
    marker = _marker(ckpt, 6)
    marker["files"] = [{"path": "step-00000006/state.pt", "size": 4096, "sha256": hashlib.sha256(garbage).hexdigest()}]
    (ckpt / "step-00000006/complete").write_text(json.dumps(marker))
    capsys.readouterr()
    # When the job starts again
    resumed = _train(dataset, tmp_path)
    # Then loading 6 fails, it says so, and step 4 resumes with the uninterrupted run's losses
    assert "skipped step-00000006: loading it failed" in capsys.readouterr().out
    assert resumed.stop is not None and resumed.stop.resumed_from_step == 4
    _assert_same_losses(resumed, uninterrupted)


def test_training_starts_fresh_only_when_no_checkpoint_verifies(
    dataset: Path, tmp_path: Path, uninterrupted: list[tuple[int, float]], capsys: pytest.CaptureFixture[str]
) -> None:
    # Given checkpoints 4 and 6, neither fully restored
    _train(dataset, tmp_path, max_steps="6")
    for step in (4, 6):
        (tmp_path / f"checkpoints/step-{step:08d}/state.pt").unlink()
    capsys.readouterr()
    # When the job starts again, Then it trains from step 1, as the uninterrupted run did
    resumed = _train(dataset, tmp_path)
    out = capsys.readouterr().out
    assert "skipped step-00000006" in out and "skipped step-00000004" in out
    assert "training starts from step 1" in out
    assert resumed.stop is not None and resumed.stop.resumed_from_step is None
    _assert_same_losses(resumed, uninterrupted)


def test_a_load_that_fails_after_changing_the_engine_never_starts_fresh(tmp_path: Path) -> None:
    # Given one DeepSpeed checkpoint that verifies, but whose load fails inside the engine (weights partly loaded)
    bench, parts, _ = _deepspeed_bench()
    bench.progress.step = 2
    bench._save(tmp_path, parts)

    def broken_load(load_dir: str, tag: str) -> tuple[str, dict[str, Any]]:
        raise RuntimeError("optimizer partition does not match the model")

    bench, parts, engine = _deepspeed_bench()
    engine.load_checkpoint = broken_load  # type: ignore[method-assign]
    # When it resumes, Then it refuses to train on from a half-loaded model instead of starting fresh
    with pytest.raises(TrainingError, match="already overwritten part of the model"):
        bench._resume(tmp_path, parts)


def test_checkpoint_keep_goes_from_the_manifest_to_train_py_and_is_validated() -> None:
    from gpuscout.domain.catalog import load_catalog
    from gpuscout.domain.manifest_loader import validate_manifest_data
    from gpuscout.errors import ManifestError
    from gpuscout.plan.planner import plan

    catalog = load_catalog()
    data: dict[str, Any] = {
        "name": "keep", "model": {"preset": "qwen2-tiny"}, "dataset": {"source": "bundled:hebrew-bible"},
        "sequence_length": 256, "training": {"max_steps": 20, "checkpoint_interval": 5, "checkpoint_keep": 3},
        "targets": [{"instance_type": "ml.g5.8xlarge"}], "variants": [{"name": "v"}],
        "constraints": {"budget_usd": 100},
    }  # fmt: skip
    # Given training.checkpoint_keep: 3, When planned, Then train.py receives it
    job = plan(validate_manifest_data(data, "keep.yaml", catalog), catalog, run_id="r1").jobs[0]
    assert job.hyperparameters["checkpoint_keep"] == "3"
    hp = train_args.parse_hyperparameters(
        [], {"SM_HPS": json.dumps(job.hyperparameters), "SM_INPUT_CONFIG_DIR": "/nonexistent"}
    )
    assert hp.checkpoint_keep == 3
    # And a value below 1 is refused with its field path, in the manifest and in train.py alike
    data["training"]["checkpoint_keep"] = 0
    with pytest.raises(ManifestError, match=r"training\.checkpoint_keep"):
        validate_manifest_data(data, "keep.yaml", catalog)
    with pytest.raises(TrainingError, match="checkpoint_keep must be at least 1"):
        train_args.parse_hyperparameters(["--checkpoint_keep", "0"], {"SM_INPUT_CONFIG_DIR": "/nonexistent"})


@pytest.mark.parametrize(
    "marker",
    [{"step": 4, "deepspeed": False}, {"step": 4, "files": [{"path": "step-00000004/state.pt"}]}, "not json"],
    ids=["old-train-py-marker", "entry-without-size", "unreadable"],
)
def test_a_marker_without_a_usable_manifest_is_not_trusted(tmp_path: Path, marker: Any) -> None:
    from gpuscout_train import checkpoints

    # Given a checkpoint whose files are all there but whose marker lists no usable manifest
    folder = tmp_path / "step-00000004"
    folder.mkdir()
    (folder / "state.pt").write_bytes(b"x" * 10)
    (folder / "complete").write_text(marker if isinstance(marker, str) else json.dumps(marker))
    # Then it does not verify (and resume would fall back past it)
    assert checkpoints.complete_steps(tmp_path) == [4]
    problems = checkpoints.verify(tmp_path, 4)
    assert len(problems) == 1 and "lists no files" in problems[0]


class _Payload:
    """A pickle that runs code when loaded: what a hostile job could leave under the shared checkpoints prefix."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_a_checkpoint_state_that_would_run_code_is_refused_not_run(tmp_path: Path) -> None:
    # Given a checkpoint folder whose state.pt unpickles into a call (the checkpoints prefix is written by jobs)
    folder = tmp_path / "step-00000010"
    folder.mkdir()
    marker = tmp_path / "ran"
    torch.save({"progress": _Payload(marker)}, folder / checkpoints.STATE)
    # When the trainer loads it, Then loading fails before anything runs (weights_only) and nothing was touched
    with pytest.raises(Exception, match=r"(?i)weights_only|unsupported|global"):
        train_state.load_training_state(folder, parts=None)  # type: ignore[arg-type]
    assert not marker.exists()
