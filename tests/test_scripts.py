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
    # train_s3.py's cache: the first epoch downloads and hits nothing, the second reads it all back
    first, second = (
        re.search(rf"^epoch {e}: \d+ samples/s, downloaded ([\d.]+) MB, (\d+) cache hits", out, re.M) for e in (0, 1)
    )
    assert first and second, out
    assert float(first[1]) > 0 and int(first[2]) == 0
    assert float(second[1]) == 0 and int(second[2]) > 0
    polling = [
        line for line in proc.stderr.splitlines() if "moto-api" in line or line.startswith(("+ sleep", "+ kill -0"))
    ]
    assert not polling and "+ waiting for moto_server" in proc.stderr, proc.stderr  # set -x off while it polls


BENCH = ROOT / "bench"
# what a benchmark may import from the repository: shardkit's public modules (the harness among
# them), the bench package's shared modules, the test servers' start-ups and the image maker
SHARED = {"bench.readers", "bench.s3", "bench.mosaic", "bench.remote_peers", "bench.peers_chart"}
# a module of bench/ or scripts/ imported by its bare name: through a changed sys.path
BARE = {p.stem for folder in ("bench", "scripts") for p in (ROOT / folder).glob("*.py")}
OURS = ("shardkit", "bench", "tests", "scripts", *BARE)


def _repository_imports(path: Path) -> list[str]:
    """The modules of this repository that `path` imports, anywhere in it (inside functions too)."""
    import ast

    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "bench"]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return [n for n in names if n.split(".")[0] in OURS]


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_a_benchmark_imports_no_other_benchmark_and_no_private(path: Path) -> None:
    """bench/ modules import shardkit's public names, the harness, the shared modules and the
    servers' start-ups (tests/servers/), never another benchmark, a `_private` or sys.path."""
    text = path.read_text()
    assert "sys.path" not in text, f"{path.name} changes sys.path"
    for name in _repository_imports(path):
        assert name.split(".")[0] not in BARE, f"{path.name} imports {name} by a bare name"
        assert not any(part.startswith("_") for part in name.split(".")), f"{path.name} imports {name}"
        if name.startswith("bench."):
            assert name in SHARED or (path.stem, name) == ("remote", "bench.remote_peers_run"), (
                f"{path.name} imports the benchmark {name}"
            )
        assert not name.startswith("tests.") or name.startswith("tests.servers."), f"{path.name} imports {name}"
        assert not name.startswith("scripts.") or name == "scripts.make_images", f"{path.name} imports {name}"


def test_the_benchmarks_and_servers_stay_out_of_the_wheel_and_the_harness_in() -> None:
    import tomllib

    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert found["include"] == ["shardkit*"]  # bench/ and tests/ are not shardkit*
    assert (ROOT / "shardkit" / "bench" / "harness.py").is_file()
    assert "prune bench" in (ROOT / "MANIFEST.in").read_text().splitlines()
