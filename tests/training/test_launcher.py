from __future__ import annotations

import json
from pathlib import Path

import launcher
import pytest


def _topology(tmp_path: Path, current: str, gpus: str) -> launcher.Topology:
    (tmp_path / "resourceconfig.json").write_text(
        json.dumps({"current_host": current, "hosts": ["algo-1", "algo-2"], "network_interface_name": "eth0"})
    )
    return launcher.read_topology({"SM_INPUT_CONFIG_DIR": str(tmp_path), "SM_NUM_GPUS": gpus})


def test_two_hosts_of_eight_gpus_run_torchrun(tmp_path: Path) -> None:
    topo = _topology(tmp_path, "algo-2", "8")
    assert topo.node_rank == 1 and topo.world_size == 16
    cmd = launcher.build_command(topo, ["--max_steps", "5"], python="/usr/bin/python3")
    assert cmd == [
        "/usr/bin/python3", "-m", "torch.distributed.run", "--nnodes=2", "--node_rank=1", "--nproc_per_node=8",
        "--master_addr=algo-1", "--master_port=29500", str(launcher.TRAIN_SCRIPT), "--max_steps", "5",
    ]  # fmt: skip


def test_sagemaker_train_argument_is_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    monkeypatch.setenv("SM_INPUT_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("SM_NUM_GPUS", "0")
    monkeypatch.setattr(launcher.os, "execv", lambda path, cmd: seen.append(cmd))
    assert launcher.main(["train", "--max_steps", "3"]) == 0
    assert seen[0][-3:] == [str(launcher.TRAIN_SCRIPT), "--max_steps", "3"]


def test_single_device_runs_train_directly(tmp_path: Path) -> None:
    for gpus in ("0", "1"):
        topo = launcher.read_topology({"SM_INPUT_CONFIG_DIR": str(tmp_path / "absent"), "SM_NUM_GPUS": gpus})
        assert launcher.build_command(topo, [], python="py") == ["py", str(launcher.TRAIN_SCRIPT)]


@pytest.mark.parametrize(
    ("instance", "expected"),
    [
        ("ml.p4d.24xlarge", {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "RDMAV_FORK_SAFE": "1"}),
        ("ml.p5.48xlarge", {"FI_PROVIDER": "efa"}),
        ("ml.p5en.48xlarge", {"FI_PROVIDER": "efa"}),
        ("ml.g5.12xlarge", {}),
    ],
)
def test_multi_node_jobs_get_sagemakers_efa_and_nccl_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, instance: str, expected: dict[str, str]
) -> None:
    # Given a two-host SageMaker job on `instance` (resourceconfig.json as SageMaker writes it)
    (tmp_path / "resourceconfig.json").write_text(json.dumps({
        "current_host": "algo-1", "hosts": ["algo-1", "algo-2"], "current_instance_type": instance,
        "network_interface_name": "ethwe",
    }))  # fmt: skip
    environ = {"SM_INPUT_CONFIG_DIR": str(tmp_path), "SM_NUM_GPUS": "8", "PATH": "/usr/bin"}
    monkeypatch.setattr(launcher.os, "environ", environ)  # the launcher's changes stay inside this test
    monkeypatch.setattr(launcher.os, "execv", lambda path, cmd: None)
    # When the launcher starts torchrun
    assert launcher.main([]) == 0
    # Then the environment is the one SageMaker's PyTorch toolkit sets (torch_distributed.py _setup)
    seen = {k: launcher.os.environ.get(k) for k in ("FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "RDMAV_FORK_SAFE")}
    assert {k: v for k, v in seen.items() if v is not None} == expected
    assert launcher.os.environ["NCCL_SOCKET_IFNAME"] == "ethwe" and launcher.os.environ["NCCL_PROTO"] == "simple"


def test_a_single_process_gets_no_nccl_environment(tmp_path: Path) -> None:
    topo = launcher.read_topology({"SM_INPUT_CONFIG_DIR": str(tmp_path / "absent"), "SM_NUM_GPUS": "1"})
    assert launcher.build_command(topo, [], python="py")[1:3] != ["-m", "torch.distributed.run"]
