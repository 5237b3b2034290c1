"""Test-only: MLflow's own tracking server (``mlflow.server``, the app ``mlflow server`` runs), in a child process
on a free local port, so tests talk to MLflow over HTTP the way a SageMaker job and ``gpuscout track`` talk to a
tracking server: the REST client, artifacts uploaded through the server (``mlflow-artifacts:/``, as a server that
serves artifacts does), nothing shared with the test process.

mlflow-skinny ships the server's code; its web framework (flask, flask-cors) is in requirements-dev.txt. The server
keeps its runs in ``<folder>/server.db`` (SQLite) and artifacts under ``<folder>/artifacts/``; a test reads them back
through the same HTTP API (``MlflowClient(tracking_uri=url)``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

START_TIMEOUT_S = 60.0

_SERVE = """
from mlflow.server import app
from werkzeug.serving import make_server

server = make_server("127.0.0.1", 0, app, threaded=True)
print(server.server_port, flush=True)
server.serve_forever()
"""


@contextmanager
def mlflow_server(folder: Path, *, artifact_root: str | None = None) -> Iterator[str]:
    """Start the server; yields its URL (``http://127.0.0.1:<port>``); stops it at the end. ``artifact_root``
    (e.g. ``s3://bucket``): the server does not serve artifacts, clients write them there themselves (``mlflow server
    --no-serve-artifacts --default-artifact-root``)."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "_MLFLOW_SERVER_FILE_STORE": f"sqlite:///{folder / 'server.db'}"}
    if artifact_root is None:
        env |= {
            "_MLFLOW_SERVER_ARTIFACT_ROOT": "mlflow-artifacts:/",
            "_MLFLOW_SERVER_SERVE_ARTIFACTS": "true",
            "_MLFLOW_SERVER_ARTIFACT_DESTINATION": str(folder / "artifacts"),
        }
    else:
        env |= {"_MLFLOW_SERVER_ARTIFACT_ROOT": artifact_root, "_MLFLOW_SERVER_SERVE_ARTIFACTS": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    log = (folder / "server.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVE], stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=folder
    )
    stdout = process.stdout
    assert stdout is not None
    port: list[str] = []
    reader = threading.Thread(target=lambda: port.append(stdout.readline().strip()), daemon=True)
    reader.start()
    reader.join(START_TIMEOUT_S)
    try:
        if not port or not port[0].isdigit():
            process.kill()
            log.flush()
            raise RuntimeError(f"the MLflow server did not start: {(folder / 'server.log').read_text()[-3000:]}")
        yield f"http://127.0.0.1:{port[0]}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
