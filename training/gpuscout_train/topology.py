"""Where this process runs in a SageMaker training job: its hosts, its place among them, the processes per host, and
the rendezvous and EFA/NCCL environment torchrun needs.

Reads /opt/ml/input/config/resourceconfig.json (``current_host``, ``hosts``) and SM_NUM_GPUS. Processes per host
follow SageMaker's training toolkit (aws/sagemaker-training-toolkit, src/sagemaker_training/runner.py
``_get_by_runner_type``): the number of GPUs, 1 on a CPU host, unless the hyperparameter
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

MASTER_PORT = 29500
SINGLE_HOST_MASTER = "127.0.0.1"  # torchrun's own default, which SageMaker's toolkit uses on one host
PROCESSES_PER_HOST_HP = "sagemaker_mpi_num_of_processes_per_host"  # the toolkit's name (params.py)

# The EFA/NCCL environment SageMaker's own PyTorch launcher sets before torchrun, from aws/sagemaker-training-toolkit
# (commit 3383937, 2025-09-19): src/sagemaker_training/torch_distributed.py, TorchDistributedRunner._setup. Without
# it, NCCL may fall back to TCP sockets and a multi-node benchmark measures the network, not the GPUs.
# FI_PROVIDER=efa: on every instance type whose catalog entry says "efa": true (configs/instances/<type>.json, which
# the image carries; uses_efa), not on a hand-kept copy of the toolkit's SM_EFA_NCCL_INSTANCES.
# FI_EFA_USE_DEVICE_RDMA=1, RDMAV_FORK_SAFE=1: on the toolkit's SM_EFA_RDMA_INSTANCES (src/sagemaker_training/
# __init__.py), kept as its list: the catalog says whether a type has EFA, not whether its EFA does device RDMA.
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


def read_hyperparameters(config_dir: Path, env: Mapping[str, str]) -> dict[str, object]:
    """hyperparameters.json, then SM_HPS over it (as train.py merges them)."""
    raw: dict[str, object] = {}
    hp_file = config_dir / "hyperparameters.json"
    try:
        if hp_file.is_file():
            raw.update(json.loads(hp_file.read_text()))
        if env.get("SM_HPS"):
            raw.update(json.loads(env["SM_HPS"]))
    except (ValueError, TypeError) as err:
        raise TrainingError(f"{hp_file} / SM_HPS: unreadable hyperparameters ({err})") from err
    return raw


def _processes_per_host(config_dir: Path, env: Mapping[str, str]) -> int | None:
    """sagemaker_mpi_num_of_processes_per_host from the hyperparameters."""
    raw = read_hyperparameters(config_dir, env)
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


def uses_efa(instance_type: str | None) -> bool:
    """Whether the instance type has EFA, as its catalog entry says (configs/instances/<type>.json ``efa``).

    A type the catalog does not know (or a catalog that cannot be read) counts as no EFA, with a line in the job's
    log, instead of failing the job: gpuscout itself launches catalogued types only (a manifest's targets are checked
    against the catalog before anything runs), so this is the image run by hand on another type. Left unset,
    FI_PROVIDER only stops forcing libfabric's EFA provider: the job runs, at worst over a slower transport, and the
    log says why. The toolkit's own list is not kept as a fallback: it is the hand-kept copy this replaces, and it
    had already gone stale (it predates P5e/P5en).
    """
    if instance_type is None:  # outside SageMaker (no resourceconfig.json current_instance_type)
        return False
    from gpuscout import paths
    from gpuscout.domain.catalog import load_instance
    from gpuscout.errors import CatalogError

    try:  # the type's own file: the price snapshot has nothing to do with the network
        instance = load_instance(instance_type)
    except CatalogError as err:
        print(
            f"[launcher] no EFA settings for {instance_type}: the instance catalog cannot be read ({err})", flush=True
        )
        return False
    if instance is None:
        print(
            f"[launcher] {instance_type} is not in the instance catalog ({paths.CONFIG_DIR / 'instances'}): treated "
            "as having no EFA (FI_PROVIDER left unset)",
            flush=True,
        )
        return False
    return instance.efa


def distributed_environment(topology: Topology) -> dict[str, str]:
    """The variables SageMaker's PyTorch launcher sets for a torchrun job (see EFA_RDMA_INSTANCES)."""
    env = {"NCCL_SOCKET_IFNAME": topology.network_interface, "NCCL_PROTO": "simple"}
    if uses_efa(topology.instance_type):
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


def process_command(
    topology: Topology,
    program: Sequence[str],
    *,
    python: str = sys.executable,
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    """``python PROGRAM`` where this host runs one process, else torchrun starting PROGRAM once per process.
    ``PROGRAM`` is ``-m MODULE args`` or ``SCRIPT args``: torchrun reads both the way Python does (its ``-m`` is
    ``--module``)."""
    if len(topology.hosts) == 1 and topology.processes_per_host == 1:
        return [python, *program]
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
        *program,
    ]
