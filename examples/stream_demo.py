"""Stream a shard directory through a DataLoader for one epoch and report throughput.

    python examples/stream_demo.py SHARDS [--batch-size 32] [--workers 2]
"""

import argparse
import time
from collections import Counter

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from shardkit import StreamingDataset

SIZE = (128, 128)


# Top level, so DataLoader workers can pickle it.
def to_input(sample: dict) -> tuple[torch.Tensor, int]:
    """CHW uint8 image of any size -> 3x128x128 uint8, paired with its class."""
    image = sample["jpg"].unsqueeze(0).float()
    image = F.interpolate(image, size=SIZE, mode="bilinear", antialias=True, align_corners=False)
    return image.squeeze(0).round().clamp(0, 255).to(torch.uint8), sample["cls"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shards", help="directory or URL written by `shardkit pack`")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    ds = StreamingDataset(args.shards, shuffle=True, seed=0, decode="tensor", transform=to_input)
    loader = DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers)

    samples = batches = 0
    classes: Counter[int] = Counter()
    start = time.perf_counter()  # includes worker start-up, as a training epoch would
    for images, labels in loader:
        if batches == 0:
            print(f"first batch: images {tuple(images.shape)} {images.dtype}, labels {tuple(labels.shape)}")
        samples += len(labels)
        batches += 1
        classes.update(labels.tolist())
    elapsed = time.perf_counter() - start

    print(f"{samples} samples in {batches} batches, {elapsed:.2f} s, {samples / elapsed:.0f} images/s")
    print("classes:", dict(sorted(classes.items())))


if __name__ == "__main__":
    main()
