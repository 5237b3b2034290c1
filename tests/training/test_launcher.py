from __future__ import annotations

import json
from pathlib import Path

import pytest
from gpuscout_train import launcher, topology

from gpuscout.domain import catalog as catalog_module
from gpuscout.domain.catalog import load_catalog
from gpuscout.errors import CatalogError


def _topology(tmp_path: Path, current: str, gpus: str) -> topology.Topology:
    (tmp_path / "resourceconfig.json").write_text(
        json.dumps({"current_host": current, "hosts": ["algo-1", "algo-2"], "network_interface_name": "eth0"})
    )
    return topology.read_topology({"SM_INPUT_CONFIG_DIR": str(tmp_path), "SM_NUM_GPUS": gpus})


def test_two_hosts_of_eight_gpus_run_torchrun(tmp_path: Path) -> None:
    topo = _topology(tmp_path, "algo-2", "8")
    assert topo.node_rank == 1 and topo.world_size == 16
    cmd = launcher.build_command(topo, ["--max_steps", "5"], python="/usr/bin/python3")
    assert cmd == [
        "/usr/bin/python3", "-m", "torch.distributed.run", "--nnodes=2", "--node_rank=1", "--nproc_per_node=8",
        "--master_addr=algo-1", "--master_port=29500", "-m", launcher.TRAIN_MODULE, "--max_steps", "5",
    ]  # fmt: skip


def test_sagemaker_train_argument_is_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    monkeypatch.setenv("SM_INPUT_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("SM_NUM_GPUS", "0")
    monkeypatch.setattr(launcher.os, "execv", lambda path, cmd: seen.append(cmd))
    assert launcher.main(["train", "--max_steps", "3"]) == 0
    assert seen[0][-4:] == ["-m", launcher.TRAIN_MODULE, "--max_steps", "3"]


def test_single_device_runs_train_directly(tmp_path: Path) -> None:
    for gpus in ("0", "1"):
        topo = topology.read_topology({"SM_INPUT_CONFIG_DIR": str(tmp_path / "absent"), "SM_NUM_GPUS": gpus})
        assert launcher.build_command(topo, [], python="py") == ["py", "-m", launcher.TRAIN_MODULE]


@pytest.mark.parametrize(
    ("instance", "expected"),
    [
        ("ml.p4d.24xlarge", {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "RDMAV_FORK_SAFE": "1"}),
        ("ml.p5.48xlarge", {"FI_PROVIDER": "efa"}),
        ("ml.p5en.48xlarge", {"FI_PROVIDER": "efa"}),
        ("ml.zz9.48xlarge", {}),  # not in the catalog: no EFA (and the job still starts); catalogued types: below
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


def _two_hosts_on(instance_type: str | None) -> topology.Topology:
    return topology.Topology(hosts=["algo-1", "algo-2"], current_host="algo-1", gpus_per_host=8,
                             instance_type=instance_type)  # fmt: skip


def test_efa_follows_the_catalog_for_every_catalogued_type() -> None:
    # Given every instance type of the catalog the image carries (configs/instances/*.json, whatever types it holds)
    catalog = load_catalog()
    assert any(t.efa for t in catalog) and any(not t.efa for t in catalog)
    for instance in catalog:
        # When the launcher sets up a two-host job on it, Then FI_PROVIDER=efa is set exactly where the catalog says EFA
        env = topology.distributed_environment(_two_hosts_on(instance.instance_type))
        assert (env.get("FI_PROVIDER") == "efa") == instance.efa, instance.instance_type
        # and device RDMA only on the toolkit's RDMA list, which holds EFA types only
        assert ("FI_EFA_USE_DEVICE_RDMA" in env) == (instance.instance_type in topology.EFA_RDMA_INSTANCES)
        assert instance.efa or instance.instance_type not in topology.EFA_RDMA_INSTANCES


def test_an_instance_type_outside_the_catalog_gets_no_efa_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    # Given a type the catalog does not hold, When the launcher sets up a two-host job on it
    env = topology.distributed_environment(_two_hosts_on("ml.zz9.48xlarge"))
    # Then it is treated as having no EFA, with a line in the job's log saying so; no crash
    assert "FI_PROVIDER" not in env and env["NCCL_PROTO"] == "simple"
    assert "ml.zz9.48xlarge is not in the instance catalog" in capsys.readouterr().out
    # Outside SageMaker (no instance type) the catalog is not consulted and nothing is logged
    assert "FI_PROVIDER" not in topology.distributed_environment(_two_hosts_on(None))
    assert capsys.readouterr().out == ""


def test_an_unreadable_catalog_gets_no_efa_and_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(instance_type: str, config_dir: object = None) -> object:
        raise CatalogError("configs/instances: no instance files")

    monkeypatch.setattr(catalog_module, "load_instance", broken)
    env = topology.distributed_environment(_two_hosts_on("ml.p5.48xlarge"))
    assert "FI_PROVIDER" not in env
    assert "the instance catalog cannot be read (configs/instances: no instance files)" in capsys.readouterr().out


def test_the_efa_flag_does_not_depend_on_the_price_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a refresh gone wrong (or no snapshot at all) must not switch EFA off on a p5
    import shutil

    from gpuscout import paths

    config = tmp_path / "configs"
    shutil.copytree(paths.CONFIG_DIR, config)
    (config / "pricing" / "sagemaker.json").unlink()
    monkeypatch.setattr(paths, "CONFIG_DIR", config)
    assert topology.uses_efa("ml.p5.48xlarge") and not topology.uses_efa("ml.g6e.xlarge")


def test_a_single_process_gets_no_nccl_environment(tmp_path: Path) -> None:
    topo = topology.read_topology({"SM_INPUT_CONFIG_DIR": str(tmp_path / "absent"), "SM_NUM_GPUS": "1"})
    assert launcher.build_command(topo, [], python="py")[1:3] != ["-m", "torch.distributed.run"]


def _cpu_host(tmp_path: Path, hyperparameters: dict[str, object], **env: str) -> topology.Topology:
    (tmp_path / "resourceconfig.json").write_text(json.dumps({"current_host": "algo-1", "hosts": ["algo-1"]}))
    (tmp_path / "hyperparameters.json").write_text(json.dumps(hyperparameters))
    return topology.read_topology({"SM_INPUT_CONFIG_DIR": str(tmp_path), "SM_NUM_GPUS": "0", **env})


@pytest.mark.parametrize("value", ["2", '"2"', 2], ids=["string", "sdk-json-encoded", "number"])
def test_processes_per_host_hyperparameter_starts_torchrun_on_a_cpu_host(tmp_path: Path, value: object) -> None:
    # Given a CPU host (SM_NUM_GPUS=0) whose job sets SageMaker's processes-per-host hyperparameter
    topo = _cpu_host(tmp_path, {"max_steps": "5", "sagemaker_mpi_num_of_processes_per_host": value})
    # When the launcher builds its command
    cmd = launcher.build_command(topo, [], python="py", environ={})
    # Then torchrun starts 2 ranks on this host, with the rendezvous on 127.0.0.1 (one host: no name lookup)
    assert topo.processes_per_host == 2 and topo.world_size == 2
    assert cmd == [
        "py", "-m", "torch.distributed.run", "--nnodes=1", "--node_rank=0", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", "--master_port=29500", "-m", launcher.TRAIN_MODULE,
    ]  # fmt: skip


def test_cpu_host_without_the_hyperparameter_runs_one_process(tmp_path: Path) -> None:
    topo = _cpu_host(tmp_path, {"max_steps": "5"})
    assert topo.processes_per_host == 1
    assert launcher.build_command(topo, [], python="py", environ={}) == ["py", "-m", launcher.TRAIN_MODULE]


def test_sm_hps_overrides_hyperparameters_json_for_processes_per_host(tmp_path: Path) -> None:
    hps = json.dumps({"sagemaker_mpi_num_of_processes_per_host": "3"})
    topo = _cpu_host(tmp_path, {"sagemaker_mpi_num_of_processes_per_host": "2"}, SM_HPS=hps)
    assert topo.processes_per_host == 3


@pytest.mark.parametrize("value", ["0", "two", "-1", ""])
def test_a_bad_processes_per_host_is_a_clear_launcher_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    (tmp_path / "hyperparameters.json").write_text(json.dumps({"sagemaker_mpi_num_of_processes_per_host": value}))
    monkeypatch.setattr(launcher.os, "environ", {"SM_INPUT_CONFIG_DIR": str(tmp_path), "SM_NUM_GPUS": "0"})
    monkeypatch.setattr(launcher.os, "execv", lambda path, cmd: pytest.fail("must not start anything"))
    assert launcher.main([]) == 2
    assert "sagemaker_mpi_num_of_processes_per_host" in capsys.readouterr().err


def test_one_host_of_eight_gpus_meets_on_localhost_like_sagemakers_toolkit(tmp_path: Path) -> None:
    # Given one 8-GPU host named algo-1 (the toolkit's torchrun command has no --master_addr for one host)
    (tmp_path / "resourceconfig.json").write_text(json.dumps({"current_host": "algo-1", "hosts": ["algo-1"]}))
    topo = topology.read_topology({"SM_INPUT_CONFIG_DIR": str(tmp_path), "SM_NUM_GPUS": "8"})
    # When / Then the rendezvous is torchrun's default address, not a host name that must resolve
    cmd = launcher.build_command(topo, [], python="py", environ={})
    assert "--master_addr=127.0.0.1" in cmd and "--nproc_per_node=8" in cmd


def test_master_address_and_port_overrides_for_several_hosts_on_one_machine(tmp_path: Path) -> None:
    topo = _topology(tmp_path, "algo-2", "1")
    # Without the overrides the first host is the master (production: SageMaker resolves algo-1)
    assert topology.rendezvous(topo, {}) == ("algo-1", 29500)
    # With them (tests run algo-1 and algo-2 on localhost) both hosts meet there
    env = {"GPUSCOUT_MASTER_ADDR": "127.0.0.1", "GPUSCOUT_MASTER_PORT": "41234"}
    cmd = launcher.build_command(topo, [], python="py", environ=env)
    assert "--master_addr=127.0.0.1" in cmd and "--master_port=41234" in cmd and "--node_rank=1" in cmd
    with pytest.raises(launcher.TrainingError, match="GPUSCOUT_MASTER_PORT"):
        topology.rendezvous(topo, {"GPUSCOUT_MASTER_PORT": "http"})
