"""train.py's timed loop (the ``Trainer`` class): it composes its components (build.py builds the data
splits, the model with its loss, the optimizer and schedule, the engine and the loader; validation.py the
validation loss; state.py what a checkpoint holds; result.py the measured result from the facts set-up
fills in, ``self.facts``) around what stays here: resume from the newest complete checkpoint, the steps
(micro-batches, accumulation, warm-up excluded from timing, GPU work synchronized before the clock is read), when to
validate and checkpoint, and the stop rules (fixed steps or steady state, decided on rank 0 for every rank).

Imported by train.py; may import gpuscout.domain and gpuscout.errors, and the components beside it."""

from __future__ import annotations

import math
import os
import random
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from gpuscout.domain.benchmark import (
    BenchmarkResult,
    LossPoint,
    Memory,
)
from gpuscout.domain.metric_lines import format_metric_line
from gpuscout.errors import TrainingError

from . import host_allocator, startup_gc
from .args import Hyperparameters
from .build import build_loader, build_model_with_loss, build_optimizer, build_parts, build_splits, warmup_steps
from .checkpoints import Checkpointer, checkpoint_root
from .data import token_counts
from .distributed import Dist
from .facts import hardware_info, process_age_s, resolve_precision, software_info
from .metrics import (
    GpuSampler,
    ResourceMeter,
    StepRecord,
    StepStats,
    Stopwatch,
)
from .packing import make_inputs
from .result import Outcome, RunFacts, build_result, failed_result, memory, report_step, write_result
from .state import Parts, Progress, Splits, StepWork, load_training_state, restore_rng, training_state
from .stop_signal import StopSignal
from .tracking import JobTracker
from .validation import validation_loss


class Trainer:
    def __init__(
        self,
        hp: Hyperparameters,
        dist: Dist,
        tracker: JobTracker | None = None,
        *,
        import_time_s: float | None = None,
        stop: StopSignal | None = None,
    ) -> None:
        self.hp = hp
        self.dist = dist
        self.tracker = tracker or JobTracker(None)  # experiment tracking (tracking.py); rank 0 only
        self.stop = stop or StopSignal()  # SIGTERM (stop_signal.py): installed by train.py for one-process jobs
        self.data_dir = Path(os.environ.get("SM_CHANNEL_TRAIN", "/opt/ml/input/data/train"))
        self.output_dir = Path(os.environ.get("SM_OUTPUT_DATA_DIR", "/opt/ml/output/data"))
        self.model_dir = Path(os.environ.get("SM_MODEL_DIR", "/opt/ml/model"))
        sampler = GpuSampler([dist.local_rank]) if dist.device.type == "cuda" else GpuSampler([])
        precision, self.precision_note = resolve_precision(hp.precision, dist.device)
        # what the result reports beside its measurements (result.py); set-up fills the model's and data's part
        self.facts = RunFacts(
            hp=hp,
            dist=dist,
            precision=precision,
            hardware=hardware_info(dist, precision, sampler),
            software=software_info(host_allocator.configure(hp.host_allocator)),
            sampler=sampler,
            # one clock from the process's start: wall and start-up times include the interpreter and the imports
            started=time.perf_counter() - (process_age_s() or 0.0),
            import_time_s=import_time_s,
            model_name=hp.model_preset or hp.model_name_or_path,
            sequence_length=hp.sequence_length,
        )
        self.progress = Progress()
        self.resumed_from: int | None = None
        self.validation_error: str | None = None
        self.trained_memory: Memory | None = None  # read before the final validation (_final_validation)

    def log(self, message: str) -> None:
        if self.dist.is_main:
            print(f"[train] {message}", flush=True)

    def write(self, result: BenchmarkResult) -> None:
        path = write_result(self.dist, self.output_dir, result)
        if path is not None:
            self.log(f"wrote {path} ({result.status})")

    def failed(self, reason: str) -> BenchmarkResult:
        return failed_result(self.facts, reason)

    # ------------------------------------------------------------ run

    def run(self) -> BenchmarkResult:
        """Set-up (data, model, optimizer, engine), resume, the timed step loop, the final validation, the result."""
        self._seed_and_check()
        data = self._load_data()
        parts = self._set_up()
        ckpt_root = checkpoint_root()
        if self.hp.search_candidate:  # a tuning job's trials share its checkpoint location: one folder each
            ckpt_root = ckpt_root / self.hp.job_name
        self._resume(ckpt_root, parts)
        stats = StepStats(warmup_steps=parts.warmup, records=list(self.progress.records))
        first_step = self.progress.step + 1
        loader = build_loader(data, self.hp, self.dist, self.facts, first_step)
        self.log(
            f"model {self.facts.model_name}: {self.facts.params_total / 1e6:.2f} M parameters, {self.facts.precision}, "
            f"{self.dist.world_size} rank(s) on {self.dist.device.type}; {len(data.train_ids)} train blocks of "
            f"{self.facts.sequence_length}; T_eff {self.facts.t_eff:.1f}; warmup {parts.warmup} steps; "
            f"steps {first_step}..{self.hp.max_steps}"
        )
        startup_gc.resume()  # set-up is done: start-up's objects frozen, collection on for the steps (startup_gc.py)
        startup_s = time.perf_counter() - self.facts.started
        self.facts.sampler.start()
        self.stop.in_loop = True
        stop_reason = self._train(parts, data, stats, iter(loader), ckpt_root)
        if self.stop.received is not None:  # stopping on SIGTERM: no validation, the result as measured
            if not stats.timed:
                raise TrainingError(f"{stop_reason}, before any timed step: nothing was measured")
        else:
            self._final_validation(parts, data, stats, startup_s, stop_reason)
        if os.environ.get("GPUSCOUT_SAVE_MODEL") == "1" and self.dist.is_main and parts.engine is None:
            saved: Any = self.facts.adapter_model or parts.model.lm  # an adapter run: its adapters, in peft's format
            saved.save_pretrained(str(self.model_dir))
        return self._result(stats, parts.warmup, startup_s, stop_reason)

    # ------------------------------------------------------------ set-up: data, model, optimizer, engine

    def _seed_and_check(self) -> None:
        hp, dist = self.hp, self.dist
        torch.manual_seed(hp.seed)
        random.seed(hp.seed)
        device_arithmetic(dist, self.facts)
        if self.precision_note:
            self.log(self.precision_note)

    def _load_data(self) -> Splits:
        return build_splits(self.data_dir, self.hp, self.facts)

    def _set_up(self) -> Parts:
        """The model with its loss, the optimizer and schedule, and the engine that drives them (build.py)."""
        hp, dist, facts = self.hp, self.dist, self.facts
        model = build_model_with_loss(hp, dist, facts)
        warmup = warmup_steps(hp)
        optimizer, scheduler = build_optimizer(model, hp, dist, facts, warmup)
        return build_parts(model, optimizer, scheduler, warmup, hp=hp, dist=dist, facts=facts)

    # ------------------------------------------------------------ the timed step loop

    def _train(self, parts: Parts, data: Splits, stats: StepStats, batches: Iterator[Any], ckpt_root: Path) -> str:
        """Steps from the one after the resumed step to max_steps (or steady state); returns why it stopped."""
        hp = self.hp
        watch = Stopwatch(self.dist.synchronize)
        exit_after = int(os.environ.get("GPUSCOUT_EXIT_AFTER_STEP", "0"))
        parts.model.train()
        first_step = self.progress.step + 1
        meter = ResourceMeter(self.facts.sampler)
        for steps_here, step in enumerate(range(first_step, hp.max_steps + 1), start=1):
            timed = not stats.is_warmup(steps_here)
            t0 = watch.now()
            self.facts.sampler.timing(timed)  # GPU utilization and power means cover the timed steps only
            used = meter.read()
            lr = float(parts.scheduler.get_last_lr()[0])  # this step's: the scheduler steps after the update
            work = self._micro_batches(parts, batches)
            work.lr = lr
            work.grad_norm = self._optimizer_step(parts)
            seconds = watch.now() - t0
            self.facts.sampler.timing(False)
            work.usage = meter.since(used)
            self._record_step(step, work, stats, parts, seconds=seconds, timed=timed)
            if hp.eval_interval and step % hp.eval_interval == 0 and step < hp.max_steps:
                self._validate(parts, data)
            if hp.checkpoint_interval and step % hp.checkpoint_interval == 0:
                self._save(ckpt_root, parts)
            if exit_after and step == exit_after:
                self.log(f"GPUSCOUT_EXIT_AFTER_STEP={exit_after}: exiting hard (interruption test)")
                sys.stdout.flush()
                os._exit(3)
            if self.stop.received is not None:  # SIGTERM: after this step, with a checkpoint when the job keeps them
                if hp.checkpoint_interval and step % hp.checkpoint_interval != 0:
                    self._save(ckpt_root, parts)
                return self.stop.reason(step)
            reason = self._steady_state(stats)
            if reason:
                return reason
        return "max_steps reached"

    def _micro_batches(self, parts: Parts, batches: Iterator[Any]) -> StepWork:
        """Forward and backward of the step's micro-batches (DeepSpeed steps its optimizer inside)."""
        hp, dist = self.hp, self.dist
        work = StepWork(loss_sum=torch.zeros((), device=dist.device))
        for micro in range(hp.gradient_accumulation_steps):
            tw = time.perf_counter()
            ids, seg = next(batches)
            work.wait += time.perf_counter() - tw
            n_tok, _ = token_counts(seg, hp.packing)
            work.tokens, work.samples = work.tokens + n_tok, work.samples + len(ids)
            ids = ids.to(dist.device, non_blocking=True)
            seg = seg.to(dist.device, non_blocking=True)
            inputs = make_inputs(
                ids, seg, packing=hp.packing, attention=hp.attention_implementation, dtype=parts.compute_dtype
            )
            last = micro == hp.gradient_accumulation_steps - 1
            no_sync = not last and parts.engine is None and dist.world_size > 1
            with parts.wrapped.no_sync() if no_sync else nullcontext(), parts.autocast:
                loss = parts.wrapped(inputs.input_ids, inputs.position_ids, inputs.attention_mask, inputs.labels)
            if parts.engine is not None:
                parts.engine.backward(loss)
                parts.engine.step()
            else:
                scaled = loss / hp.gradient_accumulation_steps
                (parts.scaler.scale(scaled) if parts.scaler else scaled).backward()
            work.loss_sum += loss.detach()
        return work

    def _optimizer_step(self, parts: Parts) -> float | None:
        """Clip, step and zero the gradients; the gradient norm (None under DeepSpeed: it clips internally)."""
        if parts.engine is not None:
            return None
        optimizer, scaler = parts.optimizer, parts.scaler
        if scaler:
            scaler.unscale_(optimizer)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(parts.model.parameters(), 1.0))
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        parts.scheduler.step()
        # DDP's gradients stay views of its buckets when zeroed in place; with set_to_none the reducer copies each
        # new gradient into its bucket slot and repoints .grad (briefly one parameter's copy at a time; a whole
        # second copy across no_sync micro-batches under accumulation). In place keeps the memory model's figure.
        optimizer.zero_grad(set_to_none=not (self.dist.world_size > 1 and parts.engine is None))
        return grad_norm

    def _record_step(
        self, step: int, work: StepWork, stats: StepStats, parts: Parts, *, seconds: float, timed: bool
    ) -> None:
        """Sum the step's counters over the ranks, record them and print rank 0's metric line."""
        hp, dist = self.hp, self.dist
        total_tokens, total_samples, total_loss = dist.all_reduce_sum(
            [work.tokens, work.samples, float(work.loss_sum) / hp.gradient_accumulation_steps]
        )
        mean_loss = total_loss / dist.world_size
        if not math.isfinite(mean_loss):
            raise TrainingError(f"loss is {mean_loss} at step {step}; lower learning_rate or use bf16")
        stats.add(
            StepRecord(
                step=step,
                seconds=seconds,
                tokens=int(total_tokens),
                samples=int(total_samples),
                dataloader_wait_s=work.wait,
                loss=mean_loss,
                timed=timed,
                **work.usage,
            )
        )
        prog = self.progress
        prog.step, prog.records = step, stats.records
        prog.tokens += int(total_tokens)
        prog.train_time_s += seconds
        prog.train_loss.append(LossPoint(step=step, tokens=prog.tokens, elapsed_s=prog.train_time_s, loss=mean_loss))
        if dist.is_main:
            totals = (total_tokens, total_samples, mean_loss)
            report_step(self.facts, self.tracker, stats, step, work, totals=totals, seconds=seconds, timed=timed)

    def _steady_state(self, stats: StepStats) -> str | None:
        """Why to stop now under stop_rule=steady_state (every rank follows rank 0's decision), else None."""
        hp, dist = self.hp, self.dist
        if hp.stop_rule != "steady_state":
            return None
        floor = hp.min_timed_seconds if hp.min_timed_seconds >= 0 else (60.0 if dist.device.type == "cuda" else 0.0)
        done, reason = stats.steady_state_reached(
            ci_tolerance=hp.ci_tolerance, min_timed_steps=hp.min_timed_steps, min_timed_seconds=floor
        )
        if dist.world_size > 1:  # every rank stops on rank 0's decision
            flag = torch.tensor([1.0 if done else 0.0], device=dist.device)
            torch.distributed.broadcast(flag, 0)
            done = bool(flag.item())
        return (reason or "throughput steady on rank 0") if done else None

    def _result(
        self, stats: StepStats, warmup: int, startup_s: float, stop_reason: str, *, provisional: bool = False
    ) -> BenchmarkResult:
        """The result of the timed steps (train_result.build_result)."""
        outcome = Outcome(
            progress=self.progress,
            warmup=warmup,
            startup_s=startup_s,
            stop_reason=stop_reason,
            resumed_from=self.resumed_from,
            validation_error=self.validation_error,
            trained_memory=self.trained_memory,
        )
        return build_result(self.facts, stats, outcome, provisional=provisional)

    # ------------------------------------------------------------ validation and checkpoints

    def _final_validation(self, parts: Parts, data: Splits, stats: StepStats, startup_s: float, reason: str) -> None:
        """Validate after the timed steps. The measurement (its memory peaks the steps', not validation's) is written
        first; on one process a failure here is a note in the result. With several ranks it fails the job (a rank left
        waiting in a collective would hang), and the launcher stops them all; the measurement stays on disk."""
        self.trained_memory = memory(self.facts)
        self.write(self._result(stats, parts.warmup, startup_s, reason, provisional=True))
        try:
            self._validate(parts, data)
        except Exception as err:  # any failure of the validation itself; the timed steps are done
            if self.dist.world_size > 1:
                raise
            if isinstance(err, torch.OutOfMemoryError):
                torch.cuda.empty_cache()
            self.validation_error = f"{type(err).__name__}: {err}"[:1000]
            self.log(f"the final validation failed; the measurement stands: {self.validation_error}")

    def _validate(self, parts: Parts, data: Splits) -> None:
        value = validation_loss(parts, data, self.hp, self.dist)
        if value is None:
            return
        p = self.progress
        p.validation_loss.append(LossPoint(step=p.step, tokens=p.tokens, elapsed_s=p.train_time_s, loss=value))
        if self.dist.is_main:
            print(format_metric_line({"step": p.step, "val_loss": value}), flush=True)
            self.tracker.log_step(p.step, {"val_loss": value})

    def _checkpointer(self, root: Path) -> Checkpointer:
        return Checkpointer(root, self.dist, self.hp.checkpoint_keep, self.log)

    def _save(self, root: Path, parts: Parts) -> None:
        self._checkpointer(root).save(self.progress.step, training_state(self.progress, parts), parts.engine)

    def _resume(self, root: Path, parts: Parts) -> None:
        """Continue from the newest checkpoint under ``root`` that verifies and loads, if any."""
        state = self._checkpointer(root).resume(lambda folder: load_training_state(folder, parts))
        if state is None:
            return
        restore_rng(state)
        self.progress = Progress.from_state(state["progress"])
        self.resumed_from = self.progress.step


def device_arithmetic(dist: Dist, facts: RunFacts) -> None:
    """TF32 matmuls on CUDA unless the precision is fp32. On a CPU, subnormal floats as zero, as GPUs compute them at
    full speed and x86 CPUs do not: a pretrained model's confident softmax gives gradients of ~1e-20, whose squares
    in AdamW's second moment are subnormal, and every step then ran ~20x slower on a CPU (a full fine-tune of the tiny
    model from pretrained weights: 420 tokens/s against 8,000 before the moments filled up)."""
    if dist.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = facts.precision != "fp32"
        torch.backends.cudnn.allow_tf32 = facts.precision != "fp32"
    else:
        torch.set_flush_denormal(True)
        facts.optimizations.append("flush_denormal")
