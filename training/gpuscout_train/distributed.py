"""train.py's distributed set-up: the ranks (one process, torchrun's variables, or SageMaker's environment for one
process), the process group (NCCL on GPUs, gloo on CPUs) and the way a finished rank leaves.

Imported by train.py; imports nothing of gpuscout."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

import torch


@dataclass
class Dist:
    world_size: int
    rank: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order."""
        if self.world_size == 1:
            return [value]
        values: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(values, value)
        return values

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        return [float(v) for v in t.tolist()]


SINGLE_PROCESS_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def single_process_environment() -> None:
    """Without a launcher (one process: `gpuscout local`, a one-GPU SageMaker instance), set the variables a
    launcher would. DeepSpeed otherwise "discovers" its environment: under SageMaker (SM_TRAINING_ENV is set, also by
    gpuscout local) it reads OMPI_COMM_WORLD_RANK (KeyError), elsewhere it imports mpi4py (not installed)."""
    if "WORLD_SIZE" in os.environ and os.environ["WORLD_SIZE"] != "1":
        return
    defaults = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def init_distributed() -> Dist:
    single_process_environment()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(world, rank, local_rank, local_world, device)


def leave_together() -> NoReturn:
    """End a finished rank of a multi-rank job: every rank passes a barrier (all have written what they write),
    then the process exits without tearing the process group down. gloo's teardown (destroy_process_group, or the
    interpreter's C++ destructors) aborts a finished rank now and then ("terminate called without an active
    exception", exit -6, which SageMaker reports as a failed job): 2 of 40 two-rank torchrun runs of a minimal DDP
    script with barrier + destroy_process_group on a loaded 2-core machine, 0 of 60 with this exit."""
    torch.distributed.barrier()
    wandb = sys.modules.get("wandb")  # a tracked rank 0: W&B's service process is ended by an atexit hook
    if wandb is not None:
        wandb.teardown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
