"""Train a small CNN on a packed image folder, reading it with StreamingDataset.

    shardkit pack ./photos ./photos-shards
    python examples/train_local.py ./photos-shards --epochs 2 --workers 2 [--label cls]

Shows the recipe: shuffle with a seed, set_epoch every epoch, batches made in the workers
(batch_size on the dataset, None on the DataLoader), workers + pin_memory +
persistent_workers, and (in a comment) how to resume mid-epoch from (epoch, samples seen).
Any image format trains: each sample's image is its first image field (jpg, png, webp, gif,
...: a pack names a field by its file's extension); the label is its `cls` (the class
folder's number) or the field --label names.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from shardkit import StreamingDataset
from shardkit.decode import image_field

SIZE = 96


def image_and_label(sample: dict, label: str = "cls") -> tuple[torch.Tensor, int]:
    """The sample's first image field (decoded to a CHW uint8 tensor) and its label."""
    field = image_field(sample)
    if field is None or label not in sample:
        raise ValueError(
            f"sample {sample['__key__']}: no {'image' if field is None else repr(label)} field among "
            f"{', '.join(k for k in sample if not k.startswith('__'))}"
        )
    return sample[field], sample[label]


def to_training_pair(sample: dict, label: str = "cls") -> tuple[torch.Tensor, int]:
    """CHW uint8 image -> fixed-size float tensor in [0, 1] with a random flip; runs in the worker."""
    image, target = image_and_label(sample, label)
    image = image.unsqueeze(0).float().div_(255)
    image = F.interpolate(image, size=(SIZE, SIZE), mode="bilinear", antialias=True, align_corners=False)[0]
    if torch.rand(()) < 0.5:
        image = image.flip(-1)
    return image, target


def model(classes: int) -> nn.Module:
    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2))

    return nn.Sequential(
        block(3, 16), block(16, 32), block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes)
    )


def train_epoch(net: nn.Module, opt: torch.optim.Optimizer, loader: DataLoader) -> dict[str, float]:
    """One pass of SGD over `loader`: samples, correct predictions, summed loss, seconds to the
    first batch and in all."""
    start, first, seen, correct, loss_sum = time.perf_counter(), 0.0, 0, 0, 0.0
    for step, (images, labels) in enumerate(loader):
        logits = net(images)
        loss = F.cross_entropy(logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen += len(labels)
        correct += int((logits.argmax(1) == labels).sum())
        loss_sum += loss.item() * len(labels)
        if step == 0:
            first = time.perf_counter() - start
    return {
        "seen": seen,
        "correct": correct,
        "loss_sum": loss_sum,
        "first_s": first,
        "took": time.perf_counter() - start,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shards", help="a dataset folder written by `shardkit pack` (or a URL)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--label", default="cls", help="the field holding each sample's class number")
    args = ap.parse_args()

    transform = functools.partial(to_training_pair, label=args.label)  # a partial pickles, for workers
    ds = StreamingDataset(
        args.shards, shuffle=True, seed=0, decode="tensor", transform=transform, batch_size=args.batch_size
    )
    loader = DataLoader(
        ds,
        batch_size=None,
        num_workers=args.workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=args.workers > 0,
    )
    net = model(len(ds.classes) or 1000)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    print(f"{len(ds)} batches of up to {args.batch_size} per epoch, {len(ds.classes)} classes, {args.workers} workers")
    for epoch in range(args.epochs):
        ds.set_epoch(epoch)
        r = train_epoch(net, opt, loader)
        seen, took = r["seen"], r["took"]
        print(f"epoch {epoch}: first batch after {r['first_s']:.2f} s")
        # To resume mid-epoch with a plain DataLoader, save (epoch, samples seen) and later call
        # ds.load_state_dict(ds.resume_state(epoch=..., samples_seen=..., num_workers=...)).
        print(
            f"epoch {epoch}: {seen} samples in {took:.1f} s = {seen / took:.0f} samples/s, "
            f"loss {r['loss_sum'] / seen:.3f}, train accuracy {r['correct'] / seen:.1%}"
        )
    stats = ds.stats()
    print(f"loader: {stats['samples']:.0f} samples, {stats['read_fraction']:.0%} of worker time waiting for data")


if __name__ == "__main__":
    main()
