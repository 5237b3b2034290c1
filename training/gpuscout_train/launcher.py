"""Container entry point (``python -m gpuscout_train.launcher``): start train.py on every GPU of every host of a
SageMaker training job.

One process on a CPU or single-GPU host runs train.py directly; otherwise ``torchrun`` starts one process per GPU
with the first host (in SageMaker's order) as the rendezvous master (topology.py). Extra command-line arguments are
handed to train.py, which reads the hyperparameters itself (hyperparameters.json / SM_HPS). When a manifest's job
section names the user's own script (GPUSCOUT_ENTRY_POINT), that script runs instead (job_code.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpuscout.errors import TrainingError
from gpuscout.paths import TRAIN_MODULE

from .job_code import JobCode, run_job_code, sagemaker_environment, script_arguments, write_failure
from .topology import Topology, distributed_environment, process_command, read_hyperparameters, read_topology


def build_command(
    topology: Topology,
    train_args: Sequence[str],
    python: str = sys.executable,
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    """The command this host runs: ``python -m gpuscout_train.train``, or torchrun around it."""
    return process_command(topology, ["-m", TRAIN_MODULE, *train_args], python=python, environ=environ)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["train"]:  # SageMaker starts training containers as `docker run IMAGE train`
        args = args[1:]
    try:
        code = JobCode.from_environment(os.environ)
        if code is not None:
            topology = read_topology()
            config_dir = Path(os.environ.get("SM_INPUT_CONFIG_DIR", "/opt/ml/input/config"))
            hyperparameters = read_hyperparameters(config_dir, os.environ)
            env = {**os.environ, **sagemaker_environment(topology, code, os.environ, hyperparameters)}
            if topology.processes_per_host > 1 or len(topology.hosts) > 1:
                for key, value in distributed_environment(topology).items():
                    env.setdefault(key, value)
            return run_job_code(topology, code, [*script_arguments(hyperparameters), *args], env)
    except TrainingError as err:
        print(f"launcher: error: {err}", file=sys.stderr, flush=True)
        write_failure(os.environ, str(err))
        return 2
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
