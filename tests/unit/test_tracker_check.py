"""Trackers checked once before a local run's first job: a server that
accepts and never answers costs seconds once, not minutes per job; tracking to it is off for the run, or the run is
refused when the manifest says so."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from gpuscout.domain.catalog import load_catalog
from gpuscout.domain.manifest_loader import load_manifest
from gpuscout.errors import GpuscoutError
from gpuscout.local import tracker_check
from gpuscout.paths import MANIFESTS_DIR
from gpuscout.plan.planner import plan


@pytest.fixture
def silent_server() -> Iterator[str]:
    """Accepts connections and never answers (the case seen: ~2 minutes lost per job)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    sock.close()


@pytest.fixture
def http_404_server() -> Iterator[str]:
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501/404
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_server_that_never_answers_is_found_within_the_timeout(silent_server: str) -> None:
    started = time.monotonic()
    why = tracker_check.answers(silent_server + "/health", timeout_s=1.0)
    assert why is not None and "no answer" in why
    assert time.monotonic() - started < 3.0


def test_any_http_answer_counts_as_there(http_404_server: str) -> None:
    assert tracker_check.answers(http_404_server + "/health", timeout_s=2.0) is None


def _manifest(tmp_path, tracking: dict):
    import yaml

    data = yaml.safe_load((MANIFESTS_DIR / "quickstart.yaml").read_text())
    data["tracking"] = tracking
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    manifest = load_manifest(path, load_catalog())
    return manifest, plan(manifest, load_catalog(), run_id="r").jobs


def test_an_unreachable_mlflow_is_one_line_and_off_for_the_run(tmp_path, silent_server: str) -> None:
    manifest, specs = _manifest(tmp_path, {"mlflow": {"tracking_uri": silent_server}, "wandb": {"project": "p"}})
    assert all(s.tracking is not None and s.tracking.mlflow is not None for s in specs)
    said: list[str] = []
    started = time.monotonic()
    manifest2, specs2 = tracker_check.checked_tracking(
        manifest, specs, on_message=said.append, check=lambda url: tracker_check.answers(url, timeout_s=1.0)
    )
    assert time.monotonic() - started < 3.0  # once for the run, not per job
    assert len(said) == 1 and silent_server in said[0] and "off for this run" in said[0]
    assert manifest2.tracking.mlflow is None and manifest2.tracking.wandb is not None  # W&B offline: kept
    assert all(s.tracking is not None and s.tracking.mlflow is None and s.tracking.wandb for s in specs2)


def test_refuse_stops_the_run_before_it_starts(tmp_path) -> None:
    manifest, specs = _manifest(
        tmp_path, {"mlflow": {"tracking_uri": "http://127.0.0.1:9"}, "if_unreachable": "refuse"}
    )
    with pytest.raises(GpuscoutError, match=r"MLflow server http://127.0.0.1:9: no answer.*if_unreachable: refuse"):
        tracker_check.checked_tracking(manifest, specs, on_message=lambda _m: None, check=lambda _u: "no answer")


def test_only_tracker_unreachable_means_no_tracking_and_local_stores_are_not_checked(tmp_path) -> None:
    manifest, specs = _manifest(tmp_path, {"mlflow": {"tracking_uri": "http://127.0.0.1:9"}})
    manifest2, specs2 = tracker_check.checked_tracking(
        manifest, specs, on_message=lambda _m: None, check=lambda _u: "no answer"
    )
    assert manifest2.tracking is None and all(s.tracking is None for s in specs2)
    local, local_specs = _manifest(tmp_path, {"mlflow": {}, "wandb": {"project": "p", "mode": "offline"}})
    asked: list[str] = []
    tracker_check.checked_tracking(local, local_specs, on_message=lambda _m: None, check=asked.append)
    assert asked == []  # sqlite under the runs folder and W&B offline need no network
