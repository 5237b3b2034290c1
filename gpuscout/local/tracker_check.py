"""Trackers checked once, before a local run's first job: an MLflow server (http(s) tracking URI) or W&B online that
does not answer within a few seconds is one line and tracking off for that tracker for the whole run
(``tracking.if_unreachable: disable``, the default) or the run refused before anything runs (``refuse``), never a stall
in every job and again at the end. Local stores (sqlite, file) and W&B offline need no network and are not checked;
an ARN needs AWS credentials and is left to MLflow.

May import: gpuscout.domain and gpuscout.errors."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from gpuscout.domain.jobspec import JobSpec
from gpuscout.errors import GpuscoutError

if TYPE_CHECKING:
    from gpuscout.domain.manifest import Manifest

CHECK_TIMEOUT_S = 5.0
WANDB_DEFAULT_URL = "https://api.wandb.ai"


def answers(url: str, *, timeout_s: float = CHECK_TIMEOUT_S) -> str | None:
    """None when ``url``'s server answers an HTTP request within ``timeout_s`` (any status: it is there), else why
    not in a few words."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout_s):
            return None
    except urllib.error.HTTPError:
        return None  # it answered, with an error status: reachable
    except urllib.error.URLError as err:
        return f"no answer ({err.reason})"
    except TimeoutError as err:
        return f"no answer within {timeout_s:.0f} s ({type(err).__name__})"
    except OSError as err:
        return f"no answer ({err})"


def unreachable_trackers(tracking: Any, *, check: Callable[[str], str | None] = answers) -> dict[str, str]:
    """{"mlflow" | "wandb": why} for the trackers of a resolved TrackingSection that need a server that is not there."""
    out: dict[str, str] = {}
    uri = tracking.mlflow.tracking_uri if tracking.mlflow is not None else None
    if uri and uri.startswith(("http://", "https://")):
        why = check(uri.rstrip("/") + "/health")
        if why:
            out["mlflow"] = f"MLflow server {uri}: {why}"
    if tracking.wandb is not None and tracking.wandb.mode == "online":
        base = os.environ.get("WANDB_BASE_URL", WANDB_DEFAULT_URL)
        why = check(base)
        if why:
            out["wandb"] = f"W&B ({base}, mode online): {why}"
    return out


def checked_tracking(
    manifest: Manifest, specs: Sequence[JobSpec], *, on_message: Callable[[str], None],
    check: Callable[[str], str | None] = answers,
) -> tuple[Manifest, list[JobSpec]]:  # fmt: skip
    """The manifest and job specs with unreachable trackers turned off for the run (one message each), or a
    GpuscoutError when the manifest says ``tracking.if_unreachable: refuse``."""
    tracking = manifest.resolved_tracking()
    if tracking is None:
        return manifest, list(specs)
    down = unreachable_trackers(tracking, check=check)
    if not down or manifest.tracking is None:
        return manifest, list(specs)
    if manifest.tracking.if_unreachable == "refuse":
        raise GpuscoutError(
            "; ".join(down.values()) + " (tracking.if_unreachable: refuse; start the server, or set it to disable)"
        )
    for why in down.values():
        on_message(f"tracking: {why}: tracking to it is off for this run (`gpuscout track RUN_ID` logs it later)")
    kept = manifest.tracking.model_copy(update=dict.fromkeys(down))
    reduced = kept if (kept.mlflow is not None or kept.wandb is not None) else None
    manifest = manifest.model_copy(update={"tracking": reduced})
    resolved = manifest.resolved_tracking()
    return manifest, [s.model_copy(update={"tracking": resolved}) for s in specs]
