"""The Reporter: one job's step measurements, its stop rule and benchmark.json; and the shared instance the
package's functions use (``gs.step``, ``gs.done``)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from gpuscout_train.metrics import ResourceMeter, StepRecord, StepStats, default_warmup_steps, step_accounts
from gpuscout_train.nvidia_versions import nvidia_versions

from gpuscout.domain.disturbance import detect
from gpuscout.domain.metric_lines import format_metric_line

SCHEMA_VERSION = "1.6"


def _env_int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name, "")
    return int(raw) if raw.strip() else default


def _env_float(name: str, default: float | None) -> float | None:
    raw = os.environ.get(name, "")
    return float(raw) if raw.strip() else default


def _agreed_stop(stop: bool) -> bool:
    """Under torch.distributed every rank must stop at the same step (a rank that stops alone leaves the others
    waiting in their next all-reduce): rank 0's clock decides, broadcast to all. One process: ``stop`` itself."""
    dist = getattr(sys.modules.get("torch"), "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return stop
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    flag = torch.tensor([int(stop)], device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


class Reporter:
    """One job's measurements. The module-level functions use one shared instance (:func:`reporter`)."""

    def __init__(
        self,
        *,
        unit: str | None = None,
        max_steps: int | None = None,
        warmup_steps: int | None = None,
        stop_rule: str | None = None,
        ci_tolerance: float | None = None,
        min_timed_steps: int | None = None,
        output_dir: str | Path | None = None,
        clock: Callable[[], float] = time.perf_counter,
        emit: Callable[[str], None] | None = None,
        reporter_name: str = "helper",
        measure_usage: bool = True,
    ) -> None:
        self.unit = unit or os.environ.get("GPUSCOUT_UNIT", "samples")
        if self.unit not in ("tokens", "samples"):
            raise ValueError(f"unit must be tokens or samples, not {self.unit!r}")
        self.max_steps = max_steps if max_steps is not None else _env_int("GPUSCOUT_MAX_STEPS", None)
        auto_warmup = default_warmup_steps(self.max_steps) if self.max_steps else 3
        self.warmup_steps = warmup_steps if warmup_steps is not None else _env_int("GPUSCOUT_WARMUP_STEPS", auto_warmup)
        self.stop_rule = stop_rule or os.environ.get("GPUSCOUT_STOP_RULE", "fixed")
        self.ci_tolerance = ci_tolerance or _env_float("GPUSCOUT_CI_TOLERANCE", 0.02) or 0.02
        self.min_timed_steps = min_timed_steps or _env_int("GPUSCOUT_MIN_TIMED_STEPS", 10) or 10
        self.items_per_sample = _env_float("GPUSCOUT_ITEMS_PER_SAMPLE", None)
        self.output_dir = Path(output_dir or os.environ.get("SM_OUTPUT_DATA_DIR", "."))
        self.reporter_name = reporter_name
        self.stats = StepStats(warmup_steps=self.warmup_steps or 0)
        self._clock = clock
        self._emit = emit or (lambda line: print(line, flush=True))
        self._sync: Callable[[], object] = lambda: None
        self._started = clock()
        self._last = self._started
        # the process's own CPU time, page faults and switches between step() calls (not when reading a log)
        self._meter = ResourceMeter() if measure_usage else None
        self._used = ResourceMeter.read()
        self._phase: str | None = None  # None = automatic: the first warmup_steps steps are warm-up
        self._losses: list[dict[str, Any]] = []
        self._tokens_total = 0
        self._samples_total = 0
        self.stop_reason: str | None = None
        self.finished = False

    # -- what the script calls -------------------------------------------------------------------------------

    def configure(self, *, sync: Callable[[], object] | None = None) -> None:
        if sync is not None:
            self._sync = sync

    def phase(self, name: str) -> None:
        """``warmup``: the following steps are not timed; ``timed``: they are (overrides the automatic count)."""
        if name not in ("warmup", "timed"):
            raise ValueError(f"phase is 'warmup' or 'timed', not {name!r}")
        self._phase = name
        self._last = self._now()
        self._used = ResourceMeter.read()

    def step(
        self,
        *,
        samples: int | None = None,
        tokens: int | None = None,
        loss: float | None = None,
        seconds: float | None = None,
    ) -> bool:
        """One optimizer step ended: its samples and tokens (all ranks together: under torchrun, one rank's batch x
        the world size), its loss. Returns True when the script should stop (max_steps reached, or steady state under
        that rule); under torch.distributed every rank gets rank 0's answer (call it on every rank, every step)."""
        now = self._now()
        elapsed = seconds if seconds is not None else now - self._last
        self._last = now
        usage = self._meter.since(self._used) if self._meter is not None else {}
        self._used = ResourceMeter.read()
        if samples is None and self.unit == "samples":
            raise ValueError("a samples job must pass step(samples=...)")
        samples = int(samples or 0)
        if tokens is None:
            tokens = round(samples * self.items_per_sample) if self.items_per_sample else 0
        if tokens == 0 and self.unit == "tokens":
            raise ValueError("a tokens job must pass step(tokens=...) (non-padding tokens of all ranks)")
        number = len(self.stats.records) + 1
        timed = self._phase == "timed" or (self._phase is None and not self.stats.is_warmup(number))
        self.stats.add(StepRecord(number, elapsed, int(tokens), samples, 0.0, float(loss or 0.0), timed=timed, **usage))
        self._tokens_total += int(tokens)
        self._samples_total += samples
        if loss is not None:
            self._losses.append(
                {
                    "step": number,
                    "tokens": self._tokens_total,
                    "samples": self._samples_total,
                    "elapsed_s": sum(r.seconds for r in self.stats.records),
                    "loss": float(loss),
                }
            )
        rate = (samples if self.unit == "samples" else tokens) / elapsed if elapsed > 0 else None
        self._emit(
            format_metric_line(
                {
                    "step": number,
                    "loss": loss,
                    f"{self.unit}_per_s": rate,
                    **({"tokens_per_s": tokens / elapsed} if self.unit == "samples" and tokens and elapsed else {}),
                    "step_time_s": elapsed,
                }
            )
        )
        answered = self.stop_reason is not None
        stop = _agreed_stop(self.should_stop())
        if stop and not answered:  # the runner ends a script that goes on STOP_GRACE_S after this line
            self._emit(format_metric_line({"stop_step": number}))
        return stop

    def should_stop(self) -> bool:
        count = len(self.stats.records)
        if self.stop_reason is not None:
            return True
        if self.stop_rule == "steady_state":
            reached, reason = self.stats.steady_state_reached(
                ci_tolerance=self.ci_tolerance, min_timed_steps=self.min_timed_steps, unit=self.unit
            )
            if reached:
                self.stop_reason = reason
                return True
        if self.max_steps is not None and count >= self.max_steps:
            self.stop_reason = "max_steps reached"
            return True
        return False

    def done(self) -> dict[str, Any]:
        """Write benchmark.json (completed) and the summary metric line; returns what was written."""
        result = self.result()
        self._write(result)
        summary = result["throughput"] or {}
        self._emit(
            format_metric_line(
                {
                    f"{self.unit}_per_s": summary.get(f"{self.unit}_per_s"),
                    "step_time_p50_s": result["timing"]["step_time_p50_s"],
                    "step_time_p90_s": result["timing"]["step_time_p90_s"],
                    "final_loss": (result["loss"] or {}).get("final_train_loss"),
                },
                summary=True,
            )
        )
        return result

    def fail(self, reason: str) -> None:
        """Write a failed benchmark.json with ``reason`` (the runner classifies "out of memory" as OOM)."""
        self._write(self._base("failed", failure_reason=reason[-1500:]))

    # -- the result ----------------------------------------------------------------------------------------------

    def _now(self) -> float:
        self._sync()
        return self._clock()

    def _base(self, status: str, failure_reason: str | None = None) -> dict[str, Any]:
        gpus = _env_int("SM_NUM_GPUS", 0) or 0
        hosts = json.loads(os.environ.get("SM_HOSTS", '["algo-1"]'))
        torch = sys.modules.get("torch")
        return {
            "schema_version": SCHEMA_VERSION,
            "status": status,
            "unit": self.unit,
            "job_name": os.environ.get("GPUSCOUT_JOB_NAME", "local"),
            "run_id": os.environ.get("GPUSCOUT_RUN_ID"),
            "instance_type": os.environ.get("SM_CURRENT_INSTANCE_TYPE", "local"),
            "failure_reason": failure_reason,
            "job": {
                "entry_point": os.environ.get("GPUSCOUT_ENTRY_POINT") or Path(sys.argv[0] or "unknown").name,
                "hyperparameters": json.loads(os.environ.get("SM_HPS", "{}")),
                "reporter": self.reporter_name,
                "items_per_sample": self.items_per_sample,
            },
            "hardware": {
                "device": "cuda" if gpus else "cpu",
                "gpus_per_node": gpus,
                "nodes": max(1, len(hosts)),
                "world_size": max(1, gpus) * max(1, len(hosts)),
                "cpu_model": platform.processor() or None,
                "cpu_count": os.cpu_count(),
            },
            "software": {
                "python": platform.python_version(),
                "torch": getattr(torch, "__version__", None) if torch is not None else None,
                "gpuscout": _gpuscout_version(),
                **nvidia_versions(),
            },
        }

    def result(self) -> dict[str, Any]:
        stats = self.stats
        if not stats.timed:
            raise ValueError(
                f"no timed steps: {len(stats.records)} step(s) reported, {stats.warmup_steps} are warm-up; "
                "report more steps or lower training.warmup_steps"
            )
        s = stats.summary()
        wall = self._clock() - self._started
        tokens_known = s["tokens_timed"] > 0
        gpus = _env_int("SM_NUM_GPUS", 0) or 0
        result = self._base("completed")
        result["timing"] = {
            "warmup_steps": sum(1 for r in stats.records if not r.timed),
            "timed_steps": s["timed_steps"],
            "total_steps": len(stats.records),
            "step_time_mean_s": s["step_time_mean_s"],
            "step_time_p50_s": s["step_time_p50_s"],
            "step_time_p90_s": s["step_time_p90_s"],
            "wall_time_s": max(wall, s["train_time_s"]),
            "train_time_s": s["train_time_s"],
            "dataloader_wait_fraction": 0.0,
            "startup_time_s": 0.0,
        }
        result["throughput"] = {
            "tokens_per_s": s["tokens_per_s"] if tokens_known else None,
            "tokens_per_s_ci95": list(s["tokens_per_s_ci95"]) if tokens_known else None,
            "tokens_per_s_per_gpu": s["tokens_per_s"] / gpus if tokens_known and gpus else None,
            "samples_per_s": s["samples_per_s"],
            "samples_per_s_ci95": list(s["samples_per_s_ci95"]),
            "tokens_timed": s["tokens_timed"],
            "samples_timed": s["samples_timed"],
        }
        result["loss"] = {
            "train": self._losses,
            "final_train_loss": self._losses[-1]["loss"] if self._losses else None,
        }
        count = len(stats.records)
        result["stop"] = {
            "rule": self.stop_rule,
            "reason": self.stop_reason or f"the script ended after {count} steps",
            "steps": count,
        }
        result["steps"] = step_accounts(stats.records)
        result["disturbance"] = detect(result["steps"])
        return result

    def _write(self, result: dict[str, Any]) -> None:
        if os.environ.get("RANK", "0") != "0":  # one process writes: the numbers are for all ranks
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.output_dir / "benchmark.json.tmp"
        tmp.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        tmp.replace(self.output_dir / "benchmark.json")
        self.finished = True


def _gpuscout_version() -> str:
    try:
        import gpuscout

        return str(gpuscout.__version__)
    except ImportError:
        return "unknown"


_SHARED: list[Reporter] = []


def reporter() -> Reporter:
    """The shared Reporter, created on first use from the job's environment (GPUSCOUT_*, SM_*)."""
    if not _SHARED:
        _SHARED.append(Reporter())
        _install_failure_hook(_SHARED[0])
    return _SHARED[0]


def _install_failure_hook(rep: Reporter) -> None:
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if not rep.finished:
            rep.fail(f"{kind.__name__}: {value}")
        previous(kind, value, tb)

    sys.excepthook = hook


def configure(*, sync: Callable[[], object] | None = None) -> None:
    reporter().configure(sync=sync)


def phase(name: str) -> None:
    reporter().phase(name)


def step(
    *, samples: int | None = None, tokens: int | None = None, loss: float | None = None, seconds: float | None = None
) -> bool:
    return reporter().step(samples=samples, tokens=tokens, loss=loss, seconds=seconds)


def done() -> dict[str, Any]:
    return reporter().done()
