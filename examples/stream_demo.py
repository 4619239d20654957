"""Stream a packed dataset for one epoch and say what happened (used by scripts/demo.sh)."""

from __future__ import annotations

import argparse
import collections
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from shardkit import StreamingDataset


def to_pair(sample: dict) -> tuple[torch.Tensor, int]:
    """CHW uint8 tensor -> 128x128 CHW uint8 tensor, plus the label. Runs in the worker."""
    image = sample["jpg"].unsqueeze(0).float()
    image = F.interpolate(image, size=(128, 128), mode="bilinear", antialias=True, align_corners=False)
    return image[0].round().clamp(0, 255).to(torch.uint8), sample["cls"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("shards")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()

    ds = StreamingDataset(args.shards, shuffle=True, seed=0, decode="tensor", transform=to_pair)
    loader = DataLoader(ds, batch_size=32, num_workers=args.workers)
    start = time.perf_counter()
    counts: collections.Counter[int] = collections.Counter()
    batches = 0
    for images, labels in loader:
        batches += 1
        counts.update(labels.tolist())
        if batches == 1:
            print(f"first batch {tuple(images.shape)} {images.dtype} after {time.perf_counter() - start:.2f} s")
    took = time.perf_counter() - start
    n = sum(counts.values())
    print(f"streamed {n} samples in {batches} batches in {took:.1f} s ({n / took:.0f} images/s), len(ds) = {len(ds)}")
    print("per class: " + ", ".join(f"{ds.classes[c]}={counts[c]}" for c in sorted(counts)))
    stats = ds.stats()
    print(f"workers spent {stats['read_s']:.2f} s reading, {stats['decode_s']:.2f} s decoding, "
          f"{stats['transform_s']:.2f} s in the transform")


if __name__ == "__main__":
    main()
