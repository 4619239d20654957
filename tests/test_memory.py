"""Memory stays flat over epochs: workers keep their state in numpy arrays, not in Python
objects that copy-on-access would duplicate or that grow per pass."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from shardkit import StreamingDataset


def rss_of_worker(sample: dict) -> tuple[int, int]:
    """(pid, resident KB) of the worker process that produced this sample."""
    import os

    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return os.getpid(), rss


def image_and_rss(sample: dict) -> tuple[torch.Tensor, int, int]:
    return (sample["jpg"], *rss_of_worker(sample))


@pytest.mark.parametrize("batched", [False, True])
def test_worker_rss_is_flat_over_epochs(packed: Path, batched: bool) -> None:
    """Also with batches made in the workers: their buffers are reused, not piled up."""
    if batched:
        ds = StreamingDataset(str(packed), shuffle=True, decode="tensor", transform=image_and_rss, batch_size=8)
    else:
        ds = StreamingDataset(str(packed), shuffle=True, decode="rgb8", transform=rss_of_worker)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    peaks: list[dict[int, int]] = []
    for epoch in range(8):
        ds.set_epoch(epoch)
        peak: dict[int, int] = {}
        for item in loader:
            pids, rsss = (item[1].tolist(), item[2].tolist()) if batched else ([item[0]], [item[1]])
            for pid, rss in zip(pids, rsss):
                peak[int(pid)] = max(peak.get(int(pid), 0), int(rss))
        peaks.append(peak)
    assert peaks[1].keys() == peaks[-1].keys()  # the same persistent workers throughout
    for pid in peaks[1]:
        growth_kb = peaks[-1][pid] - peaks[1][pid]
        assert growth_kb < 4096, f"worker {pid} grew by {growth_kb} KB over 6 epochs"
