"""The CDK CLI (pinned in package.json) synthesizes the app offline, as `make synth` and `cdk deploy` do."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO_DIR = Path(__file__).resolve().parents[2]
CDK = REPO_DIR / "node_modules" / ".bin" / "cdk"


@pytest.mark.slow(seconds=16)
@pytest.mark.skipif(not CDK.exists() or shutil.which("node") is None, reason="CDK CLI not installed (make install)")
def test_cdk_synth_quiet_works_offline_within_a_minute(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20",
        "CDK_DISABLE_VERSION_CHECK": "1",
        "AWS_EC2_METADATA_DISABLED": "true",  # no instance-metadata lookups for credentials
        # any network access fails fast instead of hanging: synth must need none
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "NO_PROXY": "",
    }
    for name in ("AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        env.pop(name, None)
    started = time.monotonic()
    result = subprocess.run(
        [str(CDK), "synth", "--quiet", "--no-notices", "--output", str(tmp_path / "cdk.out")],
        cwd=REPO_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "cdk.out" / "Gpuscout.template.json").is_file()
    assert elapsed < 60, f"cdk synth took {elapsed:.0f} s"
