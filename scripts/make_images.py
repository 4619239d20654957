"""Generate a realistic ImageFolder tree from the photos bundled inside scikit-image.

Each image is a random crop (position, scale, flip) of one of the bundled photos, resized to
an ImageNet-like size and saved as JPEG, so files look and weigh like real data (mean ~100 KB
at the default sizes, as in ImageNet) without downloading anything. The same arguments give
byte-identical files, whatever the number of workers.

    ROOT/class_000/img_000000.jpg, ROOT/class_001/img_000001.jpg, ...   (round-robin)

    python scripts/make_images.py ROOT --images N --classes K --seed S [--small]
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import math
import os
import random
import sys
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from PIL import Image

# Only files shipped inside skimage/data; the rest of skimage.data is fetched over the network.
# The grayscale textures are converted to RGB so every output is a 3-channel JPEG.
SOURCES = (
    "astronaut.png",
    "chelsea.png",
    "coffee.png",
    "hubble_deep_field.jpg",
    "ihc.png",
    "motorcycle_left.png",
    "motorcycle_right.png",
    "retina.jpg",
    "rocket.jpg",
    "brick.png",
    "camera.png",
    "grass.png",
    "gravel.png",
)
SMALL_SIDES = (64, 128)

_photos: list[Image.Image] = []  # decoded once per worker process


def _data_dir() -> Path:
    # find_spec locates the package without importing skimage, which takes about a second.
    spec = importlib.util.find_spec("skimage")
    if spec is None or spec.origin is None:
        raise RuntimeError("scikit-image is required: pip install scikit-image")
    return Path(spec.origin).parent / "data"


def _load_photos() -> None:
    if not _photos:
        data = _data_dir()
        _photos.extend(Image.open(data / name).convert("RGB") for name in SOURCES)


def image_paths(root: str | os.PathLike, n_images: int, n_classes: int = 10) -> list[Path]:
    """The paths make_image_folder writes, in index order."""
    root = Path(root)
    return [root / f"class_{i % n_classes:03d}" / f"img_{i:06d}.jpg" for i in range(n_images)]


def _render(seed: int, index: int, min_side: int, max_side: int) -> bytes:
    # A private RNG per image keeps the output independent of worker count and scheduling.
    rng = random.Random(f"{seed}:{index}")
    photo = _photos[rng.randrange(len(_photos))]

    short = rng.randint(min_side, max_side)
    aspect = math.exp(rng.uniform(math.log(0.75), math.log(4 / 3)))  # width / height
    if aspect >= 1:
        size = (round(short * aspect), short)
    else:
        size = (short, round(short / aspect))

    # Largest crop of the target aspect that fits, then shrink it to 50-100% of that area.
    pw, ph = photo.size
    cw = min(pw, ph * aspect)
    scale = math.sqrt(rng.uniform(0.5, 1.0))
    cw, ch = cw * scale, cw * scale / aspect
    x, y = rng.uniform(0, pw - cw), rng.uniform(0, ph - ch)
    img = photo.resize(size, Image.Resampling.BICUBIC, box=(x, y, x + cw, y + ch))
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)

    # The bundled photos are ~512 px, so crops are at best 1:1 and often upscaled: smoother than
    # camera images, and about half ImageNet's bytes per pixel. Luminance grain, quality 88-95
    # and no chroma subsampling bring the mean back to ~100 KB, as in ImageNet.
    noise = np.random.default_rng(rng.getrandbits(64)).standard_normal((size[1], size[0], 1), dtype=np.float32)
    pixels = np.asarray(img, dtype=np.float32) + noise * rng.uniform(4, 10)
    img = Image.fromarray(np.clip(pixels + 0.5, 0, 255).astype(np.uint8))

    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=rng.randint(88, 95), subsampling=0)  # 0 = 4:4:4
    return buf.getvalue()


def _write(job: tuple[str, int, int, int, int]) -> None:
    path, seed, index, min_side, max_side = job
    _load_photos()
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(_render(seed, index, min_side, max_side))
    os.replace(tmp, path)  # never leave a truncated .jpg behind for the skip check to count


def make_image_folder(
    root: str | os.PathLike,
    n_images: int,
    n_classes: int = 10,
    seed: int = 0,
    min_side: int = 300,
    max_side: int = 500,
    workers: int | None = None,
) -> list[Path]:
    """Write n_images JPEGs under root, spread round-robin over n_classes folders.

    If root already holds exactly the expected file names (and no other .jpg), nothing is
    written. That check looks at names and count only, not contents: after changing seed or
    sizes, use a fresh root.
    """
    if n_images < 0 or n_classes < 1 or not 1 <= min_side <= max_side:
        raise ValueError("need n_images >= 0, n_classes >= 1 and 1 <= min_side <= max_side")
    root = Path(root)
    paths = image_paths(root, n_images, n_classes)
    existing = set(root.glob("class_*/*.jpg")) if root.is_dir() else set()
    if existing == set(paths):
        return paths
    if existing - set(paths):
        raise FileExistsError(f"{root} holds images from a different run; use an empty directory")

    for d in {p.parent for p in paths}:
        d.mkdir(parents=True, exist_ok=True)
    jobs = [(str(p), seed, i, min_side, max_side) for i, p in enumerate(paths)]
    with Pool(workers or os.cpu_count()) as pool:
        for _ in pool.imap_unordered(_write, jobs, chunksize=16):
            pass
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root")
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--small", action="store_true", help="64-128 px images, for fast unit tests")
    parser.add_argument("--workers", type=int, default=None, help="default: all CPUs")
    args = parser.parse_args(argv)

    min_side, max_side = SMALL_SIDES if args.small else (300, 500)
    paths = make_image_folder(args.root, args.images, args.classes, args.seed, min_side, max_side, args.workers)
    total = sum(p.stat().st_size for p in paths)
    print(f"{len(paths)} images in {args.classes} classes under {args.root} ({total / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
