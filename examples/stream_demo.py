"""Stream a shard directory through a DataLoader for one epoch and report throughput.

    python examples/stream_demo.py SHARDS [--batch-size 32] [--workers 2] [--label cls]

Each sample's image is its first image field, whatever its format (see train_local.py).
"""

import argparse
import functools
import time
from collections import Counter

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from train_local import image_and_label

from shardkit import StreamingDataset

SIZE = (128, 128)


# Top level, so DataLoader workers can pickle it.
def to_input(sample: dict, label: str = "cls") -> tuple[torch.Tensor, int]:
    """CHW uint8 image of any size -> 3x128x128 uint8, paired with its class."""
    image, target = image_and_label(sample, label)
    image = F.interpolate(image.unsqueeze(0).float(), size=SIZE, mode="bilinear", antialias=True, align_corners=False)
    return image.squeeze(0).round().clamp(0, 255).to(torch.uint8), target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shards", help="directory or URL written by `shardkit pack`")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--label", default="cls", help="the field holding each sample's class number")
    args = parser.parse_args()

    ds = StreamingDataset(
        args.shards, shuffle=True, seed=0, decode="tensor", transform=functools.partial(to_input, label=args.label)
    )
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
