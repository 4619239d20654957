"""Two nodes of two ranks each, simulated on this machine: two torchrun launches meeting
at a c10d rendezvous on loopback, gloo backend. Then a checkpoint taken on 4 ranks resumes
on 2."""

from __future__ import annotations

import collections
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TORCHRUN = Path(sys.executable).parent / "torchrun"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nodes: int, per_node: int, *args: str) -> None:
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                str(TORCHRUN),
                f"--nnodes={nodes}",
                f"--nproc-per-node={per_node}",
                f"--node-rank={n}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=shardkit-test",
                "--max-restarts=0",
                str(HERE / "multinode_worker.py"),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in range(nodes)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out[-3000:]


def results(out: Path, phase: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{phase}-*.json"))]


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed")
def test_two_nodes_then_resume_on_one(packed: Path, tmp_path: Path) -> None:
    launch(2, 2, str(packed), str(tmp_path), "full+part")  # one launch for both: torch starts once a rank
    full = results(tmp_path, "full")
    assert [r["world"] for r in full] == [4] * 4
    assert len({r["batches"] for r in full}) == 1 and len({len(r["keys"]) for r in full}) == 1  # equal ranks
    assert all(len(r["keys"]) == r["len"] == 30 for r in full)
    union = [k for r in full for k in r["keys"]]
    assert len(union) == len(set(union)) == 120  # the whole dataset, once

    part = results(tmp_path, "part")
    seen = [k for r in part for k in r["keys"]]
    state = tmp_path / "state.json"
    state.write_text(json.dumps(part[0]["state"]))  # ranks move in lockstep: any rank's state will do
    launch(1, 2, str(packed), str(tmp_path), "rest", str(state))  # resume on 2 ranks
    rest = results(tmp_path, "rest")
    assert [r["world"] for r in rest] == [2, 2] and rest[0]["batches"] == rest[1]["batches"]
    after = [k for r in rest for k in r["keys"]]
    assert collections.Counter(seen + after) == collections.Counter(union)  # each sample exactly once
