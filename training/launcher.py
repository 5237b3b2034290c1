"""Container entry point: start train.py on every GPU of every host of a SageMaker training job.

Reads /opt/ml/input/config/resourceconfig.json (``current_host``, ``hosts``) and SM_NUM_GPUS. One process on a
CPU or single-GPU host runs train.py directly; otherwise ``torchrun`` starts one process per GPU with the first
host (in SageMaker's order) as the rendezvous master. Extra command-line arguments are handed to train.py, which
reads the hyperparameters itself (hyperparameters.json / SM_HPS).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuscout.errors import TrainingError

TRAIN_SCRIPT = Path(__file__).resolve().parent / "train.py"
MASTER_PORT = 29500

# The EFA/NCCL environment SageMaker's own PyTorch launcher sets before torchrun, from aws/sagemaker-training-toolkit
# (commit 3383937, 2025-09-19): src/sagemaker_training/torch_distributed.py, TorchDistributedRunner._setup, with the
# instance lists of src/sagemaker_training/__init__.py (SM_EFA_NCCL_INSTANCES, SM_EFA_RDMA_INSTANCES). The toolkit's
# list predates P5e/P5en; they have EFA (configs/instances: "efa": true), so they get FI_PROVIDER=efa too. Without
# these, NCCL may fall back to TCP sockets and a multi-node benchmark measures the network, not the GPUs.
EFA_NCCL_INSTANCES = frozenset(
    {"ml.g4dn.8xlarge", "ml.g4dn.12xlarge", "ml.g5.48xlarge", "ml.p3dn.24xlarge", "ml.p4d.24xlarge",
     "ml.p4de.24xlarge", "ml.p5.48xlarge", "ml.trn1.32xlarge", "ml.p6e-gb200.36xlarge",
     "ml.p5e.48xlarge", "ml.p5en.48xlarge"}  # the last two: gpuscout's addition (EFA instances)
)  # fmt: skip
EFA_RDMA_INSTANCES = frozenset({"ml.p4d.24xlarge", "ml.p4de.24xlarge", "ml.trn1.32xlarge", "ml.p6e-gb200.36xlarge"})


@dataclass(frozen=True)
class Topology:
    hosts: list[str]
    current_host: str
    gpus_per_host: int
    instance_type: str | None = None  # resourceconfig.json current_instance_type
    network_interface: str = "eth0"  # resourceconfig.json network_interface_name (SageMaker's default: eth0)

    @property
    def node_rank(self) -> int:
        return self.hosts.index(self.current_host)

    @property
    def world_size(self) -> int:
        return len(self.hosts) * max(1, self.gpus_per_host)


def read_topology(environ: Mapping[str, str] | None = None) -> Topology:
    env = os.environ if environ is None else environ
    config_dir = Path(env.get("SM_INPUT_CONFIG_DIR", "/opt/ml/input/config"))
    resource_file = config_dir / "resourceconfig.json"
    if resource_file.is_file():
        try:
            data = json.loads(resource_file.read_text())
            hosts = [str(h) for h in data["hosts"]]
            current = str(data["current_host"])
            instance_type = data.get("current_instance_type")
            interface = str(data.get("network_interface_name") or "eth0")
        except (ValueError, KeyError, TypeError) as err:
            raise TrainingError(f"{resource_file}: unreadable resource config ({err})") from err
        if current not in hosts:
            raise TrainingError(f"{resource_file}: current_host {current!r} is not in hosts {hosts}")
    else:  # outside SageMaker (gpuscout local): one host
        hosts, current, instance_type, interface = ["localhost"], "localhost", None, "eth0"
    if "SM_NUM_GPUS" in env:
        gpus = int(env["SM_NUM_GPUS"])
    else:
        import torch

        gpus = torch.cuda.device_count()
    return Topology(
        hosts=hosts,
        current_host=current,
        gpus_per_host=gpus,
        instance_type=str(instance_type) if instance_type else None,
        network_interface=interface,
    )


def distributed_environment(topology: Topology) -> dict[str, str]:
    """The variables SageMaker's PyTorch launcher sets for a torchrun job (see EFA_NCCL_INSTANCES)."""
    env = {"NCCL_SOCKET_IFNAME": topology.network_interface, "NCCL_PROTO": "simple"}
    if topology.instance_type in EFA_NCCL_INSTANCES:
        env["FI_PROVIDER"] = "efa"
    if topology.instance_type in EFA_RDMA_INSTANCES:
        env["FI_EFA_USE_DEVICE_RDMA"] = "1"
        env["RDMAV_FORK_SAFE"] = "1"
    return env


def build_command(topology: Topology, train_args: Sequence[str], python: str = sys.executable) -> list[str]:
    """The command this host runs: train.py itself, or torchrun around it."""
    if len(topology.hosts) == 1 and topology.gpus_per_host <= 1:
        return [python, str(TRAIN_SCRIPT), *train_args]
    return [
        python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={len(topology.hosts)}",
        f"--node_rank={topology.node_rank}",
        f"--nproc_per_node={max(1, topology.gpus_per_host)}",
        f"--master_addr={topology.hosts[0]}",
        f"--master_port={MASTER_PORT}",
        str(TRAIN_SCRIPT),
        *train_args,
    ]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["train"]:  # SageMaker starts training containers as `docker run IMAGE train`
        args = args[1:]
    try:
        topology = read_topology()
    except TrainingError as err:
        print(f"launcher: error: {err}", file=sys.stderr, flush=True)
        return 2
    command = build_command(topology, args)
    if command[1:3] == ["-m", "torch.distributed.run"] and topology.current_host != "localhost":
        for key, value in distributed_environment(topology).items():
            os.environ.setdefault(key, value)  # a value the user set in the job's Environment wins
    print(
        f"[launcher] host {topology.current_host} ({topology.node_rank + 1}/{len(topology.hosts)}): {' '.join(command)}"
    )
    sys.stdout.flush()
    os.execv(command[0], command)  # replaces this process; exit status is train.py's / torchrun's
    return 0  # pragma: no cover - execv does not return


if __name__ == "__main__":
    sys.exit(main())
