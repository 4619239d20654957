"""The demo the README starts with, run as a newcomer runs it, on a few photos."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT


@pytest.mark.timeout(300)
def test_the_demo_runs_both_modes(tmp_path: Path) -> None:
    """`./scripts/demo.sh --s3` is the plain demo (photos -> shards -> info, verify, one
    streamed epoch) followed by the same photos packed into a bucket of its own moto server
    and trained on from there: one run checks every command of both modes. The demo runs in
    this interpreter's environment (SHARDKIT_VENV), which has what the scripts need."""
    env = {
        **os.environ,
        "SHARDKIT_VENV": str(Path(sys.executable).parent.parent),
        "DEMO_DIR": str(tmp_path),
        "DEMO_IMAGES": "24",
    }
    proc = subprocess.run(
        [str(ROOT / "scripts" / "demo.sh"), "--s3"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280
    )
    out = proc.stdout
    assert proc.returncode == 0, f"{out}\n{proc.stderr}"
    assert "24 images in 6 classes" in out
    assert out.count("packed 24 samples into 1 shard") == 2  # a folder, then the bucket
    assert "all shards match the index" in out
    assert re.search(r"^24 samples in \d+ batches", out, re.M), out
    assert "s3://demo/photos: 24 samples per epoch, 6 classes" in out
    assert re.search(r"^epoch 1: \d+ samples/s, downloaded 0\.0 MB, [1-9]\d* cache hits", out, re.M), out
    polling = [
        line for line in proc.stderr.splitlines() if "moto-api" in line or line.startswith(("+ sleep", "+ kill -0"))
    ]
    assert not polling and "+ waiting for moto_server" in proc.stderr, proc.stderr  # set -x off while it polls
