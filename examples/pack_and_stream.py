"""The two-minute tour: generate a small photo folder, pack it, stream it, resume it.

    pip install '.[examples]'   # from the checkout: torch, torchdata, scikit-image, s3fs
    python examples/pack_and_stream.py [--dir /tmp/shardkit-tour] [--images 600] [--small]

1. scripts/make_images.py writes DIR/photos-N-C/class_NNN/*.jpg (real photo crops, ~400 px,
   from the photos scikit-image ships; without scikit-image, PIL drawings of the same sizes);
2. shardkit.pack turns it into tar shards plus index.json under DIR/shards;
3. StreamingDataset streams them through a DataLoader with 2 workers, each JPEG decoded
   straight to 224x224 by shardkit.decode.image_transform (DCT-domain downscaling, only the
   center crop resampled), and the loader's throughput and class histogram are printed;
4. a restart mid-epoch: from a checkpoint's (epoch, samples seen), `ds.resume_state` gives
   the rest of the epoch, each sample once (README: Resume).
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import time
from collections import Counter
from pathlib import Path

from PIL import Image, ImageDraw
from torch.utils.data import DataLoader

import shardkit
from shardkit import StreamingDataset
from shardkit.decode import image_transform

ROOT = Path(__file__).resolve().parent.parent


def drawn_photos(root: Path, images: int, classes: int, sides: tuple[int, int]) -> list[Path]:
    """Without scikit-image: PIL drawings (a gradient and a few shapes), laid out as
    make_images.py lays out its photos."""
    paths = []
    for i in range(images):
        rng = random.Random(i)
        w, h = rng.randint(*sides), rng.randint(*sides)
        img = Image.linear_gradient("L").resize((w, h)).convert("RGB")
        draw = ImageDraw.Draw(img)
        for _ in range(4):
            x, y = rng.randrange(w), rng.randrange(h)
            draw.ellipse((x, y, x + w // 3, y + h // 3), fill=tuple(rng.randrange(256) for _ in range(3)))
        path = root / f"class_{i % classes:03d}" / f"img_{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        img.save(path, quality=90)
        paths.append(path)
    return paths


def make_photos(root: Path, images: int, classes: int, small: bool) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_images import SMALL_SIDES, make_image_folder

    sides = SMALL_SIDES if small else (300, 500)
    start = time.perf_counter()
    if importlib.util.find_spec("skimage") is None:
        print("   (no scikit-image: drawing the photos with PIL; pip install '.[examples]' for real photo crops)")
        paths = drawn_photos(root, images, classes, sides)
    else:
        paths = make_image_folder(root, images, classes, seed=0, min_side=sides[0], max_side=sides[1])
    size = sum(p.stat().st_size for p in paths)
    print(
        f"1. {len(paths)} photos in {classes} classes under {root}: {size / 1e6:.1f} MB "
        f"({time.perf_counter() - start:.1f} s)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/shardkit-tour", help="working folder (photos/ and shards/ go here)")
    ap.add_argument("--images", type=int, default=600)
    ap.add_argument("--classes", type=int, default=6)
    ap.add_argument("--small", action="store_true", help="64-128 px images: a faster tour")
    ap.add_argument("--max-size", default="16MB", help="bytes per shard")
    ap.add_argument("--size", type=int, default=256, help="shorter side after resizing")
    ap.add_argument("--crop", type=int, default=224, help="center crop")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()

    work = Path(args.dir)
    photos, shards = work / f"photos-{args.images}-{args.classes}{'-small' if args.small else ''}", work / "shards"
    make_photos(photos, args.images, args.classes, args.small)

    start = time.perf_counter()
    index = shardkit.pack(str(photos), str(shards), max_size=args.max_size, workers=2, progress=False)
    took = time.perf_counter() - start
    counts = [s.samples for s in index.shards]
    print(
        f"2. packed into {shards} in {took:.1f} s: {index.samples} samples, {len(index.shards)} shard{'s' * (len(index.shards) != 1)} "
        f"({min(counts)}-{max(counts)} samples each), {index.bytes / 1e6:.1f} MB, "
        f"fields {', '.join(index.fields)}, classes {', '.join(index.classes)}"
    )

    transform = image_transform(size=args.size, crop=args.crop)
    ds = StreamingDataset(str(shards), shuffle=True, seed=0, decode="raw", transform=transform)
    loader = DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers)
    histogram: Counter[int] = Counter()
    samples = 0
    start = time.perf_counter()  # worker start-up included, as in a training epoch
    for images, labels in loader:
        if not samples:
            print(
                f"3. first batch after {time.perf_counter() - start:.2f} s: images {tuple(images.shape)} "
                f"{images.dtype}, labels {tuple(labels.shape)}"
            )
        samples += len(labels)
        histogram.update(labels.tolist())
    took = time.perf_counter() - start
    stats = ds.stats()
    print(
        f"   streamed {samples} samples in {took:.2f} s: {samples / took:.0f} samples/s with {args.workers} workers; "
        f"worker time {stats['read_s']:.2f} s reading, {stats['transform_s']:.2f} s decoding to {args.crop} px"
    )
    width = max(histogram.values(), default=0)
    print("   class histogram:")
    for label in range(len(index.classes)):
        n = histogram[label]
        print(f"   {label:3d} {index.classes[label]:>12} {n:6d} {'#' * round(40 * n / width) if width else ''}")
    resume(shards, args.batch_size, args.workers)


def key_of(sample: dict) -> str:
    return sample["__key__"]


def resume(shards: Path, batch_size: int, workers: int) -> None:
    """Epoch 0 read whole, then again as a restarted job would read it after `seen` samples."""

    def keys() -> tuple[StreamingDataset, DataLoader]:
        ds = StreamingDataset(str(shards), shuffle=True, seed=0, transform=key_of)
        return ds, DataLoader(ds, batch_size=batch_size, num_workers=workers)

    ds, loader = keys()
    epoch = [key for batch in loader for key in batch]
    seen = batch_size * max(1, len(epoch) // batch_size // 2)  # what the checkpoint says was trained on
    ds, loader = keys()  # after the restart: a new process, a new dataset
    ds.load_state_dict(ds.resume_state(epoch=0, samples_seen=seen, batch_size=batch_size, num_workers=workers))
    rest = [key for batch in loader for key in batch]
    left = "just those the first run had not reached" if sorted(rest) == sorted(epoch[seen:]) else "NOT THE REST"
    print(
        f"4. resumed epoch 0 after {seen} samples (ds.resume_state): {len(rest)} samples, {len(set(rest))} "
        f"distinct, {left}"
    )


if __name__ == "__main__":
    main()
