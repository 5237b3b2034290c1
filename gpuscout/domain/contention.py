"""What a local job's row says of the machine's other load while it ran (gpuscout.local.contention measures it): a
measurement taken while other processes competed for the CPU or the GPU is flagged wherever it is shown and never
decides a verdict."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Contention(BaseModel):
    model_config = ConfigDict(extra="forbid")

    samples: int = 0  # how many times the machine's load was read while the job ran
    cpu_count: int | None = None
    other_cpu_cores_mean: float | None = None  # CPU cores other processes used, on average
    other_cpu_cores_max: float | None = None
    load_average_max: float | None = None
    other_gpu_pids: list[int] = Field(default_factory=list)  # other processes seen on the GPU
    competing: bool = False
    note: str | None = None  # "measured under competition: ..." when competing
