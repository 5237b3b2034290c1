"""The machines a run's numbers were measured on, as its jobs' benchmark.json files say (hardware and software): the
first thing a reader of a report asks. One row per distinct machine and software stack."""

from __future__ import annotations

from collections.abc import Sequence

from gpuscout.domain.run_analysis import Machine
from gpuscout.store.base import JobRecord, JobStatus


def machines_of(jobs: Sequence[JobRecord]) -> list[Machine]:
    """Each distinct machine and software stack among the completed jobs, in the order first seen."""
    seen: dict[Machine, None] = {}
    for job in jobs:
        bench = job.benchmark
        if job.status is not JobStatus.COMPLETED or bench is None:
            continue
        hw, sw = bench.hardware, bench.software
        cuda = hw.device == "cuda"
        machine = Machine(
            instance_type=job.instance_type,
            device=hw.device,
            model=hw.gpu_name if cuda else hw.cpu_model,
            gpus=hw.world_size if cuda else 0,
            cpu_count=hw.cpu_count,
            python=sw.python,
            torch=sw.torch,
            transformers=sw.transformers,
            deepspeed=sw.deepspeed,
            cuda=sw.cuda_runtime or hw.cuda_version,
            driver=sw.nvidia_driver or hw.driver_version,
        )
        seen.setdefault(machine, None)
    return list(seen)
