"""Settings a device cannot train with at all, whatever the memory: one rule for the planner's refusals, a settings
search's skipped candidates and `gpuscout validate`'s check of a `local` target on this machine."""

from __future__ import annotations

import importlib.util

from gpuscout.domain.adapters import QLORA_ON_CPU

# PyTorch's FlexAttention runs forward on a CPU, but with inputs that need gradients it refuses ("FlexAttention does
# not support backward on CPU"); tests/training/test_device_fit.py holds the installed torch to that.
FLEX_ON_CPU = "attention flex has no backward pass on a CPU (PyTorch's FlexAttention); use attention sdpa or eager"


def device_refusal(
    *, deepspeed_stage: int, attention: str, device: str, world: int, method: str = "full", local: bool = False
) -> str | None:
    """Why a variant with these settings cannot train on ``device`` with ``world`` GPUs in all, or None; ``local``:
    on this machine (whose libraries are the job's)."""
    if method == "qlora" and device == "cpu":
        return QLORA_ON_CPU
    if method == "qlora" and local and importlib.util.find_spec("bitsandbytes") is None:
        return "method qlora needs bitsandbytes, which is not installed here: pip install bitsandbytes==0.50.2"
    if deepspeed_stage and (device == "cpu" or world < 2):
        where = "on a CPU" if device == "cpu" else "with one GPU"
        return f"ZeRO stage {deepspeed_stage} shards across GPUs, not {where}; use deepspeed_stage 0"
    if attention == "flex" and device == "cpu":
        return FLEX_ON_CPU
    return None
