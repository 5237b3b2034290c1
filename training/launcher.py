"""Container entry point: start train.py on every GPU of every host of a SageMaker training job.

Reads /opt/ml/input/config/resourceconfig.json (``current_host``, ``hosts``) and SM_NUM_GPUS. One process on a
CPU or single-GPU host runs train.py directly; otherwise ``torchrun`` starts one process per GPU with the first
host (in SageMaker's order) as the rendezvous master. Extra command-line arguments are handed to train.py, which
reads the hyperparameters itself (hyperparameters.json / SM_HPS).

Processes per host follow SageMaker's training toolkit (aws/sagemaker-training-toolkit, src/sagemaker_training/
runner.py ``_get_by_runner_type``): the number of GPUs, 1 on a CPU host, unless the hyperparameter
``sagemaker_mpi_num_of_processes_per_host`` says otherwise (train.py ignores ``sagemaker_*`` hyperparameters). On
one host the rendezvous is 127.0.0.1, as the toolkit's torchrun command has no ``--master_addr`` for one host
(torch_distributed.py ``_create_command``); on several, the first host.

GPUSCOUT_MASTER_ADDR / GPUSCOUT_MASTER_PORT replace the rendezvous address and port. SageMaker never sets them;
they let several "hosts" run on one machine (tests/training/test_multiprocess.py starts algo-1 and algo-2 on
localhost, where the name algo-1 does not resolve).
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
SINGLE_HOST_MASTER = "127.0.0.1"  # torchrun's own default, which SageMaker's toolkit uses on one host
PROCESSES_PER_HOST_HP = "sagemaker_mpi_num_of_processes_per_host"  # the toolkit's name (params.py)

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
    processes_override: int | None = None  # hyperparameter sagemaker_mpi_num_of_processes_per_host

    @property
    def node_rank(self) -> int:
        return self.hosts.index(self.current_host)

    @property
    def processes_per_host(self) -> int:
        return self.processes_override or max(1, self.gpus_per_host)

    @property
    def world_size(self) -> int:
        return len(self.hosts) * self.processes_per_host


def _processes_per_host(config_dir: Path, env: Mapping[str, str]) -> int | None:
    """sagemaker_mpi_num_of_processes_per_host from hyperparameters.json, then SM_HPS (as train.py merges them)."""
    raw: dict[str, object] = {}
    hp_file = config_dir / "hyperparameters.json"
    try:
        if hp_file.is_file():
            raw.update(json.loads(hp_file.read_text()))
        if env.get("SM_HPS"):
            raw.update(json.loads(env["SM_HPS"]))
    except (ValueError, TypeError) as err:
        raise TrainingError(f"{hp_file} / SM_HPS: unreadable hyperparameters ({err})") from err
    if PROCESSES_PER_HOST_HP not in raw:
        return None
    value = raw[PROCESSES_PER_HOST_HP]
    text = str(value).strip()
    if len(text) >= 2 and text[0] == text[-1] == '"':  # the SageMaker SDK JSON-encodes hyperparameter values
        text = text[1:-1]
    if not text.isdigit() or int(text) < 1:
        raise TrainingError(f"{PROCESSES_PER_HOST_HP}={value!r} is not a positive whole number")
    return int(text)


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
        processes_override=_processes_per_host(config_dir, env),
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


def rendezvous(topology: Topology, environ: Mapping[str, str] | None = None) -> tuple[str, int]:
    """torchrun's master address and port: 127.0.0.1 on one host, else the first host; GPUSCOUT_MASTER_* win."""
    env = os.environ if environ is None else environ
    default = SINGLE_HOST_MASTER if len(topology.hosts) == 1 else topology.hosts[0]
    address = env.get("GPUSCOUT_MASTER_ADDR") or default
    try:
        port = int(env.get("GPUSCOUT_MASTER_PORT") or MASTER_PORT)
    except ValueError as err:
        raise TrainingError(f"GPUSCOUT_MASTER_PORT={env['GPUSCOUT_MASTER_PORT']!r} is not a port number") from err
    return address, port


def build_command(
    topology: Topology,
    train_args: Sequence[str],
    python: str = sys.executable,
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    """The command this host runs: train.py itself, or torchrun around it."""
    if len(topology.hosts) == 1 and topology.processes_per_host == 1:
        return [python, str(TRAIN_SCRIPT), *train_args]
    address, port = rendezvous(topology, environ)
    return [
        python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={len(topology.hosts)}",
        f"--node_rank={topology.node_rank}",
        f"--nproc_per_node={topology.processes_per_host}",
        f"--master_addr={address}",
        f"--master_port={port}",
        str(TRAIN_SCRIPT),
        *train_args,
    ]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["train"]:  # SageMaker starts training containers as `docker run IMAGE train`
        args = args[1:]
    try:
        topology = read_topology()
        command = build_command(topology, args)
    except TrainingError as err:
        print(f"launcher: error: {err}", file=sys.stderr, flush=True)
        return 2
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
